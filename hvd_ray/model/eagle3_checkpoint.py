"""The EAGLE-3 head's checkpoint: its ``config.json`` (:class:`Eagle3Config`), its weight files, and
which target layers feed it; the head itself is ``eagle3_head.py``.

Architecture and checkpoint layout are those of the published EAGLE-3 heads as vLLM's ``eagle3``
method loads them (``vllm/model_executor/models/llama_eagle3.py``, class ``Eagle3LlamaForCausalLM``;
architecture name ``LlamaForCausalLMEagle3``). One ``model.safetensors`` with the keys::

    fc.weight                                  [H, 3*H_target]   fuses the three target taps
    midlayer.input_layernorm.weight            [H]               on the token embedding
    midlayer.hidden_norm.weight                [H]               on the fused / fed-back hidden
    midlayer.self_attn.{q,k,v}_proj.weight     [heads*D, 2*H]    input = embed ++ hidden
    midlayer.self_attn.o_proj.weight           [H, heads*D]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.{gate,up}_proj.weight         [I, H]
    midlayer.mlp.down_proj.weight              [H, I]
    norm.weight                                [H]
    lm_head.weight                             [V_draft, H]      reduced draft vocabulary
    d2t                                        int64 [V_draft]   target id = draft id + d2t[draft id]
    t2d                                        bool  [V_target]  marks the target ids in the draft vocab

There is no ``embed_tokens``: the head uses the target's token embeddings (vLLM shares them when
the checkpoint has none; a checkpoint that ships ``embed_tokens.weight`` is loaded with its own).

Target taps. vLLM asks a target with L layers for the auxiliary hidden states at layer ids
``(2, L // 2, L - 3)`` (``get_eagle3_aux_hidden_state_layers``), and a head's config may pin its own
ids as ``eagle_aux_hidden_state_layer_ids``. vLLM collects id ``j`` *before* layer ``j`` runs
(``hidden_states + residual`` at the input of layer j = the residual stream after layer ``j - 1``).
Our ``Transformer`` taps the residual stream *after* a layer, so the drafter's ``needs_taps`` is
``(j - 1 for j in ids)``: ``(1, L // 2 - 1, L - 4)``; for SmolLM2-135M (30 layers) ids (2, 15, 27),
taps (1, 14, 26). The ids are stored in vLLM's convention in ``config.json``.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .config import ModelConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layer_ids(n_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layer ids for a target with ``n_layers`` (vLLM's convention)."""
    return tuple(max(1, min(j, n_layers)) for j in (2, n_layers // 2, n_layers - 3))  # type: ignore


def taps_for(aux_layer_ids: Sequence[int]) -> tuple[int, ...]:
    """Our ``Transformer`` tap layers (residual after layer t) for vLLM aux ids (input of layer j)."""
    if any(j < 1 for j in aux_layer_ids):
        raise ValueError(f"aux layer id 0 is the embedding output, which cannot be tapped: {aux_layer_ids}")
    return tuple(j - 1 for j in aux_layer_ids)


# ------------------------------------------------------------------------------------------ config
@dataclass
class Eagle3Config:
    """The head's architecture; ``to_hf`` / ``from_hf`` read and write the published config.json."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] = (2, 2, 1)  # vLLM convention, see module docstring
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    attention_bias: bool = False
    extra: dict = field(default_factory=dict)  # other config.json fields, written back unchanged

    def to_hf(self, dtype: torch.dtype | None = None) -> dict:
        cfg = dict(self.extra)
        cfg.update(
            {
                "architectures": [ARCHITECTURE],
                "model_type": "llama",
                "hidden_act": "silu",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "num_hidden_layers": 1,
                "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings,
                "norm_before_residual": self.norm_before_residual,
                "attention_bias": self.attention_bias,
                "tie_word_embeddings": False,
            }
        )
        if dtype is not None:
            cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict, target: ModelConfig | None = None) -> Eagle3Config:
        """Parse a head's config.json; ``target`` fills what published heads leave out."""
        arch = (cfg.get("architectures") or [ARCHITECTURE])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"not an EAGLE-3 head: architectures = {cfg.get('architectures')}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-3 heads (num_hidden_layers = 1) are supported")
        known = {
            "architectures",
            "model_type",
            "hidden_act",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "eagle_aux_hidden_state_layer_ids",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "max_position_embeddings",
            "norm_before_residual",
            "attention_bias",
            "tie_word_embeddings",
            "torch_dtype",
            "dtype",
        }
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or (target.rope_theta if target else 10000.0)
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if kind != "default" else None
        n_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            if target is None:
                raise ValueError("config has no eagle_aux_hidden_state_layer_ids and no target was given")
            ids = default_aux_layer_ids(target.n_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or hidden // n_heads,
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or hidden,
            aux_layer_ids=tuple(int(j) for j in ids),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def model_config(self) -> ModelConfig:
        """The head's one layer as a ``ModelConfig``: its RoPE tables and its ``KVCache`` (one
        layer, the target's cache layout) are built from it."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            dim=self.hidden_size,
            n_layers=1,
            n_heads=self.num_attention_heads,
            n_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rope_theta=self.rope_theta,
            norm_eps=self.rms_norm_eps,
            rope_scaling=self.rope_scaling,
        )


# ------------------------------------------------------------------------------------------- files
def write_checkpoint(folder: str | Path, cfg: Eagle3Config, state: dict[str, Tensor], dtype: torch.dtype) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the published EAGLE-3 layout."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2) + "\n")
    return folder


def read_checkpoint(folder: str | Path, target: ModelConfig) -> tuple[Eagle3Config, dict[str, Tensor]]:
    """The config and weights of a head folder (ours or a published one: safetensors, or
    ``pytorch_model.bin``), with the ``d2t`` / ``t2d`` maps a full-vocabulary head may omit filled in."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{folder} has no config.json: not an EAGLE-3 head folder")
    cfg = Eagle3Config.from_hf(json.loads(cfg_path.read_text()), target)
    state: dict[str, Tensor] = {}
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(f))
    elif (folder / "pytorch_model.bin").exists():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder} has no *.safetensors or pytorch_model.bin")
    if "d2t" not in state:  # full-vocabulary heads may omit the map
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError("checkpoint has a reduced draft vocabulary but no d2t map")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][ids] = True
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    return cfg, state
