"""Training the yield predictor g_θ on trace-replay labels into a pickle-free artifact with a report.

* rows: every labelled position whose cache draft is non-empty (the policy only asks g_θ then;
  ``positions="steps"`` keeps only the simulated run's step starts); target ``y_cache``;
* split BY TRACE: the traces' own ``split`` column (by prompt id) when it has train and test
  traces, else a ``GroupShuffleSplit`` on ``prompt_id``; validation likewise (or carved from train);
* model: ``StandardScaler`` + ``MLPRegressor`` (ReLU, squared error; paper: 2x256), a small grid
  over size / alpha / learning rate chosen on validation MSE (``grid="paper"`` fits only 2x256);
* artifact: ``predictor.npz`` + ``predictor.json`` (``hvd_ray.selection.predictor.YieldPredictor``);
  the report (``predictor_report.py``) scores the artifact as served;
* where: the label folders and ``out`` are paths or storage URIs (``traces/storage.py``); with
  ``ray`` the grid's configurations are Ray Tune trials spread over the cluster (each reports the
  node that fitted it), Tune's ``storage_path`` under ``out`` (or ``storage``), and the winner is
  refitted here with the same seed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..selection.cost_policy import CostPolicy
from ..selection.features import SPEC, FeatureSpec
from ..selection.policy import AlwaysCache, AlwaysModel, OraclePolicy, ScoreRule, TauPolicy
from ..selection.predictor import YieldPredictor
from ..traces import storage
from ..traces.labels import META_FILE, SPEC_KEY, with_regime
from ..traces.simulate import simulate, trace_labels_from_table
from ..workloads import conversation_id
from .predictor_report import calibration, latency_p50_us, plot_calibration, regression_metrics, render_md

GRID = [
    {"hidden_layer_sizes": (256, 256), "alpha": 1e-4, "learning_rate_init": 1e-3},
    {"hidden_layer_sizes": (256, 256), "alpha": 1e-3, "learning_rate_init": 1e-3},
    {"hidden_layer_sizes": (256, 256), "alpha": 1e-4, "learning_rate_init": 3e-3},
    {"hidden_layer_sizes": (128, 128), "alpha": 1e-4, "learning_rate_init": 1e-3},
]


@dataclass
class TrainConfig:
    """The options of a training run (``jobs/train_predictor.py``'s flags, same names and defaults)."""

    labels: list[str]  # label parquet folders (paths or storage URIs)
    out: str  # artifact folder to write (a path or a storage URI)
    tau: float = 6.0
    positions: str = "all"  # all | steps
    grid: str = "small"  # small | paper
    clip_y: float | None = None  # cap the training target (the τ decision only needs y near τ)
    max_iter: int = 200
    max_train_rows: int = 200_000  # subsample training rows beyond this
    test_size: float = 0.2  # trace fraction for test when splitting here
    importance_rows: int = 4000
    seed: int = 0
    ray: bool = False  # fit the grid as Ray Tune trials over the cluster (else one after another here)
    address: str | None = None  # Ray to join with ``ray`` (default: $RAY_ADDRESS, else a local one)
    cpus_per_trial: float = 1.0
    storage: str | None = None  # Tune's storage_path (default: <out>/ray_tune)


def load_labels(folders: list[str]) -> tuple[pa.Table, dict]:
    tables, metas = [], []
    for f in folders:
        fs, path = storage.resolve(f)
        ds = pq.ParquetDataset(path, filesystem=fs)
        t = ds.read()
        raw = (ds.schema.metadata or {}).get(SPEC_KEY)
        meta_path = storage.join(f, META_FILE)
        meta = json.loads(storage.read_text(meta_path)) if storage.files(f, META_FILE) else {}
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


def make_model(cfg: dict, opts: TrainConfig, rows: int):
    """The scaler + MLP pipeline of one grid configuration."""
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(
        StandardScaler(),
        MLPRegressor(
            activation="relu",
            solver="adam",
            max_iter=opts.max_iter,
            random_state=opts.seed,
            early_stopping=rows >= 200,
            n_iter_no_change=10,
            **cfg,
        ),
    )


def fit_config(cfg: dict, opts: TrainConfig, Xtr, ytr_fit, Xva, yva):
    """Fit one grid configuration: (pipeline, its grid record with the validation MSE)."""
    pipe = make_model(cfg, opts, len(ytr_fit)).fit(Xtr, ytr_fit)
    vm = float(np.mean((pipe.predict(Xva) - yva) ** 2)) if len(yva) else float(pipe[-1].loss_)
    rec = {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "val_mse": vm,
        "iters": int(pipe[-1].n_iter_),
    }
    return pipe, rec


def tune_grid(grid: list[dict], opts: TrainConfig, Xtr, ytr_fit, Xva, yva) -> list[dict]:
    """The grid's records, each configuration fitted by a Ray Tune trial somewhere on the cluster
    (``node``: the Ray node that fitted it). The arrays travel through the object store; Tune's
    results land under ``opts.storage`` (default ``<out>/ray_tune``), a path or a storage URI."""
    import ray
    from ray import tune

    if not ray.is_initialized():
        address = opts.address or os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, log_to_driver=False, include_dashboard=False)

    def trial(config, Xtr=None, ytr_fit=None, Xva=None, yva=None):
        _, rec = fit_config(grid[config["i"]], opts, Xtr, ytr_fit, Xva, yva)
        tune.report({**rec, "i": config["i"], "node": ray.get_runtime_context().get_node_id()})

    fs, path = storage.resolve(opts.storage or storage.join(opts.out, "ray_tune"))
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(trial, Xtr=Xtr, ytr_fit=ytr_fit, Xva=Xva, yva=yva), {"cpu": opts.cpus_per_trial}
        ),
        param_space={"i": tune.grid_search(list(range(len(grid))))},
        tune_config=tune.TuneConfig(reuse_actors=True),
        run_config=tune.RunConfig(
            name=time.strftime("predictor-grid-%Y%m%d-%H%M%S"), storage_path=path, storage_filesystem=fs, verbose=0
        ),
    )
    results = tuner.fit()
    recs = {r.metrics["i"]: r.metrics for r in results if not r.error and "val_mse" in (r.metrics or {})}
    if len(recs) != len(grid):
        raise RuntimeError(f"predictor grid: {len(grid) - len(recs)} of {len(grid)} Tune trials failed")
    keys = [*grid[0], "val_mse", "iters", "node"]
    return [{k: recs[i][k] for k in keys} for i in range(len(grid))]


def train(opts: TrainConfig) -> dict:
    """Train g_θ on the label folders, write the artifact and the report into ``opts.out`` (a path
    or a storage URI) and return the report (module doc). Exits (``SystemExit``) when fewer than 10
    rows can train it."""
    fs, path = storage.resolve(opts.out)
    if storage.is_local(fs):
        return _train(opts, Path(path))
    with tempfile.TemporaryDirectory(prefix="hvd-predictor-") as tmp:  # written here, then copied up
        report = _train(opts, Path(tmp))
        storage.upload(tmp, opts.out)
    return report


def _train(opts: TrainConfig, out: Path) -> dict:
    from sklearn.inspection import permutation_importance

    out.mkdir(parents=True, exist_ok=True)
    table, lmeta = load_labels(opts.labels)
    splits = split_traces(table, opts.test_size, opts.seed)
    parts = {k: select(table, v, opts.positions) for k, v in splits.items()}
    (Xtr, ytr, ttr), (Xva, yva, _), (Xte, yte, tte) = (trainable(parts[k]) for k in ("train", "validation", "test"))
    if len(ytr) < 10:
        raise SystemExit(f"only {len(ytr)} training rows with a non-empty cache draft: label more traces")
    rng = np.random.default_rng(opts.seed)
    if len(ytr) > opts.max_train_rows:
        keep = rng.choice(len(ytr), opts.max_train_rows, replace=False)
        Xtr, ytr = Xtr[keep], ytr[keep]

    ytr_fit = np.minimum(ytr, opts.clip_y) if opts.clip_y else ytr

    grid = GRID if opts.grid == "small" else GRID[:1]
    t0 = time.time()
    if opts.ray:
        tried = tune_grid(grid, opts, Xtr, ytr_fit, Xva, yva)
        best_i = min(range(len(grid)), key=lambda i: tried[i]["val_mse"])
        pipe, _ = fit_config(grid[best_i], opts, Xtr, ytr_fit, Xva, yva)  # same data and seed: the trial's model
        best = (tried[best_i]["val_mse"], grid[best_i], pipe)
    else:
        tried, best = [], None
        for cfg in grid:
            pipe, rec = fit_config(cfg, opts, Xtr, ytr_fit, Xva, yva)
            tried.append(rec)
            if best is None or rec["val_mse"] < best[0]:
                best = (rec["val_mse"], cfg, pipe)
    train_s = time.time() - t0
    _, cfg, pipe = best
    scaler, mlp = pipe[0], pipe[-1]

    tr_model = ttr.filter(pc.greater(ttr.column("model_len"), 0)) if ttr.num_rows else ttr
    model_mean = float(np.mean(tr_model.column("y_model").to_numpy())) if tr_model.num_rows else 1.0
    meta = {
        "tau": opts.tau,
        "target": "y_cache",
        "clip_y": opts.clip_y,
        "positions": opts.positions,
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
        "test": regression_metrics(yte, yhat_te, opts.tau),
        "validation": regression_metrics(yva, pred.predict(Xva) if len(yva) else np.zeros(0), opts.tau),
        "baseline_score_as_prediction": regression_metrics(
            yte, Xte[:, 0].astype(np.float64) if len(yte) else np.zeros(0), opts.tau
        ),
        "baseline_train_mean": regression_metrics(yte, np.full(len(yte), ytr.mean()), opts.tau),
        # the positions a decoding run actually reaches (the replay's simulated run): what the policy sees
        "test_step_starts": regression_metrics(yte[steps], yhat_te[steps], opts.tau),
        "baseline_score_step_starts": regression_metrics(yte[steps], Xte[steps, 0], opts.tau),
        # per regime (``label_traces.py --repeat``): cold histories vs a request repeated
        "test_step_starts_by_regime": {
            r: regression_metrics(yte[steps & (reg == r)], yhat_te[steps & (reg == r)], opts.tau)
            for reg in [np.asarray(tte.column("regime").to_pylist()) if len(yte) else np.zeros(0, str)]
            for r in sorted(set(reg.tolist()))
        },
        "numpy_vs_sklearn_max_abs_diff": float(np.max(np.abs(yhat_te - sk_te))) if len(yte) else 0.0,
        "latency_single_phi": latency_p50_us(pred, Xte if len(Xte) else Xtr),
        "calibration": calibration(yte, yhat_te) if len(yte) else [],
        "test_per_workload": {
            w: regression_metrics(yte[wl == w], yhat_te[wl == w], opts.tau)
            for wl in [np.asarray(tte.column("workload").to_pylist()) if len(yte) else np.zeros(0, str)]
            for w in sorted(set(wl.tolist()))
        },
    }
    if len(yte) >= 20:
        m = min(len(yte), opts.importance_rows)
        idx = rng.choice(len(yte), m, replace=False)
        imp = permutation_importance(
            pipe, Xte[idx], yte[idx], n_repeats=3, random_state=opts.seed, scoring="neg_mean_squared_error"
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
        plot_calibration(report["calibration"], out / "calibration.png", opts.tau) if report["calibration"] else False
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
            f"score>{opts.tau:g}": ScoreRule(tau=opts.tau),
            f"tau>{opts.tau:g}": TauPolicy(pred, tau=opts.tau),
            "cost": CostPolicy(pred),
            "cost-union": CostPolicy(pred, union=True),
            "oracle": OraclePolicy(),
        }
        report["policies_by_regime"][regime] = {name: simulate(labs, p, model_depth=depth) for name, p in pols.items()}
    report["policies_test"] = report["policies_by_regime"].get("cold", {})
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render_md(report, opts.tau))
    return report
