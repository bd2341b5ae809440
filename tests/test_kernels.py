"""Triton kernels (``hvd_ray/kernels/``) against their torch references.

The kernels run on CPU tensors under ``TRITON_INTERPRET=1`` in one subprocess, so the interpreter
setting (read when Triton compiles a kernel) never reaches the other tests of this pytest process;
``hvd_ray.kernels.checks`` holds the checks, which ``hvd_ray/kernels/check_gpu.py`` runs on a GPU as well. The
torch side (references, CPU dispatch, the engine functions they must agree with) runs in process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = ["greedy", "greedy_ties", "tree", "rejection", "rejection_distribution", "kv_compact"]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    """``hvd_ray.kernels.checks.run_checks`` under the Triton interpreter: ``{check: None | error}``."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton): the kernels cannot be interpreted")
    code = (
        "import json, torch; torch.set_num_threads(1)\n"
        "from hvd_ray.kernels.checks import Setup, run_checks\n"
        "print('RESULTS ' + json.dumps(run_checks(Setup(samples=200))))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


def test_every_check_ran(interpreted):
    assert sorted(interpreted) == sorted(CHECK_NAMES)


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_equals_reference_interpreted(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # no kernel has a multiply-add to fuse
def test_kernels_compile_for_a_cuda_gpu():
    """GPU code generation (PTX, then cubin for sm_90 through Triton's bundled ptxas), no GPU needed:
    catches what the interpreter cannot, e.g. a loop-carried value changing type."""
    pytest.importorskip("triton", reason="triton is not installed")
    from hvd_ray.kernels.checks import compile_for_cuda

    done = compile_for_cuda(90, dtypes=("fp32", "bf16"))
    assert len(done) == 10, done


def test_interpreter_setting_does_not_leak():
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# --- the torch side, in process ---------------------------------------------------------------


def test_cpu_dispatch_runs_the_references():
    from hvd_ray import kernels
    from hvd_ray.verification import greedy_accept_chain_batch, greedy_accept_tree

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g)
    drafts = logits.argmax(-1)[:, :4].clone()
    drafts[1, 1] += 1
    lens = torch.tensor([4, 4, 0])
    acc, bonus = kernels.verify_greedy(logits, drafts, lens)
    assert acc.tolist() == [4, 1, 0]
    assert all(torch.equal(a, b) for a, b in zip((acc, bonus), greedy_accept_chain_batch(logits, drafts, lens)))
    parents = torch.tensor([[-1, -1, 0, 2]] * 3)
    path, n, bonus = kernels.verify_tree(logits, drafts, parents, torch.tensor([4, 4, 2]))
    for b, m in enumerate((4, 4, 2)):
        want_path, want_bonus = greedy_accept_tree(logits[b, : m + 1], drafts[b, :m], parents[b, :m].tolist())
        assert path[b, : n[b]].tolist() == want_path and int(bonus[b]) == want_bonus
        assert (path[b, n[b] :] == -1).all()


def test_greedy_references_walk_like_the_engine():
    """kernels keep torch references of their own (they import nothing else from hvd_ray): random chains
    and trees, tied logits and duplicate sibling tokens included, give the engine's walks."""
    from hvd_ray.kernels import verify_greedy_torch, verify_tree_torch
    from hvd_ray.verification import greedy_walk
    from hvd_ray.verification.greedy import greedy_accept_chain

    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        B, N, V = 1 + trial % 4, trial % 7, 3
        logits = torch.randint(0, 2, (B, N + 1, V), generator=g).float()  # many ties
        best = logits.argmax(-1)
        drafts = torch.where(torch.rand(B, N, generator=g) < 0.7, best[:, :N], torch.randint(0, V, (B, N), generator=g))
        lens = torch.randint(0, N + 1, (B,), generator=g)
        acc, bonus = verify_greedy_torch(logits, drafts, lens)
        parents = torch.tensor(
            [[int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(N)] for _ in range(B)],
            dtype=torch.long,
        ).reshape(B, N)
        path, plen, tbonus = verify_tree_torch(logits, drafts, parents, lens)
        for b in range(B):
            n = int(lens[b])
            assert (int(acc[b]), int(bonus[b])) == greedy_accept_chain(logits[b, : n + 1], drafts[b, :n])
            want = greedy_walk(best[b, : n + 1].tolist(), drafts[b, :n].tolist(), parents[b, :n].tolist())
            assert (path[b, : plen[b]].tolist(), int(tbonus[b])) == want


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_reference_accepts_like_the_engine(with_q):
    """Same generator, same uniforms for the accept tests: the accepted count is the engine's."""
    from hvd_ray.kernels import verify_rejection_torch
    from hvd_ray.verification import rejection_sample_chain

    g = torch.Generator().manual_seed(3)
    V = 40
    for trial in range(60):
        n = trial % 6
        p = (torch.randn(n + 1, V, generator=g) * 2).softmax(-1)
        q = (torch.randn(n, V, generator=g) * 2).softmax(-1) if with_q else None
        follow = p.argmax(-1)[:n] if trial % 2 else torch.randint(0, V, (n,), generator=g)
        seed = 100 + trial
        k_engine, tok_engine = rejection_sample_chain(p, follow, q, torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed)
        accept_u = torch.rand(n, generator=gen)[None]
        sample_u = torch.rand(1, generator=gen)
        acc, tok = verify_rejection_torch(
            p[None], follow[None], [n], accept_u, sample_u, None if q is None else q[None]
        )
        assert int(acc) == k_engine
        row = p[int(acc)]
        assert row[int(tok)] > 0
        if int(acc) < n and q is None:
            assert int(tok) != int(follow[int(acc)])  # the rejected token has no residual mass


def test_rejection_reference_distribution():
    from hvd_ray.kernels import verify_rejection_torch
    from hvd_ray.kernels.checks import Setup, rejection_distribution

    rejection_distribution(verify_rejection_torch, Setup(), n=100_000)


def test_chi_square_check_catches_a_wrong_sampler():
    """The distribution check has teeth: ignoring the draft distributions biases the output."""
    from hvd_ray.kernels import verify_rejection_torch
    from hvd_ray.kernels.checks import Setup, rejection_distribution

    def wrong(p, d, lens, au, su, q):
        return verify_rejection_torch(p, d, lens, au, su, None if q is None else torch.full_like(q, 1 / q.shape[-1]))

    with pytest.raises(AssertionError, match="differs from the target"):
        rejection_distribution(wrong, Setup(), n=20_000)


def test_compact_reference_equals_kvcache_compact():
    from hvd_ray.kernels import compact_kv, compact_kv_torch
    from hvd_ray.model.kv_cache import KVCache
    from hvd_ray.model.transformer import ModelConfig

    cfg = ModelConfig(vocab_size=10, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=8, intermediate_size=8)
    cache = KVCache(cfg, 3, 32, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    k, v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    cache.lengths[1] = 20
    cache.compact(1, 10, [0, 3, 4, 8])
    compact_kv_torch(k, v, [1], [10], [[0, 3, 4, 8]])
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, k + v))
    assert cache.lengths[1] == 14
    compact_kv(k, v, [2, 0], [0, 5], [[0, 1], [0, 2]])  # CPU: the reference; the no-op entry is skipped
    assert torch.equal(k[0][0, :, 6], cache.k[0][0, :, 7])
    with pytest.raises(ValueError, match="increasing"):
        compact_kv(k, v, [0], [0], [[0, 2, 2]])
    with pytest.raises(ValueError, match="outside"):
        compact_kv(k, v, [0], [30], [[0, 5]])


def test_package_name_shadows_nothing():
    """Ours is ``hvd_ray.kernels``: a top-level ``kernels`` is Hugging Face's distribution (which
    transformers imports) or nothing, never this repository's code."""
    spec = importlib.util.find_spec("hvd_ray.kernels")
    assert spec is not None and Path(spec.origin).parent == ROOT / "hvd_ray" / "kernels"
    assert not (ROOT / "kernels").exists()
    spec = importlib.util.find_spec("kernels")
    assert spec is None or "site-packages" in Path(spec.origin).parts, spec.origin


def test_nothing_imports_a_top_level_kernels():
    """Every import of ours names ``hvd_ray.kernels``: a stale ``from kernels import ...`` would reach
    Hugging Face's package, and only on CUDA (where the engine calls the kernels), so no CPU test runs it."""
    import ast

    bad = []
    for d in ("hvd_ray", "tests", "jobs"):
        for p in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                bad += [f"{p.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "kernels"]
    assert not bad, "imports of a top-level kernels:\n" + "\n".join(bad)


def test_transformers_imports_its_hub_kernels():
    """transformers' hub-kernels integration imports Hugging Face's ``kernels`` (from 5.25 it requires
    it): our old top-level ``kernels`` package shadowed it, and that import failed."""
    if importlib.util.find_spec("transformers.integrations.hub_kernels") is None:
        pytest.skip("this transformers has no hub-kernels integration")
    importlib.import_module("transformers.integrations.hub_kernels")


def test_importing_the_package_is_cheap():
    """``import hvd_ray.kernels`` (the verify functions import it lazily) does not load Triton."""
    code = "import sys, hvd_ray.kernels as kn; assert 'triton' not in sys.modules; kn.verify_greedy; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_check_gpu_without_cuda_exits_cleanly():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: run hvd_ray/kernels/check_gpu.py itself")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "hvd_ray" / "kernels" / "check_gpu.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
