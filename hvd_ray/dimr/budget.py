"""The compute budget of a slim mask: the fraction of block time it keeps, measured on the real model.

The slim verifier's job is a verify-sized forward (a few draft tokens after a long cached prefix,
batch 1 by default), so that is the workload we time. Sub-layer cost is *measured*, by difference:
``t(full) − t(every attention skipped)`` is the attention time of all layers, likewise for the MLPs,
with timings interleaved (A B C D A B C D …) so that load from other processes hits every
configuration alike, and the minimum over rounds taken (other processes only ever add time; on a
shared machine the least-disturbed round is the best estimate of the cost itself). Within one kind
all layers have identical shapes and read the same KV length, so each layer gets ``1/L`` of its
kind's measured time (``per_layer=True`` measures every sub-layer on its own instead, at 2L more
timed configurations).

``kept_fraction(mask)`` is then the share of measured block time (Σ over all sub-layers) that the
mask keeps; the budget constraint of the search is ``kept_fraction ≤ budget``. The final mask's
ratio is also measured directly (:func:`measure_mask`), and both are reported.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .mask import SUBS, SlimMask, SubLayer


@dataclass
class SubLayerCosts:
    """Measured seconds per forward of each sub-layer, plus the non-block rest (embedding, head)."""

    attn: list[float]
    mlp: list[float]
    rest: float
    full_s: float  # time of the full forward (min over interleaved rounds)
    setting: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.attn)

    def cost(self, sub: SubLayer) -> float:
        i, k = sub
        return (self.attn if k == "attn" else self.mlp)[i]

    @property
    def block_total(self) -> float:
        return sum(self.attn) + sum(self.mlp)

    def kept_fraction(self, mask: SlimMask | Iterable[SubLayer]) -> float:
        """Share of block time kept by ``mask`` (1.0 = nothing skipped)."""
        skip = mask.skip if isinstance(mask, SlimMask) else tuple(mask)
        return 1.0 - sum(self.cost(s) for s in skip) / self.block_total

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> SubLayerCosts:
        return cls(**d)

    @classmethod
    def uniform(cls, n_layers: int, attn: float = 1.0, mlp: float = 1.0) -> SubLayerCosts:
        """Assumed (not measured) costs: only for tests and dry runs."""
        return cls([attn] * n_layers, [mlp] * n_layers, 0.0, n_layers * (attn + mlp), {"assumed": True})


class _Bench:
    """A private cache on the model for timing, restored afterwards (the caller's cache is untouched)."""

    def __init__(self, model, batch: int, tokens: int, prefix: int, seed: int = 0):
        self.model, self.batch, self.tokens, self.prefix = model, batch, tokens, prefix
        self.saved = model.cache
        model.setup_cache(batch, prefix + tokens)
        g = torch.Generator().manual_seed(seed)
        V = model.cfg.vocab_size
        for s in range(batch):
            model(torch.randint(0, V, (1, prefix), generator=g).to(model.device), [s], last_only=True)
        self.x = torch.randint(0, V, (batch, tokens), generator=g).to(model.device)

    def time(self, skip: Sequence[SubLayer], reps: int) -> float:
        m, slots = self.model, list(range(self.batch))
        if m.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            m(self.x, slots, skip=skip)
            for s in slots:
                m.cache.truncate(s, self.prefix)
        if m.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    def interleaved(self, configs: dict[str, list[SubLayer]], rounds: int, reps: int) -> dict[str, float]:
        for skip in configs.values():  # warm-up
            self.time(skip, 1)
        samples: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(rounds):
            for k, skip in configs.items():
                samples[k].append(self.time(skip, reps))
        return {k: min(v) for k, v in samples.items()}

    def close(self) -> None:
        self.model.cache = self.saved


def measure_costs(
    model,
    *,
    batch: int = 1,
    tokens: int = 8,
    prefix: int = 512,
    rounds: int = 7,
    reps: int = 5,
    per_layer: bool = False,
) -> SubLayerCosts:
    """Time the sub-layers of ``model`` on a verify-shaped forward (see the module docstring)."""
    L = model.cfg.n_layers
    everything = [(i, k) for i in range(L) for k in SUBS]
    configs: dict[str, list[SubLayer]] = {
        "full": [],
        "none": everything,
        "no_attn": [(i, "attn") for i in range(L)],
        "no_mlp": [(i, "mlp") for i in range(L)],
    }
    if per_layer:
        configs.update({f"{k}{i}": [(i, k)] for i in range(L) for k in SUBS})
    bench = _Bench(model, batch, tokens, prefix)
    try:
        t = bench.interleaved(configs, rounds, reps)
    finally:
        bench.close()
    if per_layer:
        attn = [max(t["full"] - t[f"attn{i}"], 1e-9) for i in range(L)]
        mlp = [max(t["full"] - t[f"mlp{i}"], 1e-9) for i in range(L)]
    else:
        attn = [max(t["full"] - t["no_attn"], 1e-9) / L] * L
        mlp = [max(t["full"] - t["no_mlp"], 1e-9) / L] * L
    setting = {
        "batch": batch,
        "tokens": tokens,
        "prefix": prefix,
        "rounds": rounds,
        "reps": reps,
        "per_layer": per_layer,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "none_s": t["none"],
        "no_attn_s": t["no_attn"],
        "no_mlp_s": t["no_mlp"],
    }
    return SubLayerCosts(attn, mlp, max(t["none"], 0.0), t["full"], setting)


def measure_mask(
    model, mask: SlimMask, *, batch: int = 1, tokens: int = 8, prefix: int = 512, rounds: int = 7, reps: int = 5
) -> dict:
    """Directly measured speed of one mask: forward-time ratio and kept block-time fraction.

    ``block_fraction = (t(mask) − t(all blocks skipped)) / (t(full) − t(all blocks skipped))``.
    """
    L = model.cfg.n_layers
    everything = [(i, k) for i in range(L) for k in SUBS]
    bench = _Bench(model, batch, tokens, prefix)
    try:
        t = bench.interleaved({"full": [], "mask": mask.skipped, "none": everything}, rounds, reps)
    finally:
        bench.close()
    return {
        "full_s": t["full"],
        "mask_s": t["mask"],
        "none_s": t["none"],
        "time_ratio": t["mask"] / t["full"],
        "block_fraction": (t["mask"] - t["none"]) / max(t["full"] - t["none"], 1e-12),
    }
