"""Train the yield predictor g_θ on trace-replay labels and export a pickle-free artifact + report.

    python jobs/train_predictor.py --labels /abs/labels [--labels more] --out /abs/predictor [--tau 6]

* rows: every labelled position whose cache draft is non-empty (the policy only asks g_θ then;
  ``--positions steps`` keeps only the simulated run's step starts); target ``y_cache``;
* split BY TRACE: the traces' own ``split`` column (by prompt id) when it has train and test
  traces, else a ``GroupShuffleSplit`` on ``prompt_id``; validation likewise (or carved from train);
* model: ``StandardScaler`` + ``MLPRegressor`` (ReLU, squared error; paper: 2x256), a small grid
  over size / alpha / learning rate chosen on validation MSE (``--grid paper`` fits only 2x256);
* report (``report.json``, ``report.md``, ``calibration.png`` when matplotlib is installed): test
  MSE/MAE, precision and recall of ``ŷ >= τ`` for ``y >= τ`` (and the suffix score as a baseline
  predictor), calibration (mean y per ŷ bin), permutation importances, numpy-vs-sklearn agreement,
  single-φ latency, and an offline comparison of the selection policies on the test traces;
* artifact: ``predictor.npz`` + ``predictor.json`` (``hvd_ray.selection.predictor.YieldPredictor``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hvd_ray.selection.cost_policy import CostPolicy
from hvd_ray.selection.features import SPEC, FeatureSpec
from hvd_ray.selection.policy import AlwaysCache, AlwaysModel, OraclePolicy, ScoreRule, TauPolicy
from hvd_ray.selection.predictor import YieldPredictor
from hvd_ray.traces.labels import META_FILE, SPEC_KEY, with_regime
from hvd_ray.traces.simulate import simulate, trace_labels_from_table
from hvd_ray.workloads import conversation_id

GRID = [
    {"hidden_layer_sizes": (256, 256), "alpha": 1e-4, "learning_rate_init": 1e-3},
    {"hidden_layer_sizes": (256, 256), "alpha": 1e-3, "learning_rate_init": 1e-3},
    {"hidden_layer_sizes": (256, 256), "alpha": 1e-4, "learning_rate_init": 3e-3},
    {"hidden_layer_sizes": (128, 128), "alpha": 1e-4, "learning_rate_init": 1e-3},
]
CAL_EDGES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 1e9]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", action="append", required=True, help="label parquet folder (repeatable)")
    ap.add_argument("--out", required=True, help="artifact folder to write")
    ap.add_argument("--tau", type=float, default=6.0)
    ap.add_argument("--positions", choices=["all", "steps"], default="all")
    ap.add_argument("--grid", choices=["small", "paper"], default="small")
    ap.add_argument(
        "--clip-y",
        type=float,
        default=None,
        help="cap the training target (the τ decision only needs y near τ; long runs dominate MSE)",
    )
    ap.add_argument("--max-iter", type=int, default=200)
    ap.add_argument("--max-train-rows", type=int, default=200_000, help="subsample training rows beyond this")
    ap.add_argument("--test-size", type=float, default=0.2, help="trace fraction for test when splitting here")
    ap.add_argument("--importance-rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------- data
def load_labels(folders: list[str]) -> tuple[pa.Table, dict]:
    tables, metas = [], []
    for f in folders:
        ds = pq.ParquetDataset(str(f))
        t = ds.read()
        raw = (ds.schema.metadata or {}).get(SPEC_KEY)
        meta_path = Path(f) / META_FILE
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        spec_d = meta.get("feature_spec") or (json.loads(raw) if raw else None)
        if spec_d is None:
            raise ValueError(f"{f}: no feature spec (neither {META_FILE} nor schema metadata)")
        SPEC.check(FeatureSpec.from_dict(spec_d))
        tables.append(with_regime(t.replace_schema_metadata(None)))
        metas.append(meta)
    depths = {m.get("model_depth") for m in metas if "model_depth" in m}
    meta = {"model_depth": int(max(depths)) if depths else 5, "sources": [str(f) for f in folders]}
    return pa.concat_tables(tables), meta


def phi_matrix(table: pa.Table) -> np.ndarray:
    if table.num_rows == 0:
        return np.zeros((0, len(SPEC)), np.float32)
    flat = table.column("phi").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return np.asarray(flat, np.float32).reshape(table.num_rows, len(SPEC))


def split_traces(table: pa.Table, test_size: float, seed: int) -> dict[str, set[str]]:
    """prompt ids per split: the traces' own split when usable, else GroupShuffleSplit."""
    from sklearn.model_selection import GroupShuffleSplit

    pid = np.asarray(table.column("prompt_id").to_pylist())
    spl = np.asarray(table.column("split").to_pylist())
    ids = {s: set(pid[spl == s]) for s in ("train", "validation", "test")}
    out: dict[str, set[str]] = {}
    rest = sorted(set(pid))
    if ids["train"] and ids["test"]:
        out["test"], rest = ids["test"], sorted(ids["train"] | ids["validation"])
        if ids["validation"]:
            out["validation"], out["train"] = ids["validation"], ids["train"]
            return out
    else:
        gss = GroupShuffleSplit(n_splits=1, test_size=test_size, random_state=seed)
        a, b = next(gss.split(rest, groups=[conversation_id(p) for p in rest]))  # a second turn goes with its first
        out["test"] = {rest[i] for i in b}
        rest = [rest[i] for i in a]
    gss = GroupShuffleSplit(n_splits=1, test_size=0.2, random_state=seed + 1)
    a, b = next(gss.split(rest, groups=[conversation_id(p) for p in rest]))
    out["train"], out["validation"] = {rest[i] for i in a}, {rest[i] for i in b}
    return out


def select(table: pa.Table, ids: set[str], positions: str) -> pa.Table:
    mask = pc.is_in(table.column("prompt_id"), value_set=pa.array(sorted(ids), pa.string()))
    t = table.filter(mask)
    if positions == "steps":
        t = t.filter(t.column("step_start"))
    return t


def trainable(t: pa.Table) -> tuple[np.ndarray, np.ndarray, pa.Table]:
    t = t.filter(pc.greater(t.column("cache_len"), 0))
    # float64: sklearn then trains float64 weights, and the numpy artifact (float64) matches it
    return phi_matrix(t).astype(np.float64), t.column("y_cache").to_numpy().astype(np.float64), t


# ------------------------------------------------------------------------------------------- metrics
def threshold_metrics(y: np.ndarray, yhat: np.ndarray, tau: float) -> dict:
    pos, pred = y >= tau, yhat >= tau
    tp = int((pos & pred).sum())
    prec = tp / int(pred.sum()) if pred.any() else float("nan")
    rec = tp / int(pos.sum()) if pos.any() else float("nan")
    return {
        "precision": prec,
        "recall": rec,
        "predicted_pos": int(pred.sum()),
        "actual_pos": int(pos.sum()),
        "f1": 2 * prec * rec / (prec + rec) if pred.any() and pos.any() and prec + rec > 0 else float("nan"),
    }


def regression_metrics(y: np.ndarray, yhat: np.ndarray, tau: float) -> dict:
    if not len(y):
        return {"rows": 0}
    return {
        "rows": int(len(y)),
        "mse": float(np.mean((y - yhat) ** 2)),
        "mae": float(np.mean(np.abs(y - yhat))),
        **{f"{k}@{tau:g}": v for k, v in threshold_metrics(y, yhat, tau).items()},
    }


def calibration(y: np.ndarray, yhat: np.ndarray) -> list[dict]:
    rows = []
    for lo, hi in zip(CAL_EDGES[:-1], CAL_EDGES[1:]):
        m = (yhat >= lo) & (yhat < hi)
        if m.any():
            rows.append(
                {
                    "bin": f"[{lo:g},{hi:g})" if hi < 1e9 else f">={lo:g}",
                    "n": int(m.sum()),
                    "mean_pred": float(yhat[m].mean()),
                    "mean_y": float(y[m].mean()),
                }
            )
    return rows


def plot_calibration(cal: list[dict], path: Path, tau: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
    xs = [c["mean_pred"] for c in cal]
    ax.plot(xs, [c["mean_y"] for c in cal], "o-", label="mean y per ŷ bin")
    hi = max(xs + [c["mean_y"] for c in cal] + [tau]) * 1.05 + 0.5
    ax.plot([0, hi], [0, hi], "--", color="gray", label="ideal")
    ax.axvline(tau, color="red", lw=0.8, ls=":", label=f"τ = {tau:g}")
    ax.set_xlabel("predicted accepted length ŷ")
    ax.set_ylabel("observed accepted length y")
    ax.set_title("yield predictor calibration (test)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def latency_p50_us(pred: YieldPredictor, x: np.ndarray, n: int = 2000) -> dict:
    phis = [np.asarray(r, np.float32) for r in x[: min(len(x), 64)]] or [np.zeros(len(SPEC), np.float32)]
    ts = []
    for i in range(n):
        p = phis[i % len(phis)]
        t0 = time.perf_counter_ns()
        pred.predict(p)
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return {"p50_us": ts[len(ts) // 2] / 1e3, "p99_us": ts[int(len(ts) * 0.99)] / 1e3, "calls": n}


# ------------------------------------------------------------------------------------------- main
def train(a: argparse.Namespace) -> dict:
    from sklearn.inspection import permutation_importance
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table, lmeta = load_labels(a.labels)
    splits = split_traces(table, a.test_size, a.seed)
    parts = {k: select(table, v, a.positions) for k, v in splits.items()}
    (Xtr, ytr, ttr), (Xva, yva, _), (Xte, yte, tte) = (trainable(parts[k]) for k in ("train", "validation", "test"))
    if len(ytr) < 10:
        raise SystemExit(f"only {len(ytr)} training rows with a non-empty cache draft: label more traces")
    rng = np.random.default_rng(a.seed)
    if len(ytr) > a.max_train_rows:
        keep = rng.choice(len(ytr), a.max_train_rows, replace=False)
        Xtr, ytr = Xtr[keep], ytr[keep]

    ytr_fit = np.minimum(ytr, a.clip_y) if a.clip_y else ytr

    def make(cfg):
        early = len(ytr) >= 200
        return make_pipeline(
            StandardScaler(),
            MLPRegressor(
                activation="relu",
                solver="adam",
                max_iter=a.max_iter,
                random_state=a.seed,
                early_stopping=early,
                n_iter_no_change=10,
                **cfg,
            ),
        )

    grid = GRID if a.grid == "small" else GRID[:1]
    tried = []
    best = None
    t0 = time.time()
    for cfg in grid:
        pipe = make(cfg).fit(Xtr, ytr_fit)
        vm = float(np.mean((pipe.predict(Xva) - yva) ** 2)) if len(yva) else float(pipe[-1].loss_)
        tried.append(
            {
                **{k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
                "val_mse": vm,
                "iters": int(pipe[-1].n_iter_),
            }
        )
        if best is None or vm < best[0]:
            best = (vm, cfg, pipe)
    train_s = time.time() - t0
    _, cfg, pipe = best
    scaler, mlp = pipe[0], pipe[-1]

    tr_model = ttr.filter(pc.greater(ttr.column("model_len"), 0)) if ttr.num_rows else ttr
    model_mean = float(np.mean(tr_model.column("y_model").to_numpy())) if tr_model.num_rows else 1.0
    meta = {
        "tau": a.tau,
        "target": "y_cache",
        "clip_y": a.clip_y,
        "positions": a.positions,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "train_rows": int(len(ytr)),
        "model_mean_accept": model_mean,
        "model_depth": lmeta["model_depth"],
        "labels": lmeta["sources"],
    }
    pred = YieldPredictor.from_sklearn(mlp, scaler.mean_, scaler.scale_, SPEC, meta)
    pred.save(out)
    pred = YieldPredictor.load(out)  # everything below uses the artifact as served

    yhat_te = pred.predict(Xte) if len(yte) else np.zeros(0)
    steps = np.asarray(tte.column("step_start").to_pylist(), bool) if len(yte) else np.zeros(0, bool)
    sk_te = pipe.predict(Xte) if len(yte) else np.zeros(0)
    report = {
        "rows": {k: int(parts[k].num_rows) for k in parts},
        "trainable_rows": {"train": int(len(ytr)), "validation": int(len(yva)), "test": int(len(yte))},
        "traces": {k: len(v) for k, v in splits.items()},
        "grid": tried,
        "chosen": meta["config"],
        "train_s": round(train_s, 2),
        "test": regression_metrics(yte, yhat_te, a.tau),
        "validation": regression_metrics(yva, pred.predict(Xva) if len(yva) else np.zeros(0), a.tau),
        "baseline_score_as_prediction": regression_metrics(
            yte, Xte[:, 0].astype(np.float64) if len(yte) else np.zeros(0), a.tau
        ),
        "baseline_train_mean": regression_metrics(yte, np.full(len(yte), ytr.mean()), a.tau),
        # the positions a decoding run actually reaches (the replay's simulated run): what the policy sees
        "test_step_starts": regression_metrics(yte[steps], yhat_te[steps], a.tau),
        "baseline_score_step_starts": regression_metrics(yte[steps], Xte[steps, 0], a.tau),
        # per regime (``label_traces.py --repeat``): cold histories vs a request repeated
        "test_step_starts_by_regime": {
            r: regression_metrics(yte[steps & (reg == r)], yhat_te[steps & (reg == r)], a.tau)
            for reg in [np.asarray(tte.column("regime").to_pylist()) if len(yte) else np.zeros(0, str)]
            for r in sorted(set(reg.tolist()))
        },
        "numpy_vs_sklearn_max_abs_diff": float(np.max(np.abs(yhat_te - sk_te))) if len(yte) else 0.0,
        "latency_single_phi": latency_p50_us(pred, Xte if len(Xte) else Xtr),
        "calibration": calibration(yte, yhat_te) if len(yte) else [],
        "test_per_workload": {
            w: regression_metrics(yte[wl == w], yhat_te[wl == w], a.tau)
            for wl in [np.asarray(tte.column("workload").to_pylist()) if len(yte) else np.zeros(0, str)]
            for w in sorted(set(wl.tolist()))
        },
    }
    if len(yte) >= 20:
        m = min(len(yte), a.importance_rows)
        idx = rng.choice(len(yte), m, replace=False)
        imp = permutation_importance(
            pipe, Xte[idx], yte[idx], n_repeats=3, random_state=a.seed, scoring="neg_mean_squared_error"
        )
        order = np.argsort(-imp.importances_mean)
        report["permutation_importance"] = [
            {
                "feature": SPEC.names[i],
                "mse_increase": float(imp.importances_mean[i]),
                "std": float(imp.importances_std[i]),
            }
            for i in order
        ]
    report["calibration_png"] = (
        plot_calibration(report["calibration"], out / "calibration.png", a.tau) if report["calibration"] else False
    )

    # offline policy comparison on the test traces (all their positions), one regime at a time
    test_all = table.filter(
        pc.is_in(table.column("prompt_id"), value_set=pa.array(sorted(splits["test"]), pa.string()))
    )
    depth = lmeta["model_depth"]
    report["policies_by_regime"] = {}
    for regime in sorted(set(test_all.column("regime").to_pylist())):
        labs = trace_labels_from_table(test_all.filter(pc.equal(test_all.column("regime"), regime)))
        pols = {
            "always-cache": AlwaysCache(),
            "always-model": AlwaysModel(),
            f"score>{a.tau:g}": ScoreRule(tau=a.tau),
            f"tau>{a.tau:g}": TauPolicy(pred, tau=a.tau),
            "cost": CostPolicy(pred),
            "cost-union": CostPolicy(pred, union=True),
            "oracle": OraclePolicy(),
        }
        report["policies_by_regime"][regime] = {name: simulate(labs, p, model_depth=depth) for name, p in pols.items()}
    report["policies_test"] = report["policies_by_regime"].get("cold", {})
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render_md(report, a.tau))
    return report


def _f(x, nd=3):
    return "—" if x is None or (isinstance(x, float) and x != x) else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def render_md(r: dict, tau: float) -> str:
    t = r["test"]
    k = f"@{tau:g}"
    lines = [
        "# Yield predictor report",
        "",
        f"Rows (non-empty cache drafts) train / validation / test: {r['trainable_rows']['train']} / "
        f"{r['trainable_rows']['validation']} / {r['trainable_rows']['test']}; traces {r['traces']}.",
        f"Chosen MLP: {r['chosen']} (validation MSE per config below), trained in {r['train_s']} s.",
        "",
        "| predictor (test) | MSE | MAE | precision ŷ≥τ | recall ŷ≥τ |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, m in (
        ("MLP g_θ", t),
        ("suffix score", r["baseline_score_as_prediction"]),
        ("train mean", r["baseline_train_mean"]),
        ("MLP g_θ, step starts only", r["test_step_starts"]),
        ("suffix score, step starts only", r["baseline_score_step_starts"]),
    ):
        lines.append(
            f"| {name} | {_f(m.get('mse'))} | {_f(m.get('mae'))} | {_f(m.get('precision' + k))} | "
            f"{_f(m.get('recall' + k))} |"
        )
    by_regime = r.get("test_step_starts_by_regime", {})
    if len(by_regime) > 1:
        lines += [
            "",
            "Per regime (test, step starts; `agent` = a prompt's second turn, its first answer in the "
            "prompt and the global tree; `repeat` = a trace again, its own output in the global tree):",
            "",
            "| regime | step starts | y ≥ τ | MSE | precision ŷ≥τ | recall ŷ≥τ |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for g, m in by_regime.items():
            lines.append(
                f"| {g} | {m.get('rows', '—')} | {m.get('actual_pos' + k, 0)} | {_f(m.get('mse'))} | "
                f"{_f(m.get('precision' + k))} | {_f(m.get('recall' + k))} |"
            )
    lines += [
        "",
        "Per workload (test, all positions):",
        "",
        "| workload | rows | MSE | precision ŷ≥τ | recall ŷ≥τ |",
        "| --- | --- | --- | --- | --- |",
    ]
    for w, m in r.get("test_per_workload", {}).items():
        lines.append(
            f"| {w} | {m.get('rows', '—')} | {_f(m.get('mse'))} | {_f(m.get('precision' + k))} | "
            f"{_f(m.get('recall' + k))} |"
        )
    lines += [
        "",
        f"Positives (y ≥ {tau:g}) in test: {t.get('actual_pos' + k, 0)}; predicted: {t.get('predicted_pos' + k, 0)}.",
        f"numpy artifact vs sklearn, max |Δŷ|: {r['numpy_vs_sklearn_max_abs_diff']:.2e}; single-φ predict "
        f"p50 {r['latency_single_phi']['p50_us']:.1f} µs (p99 {r['latency_single_phi']['p99_us']:.1f} µs).",
        "",
        "## Grid",
        "",
        "| config | val MSE | iters |",
        "| --- | --- | --- |",
    ]
    for g in r["grid"]:
        lines.append(
            f"| {g['hidden_layer_sizes']} α={g['alpha']:g} lr={g['learning_rate_init']:g} | "
            f"{_f(g['val_mse'])} | {g['iters']} |"
        )
    lines += ["", "## Calibration (test)", "", "| ŷ bin | n | mean ŷ | mean y |", "| --- | --- | --- | --- |"]
    lines += [f"| {c['bin']} | {c['n']} | {_f(c['mean_pred'], 2)} | {_f(c['mean_y'], 2)} |" for c in r["calibration"]]
    if r.get("calibration_png"):
        lines += ["", "![calibration](calibration.png)"]
    if "permutation_importance" in r:
        lines += [
            "",
            "## Permutation importance (test MSE increase)",
            "",
            "| feature | ΔMSE | std |",
            "| --- | --- | --- |",
        ]
        lines += [
            f"| {p['feature']} | {_f(p['mse_increase'])} | {_f(p['std'])} |" for p in r["permutation_importance"][:15]
        ]
    lines += [
        "",
        "## Policies on the test traces (offline replay)",
        "",
        "| regime | policy | MAT | forwards / 1k tok | cache share | est. cost / token | est. speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g, pols in (r.get("policies_by_regime") or {"cold": r["policies_test"]}).items():
        for name, s in pols.items():
            lines.append(
                f"| {g} | {name} | {_f(s['mean_accepted_per_forward'], 2)} | "
                f"{_f(s['forwards_per_1k_tokens'], 1)} | {_f(s['cache_share'], 2)} | "
                f"{_f(s['cost_per_token'], 3)} | {_f(s['est_speedup_vs_greedy'], 2)} |"
            )
    lines += [
        "",
        "MAT = tokens per decode forward; cost in 1-token target forwards (verify-cost table "
        "1.00/1.20/1.32/1.71 for k = 1/8/16/32, layer-skip drafting 0.86 per draft token).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    r = train(parse_args(argv))
    print(
        json.dumps(
            {
                "test": r["test"],
                "latency_single_phi": r["latency_single_phi"],
                "policies_test": {k: round(v["mean_accepted_per_forward"], 3) for k, v in r["policies_test"].items()},
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
