"""The yield predictor's report: regression and τ-threshold metrics, calibration, latency, markdown.

Test MSE/MAE, precision and recall of ``ŷ >= τ`` for ``y >= τ`` (and the suffix score as a baseline
predictor), calibration (mean y per ŷ bin, plotted when matplotlib is installed), single-φ latency
of the numpy artifact, and the report's markdown rendering (``training.predictor.train`` fills in
the permutation importances and the offline policy comparison).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..selection.features import SPEC
from ..selection.predictor import YieldPredictor

CAL_EDGES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 1e9]


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
