"""Linear layers on CPU: weights prepacked once for oneDNN, and bf16 models on CPUs without bf16
instructions computing through an fp32 copy (``pack_linears``); ``linear`` picks the packed path."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Packed(NamedTuple):
    """A Linear's oneDNN-prepacked weight (:func:`pack_linears`) for inputs of ``dtype``."""

    weight: Tensor
    dtype: torch.dtype
    upcast: bool = False  # bf16 weights held in fp32: inputs of 2+ rows compute in fp32
    bias: Tensor | None = None  # the bias in fp32 (upcast only)


def bf16_upcast_enabled() -> bool:
    """Whether a bf16 model on a CPU without oneDNN bf16 computes its multi-row matmuls in fp32
    (``HVD_BF16_UPCAST=0`` turns it off, to measure the difference)."""
    return os.environ.get("HVD_BF16_UPCAST", "1") != "0"


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype, fp32: bool = False) -> bool:
    """Give every ``nn.Linear`` in ``module`` a oneDNN-prepacked weight for :func:`linear` (CPU:
    bf16 where the CPU has bf16 instructions; with ``fp32``, fp32 models too, and bf16 models on a
    CPU without them as an fp32 copy; elsewhere drop any packed copy). Only for frozen weights: the
    copy neither follows later updates nor carries gradients. Returns whether it packed.

    The fp32 copy of bf16 weights (``Packed.upcast``) is for AVX2-only CPUs, where torch's bf16
    matmul costs the same per row however many rows it has, so verifying a draft would cost as
    much as decoding it; through the fp32 copy a multi-token forward costs a fraction of that.
    One-row inputs (batch-1 decode, drafting) keep the bf16 weights, which read half the bytes.
    bf16 weights upcast exactly; results round to bf16 as before. Memory: twice the bf16 weights
    again. Measured costs: docs/results-engine.md."""
    cpu = device.type == "cpu" and torch.backends.mkldnn.is_available()
    native = cpu and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    upcast = fp32 and cpu and dtype == torch.bfloat16 and not native and bf16_upcast_enabled()
    ok = native or upcast or (fp32 and cpu and dtype == torch.float32)
    # the blocked layout's batch hint: 1 suits bf16 decode; fp32 gets 16 (a 2-17-token verify
    # forward costs little more than 1 token, where BLAS doubles from 1 to 2 rows)
    hint = 1 if native else 16
    for mod in module.modules():
        if isinstance(mod, nn.Linear):
            mod.__dict__.pop("packed", None)
            if not ok:
                continue
            w = mod.weight.detach()
            if upcast:
                bias = mod.bias.detach().float() if mod.bias is not None else None
                mod.__dict__["packed"] = Packed(
                    torch.ops.mkldnn._reorder_linear_weight(w.float(), hint), dtype, True, bias
                )
            else:
                mod.__dict__["packed"] = Packed(torch.ops.mkldnn._reorder_linear_weight(w, hint), dtype)
    return ok


def linear(x: Tensor, mod: nn.Linear) -> Tensor:
    """``mod(x)``, through oneDNN's prepacked weight when ``pack_linears`` made one (CPU)."""
    p: Packed | None = mod.__dict__.get("packed")
    if p is None or x.dtype != p.dtype:  # (a module moved to another dtype after packing)
        return F.linear(x, mod.weight, mod.bias)
    if p.upcast:
        if x.numel() == x.shape[-1]:  # one row: the bf16 GEMV reads half the bytes
            return F.linear(x, mod.weight, mod.bias)
        return torch.ops.mkldnn._linear_pointwise(x.float(), p.weight, p.bias, "none", [], "").to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, p.weight, mod.bias, "none", [], "")
