"""cluster.yaml passes Ray's own cluster-launcher validation (schema + defaults), offline."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _prepare_and_validate(config: dict) -> dict:
    """What `ray up` does before talking to the cloud: merge the provider defaults, then validate
    against ray-schema.json (the provider bootstrap, which calls AWS, is deliberately skipped)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_ray_validation():
    cfg = _load()
    prepared = _prepare_and_validate(cfg)
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    workers = {k: v for k, v in types.items() if k != prepared["head_node_type"]}
    assert head["resources"].get("GPU", 0) == 0, "the head node type is CPU-only"
    gpu_types = [v for v in workers.values() if v["resources"].get("GPU", 0) >= 1]
    assert gpu_types, "a GPU worker node type is declared"
    for w in gpu_types:
        assert 0 <= w["min_workers"] <= w["max_workers"] <= prepared["max_workers"]
        assert w["max_workers"] >= 1
    assert prepared["idle_timeout_minutes"] > 0
    assert prepared["provider"]["type"] == "aws"


def test_cluster_yaml_installs_this_package():
    """Every node runs `make install` (the package, its pinned dependencies and the prompt datasets)
    under a pinned Python, and Ray from the virtualenv it made."""
    cfg = _load()
    setup = " && ".join(cfg["setup_commands"])
    assert "make install" in setup and "python install 3.11" in setup and "uv==" in setup
    for cmd in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        assert "ray stop" in cmd or "~/hvd-ray/.venv/bin/ray start" in cmd, cmd
    assert any(Path(src) == Path(".") for src in cfg["file_mounts"].values()), "the repository is synced"
    assert ".venv" in cfg.get("rsync_exclude", []), "the local virtualenv is not uploaded"


def test_dashboard_is_not_exposed_to_the_network():
    """The dashboard serves the job-submission API (remote code execution): loopback only."""
    import re

    cfg = _load()
    commands = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    hosts = [h for c in commands for h in re.findall(r"--dashboard-host[= ]\s*['\"]?([^\s'\";]+)", c)]
    assert hosts, "the head binds the dashboard explicitly"
    assert all(h in ("127.0.0.1", "localhost", "::1") for h in hosts), hosts
    assert not any("0.0.0.0" in c for c in commands), commands


@pytest.mark.parametrize("breakage", ["unknown_key", "bad_type", "head_not_a_type", "min_over_global_max"])
def test_ray_validation_rejects_broken_variants(breakage):
    """The validator is not vacuous: a broken copy of cluster.yaml fails it."""
    import jsonschema

    cfg = _load()
    if breakage == "unknown_key":
        cfg["available_node_types"]["worker.gpu"]["min_wokers"] = 1
    elif breakage == "bad_type":
        cfg["idle_timeout_minutes"] = "ten"
    elif breakage == "head_not_a_type":
        cfg["head_node_type"] = "no.such.type"
    else:
        cfg["available_node_types"]["worker.gpu"]["min_workers"] = cfg["max_workers"] + 1
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        _prepare_and_validate(cfg)


def _replica_options(args: dict) -> dict:
    """The model replica's Ray actor options in the Serve application ``build_app(args)`` builds."""
    from hvd_ray.serving.app import build_app

    ingress = build_app(args)._bound_deployment
    (replica,) = [a._bound_deployment for a in ingress.init_args if hasattr(a, "_bound_deployment")]
    return replica.ray_actor_options


@pytest.mark.parametrize(
    "args, gpus",
    [
        ({"device": "cuda"}, 1),  # the replica holds the model's GPU
        ({"device": "cuda", "tensor_parallel_size": 2}, None),  # its rank actors hold one each
        ({"device": "cpu"}, None),
        ({"device": "auto"}, None),  # no Ray cluster with GPUs here: nothing to reserve
    ],
)
def test_a_gpu_replica_asks_for_the_gpus_it_uses(args, gpus):
    """On CUDA a replica reserves one GPU, except under tensor parallelism, where each rank actor
    reserves its own in the replica's placement group (``serving/tensor_parallel.py``): a TP = N
    replica then fits a node with N GPUs instead of asking for N + 1."""
    assert _replica_options(args).get("num_gpus") == gpus


def test_cluster_yaml_offers_a_node_type_for_tensor_parallel_replicas():
    """A node type with several GPUs, for a TP = N replica (its N rank bundles packed on one node)."""
    from hvd_ray.serving.tensor_parallel import rank_bundles

    types = _prepare_and_validate(_load())["available_node_types"]
    multi = [t for t in types.values() if t["resources"].get("GPU", 0) >= 2]
    assert multi, "no node type can hold a tensor-parallel replica"
    for t in multi:
        n = int(t["resources"]["GPU"])
        _, bundles = rank_bundles(n, gpu=True)
        assert sum(b["CPU"] for b in bundles) <= t["resources"]["CPU"] and t["max_workers"] >= 1


def test_tp_rank_bundles_fit_a_node_with_as_many_gpus_and_no_fewer():
    """On a simulated cluster (each raylet its own node; GPUs declared, not real): the bundles of a
    TP = 4 CUDA replica, ``STRICT_PACK`` as ``TensorParallelEngine`` reserves them, are placed on the
    node with 4 GPUs; TP = 2 cannot be placed over two 1-GPU nodes (``cluster.yaml``'s ``worker.gpu``).
    In such a cluster a replica on ``device: auto`` reserves a GPU."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from hvd_ray.serving.tensor_parallel import rank_bundles

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    four = cluster.add_node(num_cpus=8, num_gpus=4).node_id
    for _ in range(2):
        cluster.add_node(num_cpus=4, num_gpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        opts, bundles = rank_bundles(4, gpu=True)
        assert opts["num_gpus"] == 1 and bundles == [{"CPU": 1, "GPU": 1}] * 4
        pg = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        assert set(placement_group_table(pg)["bundles_to_node_id"].values()) == {four}
        remove_placement_group(pg)
        # the 4-GPU node busy, TP = 2 would have to span the two 1-GPU nodes: it must wait instead
        hold = placement_group([{"GPU": 4}], strategy="STRICT_PACK")
        ray.get(hold.ready(), timeout=60)
        pg2 = placement_group(rank_bundles(2, gpu=True)[1], strategy="STRICT_PACK")
        ready, _ = ray.wait([pg2.ready()], timeout=5)
        assert not ready and placement_group_table(pg2)["state"] == "PENDING"
        # built in a cluster with GPUs, a replica on device auto reserves one (it will use it)
        assert _replica_options({"device": "auto"}).get("num_gpus") == 1
    finally:
        ray.shutdown()
        cluster.shutdown()
