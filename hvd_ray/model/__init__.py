"""The target model: resolution of names to folders, and the compact transformer."""

from __future__ import annotations

import os

import torch

from .kv_cache import KVCache
from .registry import DEFAULT_MODEL, ModelError, resolve
from .transformer import ForwardOutput, ModelConfig, Transformer

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def parse_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return dev


def load(name: str = "default", dtype: str | torch.dtype = "bfloat16", device: str | None = "cpu"):
    """(model, tokenizer) for a model name or local folder; never touches a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    folder = resolve(name)
    model = Transformer.from_pretrained(folder, dtype=parse_dtype(dtype), device=parse_device(device))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


__all__ = [
    "DEFAULT_MODEL",
    "ForwardOutput",
    "KVCache",
    "ModelConfig",
    "ModelError",
    "Transformer",
    "load",
    "parse_device",
    "parse_dtype",
    "resolve",
]
