"""Hugging Face checkpoints as the compact transformer's weights: a folder's safetensors read, the
tensors renamed to ours, q/k/v and gate/up fused (fewer, larger matmuls per step)."""

from __future__ import annotations

import glob
from pathlib import Path

import torch
from torch import Tensor

from .config import ModelConfig
from .registry import ModelError


def load_hf_state_dict(folder: str | Path, cfg: ModelConfig) -> dict[str, Tensor]:
    """Every ``*.safetensors`` file of a Hugging Face folder, converted (:func:`convert_hf_state_dict`)."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for f in sorted(glob.glob(str(Path(folder) / "*.safetensors"))):
        try:
            state.update(load_file(f))
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise ModelError(f"cannot read weights {f}: {e}") from e
    return convert_hf_state_dict(state, cfg)


def convert_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename HF tensors to ours, fusing q/k/v and gate/up (fewer, larger matmuls per step)."""
    out: dict[str, Tensor] = {}

    def take(name: str) -> Tensor:
        try:
            return sd.pop(name)
        except KeyError:
            raise ModelError(f"weight {name} is missing from the checkpoint") from None

    out["tok_embeddings.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
        out["output.weight"] = out["tok_embeddings.weight"]
    else:
        out["output.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        out[q + "attn.wqkv.weight"] = torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[q + "attn.wqkv.bias"] = torch.cat([take(att + f"{n}_proj.bias") for n in "qkv"])
        out[q + "attn.wo.weight"] = take(att + "o_proj.weight")
        if cfg.qk_norm:
            out[q + "attn.q_norm.weight"] = take(att + "q_norm.weight")
            out[q + "attn.k_norm.weight"] = take(att + "k_norm.weight")
        out[q + "mlp.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[q + "mlp.w2.weight"] = take(p + "mlp.down_proj.weight")
        out[q + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[q + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    leftovers = [k for k in sd if "rotary_emb" not in k]
    if leftovers:
        raise ModelError(f"unexpected weights in checkpoint: {leftovers[:5]}")
    return out
