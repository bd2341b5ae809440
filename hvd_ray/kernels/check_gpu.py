"""Check and time the Triton kernels on a CUDA device.

    python hvd_ray/kernels/check_gpu.py    # or: python -m hvd_ray.kernels.check_gpu [--vocab 49152] [--no-timings]

1. the checks the CPU tests run under ``TRITON_INTERPRET=1`` (kernel == torch reference), compiled
   for the GPU: at test sizes with small tiles, and at the default model's vocabulary with the
   launchers' own tile sizes;
2. the engine's entry points (``hvd_ray.verification``, ``KVCache.compact``) on CUDA give what they
   give with ``HVD_RAY_KERNELS=torch`` and, for the greedy ones, on CPU;
3. timings of every kernel against its torch reference at serving sizes (``triton.testing.do_bench``).

Without a CUDA device it says so and exits 0 (nothing to check; the CPU tests cover the kernels'
logic). Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch


def _engine_entry_points(dev: str, vocab: int) -> dict[str, str | None]:
    """The wired functions on CUDA vs the torch path (forced, and on CPU)."""
    from hvd_ray.kernels._triton import ENV_VAR
    from hvd_ray.model.kv_cache import KVCache
    from hvd_ray.model.transformer import ModelConfig
    from hvd_ray.verification import (
        greedy_accept_chain,
        greedy_accept_chain_batch,
        greedy_accept_tree,
        rejection_sample_chain,
    )

    def both(fn):
        """fn() with the kernels, then with HVD_RAY_KERNELS=torch."""
        old = os.environ.get(ENV_VAR)
        got = fn()
        os.environ[ENV_VAR] = "torch"
        try:
            want = fn()
        finally:
            os.environ.pop(ENV_VAR) if old is None else os.environ.__setitem__(ENV_VAR, old)
        return got, want

    out: dict[str, str | None] = {}
    g = torch.Generator().manual_seed(1)
    B, K = 8, 6
    logits = torch.randn(B, K + 1, vocab, generator=g).to(dev)
    drafts = logits.argmax(-1)[:, :K].clone()
    drafts[1, 2] += 1
    lens = torch.tensor([K, K, 3, 0, K, 1, 2, K], device=dev)
    try:
        got, want = both(lambda: greedy_accept_chain_batch(logits, drafts, lens))
        cpu = greedy_accept_chain_batch(logits.cpu(), drafts.cpu(), lens.cpu())
        assert all(torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), c) for a, b, c in zip(got, want, cpu))
        got, want = both(lambda: greedy_accept_chain(logits[1], drafts[1]))
        assert got == want == greedy_accept_chain(logits[1].cpu(), drafts[1].cpu()) and got[0] == 2
        parents = [-1, -1, 0, 0, 2, 1]
        tree = drafts[0].tolist()
        tree[1] = tree[0]
        got, want = both(lambda: greedy_accept_tree(logits[0], tree, parents))
        assert got == want == greedy_accept_tree(logits[0].cpu(), tree, parents)
        out["entry: greedy"] = None
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["entry: greedy"] = repr(e)
    try:
        probs = logits.float().softmax(-1)
        for dists in (None, torch.randn(K, vocab, generator=g).softmax(-1).to(dev)):

            def run(d=dists):
                gen = torch.Generator(device=dev).manual_seed(7)
                return rejection_sample_chain(probs[0], drafts[0], d, gen)

            got, want = both(run)
            assert got == want == run(), (got, want)
        out["entry: rejection"] = None
    except Exception as e:  # noqa: BLE001
        out["entry: rejection"] = repr(e)
    try:
        cfg = ModelConfig(
            vocab_size=vocab, dim=192, n_layers=3, n_heads=3, n_kv_heads=3, head_dim=64, intermediate_size=256
        )
        caches = {d: KVCache(cfg, 4, 64, torch.bfloat16, torch.device(d)) for d in (dev, "cpu")}
        for layer in range(cfg.n_layers):
            init = torch.randn(4, 3, 64, 64, generator=g).bfloat16()
            for c in caches.values():
                c.k[layer].copy_(init)
                c.v[layer].copy_(-init)
        for c in caches.values():
            c.lengths[2] = 30
            c.compact(2, 20, [0, 2, 3, 7, 9])
        assert all(
            torch.equal(a.cpu(), b) for a, b in zip(caches[dev].k + caches[dev].v, caches["cpu"].k + caches["cpu"].v)
        )
        assert caches[dev].lengths == caches["cpu"].lengths
        out["entry: KVCache.compact"] = None
    except Exception as e:  # noqa: BLE001
        out["entry: KVCache.compact"] = repr(e)
    return out


def _timings(dev: str, vocab: int) -> list[tuple[str, float, float]]:
    """(case, kernel ms, torch reference ms) at serving sizes."""
    from triton.testing import do_bench

    import hvd_ray.kernels as kn

    rows = []
    g = torch.Generator().manual_seed(2)
    for B in (1, 8, 32):
        k = 8
        logits = torch.randn(B, k + 1, vocab, generator=g).to(dev, torch.bfloat16)
        drafts = logits.argmax(-1)[:, :k].contiguous()  # all accepted: every row is read
        lens = torch.full((B,), k, device=dev)
        rows.append(
            (
                f"greedy B={B} k={k} bf16, all accepted",
                do_bench(functools.partial(kn.verify_greedy_triton, logits, drafts, lens)),
                do_bench(functools.partial(kn.verify_greedy_torch, logits, drafts, lens)),
            )
        )
    B, N = 8, 32
    logits = torch.randn(B, N + 1, vocab, generator=g).to(dev, torch.bfloat16)
    parents = torch.tensor([[-1] * 4 + [int(torch.randint(0, i, (1,), generator=g)) for i in range(4, N)]] * B)
    best = logits.argmax(-1).cpu()
    drafts = torch.stack([best[b, parents[b] + 1] for b in range(B)])  # every node the argmax of its parent
    args = (logits, drafts.to(dev), parents.to(dev), torch.full((B,), N, device=dev))
    rows.append(
        (
            f"tree B={B} N={N} bf16",
            do_bench(lambda: kn.verify_tree_triton(*args)),
            do_bench(lambda: kn.verify_tree_torch(*args)),
        )
    )
    B, k = 8, 8
    p = torch.randn(B, k + 1, vocab, generator=g).softmax(-1).to(dev)
    q = torch.randn(B, k, vocab, generator=g).softmax(-1).to(dev)
    drafts = p.argmax(-1)[:, :k].contiguous()
    lens = torch.full((B,), k, device=dev)
    au, su = torch.rand(B, k, device=dev), torch.rand(B, device=dev)
    rows.append(
        (
            f"rejection B={B} k={k} fp32, with q",
            do_bench(lambda: kn.verify_rejection_triton(p, drafts, lens, au, su, q)),
            do_bench(lambda: kn.verify_rejection_torch(p, drafts, lens, au, su, q)),
        )
    )
    shape = (16, 3, 4096, 64)  # the default model's cache: 3 KV heads, d=64
    kc = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(30)]
    vc = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(30)]
    keep = [[0, 1, 3, 6, 10]]
    rows.append(
        (
            "kv compact 30 layers, 1 slot, 5 of 16",
            do_bench(lambda: kn.compact_kv_triton(kc, vc, [3], [1000], keep)),
            do_bench(lambda: kn.compact_kv_torch(kc, vc, [3], [1000], keep)),
        )
    )
    keep8 = keep * 8
    rows.append(
        (
            "kv compact 30 layers, 8 slots",
            do_bench(lambda: kn.compact_kv_triton(kc, vc, list(range(8)), [1000] * 8, keep8)),
            do_bench(lambda: kn.compact_kv_torch(kc, vc, list(range(8)), [1000] * 8, keep8)),
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary of the full-size checks and timings")
    ap.add_argument("--samples", type=int, default=200_000, help="sequences in the chi-square check")
    ap.add_argument("--no-timings", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"check_gpu: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False): "
            "nothing to check. The CPU tests (tests/test_kernels.py) run the same checks under TRITON_INTERPRET=1."
        )
        return 0
    from hvd_ray.kernels._triton import HAVE_TRITON

    if not HAVE_TRITON:
        print("check_gpu: a CUDA device but no Triton: `pip install triton` (the version your torch pins)")
        return 1
    from hvd_ray.kernels.checks import Setup, run_checks

    dev = "cuda"
    print(f"check_gpu: {torch.cuda.get_device_name()} torch {torch.__version__}")
    results: dict[str, str | None] = {}
    for label, setup in (
        ("small tiles", Setup(device=dev, samples=args.samples)),
        (f"V={args.vocab}", Setup(device=dev, vocab=args.vocab, block_v=None, batch=8, seed=1, samples=args.samples)),
    ):
        results.update({f"{name} ({label})": err for name, err in run_checks(setup).items()})
    results.update(_engine_entry_points(dev, args.vocab))
    for name, err in results.items():
        print(f"  {'ok  ' if err is None else 'FAIL'} {name}" + ("" if err is None else f"\n{err}"))
    failed = sum(err is not None for err in results.values())
    if not args.no_timings:
        print(f"\n  {'case':44s} {'triton ms':>10s} {'torch ms':>10s} {'speed-up':>9s}")
        for case, t_k, t_t in _timings(dev, args.vocab):
            print(f"  {case:44s} {t_k:10.4f} {t_t:10.4f} {t_t / t_k:8.1f}x")
    print(f"check_gpu: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
