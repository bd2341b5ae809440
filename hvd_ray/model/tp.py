"""Tensor parallelism as a transformation of a loaded :class:`Transformer` (Megatron-style).

Each rank keeps whole KV heads and the query heads that share them (q/k/v rows: column-parallel),
the matching input columns of the attention output projection (row-parallel), a slice of the MLP
intermediate (gate/up rows: column-parallel; down columns: row-parallel), and sums the two
row-parallel outputs of every block with one all-reduce each. Embeddings, norms and the LM head
stay replicated, so every rank ends a forward with the same hidden states and logits; that is what
lets the serving engine run SPMD (every rank makes the same decisions). The one input that differs
between ranks is the clock: decisions priced from measured times (the cost policy) take rank 0's
measurements on every rank (:func:`rank0_values`), a broadcast of a few floats.

Sharding by KV-head group keeps grouped-query attention local to a rank. Uneven splits are allowed
(SmolLM2-135M's 3 KV heads over 2 ranks -> 2 + 1), so any size up to the KV-head count works.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .transformer import ModelConfig, Transformer


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank's share when ``n`` items are split as evenly as possible
    (the first ``n % world_size`` ranks get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_tp_size(cfg: ModelConfig, world_size: int) -> None:
    """Raise ValueError when ``cfg`` cannot be split over ``world_size`` ranks."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if world_size > cfg.n_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the model's {cfg.n_kv_heads} KV heads: "
            f"each rank needs at least one whole KV head (use at most {cfg.n_kv_heads})"
        )
    if world_size > cfg.intermediate_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the MLP width {cfg.intermediate_size}")


def _param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.clone().contiguous(), requires_grad=False)  # clone: let the full tensor go


def _shard_linear(mod: nn.Linear, rows: list[slice] | None = None, cols: slice | None = None) -> None:
    """Keep only ``rows`` (concatenated) or ``cols`` of ``mod``'s weight (and bias rows)."""
    w = mod.weight.data
    if rows is not None:
        mod.weight = _param(torch.cat([w[r] for r in rows]))
        if mod.bias is not None:
            mod.bias = _param(torch.cat([mod.bias.data[r] for r in rows]))
    if cols is not None:
        mod.weight = _param(w[:, cols])
    mod.out_features, mod.in_features = mod.weight.shape


def apply_tensor_parallel(model: Transformer, rank: int, world_size: int, group=None) -> Transformer:
    """Shard ``model`` in place for ``rank`` of ``world_size`` and wire the all-reduces to ``group``
    (default: the world group, which must be initialised before the first forward).

    Returns the model. Its KV cache is reallocated with this rank's heads only, and its weights are
    repacked (``pack_weights``).
    """
    cfg = model.cfg
    check_tp_size(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if world_size == 1:
        return model
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first or pass a process group"
            )
        group = dist.group.WORLD
    H, KV, D, inter = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    G = H // KV
    k0, k1 = split_range(KV, world_size, rank)  # this rank's KV heads
    c0, c1 = split_range(inter, world_size, rank)  # this rank's MLP columns
    q_rows = slice(k0 * G * D, k1 * G * D)
    k_rows = slice((H + k0) * D, (H + k1) * D)
    v_rows = slice((H + KV + k0) * D, (H + KV + k1) * D)
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        _shard_linear(attn.wqkv, rows=[q_rows, k_rows, v_rows])
        _shard_linear(attn.wo, cols=q_rows)
        attn.n_heads, attn.n_kv = (k1 - k0) * G, k1 - k0
        attn.tp_group = group
        _shard_linear(mlp.w13, rows=[slice(c0, c1), slice(inter + c0, inter + c1)])
        _shard_linear(mlp.w2, cols=slice(c0, c1))
        mlp.inter = c1 - c0
        mlp.tp_group = group
    model.tp_rank, model.tp_size = rank, world_size
    if model.cache is not None:  # sized for all heads: reallocate with this rank's
        model.setup_cache(model.cache.slots, model.cache.max_len, model.cache.k[0].dtype)
    model.pack_weights()
    return model


def rank0_values(model: Transformer, values: list[float]) -> list[float]:
    """Rank 0's ``values`` on every rank of ``model``'s tensor-parallel group (``values`` itself on
    an unsharded model). Timings differ between ranks; anything decided from them must not."""
    if getattr(model, "tp_size", 1) == 1:
        return values
    group = model.layers[0].attn.tp_group
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return t.tolist()
