"""The offline jobs on a simulated multi-node Ray cluster, through a ``file://`` storage URI.

``ray.cluster_utils.Cluster`` starts extra raylets on this host, each its own node to the scheduler:
a head without CPUs (where this driver runs) and two worker nodes of one CPU. Trace collection,
labelling and predictor training (the real default model, real Ray Data / Ray Tune, real parquet)
must spread their work over both workers and meet on the one storage URI; and a worker lost in the
middle of a collection must leave exactly the prompts' traces: none lost, none written twice.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hvd_ray.traces import storage
from hvd_ray.traces.prompts import load_prompts
from hvd_ray.traces.store import part_files, read_traces

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _job(name: str):
    """A script of ``jobs/`` as a module (its ``main`` runs in this driver, on the cluster it joined)."""
    spec = importlib.util.spec_from_file_location(f"job_{name}", ROOT / "jobs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wait_idle(cpus: float, timeout_s: float = 60.0) -> None:
    """Until the cluster has ``cpus`` CPUs free: a finished stage's actors release theirs
    asynchronously, and the next stage's actors would otherwise pack onto the nodes already free."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < cpus and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster():
    """(cluster, head node id, worker node ids); this process is the driver, on the head."""
    import ray
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.delenv("RAY_ADDRESS", raising=False)
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        workers = {c.add_node(num_cpus=1).node_id for _ in range(2)}
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        ctx = ray.data.DataContext.get_current()
        wait = ctx.wait_for_min_actors_s
        ctx.wait_for_min_actors_s = 300  # a pool takes work once all its actors are up: each gets a share
        try:
            assert ray.get_runtime_context().get_node_id() == c.head_node.node_id
            yield c, c.head_node.node_id, workers
        finally:
            ctx.wait_for_min_actors_s = wait
            ray.shutdown()
            c.shutdown()


def _collect_args(out: str, address: str, limit: int) -> list[str]:
    return [
        *("--workload", "code", "--split", "test", "--limit", str(limit), "--out", out),
        *("--max-tokens", "16", "--dtype", "float32", "--batch-size", "1", "--rows-per-file", "1"),
        *("--actors", "2", "--num-cpus", "0.5", "--address", address),
    ]


def _summary(out: str) -> dict:
    line = [ln for ln in out.splitlines() if "collect_traces: summary " in ln][-1]
    return json.loads(line.split("collect_traces: summary ", 1)[1])


def _ids(limit: int) -> list[str]:
    return [p.id for p in load_prompts("code", split="test", limit=limit)]


def test_collect_label_and_train_spread_over_two_nodes_on_a_storage_uri(cluster, tmp_path, capsys):
    """Collection actors, labelers and Tune trials each run on both worker nodes; every stage
    reads the last one's output from, and writes its own to, one ``file://`` URI."""
    from hvd_ray.selection.predictor import YieldPredictor
    from hvd_ray.training.predictor import TrainConfig, train

    c, head, workers = cluster
    root = (tmp_path / "store").as_uri()
    traces, labels, predictor = (storage.join(root, name) for name in ("traces", "labels", "predictor"))
    n = 10
    t0 = time.monotonic()

    def tick(what: str) -> None:  # phase times, shown with -s
        print(f"[{time.monotonic() - t0:5.1f}s] {what}", flush=True)

    assert _job("collect_traces").main(_collect_args(traces, c.address, n)) == 0
    s = _summary(capsys.readouterr().out)
    assert s["new"] == s["traces_in_out"] == n
    assert set(s["rows_by_node"]) == workers and sum(s["rows_by_node"].values()) == n  # both workers generated
    assert read_traces(traces, ["prompt_id"]).column("prompt_id").to_pylist() == _ids(n)

    tick(f"collected: {s['rows_by_node']}")
    _wait_idle(2.0)  # the collectors' CPUs are back before the labelers are placed
    label = _job("label_traces")
    args = ["--traces", traces, "--out", labels, "--chunk", "2", "--actors", "2"]  # layerskip labels: the model
    # 0.75 CPU a labeler: one fits a 1-CPU node beside a quarter-CPU write task, two never share one
    meta = label.run(label.parse_args([*args, "--num-cpus", "0.75", "--address", c.address]))
    assert meta["traces"] == n and meta["rows"] > 0
    by_node = Counter()
    for w in meta["workers"]:
        by_node[w["node"]] += w["traces"]
    assert set(by_node) == workers and sum(by_node.values()) == n  # both workers labelled (and wrote) blocks
    assert json.loads(storage.read_text(storage.join(labels, "_labels_meta.json")))["rows"] == meta["rows"]
    assert not storage.is_dir(storage.join(labels, "_labelers"))  # the counters went into the meta

    tick(f"labelled: {dict(by_node)}")
    report = train(
        TrainConfig(labels=[labels], out=predictor, max_iter=30, importance_rows=200, ray=True, cpus_per_trial=1.0)
    )
    assert len(report["grid"]) == 4 and {g["node"] for g in report["grid"]} == workers  # trials on both workers
    tick(f"trained: {report['trainable_rows']}")
    written = {Path(p).name for p in storage.files(predictor)}
    assert {"predictor.json", "predictor.npz", "report.json", "report.md"} <= written
    assert storage.is_dir(storage.join(predictor, "ray_tune"))  # Tune's storage_path, on the URI
    pred = YieldPredictor.load(tmp_path / "store" / "predictor")
    assert pred.meta["labels"] == [labels] and pred.meta["train_rows"] == report["trainable_rows"]["train"]


def test_a_node_lost_mid_collection_leaves_every_trace_exactly_once(cluster, tmp_path, capsys):
    """A worker node removed once the first part is written: the collection (resumed if it failed)
    ends with exactly one row per prompt, and a further run finds nothing left to do."""
    c, head, workers = cluster
    out = (tmp_path / "store" / "traces").as_uri()
    n = 12
    victim = next(node for node in c.worker_nodes if node.node_id in workers)
    lost: dict = {}

    def remove_a_worker_once_started() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = len(part_files(out)) if storage.is_dir(out) else 0
            if done:
                lost["parts_before"] = done
                c.remove_node(victim)
                lost["at"] = time.monotonic()
                return
            time.sleep(0.05)

    collect = _job("collect_traces")
    remover = threading.Thread(target=remove_a_worker_once_started, daemon=True)
    remover.start()
    try:
        rc = collect.main(_collect_args(out, c.address, n))
    except Exception as e:  # the job may fail with its node; re-running it resumes
        rc = repr(e)
    remover.join(timeout=120)
    first = capsys.readouterr().out
    assert "at" in lost and lost["parts_before"] < n, first[-3000:]  # removed mid-run
    runs = [rc]
    if rc == 0:  # Ray Data restarted the lost actor on the surviving node and retried its batches
        s = _summary(first)
        assert s["new"] == n and sum(s["rows_by_node"].values()) == n
    else:
        runs.append(collect.main(_collect_args(out, c.address, n)))
        assert runs[-1] == 0
        s = _summary(capsys.readouterr().out)
        assert s["skipped_done"] + s["new"] == n and s["skipped_done"] >= lost["parts_before"]

    fs, _ = storage.resolve(out)
    rows = [pid for p in part_files(out) for pid in pq.read_table(p, filesystem=fs).column("prompt_id").to_pylist()]
    assert Counter(rows) == Counter(_ids(n))  # on disk: every prompt, once

    assert collect.main(_collect_args(out, c.address, n)) == 0
    s = _summary(capsys.readouterr().out)
    assert s["new"] == 0 and s["skipped_done"] == n and s["traces_in_out"] == n
    print(f"runs until complete: {len(runs)} (first: {runs[0]})")
