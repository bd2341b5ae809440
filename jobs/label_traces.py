"""Ray Data job: replay greedy traces -> features φ_t + oracle accepted lengths (cache and model drafter).

    python jobs/label_traces.py --traces /abs/traces --out /abs/labels [--model default]
        [--model-drafter layerskip|draft-model|eagle3|none] [--max-draft 64] [--actors 2]

Pipeline: traces (pyarrow, sorted by ``seq``) -> ``ray.data.from_arrow`` in blocks of ``--chunk``
traces -> ``map_batches(TraceLabeler, ActorPoolStrategy)`` -> ``write_parquet(out)``
(``hvd_ray/traces/labels.py`` schema), plus ``out/_labels_meta.json`` (feature spec, replay settings, row counts,
the traces each Ray node labelled). ``--traces`` and ``--out`` are paths or storage URIs (``file:///...``,
``s3://bucket/prefix``): on a cluster, one every node reaches.

The global suffix tree of a trace must hold the outputs of every *earlier* trace (smaller ``seq``),
so each actor reads every trace's output once, and labels its batches in ``seq`` order, adding the
earlier outputs it has not seen yet (rebuilding the bounded window when a batch starts before its
current point). Blocks are contiguous runs of ``seq``: one global-tree build per block at most, and
blocks label in parallel. See ``hvd_ray/traces/replay.py`` for what exactly is replayed
(``hvd_ray/traces/labeler.py`` runs it). Model-drafter labels run teacher-forced and batched in the
same actor (give the actors GPUs with ``--num-gpus``; on CPU use fp32 and few threads per actor).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from hvd_ray.traces.labeler import ReplayConfig, label_traces_ray


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True, help="trace parquet folder or URI (collect_traces output)")
    ap.add_argument("--out", required=True, help="label parquet folder or URI to write")
    ap.add_argument("--model", default="default", help="target model name or folder")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-drafter", default="layerskip", choices=["layerskip", "draft-model", "eagle3", "none"])
    ap.add_argument("--skip", default=None, help="layer-skip spec, e.g. attn:10-17 (default: layerskip.default_skip)")
    ap.add_argument("--depth", type=int, default=None, help="model drafter depth k (default: the drafter's)")
    ap.add_argument("--min-prob", type=float, default=None, help="model drafter confidence stop")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--eagle3-head", default=None)
    ap.add_argument("--eagle3-tree", action="store_true", help="EAGLE-3 tree drafts (default: chains)")
    ap.add_argument("--max-draft", type=int, default=64, help="engine draft budget (num_draft_tokens)")
    ap.add_argument("--max-cached", type=int, default=10000, help="global tree bound in requests")
    ap.add_argument("--tree", action="store_true", help="suffix tree drafts instead of chains")
    ap.add_argument("--sim-tau", type=float, default=6.0, help="τ of the simulated decoding run")
    ap.add_argument("--sim-predictor", default=None, help="predictor artifact for the simulated run")
    ap.add_argument(
        "--repeat",
        action="store_true",
        help="also label each trace replayed again right after, its own output in the global tree "
        "(regime 'repeat': retries, agent loops re-sending context)",
    )
    ap.add_argument("--chunk", type=int, default=32, help="traces per batch")
    ap.add_argument("--batch-slots", type=int, default=8, help="positions drafted per model forward")
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per actor (fractional is fine)")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per actor (default: num_cpus)")
    ap.add_argument("--address", default=None, help="Ray address (default: local or RAY_ADDRESS)")
    return ap.parse_args(argv)


def replay_config(a: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(
        model=a.model,
        tokenizer=a.tokenizer,
        dtype=a.dtype,
        device=a.device,
        model_drafter=a.model_drafter,
        skip=a.skip,
        depth=a.depth,
        min_prob=a.min_prob,
        draft_model=a.draft_model,
        eagle3_head=a.eagle3_head,
        eagle3_tree=a.eagle3_tree,
        max_draft=a.max_draft,
        suffix={"max_cached_requests": a.max_cached, "use_tree_spec": a.tree},
        sim_tau=a.sim_tau,
        sim_predictor=a.sim_predictor,
        repeat=a.repeat,
        batch_slots=a.batch_slots,
        threads=a.threads or max(1, int(a.num_cpus)),
    )


def run(a: argparse.Namespace) -> dict:
    return label_traces_ray(
        a.traces,
        a.out,
        replay_config(a),
        chunk=a.chunk,
        actors=a.actors,
        num_cpus=a.num_cpus,
        num_gpus=a.num_gpus,
        address=a.address,
    )


def main(argv=None) -> None:
    meta = run(parse_args(argv))
    print(json.dumps({k: meta[k] for k in ("rows", "traces", "elapsed_s")}))


if __name__ == "__main__":
    main()
