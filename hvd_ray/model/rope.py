"""Rotary position embeddings: the cos/sin tables (with Llama-3 / linear scaling) and their
application in Hugging Face's rotate-half convention, shared by the target and the EAGLE-3 head."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig
from .registry import ModelError


def rope_tables(cfg: ModelConfig, length: int) -> tuple[Tensor, Tensor]:
    """cos/sin tables [length, head_dim] in fp32 (HF's rotate-half convention)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    sc = cfg.rope_scaling
    if sc:
        kind = sc.get("rope_type", sc.get("type"))
        if kind == "linear":
            inv = inv / sc["factor"]
        elif kind == "llama3":
            low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
            old = sc.get("original_max_position_embeddings", 8192)
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old / low, inv / sc["factor"], inv)
            mid = (wavelen <= old / low) & (wavelen >= old / high)
            inv = torch.where(mid, (1 - smooth) * inv / sc["factor"] + smooth * inv, scaled)
        else:
            raise ModelError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    freqs = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's rotate-half RoPE, ``x*cos + rotate_half(x)*sin``, in two fused ops.

    ``rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1, 1]``, so the sign is folded into
    ``sin_signed = [-sin, sin]`` (see ``rope_cos_sin``). x [B, T, H, D]; cos/sin [B, T, 1, D].
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def rope_cos_sin(cos_table: Tensor, sin_table: Tensor, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin for positions ``pos [B, T]``, shaped [B, T, 1, D], in ``dtype``."""
    cos, sin = cos_table[pos].unsqueeze(2), sin_table[pos].unsqueeze(2)
    half = sin.shape[-1] // 2
    return cos.to(dtype), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(dtype)
