"""DIMR: search the VIA-SD slim verifier's routing mask on Ray Tune; compare with greedy and random masks.

    python jobs/search_slim.py --budget 0.6 --out hvd_ray/assets/slim-smollm2 [--minutes 20 --parallel 2]

1. measure per-sub-layer time on the real model (``hvd_ray.dimr.budget``; verify-shaped forward);
2. calibration = teacher-forced windows of the target's own greedy outputs on train-split prompts
   (``--traces`` parquet if present, else generated now with our Engine); held-out = validation split;
3. DIMR on Ray Tune (``OptunaSearch``: random start-up trials, then TPE interleaved with random
   trials; ``reuse_actors=True``; one model per actor) minimising ``--objective`` (R or KL(q‖q'));
   every trial's mask meets the budget by construction (``hvd_ray.dimr.space.decode``);
4. baselines at the same budget: greedy one-sub-layer-at-a-time on calibration KL, ``--random`` random
   masks; all masks scored on held-out (KL, R, top-1 agreement, mean agreed run), the DIMR and
   greedy masks timed directly;
5. writes ``--out``: ``mask.json`` + ``checksum.json`` (load with ``hvd_ray.dimr.load_mask``),
   ``report.md``, ``report.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from hvd_ray.dimr import SlimMask, save_mask
from hvd_ray.dimr.budget import SubLayerCosts, measure_costs, measure_mask
from hvd_ray.dimr.calibration import generate_sequences, place_windows, sequences_from_traces
from hvd_ray.dimr.cost import DEFAULT_ALPHA, DEFAULT_BETA
from hvd_ray.dimr.evaluator import SlimEvaluator
from hvd_ray.dimr.greedy import greedy_search
from hvd_ray.dimr.search import LOCAL_MOVES, OBJECTIVES, SearchProblem, run_screen, run_search
from hvd_ray.dimr.space import decode, parse_param, random_scores, screen_seeds

CACHE = Path(os.environ.get("HVD_RAY_CACHE", Path.home() / ".cache" / "hvd_ray"))
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help="folder for the mask artifact and the report")
    ap.add_argument("--budget", type=float, default=0.6, help="fraction of measured block time kept (0, 1]")
    ap.add_argument("--objective", choices=OBJECTIVES, default="r")
    ap.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    ap.add_argument("--beta", type=float, default=DEFAULT_BETA)
    ap.add_argument(
        "--traces",
        default=str(CACHE / "traces" / "train-v1"),
        help="calibration traces (train split); generated with our Engine if the folder is missing",
    )
    ap.add_argument(
        "--heldout",
        default=str(CACHE / "traces" / "val-v1"),
        help="held-out traces (validation split); generated if missing",
    )
    ap.add_argument("--generate", action="store_true", help="always generate calibration data, ignore --traces")
    ap.add_argument("--gen-max-tokens", type=int, default=128)
    ap.add_argument("--calib-seqs", type=int, default=48)
    ap.add_argument("--heldout-seqs", type=int, default=48)
    ap.add_argument("--windows", type=int, default=4, help="scored windows per sequence")
    ap.add_argument("--width", type=int, default=8, help="tokens per window (a draft's length)")
    ap.add_argument("--topk", type=int, default=64, help="target top-k kept per position (+ folded rest)")
    ap.add_argument("--max-len", type=int, default=640, help="longest calibration sequence (prompt + output)")
    ap.add_argument("--trials", type=int, default=2000, help="DIMR trial cap (--minutes usually ends it first)")
    ap.add_argument("--minutes", type=float, default=20.0, help="DIMR wall-clock budget (screen + search)")
    ap.add_argument("--parallel", type=int, default=2, help="concurrent trials (one actor each)")
    ap.add_argument(
        "--address", default=None, help="Ray cluster to run the trials on (default: $RAY_ADDRESS, else a local Ray)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per trial actor and in the driver")
    ap.add_argument(
        "--startup",
        type=int,
        default=16,
        help="start-up trials before TPE (warm-start points count; the rest are random)",
    )
    ap.add_argument("--random-every", type=int, default=2, help="after start-up, every k-th trial is random")
    ap.add_argument(
        "--local",
        choices=LOCAL_MOVES,
        default="swap",
        help="interleaved random trials: swap moves around the incumbent, Gaussian noise on its "
        "scores, or uniform random masks",
    )
    ap.add_argument("--local-sigma", type=float, default=0.05, help="σ of --local gauss")
    ap.add_argument(
        "--costs",
        default=None,
        help="reuse measured sub-layer costs (a report.json of an earlier run) instead of timing now",
    )
    ap.add_argument(
        "--greedy-from",
        default=None,
        help="take the greedy baseline mask from an earlier run's report.json (same calibration set "
        "and --costs) instead of recomputing it; the report says so",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prior", action="store_true", help="do not warm-start with the layer-skip heuristic")
    ap.add_argument(
        "--no-screen",
        action="store_true",
        help="skip the single-drop sensitivity screen (no screen-derived warm-start points)",
    )
    ap.add_argument("--seeds", type=int, default=8, help="warm-start points derived from the screen")
    ap.add_argument(
        "--greedy-recheck",
        type=int,
        default=8,
        help="lazy greedy: re-score only the m best candidates after the first pass (0 = full greedy)",
    )
    ap.add_argument("--no-greedy", action="store_true")
    ap.add_argument("--random", type=int, default=24, help="random equal-budget masks for the baseline")
    ap.add_argument("--time-prefix", type=int, default=512, help="cached prefix length of the timed forward")
    ap.add_argument("--time-tokens", type=int, default=8, help="new tokens of the timed forward")
    ap.add_argument("--time-batch", type=int, default=1)
    ap.add_argument("--time-rounds", type=int, default=9)
    a = ap.parse_args(argv)
    if not 0 < a.budget <= 1:
        ap.error("--budget must be in (0, 1]")
    if min(a.parallel, a.threads, a.windows, a.width, a.topk, a.calib_seqs, a.heldout_seqs) < 1:
        ap.error("--parallel, --threads, --windows, --width, --topk, --calib-seqs, --heldout-seqs must be >= 1")
    return a


def load_split(a, model, tokenizer, folder, traces: str, split: str, limit: int, revision: str, seed: int):
    if not a.generate and Path(traces).expanduser().is_dir():
        seqs = sequences_from_traces(
            str(Path(traces).expanduser()),
            limit=limit * 2,
            max_len=a.max_len,
            model_revision=revision,
            split=split,
            seed=seed,
        )
        source = f"traces {traces}"
    else:
        log(f"generating {split} calibration sequences with the Engine ({traces} not used)")
        seqs = generate_sequences(
            model, tokenizer, str(folder), split=split, limit=limit * 2, max_tokens=a.gen_max_tokens, max_len=a.max_len
        )
        source = f"generated ({split} split, greedy, {a.gen_max_tokens} tokens)"
    seqs = place_windows(seqs, a.windows, a.width, seed)[:limit]
    if not seqs:
        raise SystemExit(f"no {split} sequence has room for {a.windows} windows of {a.width} tokens")
    return seqs, source


def fmt_row(name: str, m: dict, cal: dict | None, kept: float, extra: str = "") -> str:
    c = f"{cal['kl']:.4f} | {cal['r']:.4f}" if cal else "– | –"
    return f"| {name} | {kept:.3f} | {c} | {m['kl']:.4f} | {m['r']:.4f} | {m['top1']:.3f} | {m['run']:.2f} | {extra} |"


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from hvd_ray.model import load, resolve
    from hvd_ray.traces.model_info import model_revision

    command = "python jobs/search_slim.py " + " ".join(sys.argv[1:] if argv is None else argv)
    folder = resolve(a.model)
    revision = model_revision(folder)
    model, tokenizer = load(a.model, dtype=a.dtype, device=a.device)
    log(f"model {folder.name} ({model.cfg.n_layers} layers, {a.dtype}, {a.device}), revision {revision[:12]}")

    if a.costs:
        costs = SubLayerCosts.from_json(json.loads(Path(a.costs).read_text())["costs"])
        log(f"sub-layer costs from {a.costs} (measured there)")
    else:
        costs = measure_costs(
            model, batch=a.time_batch, tokens=a.time_tokens, prefix=a.time_prefix, rounds=a.time_rounds
        )
    L = model.cfg.n_layers
    if costs.n_layers != L:
        raise SystemExit(f"--costs are for {costs.n_layers} layers, the model has {L}")
    log(
        f"measured: full forward {costs.full_s * 1e3:.1f} ms, attention {costs.attn[0] * 1e3:.3f} ms/layer, "
        f"MLP {costs.mlp[0] * 1e3:.3f} ms/layer, non-block {costs.rest * 1e3:.1f} ms"
    )

    calib, calib_src = load_split(a, model, tokenizer, folder, a.traces, "train", a.calib_seqs, revision, a.seed)
    held, held_src = load_split(
        a, model, tokenizer, folder, a.heldout, "validation", a.heldout_seqs, revision, a.seed + 1
    )
    log(
        f"calibration: {len(calib)} sequences x {a.windows} windows x {a.width} = "
        f"{len(calib) * a.windows * a.width} positions ({calib_src}); held-out: {len(held)} sequences ({held_src})"
    )

    problem = SearchProblem(
        model=str(folder),
        dtype=a.dtype,
        device=a.device,
        seqs=calib,
        costs=costs,
        budget=a.budget,
        objective=a.objective,
        alpha=a.alpha,
        beta=a.beta,
        width=a.width,
        topk=a.topk,
        threads=a.threads,
    )
    import ray

    out = Path(a.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    address = a.address or os.environ.get("RAY_ADDRESS")
    if address:  # a cluster: trials go wherever the scheduler finds a CPU (each node needs the model folder)
        ray.init(address=address, log_to_driver=False)
    else:  # "local": always a fresh instance, never a cluster joined by accident
        ray.init(address="local", num_cpus=a.parallel * a.threads, include_dashboard=False, log_to_driver=False)
    screen, screen_s, seeds = {}, 0.0, []
    try:
        log(f"DIMR: {a.parallel} parallel trials, up to {a.trials} trials / {a.minutes} min, objective {a.objective}")
        if not a.no_screen:
            screen, screen_s = run_screen(
                problem, parallel=a.parallel, storage=str(CACHE / "tune"), verbose=0, progress=log
            )
            seeds = screen_seeds({k: m[a.objective] for k, m in screen.items()}, costs, a.seeds, a.seed)
        res = run_search(
            problem,
            trials=a.trials,
            minutes=max(a.minutes - screen_s / 60, 0.5),
            parallel=a.parallel,
            startup=a.startup,
            random_every=a.random_every,
            seed=a.seed,
            storage=str(CACHE / "tune"),
            verbose=0,
            progress=log,
            prior=not a.no_prior,
            seeds=seeds,
            local=a.local,
            local_sigma=a.local_sigma,
        )
    finally:
        ray.shutdown()
    dimr_s = screen_s + res.wall_s
    log(
        f"DIMR done: {len(screen)} screen + {len(res.trials)} search trials on "
        f"{len({t.get('node') for t in res.trials})} Ray node(s) in {dimr_s:.0f} s; "
        f"best {a.objective}={res.metrics['objective']:.4f} mask {res.mask.spec()}"
    )

    kw = dict(alpha=a.alpha, beta=a.beta)
    ev = SlimEvaluator(model, calib, width=a.width, topk=a.topk)
    cal = {"dimr": ev.evaluate(res.mask, **kw), "full": ev.evaluate([], **kw)}
    masks = {"dimr": res.mask}
    greedy_info = {}
    if a.greedy_from:
        prev = json.loads(Path(a.greedy_from).read_text())
        if prev["costs"] != costs.to_json() or prev["calibration"]["sequences"] != len(calib):
            raise SystemExit("--greedy-from needs the same --costs and calibration set as that run")
        masks["greedy"] = SlimMask.parse(prev["masks"]["greedy"]["spec"], L)
        greedy_info = {**prev["greedy"], "from": a.greedy_from, "from_command": prev["command"]}
        cal["greedy"] = ev.evaluate(masks["greedy"], **kw)
        log(f"greedy mask from {a.greedy_from}: {masks['greedy'].spec()}")
    elif not a.no_greedy:
        t0 = time.perf_counter()
        first = {parse_param(k): m["kl"] for k, m in screen.items()} or None
        masks["greedy"], greedy_info = greedy_search(
            lambda s: ev.evaluate(s, **kw),
            costs,
            a.budget,
            metric="kl",
            recheck=a.greedy_recheck,
            first=first,
            progress=log,
        )
        greedy_info["wall_s"] = time.perf_counter() - t0
        greedy_info["first_pass_from_screen"] = bool(first)
        greedy_info["recheck"] = a.greedy_recheck
        cal["greedy"] = ev.evaluate(masks["greedy"], **kw)
        log(f"greedy done: {masks['greedy'].spec()} in {greedy_info['wall_s']:.0f} s")
    rng = random.Random(a.seed + 7)
    rand_masks = [decode(random_scores(L, rng), costs, a.budget) for _ in range(a.random)]
    rand_cal = [ev.evaluate(m, **kw) for m in rand_masks]
    ev = None  # frees the calibration K/V backups
    log(f"{a.random} random masks scored on calibration")

    hv = SlimEvaluator(model, held, width=a.width, topk=a.topk)
    heldout = {k: hv.evaluate(m, **kw) for k, m in masks.items()}
    heldout["full"] = hv.evaluate([], **kw)
    rand_held = [hv.evaluate(m, **kw) for m in rand_masks]
    hv = None
    model.cache = None
    if rand_masks:
        bi = min(range(len(rand_masks)), key=lambda i: rand_held[i]["kl"])
        bc = min(range(len(rand_masks)), key=lambda i: rand_cal[i][a.objective])
        masks["random_best_heldout"], heldout["random_best_heldout"], cal["random_best_heldout"] = (
            rand_masks[bi],
            rand_held[bi],
            rand_cal[bi],
        )
        masks["random_best_calib"], heldout["random_best_calib"], cal["random_best_calib"] = (
            rand_masks[bc],
            rand_held[bc],
            rand_cal[bc],
        )
    log("held-out scored; timing masks directly")
    timing = {
        k: measure_mask(
            model, masks[k], batch=a.time_batch, tokens=a.time_tokens, prefix=a.time_prefix, rounds=a.time_rounds
        )
        for k in ("dimr", "greedy")
        if k in masks
    }

    wins = {k: heldout["dimr"]["kl"] < heldout[k]["kl"] for k in ("greedy", "random_best_heldout") if k in heldout}
    meta = {
        "budget": a.budget,
        "objective": a.objective,
        "alpha": a.alpha,
        "beta": a.beta,
        "kept_fraction": costs.kept_fraction(res.mask),
        "measured": timing.get("dimr"),
        "heldout": heldout["dimr"],
        "calibration": cal["dimr"],
        "trials": len(screen) + len(res.trials),
        "search_s": dimr_s,
        "command": command,
    }
    mask = SlimMask(L, res.mask.skip, model_id=folder.name, model_revision=revision, meta=meta)
    save_mask(mask, out)

    report = {
        "command": command,
        "model": folder.name,
        "model_revision": revision,
        "dtype": a.dtype,
        "device": a.device,
        "budget": a.budget,
        "objective": a.objective,
        "alpha": a.alpha,
        "beta": a.beta,
        "calibration": {"source": calib_src, "sequences": len(calib), "positions": len(calib) * a.windows * a.width},
        "heldout": {"source": held_src, "sequences": len(held), "positions": len(held) * a.windows * a.width},
        "costs": costs.to_json(),
        "threads": a.threads,
        "parallel": a.parallel,
        "dimr": {
            "trials": len(res.trials),
            "screen_trials": len(screen),
            "screen_s": screen_s,
            "search_s": dimr_s,
            "warm_start_points": len(seeds) + (not a.no_prior),
            "startup": a.startup,
            "random_every": a.random_every,
            "local": a.local,
            "local_sigma": a.local_sigma,
            "best_trial": res.metrics,
        },
        "greedy": greedy_info,
        "random": {"n": len(rand_masks), "heldout_kl": [m["kl"] for m in rand_held]},
        "masks": {
            k: {
                "spec": m.spec(),
                "n_attn": sum(s == "attn" for _, s in m.skip),
                "n_mlp": sum(s == "mlp" for _, s in m.skip),
                "kept": costs.kept_fraction(m),
                "calibration": cal.get(k),
                "heldout": heldout.get(k),
            }
            for k, m in masks.items()
        },
        "full": {"calibration": cal["full"], "heldout": heldout["full"]},
        "timing": timing,
        "dimr_beats_on_heldout_kl": wins,
        "load": os.getloadavg(),
        "trial_history": [{k: t[k] for k in ("objective", "kl", "top1", "kept", "eval_s")} for t in res.trials],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(render_md(report))
    log(
        f"wrote {out}: mask {mask.spec()}; held-out KL dimr {heldout['dimr']['kl']:.4f}"
        + "".join(f", {k} {heldout[k]['kl']:.4f}" for k in ("greedy", "random_best_heldout") if k in heldout)
    )


def render_md(r: dict) -> str:
    names = {
        "dimr": f"DIMR (TPE+random, objective {r['objective'].upper()})",
        "greedy": "greedy (calibration KL)",
        "random_best_heldout": f"best of {r['random']['n']} random (by held-out KL)",
        "random_best_calib": f"best of {r['random']['n']} random (by calibration {r['objective'].upper()})",
    }
    lines = [
        f"# DIMR slim-verifier mask — {r['model']}, budget {r['budget']}",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Model revision `{r['model_revision'][:16]}`, {r['dtype']} on {r['device']}, "
        f"{r['threads']} thread(s) per trial, {r['parallel']} parallel trials. "
        f"R with α = {r['alpha']}, β = {r['beta']} (p ← slim q', q ← full target).",
        "",
        f"Calibration: {r['calibration']['sequences']} sequences, {r['calibration']['positions']} positions "
        f"({r['calibration']['source']}). Held-out: {r['heldout']['sequences']} sequences, "
        f"{r['heldout']['positions']} positions ({r['heldout']['source']}).",
        "",
        "| mask | kept block time (measured costs) | cal KL | cal R | held-out KL | held-out R | "
        "held-out top-1 | held-out mean run (of 8) | sub-layers skipped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, m in r["masks"].items():
        lines.append(
            fmt_row(
                names.get(k, k), m["heldout"], m["calibration"], m["kept"], f"{m['n_attn']} attn + {m['n_mlp']} MLP"
            )
        )
    f = r["full"]
    lines.append(fmt_row("full target (sanity)", f["heldout"], f["calibration"], 1.0, "none"))
    c = r["costs"]
    d = r["dimr"]
    lines += [
        "",
        f"DIMR search time {d['search_s']:.0f} s wall (incl. Ray actor start-up and the per-actor "
        f"calibration precompute): sensitivity screen {d['screen_trials']} trials in {d['screen_s']:.0f} s, "
        f"then {d['trials']} TPE/random trials ({d['warm_start_points']} warm-start points, "
        f"{d['startup']} start-up trials, every {d['random_every']}th later trial random"
        + {
            "swap": ": a local move, 1-2 random kept/skipped swaps of the incumbent",
            "gauss": f": a local move, incumbent scores + N(0, {d['local_sigma']}²)",
        }.get(d.get("local"), "")
        + ").",
    ]
    if r["greedy"]:
        g = r["greedy"]
        lines.append(
            f"Greedy: {g['evals']} evaluations in {g['wall_s']:.0f} s"
            + (" (its first pass is the DIMR screen, not re-evaluated)" if g.get("first_pass_from_screen") else "")
            + (
                f"; computed by an earlier run on the same calibration set and costs: `{g['from_command']}`"
                if g.get("from")
                else ""
            )
            + (f"; lazy, re-scoring the {g['recheck']} best candidates per step" if g.get("recheck") else "")
            + "."
        )
    lines += [
        "",
        "Measured time (verify-shaped forward: batch "
        f"{c['setting']['batch']}, {c['setting']['tokens']} new tokens after a {c['setting']['prefix']}-token "
        f"prefix; minimum over interleaved rounds): full forward {c['full_s'] * 1e3:.1f} ms, attention "
        f"{c['attn'][0] * 1e3:.3f} ms/layer, MLP {c['mlp'][0] * 1e3:.3f} ms/layer.",
    ]
    for k, t in r["timing"].items():
        lines.append(
            f"- {k}: forward time ratio {t['time_ratio']:.3f}, block-time fraction kept "
            f"{t['block_fraction']:.3f} (directly timed)"
        )
    lines += [
        "",
        "DIMR beats on held-out KL: "
        + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in r["dimr_beats_on_heldout_kl"].items()),
        "",
        "Masks:",
    ]
    lines += [f"- {names.get(k, k)}: `{m['spec']}`" for k, m in r["masks"].items()]
    lines += [
        "",
        f"Load average at the end: {', '.join(f'{x:.2f}' for x in r['load'])} (shared 2-core box: "
        "timings and search time include contention from other users).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
