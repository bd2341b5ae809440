"""Train an EAGLE-3 head for a target with Ray Train (TorchTrainer), from target-regenerated traces.

    # 1. target greedy traces of the train split (see jobs/collect_traces.py)
    python jobs/collect_traces.py --workload all --split train --limit 600 --max-tokens 128 \
        --out ~/.cache/hvd_ray/traces/train-v1
    # 2. features + draft vocabulary + training + held-out evaluation -> a head folder (vLLM layout)
    python jobs/train_eagle3.py --traces ~/.cache/hvd_ray/traces/train-v1 --out heads/eagle3-smollm2 \
        --minutes 60 [--workers 1 --use-gpu] [--resume]

A new head starts from the target (``--head-init target``): the target's output rows for the draft
vocabulary over its highest tap, so training refines a working decoder instead of learning an
8k-row output layer from noise (``benchmarks/eagle3_retrain.md``: better held-out acceptance).

Stages are resumable: features are cached under ``<out>/features`` and training checkpoints under
``<out>/ray_train``; ``--resume`` continues from the latest checkpoint. Held-out traces (the
validation split, or ``--heldout DIR``) give the per-position acceptance report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch

from hvd_ray.model import Transformer, parse_dtype, resolve
from hvd_ray.model.eagle3_head import Eagle3Head, default_aux_layer_ids, taps_for
from hvd_ray.traces import read_traces
from hvd_ray.training.eagle3 import (
    TTTLoss,
    draft_vocab_from_counts,
    extract_features,
    read_shard,
    shard_size,
    state_digest,
    ttt_logits,
    write_shards,
)
from hvd_ray.workloads import split_of


def sequences(traces_dirs: list[str], splits: set[str]) -> list[tuple[list[int], int, str]]:
    """(prompt + output tokens, prompt length, workload) of the traces in ``splits``, folder by folder."""
    out = []
    for traces_dir in traces_dirs:
        t = read_traces(traces_dir, columns=["prompt_id", "prompt_tokens", "output_tokens", "workload"])
        out += [
            (r["prompt_tokens"] + r["output_tokens"], len(r["prompt_tokens"]), r["workload"])
            for r in t.to_pylist()
            if split_of(r["prompt_id"]) in splits
        ]
    return out


def features_for(args, name: str, srcs: list[str], splits: set[str]) -> list[Path]:
    """Feature shards of one sequence set, extracted once per trace folder
    (``<out>/features/<name>/<folder name>``), so adding a folder to ``--traces`` extracts only it."""
    shards: list[Path] = []
    target = None
    for src in srcs:
        folder = Path(args.out) / "features" / name / Path(src).resolve().name
        if (folder / "done").exists():
            made_from = json.loads((folder / "done").read_text()).get("source")
            if made_from != str(Path(src).resolve()):
                raise SystemExit(f"{folder} holds features of {made_from}, not of {src}: use another --out")
        else:
            seqs = sequences([src], splits)[: args.max_sequences]
            if not seqs:
                raise SystemExit(f"no {name} sequences in {src} (splits {sorted(splits)})")
            if target is None:
                target = Transformer.from_pretrained(resolve(args.model), dtype=parse_dtype(args.feature_dtype))
            taps = taps_for(default_aux_layer_ids(target.cfg.n_layers))
            print(f"[features] {name}: {len(seqs)} sequences of {src} -> {folder}", file=sys.stderr)
            t0 = time.time()
            samples = extract_features(target, [s for s, _, _ in seqs], taps, args.max_len, [p for _, p, _ in seqs])
            write_shards(_progress(samples, len(seqs), name), folder)
            (folder / "done").write_text(
                json.dumps(
                    {
                        "sequences": len(seqs),
                        "seconds": time.time() - t0,
                        "source": str(Path(src).resolve()),
                        "workloads": [w for _, _, w in seqs],
                    }
                )
            )
        shards += sorted(folder.glob("shard-*.safetensors"))
    return shards


def shard_workloads(shards: list[Path]) -> list[str] | None:
    """Each sequence's workload, in shard order (None if a feature folder predates keeping them)."""
    out: list[str] = []
    for folder in dict.fromkeys(p.parent for p in shards):  # folders in shard order
        workloads = json.loads((folder / "done").read_text()).get("workloads")
        if workloads is None:
            return None
        out += workloads
    return out


def draft_vocab(args, shards: list[Path]) -> list[int]:
    """The reduced draft vocabulary: the most frequent target predictions on the training set."""
    vocab_file = Path(args.out) / "features" / "draft_vocab.json"
    if args.init:  # a fine-tuned head keeps the vocabulary its weights were trained for
        head = Eagle3Head.load(args.init, Transformer.from_pretrained(resolve(args.model), dtype=torch.float32))
        return head.to_target_ids(torch.arange(head.cfg.draft_vocab_size)).tolist()
    if not vocab_file.exists():
        counts = None
        for p in shards:
            for s in read_shard(p):
                c = torch.bincount(s["pred"].long())
                counts = c if counts is None else _add(counts, c)
        ids = draft_vocab_from_counts(counts, args.draft_vocab)
        covered = counts[ids].sum().item() / max(counts.sum().item(), 1)
        vocab_file.write_text(json.dumps({"ids": ids, "coverage": covered}))
        print(f"[vocab] {len(ids)} draft tokens cover {covered:.1%} of target predictions", file=sys.stderr)
    return json.loads(vocab_file.read_text())["ids"]


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    n = max(a.numel(), b.numel())
    return torch.nn.functional.pad(a, (0, n - a.numel())) + torch.nn.functional.pad(b, (0, n - b.numel()))


def _progress(it, total: int, name: str):
    for i, x in enumerate(it, 1):
        if i % 25 == 0 or i == total:
            print(f"[features] {name} {i}/{total}", file=sys.stderr)
        yield x


def train_loop(config: dict) -> None:
    """One Ray Train worker of data-parallel TTT. Every epoch all workers build the same seeded order
    of the training samples (the shards shuffled, as with one worker, each read whole, so a worker
    holds one shard at a time) and worker r takes the r-th of ``world`` equal slices of it (the
    remainder, under ``world`` samples, is left out that epoch). So all workers take the same number
    of optimizer steps under one learning-rate schedule, with gradients averaged by DDP; the time
    limit is decided together (any worker past it stops all, on the same step); rank 0 checkpoints.
    With one worker this is the serial loop: every sample, in the same order."""
    import ray.train
    import torch.distributed as dist

    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    target = Transformer.from_pretrained(config["model_folder"], dtype=torch.float32, device=device)
    if config["init"]:  # fine-tune an existing head (its draft vocabulary is kept: see draft_vocab)
        head = Eagle3Head.load(config["init"], target, dtype=torch.float32)
    else:
        head = Eagle3Head.from_target(
            target, config["vocab"], seed=config["seed"], dtype=torch.float32, warm_start=config["warm_start"]
        )
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config["lr"], weight_decay=0.0)
    epoch0, step = 0, 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", map_location=device, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        epoch0, step = state["epoch"], state["step"]
    # DDP (world > 1; one worker runs the bare module): the head runs `steps` times per sample inside
    # ttt_logits, but all of it is one forward of TTTLoss and one backward, so DDP's per-parameter
    # hooks fire once per step with the summed gradient and it averages them across workers, bucketed.
    model = ray.train.torch.prepare_model(TTTLoss(head))

    def together(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """All-reduce a few numbers across the workers (as they are with one)."""
        if world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def past_deadline() -> bool:  # collective: every worker stops on the same step
        return together([float(time.time() > deadline)], dist.ReduceOp.MAX)[0] > 0

    def means(run_loss: float, run_acc: list[float], n: int) -> dict:  # over all workers' samples
        loss, *acc, n = together([run_loss, *run_acc, n])
        n = max(n, 1)
        return {"loss": loss / n, **{f"acc{k + 1}": a / n for k, a in enumerate(acc)}}

    shards = [Path(p) for p in config["shards"]]
    sizes = [shard_size(p) for p in shards]
    per_worker = sum(sizes) // world  # samples (= optimizer steps) per worker and epoch, on every worker
    if per_worker == 0:
        raise ValueError(f"{sum(sizes)} training samples cannot be shared by {world} workers")
    deadline = time.time() + 60 * config["minutes"]
    total_steps = config["epochs"] * per_worker
    stop = False
    for epoch in range(epoch0, config["epochs"]):
        g = torch.Generator().manual_seed(config["seed"] + epoch)
        order = [(i, j) for i in torch.randperm(len(shards), generator=g).tolist() for j in range(sizes[i])]
        mine = order[rank * per_worker : (rank + 1) * per_worker]
        run_loss, run_acc, n = 0.0, [0.0] * config["steps"], 0
        loaded, samples = None, []
        for i, j in mine:
            if i != loaded:  # `mine` runs through each of its shards in one go
                loaded, samples = i, read_shard(shards[i])
            s = samples[j]
            lr = config["lr"] * min(1.0, (step + 1) / 50) * max(0.1, 1 - step / max(total_steps, 1))
            for group in opt.param_groups:
                group["lr"] = lr
            loss, accs = model(
                s["taps"].float(),
                s["tokens"],
                s["pred"],
                steps=config["steps"],
                start=int(s["start"][0]),
                prompt_weight=config["prompt_weight"],
            )
            opt.zero_grad()
            loss.backward()  # DDP: gradients averaged across the workers here
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            run_loss += loss.item()
            run_acc = [a + b for a, b in zip(run_acc, accs)]
            n += 1
            if step % config["report_every"] == 0:
                ray.train.report({"epoch": epoch, "step": step, **means(run_loss, run_acc, n)})
            if stop := past_deadline():
                break
        samples = []
        metrics = {
            "epoch": epoch + 1,
            "step": step,
            **means(run_loss, run_acc, n),
            **sync_check(head, step, world, device),
        }
        if not metrics["ranks_in_sync"] and rank == 0:
            print(
                f"[train] WARNING: workers diverged: steps {metrics['rank_steps']}, weights {metrics['rank_digests']}",
                file=sys.stderr,
            )
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save(
                    {"head": head.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1, "step": step},
                    Path(d) / "state.pt",
                )
                head.save(Path(d) / "head")
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        if stop or past_deadline():
            break


def sync_check(head: Eagle3Head, step: int, world: int, device) -> dict:
    """Every worker's step count and head-weight digest (collective), and whether they all agree:
    data-parallel workers must hold bit-identical weights after every step."""
    import torch.distributed as dist

    mine = torch.tensor([step, *bytes.fromhex(state_digest(head))], dtype=torch.int64, device=device)
    everyone = [mine]
    if world > 1:
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
    steps = [int(t[0]) for t in everyone]
    digests = [bytes(t[1:].tolist()).hex() for t in everyone]
    return {
        "rank_steps": steps,
        "rank_digests": digests,
        "ranks_in_sync": len(set(steps)) == 1 and len(set(digests)) == 1,
    }


def fit(args, train_shards: list[Path], vocab: list[int]):
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(
        address=os.environ.get("RAY_ADDRESS") or "local",
        num_cpus=max(2, args.workers),
        include_dashboard=False,
        ignore_reinit_error=True,
    )
    # Ray Train's helper actors look the cluster up again: point them at ours, not another local one
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    storage = (Path(args.out) / "ray_train").resolve()
    config = {
        "model_folder": str(resolve(args.model)),
        "vocab": vocab,
        "shards": [str(p) for p in train_shards],
        "lr": args.lr,
        "epochs": args.epochs,
        "steps": args.ttt_steps,
        "seed": args.seed,
        "minutes": args.minutes,
        "threads": args.threads,
        "report_every": 20,
        "prompt_weight": args.prompt_weight,
        "warm_start": args.head_init == "target",
        "init": str(Path(args.init).resolve()) if args.init else None,
    }
    run = RunConfig(name="eagle3", storage_path=str(storage), checkpoint_config=CheckpointConfig(num_to_keep=2))
    scaling = ScalingConfig(
        num_workers=args.workers, use_gpu=args.use_gpu, resources_per_worker={"CPU": args.cpus_per_worker}
    )
    if args.resume and TorchTrainer.can_restore(str(storage / "eagle3")):
        trainer = TorchTrainer.restore(
            str(storage / "eagle3"), train_loop_per_worker=train_loop, train_loop_config=config
        )
    else:
        trainer = TorchTrainer(train_loop, train_loop_config=config, scaling_config=scaling, run_config=run)
    result = trainer.fit()
    if result.error:
        raise result.error
    return result


@torch.no_grad()
def evaluate(head: Eagle3Head, shards: list[Path], depth: int = 5, workloads: list[str] | None = None) -> dict:
    """Held-out acceptance of chain drafts, teacher-forced on the traces: per draft position k, the
    rate at which token k is right given 1..k-1 were; and mean accepted tokens per target forward.
    The headline figures count response positions only (where drafting happens live), per workload
    too; ``all_positions`` adds the prompts (easy to predict: tool schemas repeat), for comparison."""
    hits, tries = [0] * depth, [0] * depth
    acc: dict[str, list[int]] = {}  # region or workload -> [accepted, positions]
    i = -1
    for path in shards:
        for s in read_shard(path):
            i += 1
            tokens, pred = s["tokens"], s["pred"].long()
            L = tokens.shape[0] - 1
            if L <= depth:
                continue
            start = int(s["start"][0])
            logits = ttt_logits(head, s["taps"].float(), tokens, depth)
            drafted = [head.to_target_ids(lg.argmax(-1)) for lg in logits]  # step k at index i
            for pos in range(0, L - depth):
                n = 0
                response = pos >= start - 1
                for k in range(depth):  # draft token k+1 comes from step k+1 at index pos+k
                    if response:
                        tries[k] += 1
                    if int(drafted[k][pos + k]) != int(pred[pos + k + 1]):
                        break
                    hits[k] += response
                    n += 1
                keys = ["all"] + (
                    ["response", f"workload:{workloads[i]}" if workloads else "workload:?"] if response else []
                )
                for key in keys:
                    a = acc.setdefault(key, [0, 0])
                    a[0] += n
                    a[1] += 1

    def mat(key: str) -> float:
        return 1 + acc[key][0] / acc[key][1] if acc.get(key, [0, 0])[1] else 0.0

    return {
        "per_position_acceptance": [h / t if t else 0.0 for h, t in zip(hits, tries)],
        "mean_accepted_tokens_per_forward": mat("response"),
        "positions": acc.get("response", [0, 0])[1],
        "per_workload": {
            k.split(":", 1)[1]: {"mean_accepted_tokens_per_forward": mat(k), "positions": v[1]}
            for k, v in sorted(acc.items())
            if k.startswith("workload:")
        },
        "all_positions": {"mean_accepted_tokens_per_forward": mat("all"), "positions": acc.get("all", [0, 0])[1]},
        "scope": f"response positions (teacher-forced chain of {depth})",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--traces",
        required=True,
        nargs="+",
        help="trace directories (collect_traces output); their train split is trained on",
    )
    ap.add_argument(
        "--heldout",
        default=None,
        nargs="+",
        help="held-out trace directories (default: --traces' validation/test split)",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument(
        "--ttt-steps",
        type=int,
        default=3,
        help="unrolled draft steps in training (the chain depth "
        "drafting uses is 5: train with 5 to teach positions 4-5)",
    )
    ap.add_argument(
        "--prompt-weight",
        type=float,
        default=1.0,
        help="loss weight of prompt positions (responses weigh 1; the head only drafts responses)",
    )
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=60.0, help="training time budget")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-sequences", type=int, default=None)
    ap.add_argument("--feature-dtype", default="bfloat16", help="target dtype for feature extraction")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--cpus-per-worker", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--use-gpu", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--init",
        default=None,
        metavar="HEAD_DIR",
        help="start from this head's weights and draft vocabulary (fine-tuning) instead of from scratch",
    )
    ap.add_argument(
        "--head-init",
        choices=["target", "random"],
        default="target",
        help="a new head starts from the target's output layer and late features (target) "
        "or from noise (random: the recipe of the v1 head)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    train_shards = features_for(args, "train", args.traces, {"train"})
    vocab = draft_vocab(args, train_shards)
    result = fit(args, train_shards, vocab)
    heldout_shards = features_for(args, "heldout", args.heldout or args.traces, {"validation", "test"})
    with result.checkpoint.as_directory() as d:
        target = Transformer.from_pretrained(resolve(args.model), dtype=torch.float32)
        head = Eagle3Head.load(Path(d) / "head", target, dtype=torch.float32)
    report = evaluate(head, heldout_shards, workloads=shard_workloads(heldout_shards))
    out = Path(args.out)
    head.to(torch.bfloat16).save(out)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    history = result.metrics_dataframe
    loss_history = history["loss"].tolist() if history is not None and "loss" in history else []
    meta = {
        "train_metrics": result.metrics,
        "loss_history": loss_history,
        "heldout": report,
        "sha256": digest,
        "checkpoint": result.checkpoint.path,
        "args": vars(args),
        "draft_vocab_size": len(vocab),
    }
    (out / "training.json").write_text(json.dumps(meta, indent=1, default=str))
    print(json.dumps({"heldout": report, "sha256": digest}, indent=1))


if __name__ == "__main__":
    main()
