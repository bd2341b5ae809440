"""EAGLE-3 training: the training-time-test unroll equals what drafting computes, and training learns."""

from __future__ import annotations

from datetime import UTC

import torch

from hvd_ray.model.eagle3_head import Eagle3Head
from hvd_ray.model.transformer import Transformer
from hvd_ray.training.eagle3 import extract_features, read_shard, ttt_logits, ttt_loss, write_shards
from hvd_ray.workloads import split_of


def test_ttt_unroll_matches_cached_drafting(tiny_llama, tmp_path):
    target = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    head = Eagle3Head.from_target(target, seed=1, dtype=torch.float32)
    seq = list(range(7, 27))
    paths = write_shards(extract_features(target, [seq], head.tap_layers, max_len=64), tmp_path)
    sample = read_shard(paths[0])[0]
    taps, tokens = sample["taps"].float(), sample["tokens"]
    steps = 3
    with torch.no_grad():
        unrolled = ttt_logits(head, taps, tokens, steps)
    head.setup_cache(1, 64)
    for k in range(1, steps + 1):
        for i in (k - 1, 9, 17):
            c = i - k + 2  # committed indices 0..c-1
            head.cache.truncate(0, 0)
            prenorm, logits = head(tokens[1 : c + 1].long()[None], head.fuse(taps[:c])[None], [0])
            for j in range(2, k + 1):  # draft steps fed the true tokens and the head's own output
                pos = c + j - 2
                prenorm, logits = head(tokens[pos + 1 : pos + 2].long()[None], prenorm[:, -1:], [0])
            assert torch.allclose(logits[0, -1].float(), unrolled[k - 1][i], atol=1e-4), (k, i)


def test_a_few_ttt_steps_reduce_the_loss(tiny_llama, tmp_path):
    target = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    head = Eagle3Head.from_target(target, seed=0, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (40,), generator=g).tolist() for _ in range(4)]
    data = list(extract_features(target, seqs, head.tap_layers, max_len=64))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = last = None
    for _epoch in range(15):
        total = 0.0
        for s in data:
            loss, _ = ttt_loss(head, s["taps"].float(), s["tokens"], s["pred"], steps=3)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        first = total if first is None else first
        last = total
    assert last < 0.7 * first


def _smoke_traces(tmp_path):
    """24 repetitive trace rows (a head can learn something quickly) in two trace folders."""
    from datetime import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    from hvd_ray.traces.schema import TRACE_SCHEMA

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):
        base = torch.randint(3, 60, (6,), generator=g).tolist()
        seq = (base * 8)[: 30 + i % 5]
        rows.append(
            {
                "prompt_id": f"smoke/{i}",
                "workload": "chat",
                "split": "train",
                "seq": i,
                "prompt_tokens": seq[:8],
                "output_tokens": seq[8:],
                "finish_reason": "length",
                "model_id": "tiny",
                "model_revision": "x",
                "backend": "hvd_ray",
                "decoding": "{}",
                "prefill_s": 0.0,
                "decode_s": 0.0,
                "created_at": datetime.now(UTC),
                "topk_ids": None,
                "topk_logprobs": None,
            }
        )
    folders = [tmp_path / "traces-a", tmp_path / "traces-b"]
    for k, folder in enumerate(folders):
        folder.mkdir()
        pq.write_table(pa.Table.from_pylist(rows[k::2], schema=TRACE_SCHEMA), folder / "part-0.parquet")
    return folders, rows


def _job_env() -> dict:
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return env


def test_train_eagle3_job_smoke(tiny_llama, tmp_path):
    """The Ray Train job end to end on a tiny target with ``--workers 2`` (2 CPU Ray Train workers,
    DDP over gloo): loss goes down, the head round-trips, and both workers take the same number of
    steps (an equal share of the samples each epoch) and end with bit-identical head weights --
    which, since they trained on different samples, also shows the gradients were averaged. The
    digests the workers report are those of the weights rank 0 saved. Then ``--init`` (one worker)
    fine-tunes that head."""
    import json
    import os
    import subprocess
    import sys

    from hvd_ray.training.eagle3 import state_digest

    folders, rows = _smoke_traces(tmp_path)  # two trace folders, trained on together
    out = tmp_path / "head"
    env = _job_env()
    common = [
        "--model",
        str(tiny_llama),
        "--minutes",
        "3",
        "--draft-vocab",
        "64",
        "--max-len",
        "64",
        "--threads",
        "1",
        "--lr",
        "3e-3",
        "--feature-dtype",
        "float32",
    ]
    epochs = 6
    res = subprocess.run(
        [
            sys.executable,
            "jobs/train_eagle3.py",
            "--traces",
            *map(str, folders),
            "--out",
            str(out),
            "--epochs",
            str(epochs),
            "--workers",
            "2",
            "--cpus-per-worker",
            "0.5",
            *common,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    meta = json.loads((out / "training.json").read_text())
    m = meta["train_metrics"]
    n_train = sum(split_of(r["prompt_id"]) == "train" for r in rows)
    assert n_train % 2 == 1  # so one sample an epoch is left out, and the shares are still equal
    assert m["rank_steps"] == [epochs * (n_train // 2)] * 2, m
    assert m["step"] == epochs * (n_train // 2)
    assert len(m["rank_digests"]) == 2 and m["rank_digests"][0] == m["rank_digests"][1], m
    assert m["ranks_in_sync"] is True
    state = torch.load(f"{meta['checkpoint']}/state.pt", map_location="cpu", weights_only=True)
    assert state_digest(state["head"]) == m["rank_digests"][0]
    assert state["step"] == m["step"]
    per_folder = [json.loads((out / "features" / "train" / f.name / "done").read_text()) for f in folders]
    assert [d["source"] for d in per_folder] == [str(f.resolve()) for f in folders]
    assert sum(d["sequences"] for d in per_folder) == sum(split_of(r["prompt_id"]) == "train" for r in rows)
    losses = meta["loss_history"]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert 0 <= meta["heldout"]["per_position_acceptance"][0] <= 1
    target = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    shipped = Eagle3Head.load(out, target, dtype=torch.float32)
    trained = Eagle3Head.load(os.path.join(meta["checkpoint"], "head"), target, dtype=torch.float32)
    for (n, a), (_, b) in zip(shipped.state_dict().items(), trained.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2), n  # bf16 export of the same weights

    # --init fine-tunes that head: same draft vocabulary, and it starts where the first run ended
    tuned = tmp_path / "tuned"
    res = subprocess.run(
        [
            sys.executable,
            "jobs/train_eagle3.py",
            "--traces",
            *map(str, folders),
            "--out",
            str(tuned),
            "--init",
            os.path.join(meta["checkpoint"], "head"),
            "--epochs",
            "1",
            *common,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    again = Eagle3Head.load(tuned, target, dtype=torch.float32)
    assert torch.equal(again.d2t, shipped.d2t)
    start = json.loads((tuned / "training.json").read_text())["loss_history"][0]
    assert abs(start - losses[-1]) < abs(start - losses[0]), (losses, start)  # near where the first run ended


def test_prompt_positions_weigh_prompt_weight(tiny_llama):
    """With prompt_weight 0 the loss is the response positions' alone: changing what the target
    predicts inside the prompt leaves it unchanged; with weight 1 it moves."""
    target = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    head = Eagle3Head.from_target(target, seed=2, dtype=torch.float32)
    seq = list(range(30, 60))
    s = next(extract_features(target, [seq], head.tap_layers, max_len=64, starts=[12]))
    assert int(s["start"][0]) == 12
    other = s["pred"].clone()
    other[:10] = (other[:10] + 1) % 64  # labels of indices 0..9 (< start - 1) only
    with torch.no_grad():
        args = (s["taps"].float(), s["tokens"])
        resp = [ttt_loss(head, *args, p, steps=3, start=12, prompt_weight=0.0)[0].item() for p in (s["pred"], other)]
        full = [ttt_loss(head, *args, p, steps=3, start=12, prompt_weight=1.0)[0].item() for p in (s["pred"], other)]
    assert abs(resp[0] - resp[1]) < 1e-6 and abs(full[0] - full[1]) > 1e-4
