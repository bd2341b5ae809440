"""A tensor-parallel Engine: one Ray actor per rank, driven SPMD like vLLM's executor.

Every rank actor (:class:`TPWorker`, one bundle of a placement group each) loads the model, joins a
``torch.distributed`` group (gloo on CPU, NCCL on GPU), shards the model with
:func:`hvd_ray.model.tp.apply_tensor_parallel` and builds the same :class:`Engine` with the same
drafter. The driver (:class:`TensorParallelEngine`) then sends every rank the identical command
list once per step: the requests added and aborted since the last step, then ``step()``. The ranks
stay in lockstep without exchanging any decisions, because everything an engine decides from is
identical on every rank: the all-reduced hidden states (hence the replicated LM head's logits),
greedy argmax, seeded samplers (the driver fixes a seed for requests that have none), the
drafters' state and, for the cost policy, rank 0's timings (``model.tp.rank0_values``). Only rank
0's outputs are returned; one Ray round trip per rank per step.

:class:`TensorParallelEngine` has the ``Engine`` surface the serving replica's ``EngineLoop``
uses (``add_request``, ``abort``, ``step``, ``has_unfinished``, ``waiting``, ``running``,
``free_slots``, ``max_len``, ``num_draft_tokens``), backed by local mirrors of the requests that
are updated from rank 0's step results, so the replica runs it unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import ray

from ..build import EngineSpec
from ..engine.engine import Engine, StepOutput
from ..engine.request import Request, SamplingParams
from ..engine.slots import check_fits

logger = logging.getLogger(__name__)


@dataclass
class TPEngineSpec:
    """Everything a rank needs to build its shard and engine (identical on every rank)."""

    model: str = "default"
    dtype: str = "bfloat16"
    device: str = "cpu"
    engine: EngineSpec = field(default_factory=EngineSpec)  # its max_len is capped by the model's context
    torch_threads: int | None = None  # per rank (default: the rank's CPU reservation)
    timeout_s: float = 300.0  # a collective waiting longer than this fails (a dead peer) instead of hanging
    # a step (or logits call) some rank has not answered by then fails: the ranks are killed and the
    # step raises TimeoutError, so the serving loop fails and Serve replaces the replica
    step_timeout_s: float = 300.0
    setup_timeout_s: float = 1800.0  # starting the ranks, loading and sharding the model


def load_tokenizer(folder):
    """The folder's tokenizer, or None for a weights-only folder (e.g. a test model): the engine
    then runs on token ids alone (no stop strings), as a bare ``Engine`` does."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).exists() for n in names):
        return None
    return AutoTokenizer.from_pretrained(folder)


class TPWorker:
    """One tensor-parallel rank: a model shard and a full Engine replica of the decoding state."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.engine = None
        self.reqs: dict[str, Request] = {}

    def address(self) -> str:
        """A ``tcp://ip:port`` rendezvous on this rank's node (called on rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, spec: TPEngineSpec, init_method: str) -> dict:
        """Join the process group, load and shard the model, build the engine; returns its limits."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        import torch.distributed as dist

        from ..build import build_engine
        from ..model import parse_device, parse_dtype, resolve
        from ..model.tp import apply_tensor_parallel
        from ..model.transformer import Transformer

        threads = spec.torch_threads or int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1) or 1)
        torch.set_num_threads(max(1, threads))
        device = parse_device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes only this rank's GPU
            device = torch.device("cuda", 0)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        folder = resolve(spec.model)
        # load on the CPU and shard there, so a GPU never holds more than its shard
        model = Transformer.from_pretrained(folder, dtype=parse_dtype(spec.dtype), device="cpu")
        apply_tensor_parallel(model, self.rank, self.world_size)
        if device.type != "cpu":
            model = model.to(device)
            model.pack_weights()
        self.engine = build_engine(spec.engine, model, load_tokenizer(folder))
        return {
            "max_len": self.engine.max_len,
            "num_draft_tokens": self.engine.num_draft_tokens,
            "slots": self.engine.slots,
            "kv_heads": model.cache.k[0].shape[1],
            "threads": torch.get_num_threads(),
        }

    def step(self, commands: list[tuple]) -> dict | None:
        """Apply the driver's commands in order, then run one engine step (if anything is left).

        Returns rank 0's view (outputs, slots, final stats, queue state); the other ranks return
        None, as their state is identical by construction."""
        eng = self.engine
        for cmd in commands:
            if cmd[0] == "add":
                _, prompt, params, req_id = cmd
                self.reqs[req_id] = eng.add_request(prompt, params, req_id)
            else:
                eng.abort(cmd[1])
        outs: list[StepOutput] = eng.step() if eng.has_unfinished() else []
        stats = {}
        for out in outs:
            if out.finished:
                req = self.reqs.pop(out.req_id, None)
                if req is not None:
                    stats[out.req_id] = req.stats
        for rid in [rid for rid, r in self.reqs.items() if r.finished and r.slot < 0]:  # aborted while waiting
            del self.reqs[rid]
        if self.rank != 0:
            return None
        return {
            "outs": outs,
            "stats": stats,
            "slots": {r.req_id: r.slot for r in eng.running},
            "waiting": [r.req_id for r in eng.waiting],
            "free_slots": list(eng.free_slots),
        }

    def logits(self, tokens: list[int]):
        """Logits [T, V] of ``tokens`` as a fresh sequence in a free slot (diagnostics and tests;
        every rank must be called, as the forward is collective). The slot is left empty."""
        import torch

        eng = self.engine
        if not eng.free_slots:
            raise RuntimeError("no free KV-cache slot to score in")
        slot = eng.free_slots[0]
        eng.model.cache.truncate(slot, 0)
        out = eng.model(torch.tensor([tokens], device=eng.model.device), [slot]).logits[0]
        eng.model.cache.truncate(slot, 0)
        return out.float().cpu() if self.rank == 0 else None

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_bundles(
    world_size: int, gpu: bool, rank_options: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Each rank actor's Ray options and the placement-group bundles reserved for them: one bundle
    per rank, ``{"CPU": num_cpus}`` plus ``{"GPU": 1}`` on a GPU. Packed on one node (``STRICT_PACK``),
    TP = N fits a node with N GPUs; the replica driving the ranks reserves no GPU of its own."""
    opts = dict(rank_options or {"num_cpus": 1})
    if gpu:
        opts.setdefault("num_gpus", 1)
    bundle = {"CPU": opts.get("num_cpus", 1)} | ({"GPU": opts["num_gpus"]} if opts.get("num_gpus") else {})
    return opts, [dict(bundle) for _ in range(world_size)]


class TensorParallelEngine:
    """The ``Engine`` interface over ``world_size`` :class:`TPWorker` rank actors.

    Must be created where Ray is initialised (a Serve replica, or a driver after ``ray.init``).
    ``rank_options`` are each rank actor's Ray resources (default ``{"num_cpus": 1}``, plus
    ``num_gpus: 1`` on a GPU); the ranks are reserved as one placement group (``strategy``
    ``STRICT_PACK``: all on one node, as tensor parallelism all-reduces twice per layer).
    """

    def __init__(
        self,
        spec: TPEngineSpec,
        world_size: int,
        *,
        rank_options: dict[str, Any] | None = None,
        strategy: str = "STRICT_PACK",
        reserve_timeout_s: float = 300.0,
    ):
        from ..model import parse_device, resolve
        from ..model.config import load_hf_config
        from ..model.tp import check_tp_size

        folder = resolve(spec.model)
        cfg = load_hf_config(folder)
        check_tp_size(cfg, world_size)  # a clear error before any actor starts
        if world_size < 2:
            raise ValueError("TensorParallelEngine needs tensor_parallel_size >= 2 (use Engine for 1)")
        if not ray.is_initialized():
            raise RuntimeError("TensorParallelEngine needs a running Ray (ray.init() first)")
        self.spec, self.world_size = spec, world_size
        self.tokenizer = load_tokenizer(folder)
        opts, bundles = rank_bundles(world_size, parse_device(spec.device).type == "cuda", rank_options)
        bundle = bundles[0]
        self._pg = ray.util.placement_group(bundles, strategy=strategy)
        self.workers: list = []
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=reserve_timeout_s)
            if not ready:
                raise RuntimeError(
                    f"could not reserve {world_size} x {bundle} ({strategy}) for tensor parallelism "
                    f"within {reserve_timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
                )
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            actor = ray.remote(TPWorker)
            self.workers = [
                actor.options(
                    **opts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
                ).remote(r, world_size)
                for r in range(world_size)
            ]
            init_method = ray.get(self.workers[0].address.remote(), timeout=spec.setup_timeout_s)
            info = self._gather([w.setup.remote(spec, init_method) for w in self.workers], spec.setup_timeout_s)[0]
        except BaseException:
            self.shutdown()
            raise
        self.max_len: int = info["max_len"]
        self.num_draft_tokens: int = info["num_draft_tokens"]
        self.rank_info = info
        # what the replica reads from ``engine.model``: the (full) config and the device
        self.model = SimpleNamespace(cfg=cfg, device=parse_device(spec.device))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.slots: int = info["slots"]  # max_batch + reuse_slots
        self.free_slots: deque[int] = deque(range(self.slots))
        self._reqs: dict[str, Request] = {}
        self._commands: list[tuple] = []
        self._ids = itertools.count()
        self.closed = False

    @classmethod
    def from_serving_config(cls, cfg) -> TensorParallelEngine:
        """Build from a :class:`~hvd_ray.serving.config.ServingConfig` with ``tensor_parallel_size > 1``."""
        spec = TPEngineSpec(
            model=cfg.model,
            dtype=cfg.dtype,
            device=cfg.device,
            engine=cfg.engine_spec(),
            torch_threads=cfg.torch_threads,
            step_timeout_s=cfg.step_timeout_s,
        )
        return cls(spec, cfg.tensor_parallel_size, rank_options=cfg.tp_ray_actor_options)

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self, prompt: Sequence[int], params: SamplingParams | None = None, req_id: str | None = None
    ) -> Request:
        """Queue a request for every rank (sent with the next step); returns its local mirror."""
        params = params or SamplingParams()
        prompt = check_fits(prompt, params, self.num_draft_tokens, self.max_len)  # the ranks check the ids' range
        req_id = req_id or f"tp-req-{next(self._ids)}"
        if req_id in self._reqs:
            raise ValueError(f"request id {req_id!r} is already in use")
        sent = params
        if not params.greedy and params.seed is None:  # every rank must draw the same samples
            sent = dataclasses.replace(params, seed=secrets.randbits(63))
        req = Request(req_id, prompt, params)
        self._reqs[req_id] = req
        self.waiting.append(req)
        self._commands.append(("add", prompt, sent, req_id))
        return req

    def abort(self, req_id: str) -> None:
        for req in list(self.waiting) + self.running:  # as Engine.abort, on the mirrors
            if req.req_id == req_id and not req.finished:
                req.finish_reason = "abort"
        self.waiting = deque(r for r in self.waiting if not r.finished)
        req = self._reqs.get(req_id)
        if req is not None and req.slot < 0 and req.finished:
            del self._reqs[req_id]
        self._commands.append(("abort", req_id))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """Send the pending commands and one step to every rank; return rank 0's outputs. A rank that
        fails, or does not answer within ``spec.step_timeout_s`` (``TimeoutError``), shuts them all down."""
        if self.closed:
            raise RuntimeError("this TensorParallelEngine is shut down")
        commands, self._commands = self._commands, []
        res = self._gather([w.step.remote(commands) for w in self.workers])[0]
        for out in res["outs"]:
            req = self._reqs.get(out.req_id)
            if req is None:
                continue
            req.output += out.new_tokens
            if out.finished:
                req.finish_reason = out.finish_reason
                req.stats = res["stats"].get(out.req_id, req.stats)
                del self._reqs[out.req_id]
            elif req.output:
                req.pending = req.output[-1]
        for rid, slot in res["slots"].items():
            if rid in self._reqs:
                self._reqs[rid].slot = slot
        self.running = [self._reqs[rid] for rid in res["slots"] if rid in self._reqs]
        self.waiting = deque(self._reqs[rid] for rid in res["waiting"] if rid in self._reqs)
        self.free_slots = deque(res["free_slots"])
        return res["outs"]

    generate = Engine.generate  # add_request / has_unfinished / step: the same loop, on the facade

    def logits(self, tokens: Sequence[int]):
        """Rank 0's logits [T, V] (fp32, CPU) for ``tokens`` scored as a fresh sequence."""
        return self._gather([w.logits.remote(list(tokens)) for w in self.workers])[0]

    # ------------------------------------------------------------------------------ plumbing
    def _gather(self, refs: list, timeout_s: float | None = None) -> list:
        """All ranks' results (``refs[r]``: rank r's call) within ``timeout_s`` (default the spec's
        ``step_timeout_s``). On the first failure, or at the deadline (a ``TimeoutError`` naming the
        ranks that did not answer), tear every rank down and raise: the surviving ranks would
        otherwise sit in a collective until the process-group timeout, or forever."""
        timeout_s = self.spec.step_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    late = [r for r, ref in enumerate(refs) if ref in pending]
                    raise TimeoutError(
                        f"tensor-parallel rank(s) {late} did not answer within {timeout_s:g}s; all ranks are shut down"
                    )
                ray.get(ready[0])
        except BaseException:
            self.shutdown()
            raise
        return ray.get(refs)

    def shutdown(self) -> None:
        """Kill the rank actors and release their placement group."""
        self.closed = True
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed, or Ray is shutting down
                pass

    def __del__(self) -> None:
        if ray.is_initialized() and getattr(self, "workers", None):
            self.shutdown()
