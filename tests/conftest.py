"""Shared fixtures: tiny randomly initialised HF models saved as real safetensors folders."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def make_tiny(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``kind`` (llama | qwen2 | qwen3) model as a HF safetensors folder."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    cfg_cls, model_cls = classes[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    cfg = cfg_cls(**{**TINY, **extra, **overrides}, tie_word_embeddings=kind != "qwen2")
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():  # random norms so q/k-norm and layer norms are actually exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory) -> Path:
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def default_folder() -> Path:
    from hvd_ray.model.registry import resolve

    return resolve("default")
