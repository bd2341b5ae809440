"""Train the yield predictor g_θ on trace-replay labels and export a pickle-free artifact + report.

    python jobs/train_predictor.py --labels /abs/labels [--labels more] --out /abs/predictor [--tau 6]
    # on a cluster: the grid as Ray Tune trials over the nodes, folders on shared storage
    python jobs/train_predictor.py --labels s3://bucket/hvd/labels --out s3://bucket/hvd/predictor --ray

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
* artifact: ``predictor.npz`` + ``predictor.json`` (``hvd_ray.selection.predictor.YieldPredictor``);
* ``--labels`` and ``--out`` are paths or storage URIs (``file:///...``, ``s3://bucket/prefix``);
  ``--ray`` fits the grid's configurations as Ray Tune trials on the cluster (``--address`` or
  ``$RAY_ADDRESS``, else a local Ray), Tune's ``storage_path`` under ``--out`` unless ``--storage``.
"""

from __future__ import annotations

import argparse
import json
import os

from hvd_ray.training.predictor import TrainConfig, train


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", action="append", required=True, help="label parquet folder or URI (repeatable)")
    ap.add_argument("--out", required=True, help="artifact folder or URI to write")
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
    ap.add_argument("--ray", action="store_true", help="fit the grid as Ray Tune trials spread over the cluster")
    ap.add_argument("--address", default=None, help="Ray address for --ray (default: $RAY_ADDRESS, else local)")
    ap.add_argument("--cpus-per-trial", type=float, default=1.0, help="CPUs per Tune trial (--ray)")
    ap.add_argument("--storage", default=None, help="Tune storage_path, path or URI (default: <out>/ray_tune)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    r = train(TrainConfig(**vars(parse_args(argv))))
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
