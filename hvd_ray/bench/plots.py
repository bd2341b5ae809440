"""PNG plots of the benchmark report: speedup per method and workload, accepted-length histograms
per draft source, and the yield predictor's calibration (live, from this run's HVD steps, next to
the shipped offline one)."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

SHIPPED_CALIBRATION = Path(__file__).resolve().parents[1] / "assets" / "predictor-smollm2" / "calibration.png"


def speedup(path: Path, cells: dict, workloads: list[str], methods: list[str]) -> None:
    ms = [m for m in methods if m != "greedy" and any(f"{w}/{m}" in cells for w in workloads)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(workloads) * max(len(ms), 1) / 3), 4))
    width = 0.8 / max(len(ms), 1)
    x = np.arange(len(workloads))
    for i, m in enumerate(ms):
        ys = [cells.get(f"{w}/{m}", {}).get("speedup", np.nan) for w in workloads]
        ax.bar(x + i * width - 0.4 + width / 2, ys, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, workloads)
    ax.set_ylabel("tok/s / greedy tok/s (same run)")
    ax.set_title("Speedup over greedy, batch 1")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accepted_hist(path: Path, steps: dict) -> None:
    by_source: dict[str, list[int]] = defaultdict(list)
    for recs in steps.values():
        for src, acc, _ in recs:
            if src != "none":
                by_source[src].append(acc)
    srcs = sorted(by_source) or ["(no drafted steps)"]
    fig, axes = plt.subplots(1, len(srcs), figsize=(3.2 * len(srcs), 3), squeeze=False)
    for ax, s in zip(axes[0], srcs):
        xs = by_source.get(s, [])
        if xs:
            ax.hist(xs, bins=np.arange(max(xs) + 2) - 0.5, color="C0")
            ax.set_title(f"{s} (mean {np.mean(xs):.2f}, n={len(xs)})", fontsize=9)
        else:
            ax.set_title(s, fontsize=9)
        ax.set_xlabel("accepted draft tokens per step")
    axes[0][0].set_ylabel("steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibration(path: Path, steps: dict) -> bool:
    """Predicted vs realised accepted length of the cache drafts HVD verified (binned); False when
    this run has no predicted steps."""
    pts = [
        (p, a)
        for m, recs in steps.items()
        if m.startswith("hvd")
        for src, a, p in recs
        if p is not None and src.startswith("suffix")
    ]
    if not pts:
        return False
    p, a = np.array(pts, dtype=float).T
    edges = np.unique(np.quantile(p, np.linspace(0, 1, 11)))
    idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, max(len(edges) - 2, 0))
    bx = [p[idx == i].mean() for i in range(max(len(edges) - 1, 1)) if (idx == i).any()]
    by = [a[idx == i].mean() for i in range(max(len(edges) - 1, 1)) if (idx == i).any()]
    fig, ax = plt.subplots(figsize=(4, 4))
    hi = max(p.max(), a.max(), 1.0)
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="ideal")
    ax.plot(bx, by, "o-", label=f"this run (n={len(p)} cache steps)")
    ax.set_xlabel("predicted accepted tokens (ŷ)")
    ax.set_ylabel("accepted tokens")
    ax.set_title("Yield predictor calibration (live)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_all(fig_dir: Path, cells: dict, workloads: list[str], methods: list[str], steps: dict) -> dict[str, str]:
    """Write the PNGs into ``fig_dir``; returns {caption: file name}."""
    figs = {"speedup per method and workload": "speedup.png", "accepted length per draft source": "accepted_hist.png"}
    speedup(fig_dir / figs["speedup per method and workload"], cells, workloads, methods)
    accepted_hist(fig_dir / figs["accepted length per draft source"], steps)
    if calibration(fig_dir / "calibration_live.png", steps):
        figs["predictor calibration, this run's HVD cache steps"] = "calibration_live.png"
    if SHIPPED_CALIBRATION.exists():
        shutil.copyfile(SHIPPED_CALIBRATION, fig_dir / "calibration_offline.png")
        figs["predictor calibration, held-out traces (shipped predictor report)"] = "calibration_offline.png"
    return figs
