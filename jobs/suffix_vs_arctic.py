"""Suffix drafter vs arctic-inference's C++ SuffixDecodingCache on the same token streams.

Simulates greedy decoding against a known continuation: each request is a text split into prompt
(first quarter) and "generated" output; at every step both drafters speculate, the draft is accepted
up to its longest prefix (chain) or root path (tree) matching the true continuation, and the
accepted tokens plus one bonus token are appended. Requests run one after another (A then B per
request, so machine noise hits both alike) and outputs stay in each drafter's global cache.

    .venv/bin/python jobs/suffix_vs_arctic.py --tokens 100000 \
        --out benchmarks/suffix_vs_arctic.md

arctic-inference is optional (``pip install -e .[bench]``; see the .md for how it was built).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hvd_ray.drafters.suffix import SuffixConfig, SuffixDrafter

TOKENIZER = Path.home() / ".cache/hvd_ray/models/SmolLM2-135M-Instruct/tokenizer.json"
STDLIB_PKGS = [
    "json",
    "email",
    "http",
    "urllib",
    "logging",
    "concurrent",
    "unittest",
    "asyncio",
    "importlib",
    "xml",
    "multiprocessing",
    "sqlite3",
    "tomllib",
    "zoneinfo",
]


# ------------------------------------------------------------------ token streams
class Tok:
    """SmolLM2's BPE tokenizer when provisioned, else a word/punctuation id map (stable order)."""

    def __init__(self) -> None:
        self.name = "regex word-level ids"
        self._tok = None
        if TOKENIZER.exists():
            try:
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(TOKENIZER))
                self.name = f"SmolLM2-135M-Instruct BPE ({TOKENIZER.name})"
            except Exception as e:  # pragma: no cover - fallback path
                print(f"tokenizer unavailable ({e}); using regex ids", file=sys.stderr)
        self._vocab: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text).ids
        return [self._vocab.setdefault(w, len(self._vocab)) for w in re.findall(r"\w+|[^\w\s]|\s+", text)]


def code_texts() -> list[str]:
    """Python stdlib sources (fixed by the interpreter version)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for pkg in STDLIB_PKGS:
        for f in sorted((lib / pkg).rglob("*.py")):
            if "test" not in f.parts:
                out.append(f.read_text(encoding="utf-8", errors="replace"))
    return out


def json_texts() -> list[str]:
    """Function-calling records (BFCL, shipped in the bfcl-eval wheel), one JSON object each."""
    try:
        import bfcl_eval
    except ImportError:
        return []
    data = Path(bfcl_eval.__file__).parent / "data"
    out = []
    for name in [
        "BFCL_v4_multiple.json",
        "BFCL_v4_live_multiple.json",
        "BFCL_v4_parallel.json",
        "BFCL_v4_simple_python.json",
    ]:
        f = data / name
        if f.exists():
            out += [json.dumps(json.loads(line), indent=1) for line in f.read_text().splitlines() if line.strip()]
    return out


def make_requests(
    texts: list[str], tok: Tok, budget: int, max_out: int = 1024, skip: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs: prompt = first quarter, output = up to ``max_out`` following."""
    reqs, used = [], 0
    for text in texts[skip:]:
        ids = tok(text)
        if len(ids) < 64:
            continue
        p = len(ids) // 4
        prompt, out = ids[:p], ids[p : p + max_out]
        reqs.append((prompt, out))
        used += len(prompt) + len(out)
        if used >= budget:
            break
    return reqs


# ------------------------------------------------------------------ drafters under test
class Ours:
    name = "hvd_ray"

    def __init__(self, tree: bool) -> None:
        self.d = SuffixDrafter(SuffixConfig(use_tree_spec=tree, max_cached_requests=10000))

    def begin(self, rid, prompt, full):
        self.d.begin(rid, prompt)

    def speculate(self, rid, n):
        d = self.d.speculate(rid)
        return d.token_ids, d.parents

    def accept(self, rid, toks):
        self.d.accept(rid, toks)

    def end(self, rid):
        self.d.end(rid)


class Arctic:
    name = "arctic-inference"

    def __init__(self, tree: bool) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.c = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=10000)
        self.tree = tree
        self.full: np.ndarray | None = None

    def begin(self, rid, prompt, full):
        self.full = np.asarray(full, dtype=np.int32)  # context views are zero-copy slices
        self.c.start_request(rid, prompt)

    def speculate(self, rid, n):
        ctx = self.full[max(0, n - 64) : n]
        d = self.c.speculate(
            rid,
            ctx,
            max_spec_tokens=64,
            max_spec_factor=1.0,
            max_spec_offset=0.0,
            min_token_prob=0.1,
            use_tree_spec=self.tree,
        )
        return d.token_ids, d.parents

    def accept(self, rid, toks):
        self.c.add_active_response(rid, toks)

    def end(self, rid):
        self.c.stop_request(rid)


class ArcticRaw(Arctic):
    """Same cache, but speculate calls the two C++ trees directly (no Python wrapper)."""

    name = "arctic-inference (C++ calls only)"

    def __init__(self, tree: bool) -> None:
        super().__init__(tree)
        from arctic_inference.suffix_decoding._C import SuffixTree

        self.spec = SuffixTree.speculate_ndarray
        self.g = self.c._global_tree

    def speculate(self, rid, n):
        ctx = self.full[max(0, n - 64) : n]
        d1 = self.spec(self.c._local_trees[rid], ctx, 64, 1.0, 0.0, 0.1, self.tree)
        d2 = self.spec(self.g, ctx, 64, 1.0, 0.0, 0.1, self.tree)
        d = d1 if d1.score >= d2.score else d2
        return d.token_ids, d.parents


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Longest draft root path that matches ``truth`` (a chain's longest matching prefix)."""
    depth = [0] * len(tokens)
    best = 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = 1 if p < 0 else depth[p] + 1 if depth[p] > 0 else 0
        depth[i] = d if d and d <= len(truth) and truth[d - 1] == t else 0
        best = max(best, depth[i])
    return best


class Stats:
    def __init__(self) -> None:
        self.spec_ns: list[int] = []
        self.app_ns: list[int] = []
        self.steps = self.acc = self.drafted = self.tokens = 0


def run_request(impl, rid, prompt, out, st: Stats) -> None:
    full = prompt + out
    impl.begin(rid, prompt, full)
    pc = time.perf_counter_ns
    i, P = 0, len(prompt)
    while i < len(out):
        t0 = pc()
        toks, parents = impl.speculate(rid, P + i)
        t1 = pc()
        a = accepted(toks, parents, out[i:])
        step = out[i : i + a + 1]
        t2 = pc()
        impl.accept(rid, step)
        t3 = pc()
        st.spec_ns.append(t1 - t0)
        st.app_ns.append(t3 - t2)
        st.steps += 1
        st.acc += a
        st.drafted += len(toks)
        st.tokens += len(step)
        i += len(step)
    impl.end(rid)


def agreement(reqs, tree: bool) -> tuple[float, float, int]:
    """Lockstep on identical contexts: share of steps whose drafts are identical, and whose
    score and match length agree (ties between equally frequent tokens are broken differently)."""
    o, a = Ours(tree), Arctic(tree)
    same = same_score = steps = 0
    for k, (p, out) in enumerate(reqs):
        o.begin(k, p, p + out)
        a.begin(k, p, p + out)
        i = 0
        while i < len(out):
            n = len(p) + i
            od = o.d.speculate(k)
            ad = a.c.speculate(
                k,
                a.full[max(0, n - 64) : n],
                max_spec_tokens=64,
                max_spec_factor=1.0,
                max_spec_offset=0.0,
                min_token_prob=0.1,
                use_tree_spec=tree,
            )
            steps += 1
            same += od.token_ids == list(ad.token_ids) and od.parents == list(ad.parents)
            same_score += abs(od.score - ad.score) < 1e-4 and (od.match_len == ad.match_len or not od.token_ids)
            step = out[i : i + accepted(od.token_ids, od.parents, out[i:]) + 1]
            o.accept(k, step)
            a.accept(k, step)
            i += len(step)
        o.end(k)
        a.end(k)
    return same / steps, same_score / steps, steps


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000, help="prompt+output tokens in all")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--no-tree", action="store_true", help="skip the tree-speculation rows")
    args = ap.parse_args()

    tok = Tok()
    code, js = code_texts(), json_texts()
    budget = args.tokens // 2 if js else args.tokens
    workloads = {"code (stdlib .py)": make_requests(code, tok, budget, skip=5)}
    if js:
        workloads["json (BFCL records)"] = make_requests(js, tok, args.tokens - budget, skip=5)
    warm = make_requests(code, tok, 4000) + (make_requests(js, tok, 4000) if js else [])

    impls = [Ours]
    arctic_err = None
    try:
        Arctic(False)
        impls += [Arctic, ArcticRaw]
    except Exception as e:
        arctic_err = f"{type(e).__name__}: {e}"
    modes = [False] if args.no_tree else [False, True]

    rows = []
    for wname, reqs in workloads.items():
        for tree in modes:
            drafters = [cls(tree) for cls in impls]
            for d in drafters:  # warm-up on other texts, on separate instances
                w = type(d)(tree)
                for k, (p, o) in enumerate(warm):
                    run_request(w, f"w{k}", p, o, Stats())
            stats = [Stats() for _ in drafters]
            for k, (p, o) in enumerate(reqs):  # A B A B ... per request
                for d, st in zip(drafters, stats):
                    run_request(d, k, p, o, st)
            for d, st in zip(drafters, stats):
                rows.append(
                    dict(
                        workload=wname,
                        mode="tree" if tree else "chain",
                        impl=d.name,
                        requests=len(reqs),
                        tokens=sum(len(p) + len(o) for p, o in reqs),
                        steps=st.steps,
                        mat=st.acc / st.steps,
                        tps=st.tokens / st.steps,
                        drafted=st.drafted / st.steps,
                        spec50=pct(st.spec_ns, 0.5),
                        spec90=pct(st.spec_ns, 0.9),
                        app50=pct(st.app_ns, 0.5),
                        app90=pct(st.app_ns, 0.9),
                        app_tok=sum(st.app_ns) / st.tokens / 1000.0,
                    )
                )
                r = rows[-1]
                print(
                    f"{wname:22s} {r['mode']:5s} {r['impl']:16s} acc/step {r['mat']:.3f} "
                    f"spec p50 {r['spec50']:.1f}us p90 {r['spec90']:.1f}us "
                    f"append p50 {r['app50']:.1f}us",
                    flush=True,
                )

    agree = {}
    if not arctic_err:
        for wname, reqs in workloads.items():
            for tree in modes:
                agree[(wname, "tree" if tree else "chain")] = agreement(reqs, tree)

    md = report(rows, agree, tok, arctic_err, args)
    if args.out:
        args.out.write_text(md)
    print(md)


def report(rows, agree, tok, arctic_err, args) -> str:
    try:
        from importlib.metadata import version

        av = version("arctic-inference")
    except Exception:
        av = "not installed"
    lines = [
        "# Suffix drafter vs arctic-inference",
        "",
        "Produced by:",
        "",
        "```",
        f".venv/bin/python jobs/suffix_vs_arctic.py --tokens {args.tokens}"
        + (" --no-tree" if args.no_tree else "")
        + " --out benchmarks/suffix_vs_arctic.md",
        "```",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), Python "
        f"{platform.python_version()}; arctic-inference {av}; tokens: {tok.name}.",
        "Both drafters: max depth 64, max 64 spec tokens, factor 1.0, offset 0.0, min token prob "
        "0.1, global cache of past outputs (live outputs included), requests run A B A B.",
        "",
        "arctic-inference was built from its PyPI sdist into the venv (benchmark-only, `bench` "
        "extra): `apt-get install -y cmake; .venv/bin/pip install nanobind==2.9.2 "
        "scikit-build-core; CMAKE_ARGS=-DPython_EXECUTABLE=$PWD/.venv/bin/python .venv/bin/pip "
        "install --no-build-isolation arctic-inference`.",
        "",
        "Workloads: Python stdlib sources and BFCL function-calling records (JSON), each text one "
        "request, prompt = its first quarter, output = up to 1,024 following tokens; ~half the "
        "token budget each.",
        "",
        "Greedy simulation: at each step speculate, accept the longest draft prefix / root path "
        "that matches the true continuation, append accepted + 1 bonus token. `acc/step` = mean "
        "accepted draft tokens per step (MAT - 1); `tok/step` includes the bonus token. "
        "Latencies are per call (`append` = one `accept` of a step's tokens), in microseconds, "
        "`perf_counter_ns`, after a warm-up on other texts.",
        "",
        "| workload | mode | drafter | requests | tokens | steps | acc/step | tok/step | "
        "draft len | speculate p50 | speculate p90 | append p50 | append p90 | append / token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['impl']} | {r['requests']} | {r['tokens']} | "
            f"{r['steps']} | {r['mat']:.3f} | {r['tps']:.3f} | {r['drafted']:.2f} | "
            f"{r['spec50']:.1f} | {r['spec90']:.1f} | {r['app50']:.1f} | {r['app90']:.1f} | "
            f"{r['app_tok']:.1f} |"
        )
    lines += [
        "",
        "hvd_ray's speculate is pure Python yet cheaper per call: it reuses the "
        "sequences' active nodes as the matches for every suffix length (arctic walks each "
        "of up to 63 suffixes from the root) and tries match lengths longest-first, "
        "skipping any whose score upper bound (probability of its first token x tokens "
        "allowed) cannot beat the best so far. Its append is 4-5x slower than C++ (up to 64 "
        "active nodes touched per token in the interpreter, in two trees).",
        "",
    ]
    if arctic_err:
        lines.append(f"arctic-inference could not be used: `{arctic_err}`.")
    else:
        lines.append(
            "Ratios hvd_ray / arctic-inference (its Python `SuffixDecodingCache`, and in "
            "brackets its two C++ tree calls alone):"
        )
        lines.append("")
        lines.append("| workload | mode | acc/step | speculate p50 | append p50 |")
        lines.append("|---|---|---|---|---|")
        by = {(r["workload"], r["mode"], r["impl"]): r for r in rows}
        for (w, m, i), r in by.items():
            if i != "hvd_ray" or (w, m, Arctic.name) not in by:
                continue
            a, c = by[(w, m, Arctic.name)], by[(w, m, ArcticRaw.name)]
            lines.append(
                f"| {w} | {m} | {r['mat'] / a['mat']:.3f} | "
                f"{r['spec50'] / a['spec50']:.2f}x ({r['spec50'] / c['spec50']:.2f}x) | "
                f"{r['app50'] / a['app50']:.2f}x |"
            )
        lines += [
            "",
            "Draft fidelity: both drafters fed the same contexts in lockstep (advancing "
            "by hvd_ray's acceptance). Drafts differ almost only where two continuations "
            "are equally frequent: hvd_ray breaks such ties by the smaller token id, arctic "
            "by its sibling-list order; arctic also multiplies float32 ratios where hvd_ray "
            "divides exact counts.",
            "",
            "| workload | mode | steps | identical drafts | same score and match length |",
            "|---|---|---|---|---|",
        ]
        for (w, m), (same, same_score, steps) in agree.items():
            lines.append(f"| {w} | {m} | {steps} | {same:.1%} | {same_score:.1%} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
