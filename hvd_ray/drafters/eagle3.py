"""EAGLE-3 draft head: one decoder layer over fused low / mid / high target features.

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

One step of the head, for a feature ``h`` (fused target taps, or the head's own previous output)
and the embedding ``e`` of the token that follows it, at RoPE position ``pos``::

    x        = [input_layernorm(e), hidden_norm(h)]             # 2H wide
    r        = h + o_proj(attn(q/k/v_proj(x), pos))             # (hidden_norm(h) + ... when
    prenorm  = r + mlp(post_attention_layernorm(r))             #  norm_before_residual)
    logits   = lm_head(norm(prenorm))                           # over the draft vocab

``prenorm`` is what the head feeds itself when it drafts further (EAGLE's autoregression on
features; vLLM feeds back the second output of the draft model, the pre-norm hidden state).

Target taps. vLLM asks a target with L layers for the auxiliary hidden states at layer ids
``(2, L // 2, L - 3)`` (``get_eagle3_aux_hidden_state_layers``), and a head's config may pin its own
ids as ``eagle_aux_hidden_state_layer_ids``. vLLM collects id ``j`` *before* layer ``j`` runs
(``hidden_states + residual`` at the input of layer j = the residual stream after layer ``j - 1``).
Our ``Transformer`` taps the residual stream *after* a layer, so the drafter's ``needs_taps`` is
``(j - 1 for j in ids)``: ``(1, L // 2 - 1, L - 4)``; for SmolLM2-135M (30 layers) ids (2, 15, 27),
taps (1, 14, 26). The ids are stored in vLLM's convention in ``config.json``.

Alignment (as in vLLM's proposer): the tap at target position ``i`` is paired with token ``i + 1``
and the head runs at RoPE position ``i``; its output there predicts token ``i + 2``. So after the
target has committed ``n`` positions the head's cache holds exactly ``n`` entries, its last output
predicts the token after the pending one, and draft step ``s`` (s >= 1) runs at position
``n + s - 1``. Drafting writes past the committed length and never advances it, so the rollback
after drafting is free and exact.
"""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..model.transformer import (ModelConfig, RMSNorm, Transformer, apply_rope, linear, pack_linears, rope_cos_sin,
                                 rope_tables)
from .base import Draft, Drafter, DraftRequest

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
        cfg.update({
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
        })
        if dtype is not None:
            cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict, target: ModelConfig | None = None) -> "Eagle3Config":
        """Parse a head's config.json; ``target`` fills what published heads leave out."""
        arch = (cfg.get("architectures") or [ARCHITECTURE])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"not an EAGLE-3 head: architectures = {cfg.get('architectures')}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-3 heads (num_hidden_layers = 1) are supported")
        known = {"architectures", "model_type", "hidden_act", "hidden_size", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                 "vocab_size", "draft_vocab_size", "target_hidden_size",
                 "eagle_aux_hidden_state_layer_ids", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "max_position_embeddings", "norm_before_residual",
                 "attention_bias", "tie_word_embeddings", "torch_dtype", "dtype"}
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

    def rope_config(self) -> ModelConfig:
        """A ``ModelConfig`` carrying this head's RoPE settings, for ``rope_tables``."""
        return ModelConfig(vocab_size=self.vocab_size, dim=self.hidden_size, n_layers=1,
                           n_heads=self.num_attention_heads, n_kv_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                           rope_theta=self.rope_theta, norm_eps=self.rms_norm_eps,
                           rope_scaling=self.rope_scaling)


# ------------------------------------------------------------------------------------------- cache
class Eagle3Cache:
    """The head's K/V ``[slots, max_len, kv_heads, head_dim]`` (one layer) plus per-slot lengths.

    Same contract as the target's ``KVCache``: entries past ``lengths[slot]`` are garbage, so a
    rollback is ``truncate`` (O(1)). The committed length tracks the target's committed length.
    """

    def __init__(self, cfg: Eagle3Config, slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (slots, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots
        self.max_len = max_len

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def truncate(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length


# -------------------------------------------------------------------------------------------- head
class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Eagle3Cache | None = None,
                slots: Sequence[int] = (), starts: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """Attention over the cache (writing the new K/V rows), or, without a cache, plain causal
        self-attention over ``x`` (the differentiable teacher-forced path)."""
        B, T, _ = x.shape
        q = apply_rope(linear(x, self.q_proj).view(B, T, self.n_heads, self.hd), cos, sin)
        k = apply_rope(linear(x, self.k_proj).view(B, T, self.n_kv, self.hd), cos, sin)
        v = linear(x, self.v_proj).view(B, T, self.n_kv, self.hd)
        if cache is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, enable_gqa=self.n_heads != self.n_kv,
            )
            return linear(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd), self.o_proj)
        span = mask.shape[-1]
        if B == 1:
            s, a = slots[0], int(starts[0])
            cache.k[s, a : a + T] = k[0]
            cache.v[s, a : a + T] = v[0]
            keys, vals = cache.k[s : s + 1, :span], cache.v[s : s + 1, :span]
        else:
            slots_t = torch.tensor(list(slots), device=x.device)
            write = starts[:, None] + torch.arange(T, device=x.device)
            idx = (slots_t[:, None].expand(B, T), write)
            cache.k.index_put_(idx, k)
            cache.v.index_put_(idx, v)
            keys, vals = cache.k[slots_t, :span], cache.v[slots_t, :span]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=mask.unsqueeze(1), enable_gqa=self.n_heads != self.n_kv,
        )
        return linear(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd), self.o_proj)


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


class Eagle3Head(nn.Module):
    """The EAGLE-3 head's weights plus its own KV cache; token embeddings are the target's."""

    def __init__(self, cfg: Eagle3Config, embed: nn.Embedding | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.draft_vocab_size == cfg.vocab_size:
            self.t2d.fill_(True)
        # Shared, not a submodule: it must not land in the checkpoint, nor be moved by .to().
        object.__setattr__(self, "_shared_embed", embed)
        self.embed_tokens: nn.Embedding | None = None  # only when a checkpoint ships its own
        self.cache: Eagle3Cache | None = None
        self._rope_len = 0

    # ------------------------------------------------------------------------------- properties
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers to tap (our convention: residual stream after the layer)."""
        return taps_for(self.cfg.aux_layer_ids)

    def embed(self, tokens: Tensor) -> Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens.to(self.device)).to(self.dtype)
        table = self._shared_embed
        if table is None:
            raise RuntimeError("the head has no token embeddings: pass the target's tok_embeddings")
        # The target's embeddings are frozen as far as the head is concerned (EAGLE-3 trains without them).
        return table(tokens.to(table.weight.device)).detach().to(device=self.device, dtype=self.dtype)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (``d + d2t[d]``)."""
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------------------------ cache
    def setup_cache(self, slots: int, max_len: int) -> Eagle3Cache:
        self.cache = Eagle3Cache(self.cfg, slots, max_len, self.dtype, self.device)
        if self._rope_len < max_len:
            cos, sin = rope_tables(self.cfg.rope_config(), max_len)
            self.rope_cos, self.rope_sin = cos.to(self.device), sin.to(self.device)
            self._rope_len = max_len
        return self.cache

    # ---------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def fuse(self, taps: Tensor) -> Tensor:
        """``fc`` over the concatenated target taps ``[..., 3 * H_target]``."""
        return linear(taps.to(device=self.device, dtype=self.dtype), self.fc)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        hidden: Tensor,
        slots: Sequence[int],
        *,
        starts: Sequence[int] | None = None,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
        advance: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """One head step over ``tokens [B, T]`` (target ids) and ``hidden [B, T, H]``.

        K/V are written at cache rows ``starts[b] + t`` (default: the slot's length). ``positions
        [B, T]`` are the RoPE positions (default: the write rows). ``attn_mask [B, T, S]`` says which
        cache rows ``0..S-1`` each token sees, ``S = max(starts) + T`` (default: causal, everything
        below its own row). ``advance`` commits the new rows (``lengths = starts + T``); drafting
        passes ``False`` so nothing needs rolling back. Returns ``(prenorm [B,T,H], logits [B,T,Vd])``.
        """
        cache = self.cache
        if cache is None:
            raise RuntimeError("call setup_cache() before forward()")
        B, T = tokens.shape
        dev = self.device
        starts = [cache.lengths[s] for s in slots] if starts is None else list(starts)
        span = max(starts) + T
        if span > cache.max_len:
            raise ValueError(f"the head's cache would exceed its length {cache.max_len}")
        start_t = torch.tensor(starts, device=dev)
        rows = start_t[:, None] + torch.arange(T, device=dev)
        pos = rows if positions is None else positions.to(dev)
        cos, sin = rope_cos_sin(self.rope_cos, self.rope_sin, pos, self.dtype)
        if attn_mask is None:
            mask = torch.arange(span, device=dev)[None, None, :] <= rows[:, :, None]
        else:
            mask = attn_mask.to(dev)

        prenorm, logits = self._step(tokens, hidden, cos, sin, cache, slots, start_t, mask)
        if advance:
            for b, s in enumerate(slots):
                cache.lengths[s] = starts[b] + T
        return prenorm, logits

    def _step(self, tokens: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, *attn_args) -> tuple[Tensor, Tensor]:
        layer = self.midlayer
        h = hidden.to(device=self.device, dtype=self.dtype)
        hn = layer.hidden_norm(h)
        x = torch.cat([layer.input_layernorm(self.embed(tokens)), hn], dim=-1)
        resid = hn if layer.norm_before_residual else h
        resid = resid + layer.self_attn(x, cos, sin, *attn_args)
        prenorm = resid + layer.mlp(layer.post_attention_layernorm(resid))
        return prenorm, linear(self.norm(prenorm), self.lm_head)

    def teacher_forward(self, next_tokens: Tensor, taps: Tensor) -> Tensor:
        """Differentiable training forward: logits ``[B, T, V_draft]`` for sequences of pairs
        (``taps [B, T, 3*H_target]`` at positions ``0..T-1``, ``next_tokens [B, T]`` the tokens that
        follow them), causal, no cache. Row i should predict the target's token at position i + 2.
        This is EAGLE-3's first training step only (no training-time test over fed-back features).
        """
        T = next_tokens.shape[1]
        if self._rope_len < T:
            cos, sin = rope_tables(self.cfg.rope_config(), T)
            self.rope_cos, self.rope_sin = cos.to(self.device), sin.to(self.device)
            self._rope_len = T
        cos, sin = rope_cos_sin(self.rope_cos, self.rope_sin, torch.arange(T, device=self.device)[None], self.dtype)
        return self._step(next_tokens, self.fc(taps.to(device=self.device, dtype=self.dtype)), cos, sin)[1]

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls,
        target: Transformer,
        draft_vocab_ids: Sequence[int] | None = None,
        *,
        draft_vocab_size: int | None = None,
        seed: int = 0,
        aux_layer_ids: Sequence[int] | None = None,
        intermediate_size: int | None = None,
        dtype: torch.dtype | None = None,
        warm_start: bool = False,
    ) -> "Eagle3Head":
        """A new head shaped for ``target`` (same width, heads and RoPE): random, or warm-started.

        The draft vocabulary is ``draft_vocab_ids`` (sorted, deduplicated) or the first
        ``draft_vocab_size`` ids (default: the whole target vocabulary). ``warm_start`` starts
        training from the target instead of noise: the output layer is the target's rows for the
        draft vocabulary, the final norm the target's, ``fc`` passes the highest tap through and
        the layer adds nothing yet (zero output projections), so the untrained head already
        decodes the target's late features. With a few hundred thousand training tokens this
        generalises better than learning an 8k-row output layer from scratch.
        """
        t = target.cfg
        if draft_vocab_ids is None:
            ids = list(range(draft_vocab_size or t.vocab_size))
        else:
            ids = sorted(set(int(i) for i in draft_vocab_ids))
        if not ids or ids[0] < 0 or ids[-1] >= t.vocab_size:
            raise ValueError(f"draft vocabulary ids must be non-empty and within [0, {t.vocab_size})")
        cfg = Eagle3Config(
            hidden_size=t.dim, intermediate_size=intermediate_size or t.intermediate_size,
            num_attention_heads=t.n_heads, num_key_value_heads=t.n_kv_heads, head_dim=t.head_dim,
            vocab_size=t.vocab_size, draft_vocab_size=len(ids), target_hidden_size=t.dim,
            aux_layer_ids=tuple(aux_layer_ids or default_aux_layer_ids(t.n_layers)),
            rms_norm_eps=t.norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
            max_position_embeddings=t.max_position,
        )
        head = cls(cfg, target.tok_embeddings)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(torch.empty(p.shape).uniform_(0.8, 1.2, generator=gen))
                elif p.dim() == 2:  # unit-variance outputs for unit-variance inputs
                    bound = math.sqrt(3.0 / p.shape[1])
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
                else:
                    p.zero_()
            head.set_draft_vocab(ids)
            if warm_start:
                H = t.dim
                head.lm_head.weight.copy_(target.output.weight.detach()[torch.tensor(ids)].float())
                head.norm.weight.copy_(target.norm.weight.detach().float())
                head.fc.weight.zero_()
                head.fc.weight[:, 2 * H:] = torch.eye(H)  # aux ids are low, mid, high: the high tap
                head.midlayer.self_attn.o_proj.weight.zero_()
                head.midlayer.mlp.down_proj.weight.zero_()
        head.check_target(target)
        head = head.to(device=target.device, dtype=dtype or target.dtype).eval()
        pack_linears(head, head.device, head.dtype)  # bf16 CPU: oneDNN-prepacked, as the target's
        return head

    def set_draft_vocab(self, ids: Sequence[int]) -> None:
        """Fill ``d2t`` / ``t2d`` for the sorted target ids ``ids`` of the draft vocabulary."""
        ids_t = torch.tensor(list(ids), dtype=torch.long)
        if ids_t.numel() != self.cfg.draft_vocab_size or bool((ids_t[1:] <= ids_t[:-1]).any()):
            raise ValueError("draft vocabulary ids must be strictly increasing, one per draft id")
        self.d2t.copy_(ids_t - torch.arange(ids_t.numel()))
        self.t2d.zero_()
        self.t2d[ids_t] = True

    def check_target(self, target: Transformer) -> None:
        c, t = self.cfg, target.cfg
        problems = []
        if c.target_hidden_size != t.dim:
            problems.append(f"target_hidden_size {c.target_hidden_size} != target width {t.dim}")
        if c.vocab_size != t.vocab_size:
            problems.append(f"vocab_size {c.vocab_size} != target vocabulary {t.vocab_size}")
        if self.embed_tokens is None and c.hidden_size != t.dim:
            problems.append(f"hidden_size {c.hidden_size} != target embedding width {t.dim} "
                            "(the head shares the target's embeddings)")
        if any(not 1 <= j <= t.n_layers for j in c.aux_layer_ids):
            problems.append(f"aux layer ids {c.aux_layer_ids} outside 1..{t.n_layers}")
        if problems:
            raise ValueError("EAGLE-3 head does not fit the target: " + "; ".join(problems))

    # ---------------------------------------------------------------------------------- save/load
    def save(self, folder: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the published EAGLE-3 layout."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(self.cfg.to_hf(self.dtype), indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> "Eagle3Head":
        """Load a head folder (ours or a published one: safetensors, or ``pytorch_model.bin``)."""
        folder = Path(folder)
        cfg_path = folder / "config.json"
        if not cfg_path.exists():
            raise ValueError(f"{folder} has no config.json: not an EAGLE-3 head folder")
        cfg = Eagle3Config.from_hf(json.loads(cfg_path.read_text()), target.cfg)
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
        head = cls(cfg, target.tok_embeddings)
        if "embed_tokens.weight" in state:
            w = state["embed_tokens.weight"]
            head.embed_tokens = nn.Embedding(w.shape[0], w.shape[1])
        if "d2t" not in state:  # full-vocabulary heads may omit the map
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise ValueError("checkpoint has a reduced draft vocabulary but no d2t map")
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
            state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            state["t2d"][ids] = True
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
        expected = set(head.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 checkpoint keys do not match: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        head.check_target(target)
        head.load_state_dict(state, strict=True)
        head = head.to(device=target.device, dtype=dtype or target.dtype).eval()
        pack_linears(head, head.device, head.dtype)  # bf16 CPU: oneDNN-prepacked, as the target's
        return head


# ----------------------------------------------------------------------------------------- drafter
@dataclass
class _ReqState:
    slot: int
    hidden: Tensor | None = None  # [H] the head's last pre-norm output (the feature to continue from)
    logp: Tensor | None = None  # [V_draft] fp32 log-probs of that output (the next draft token)
    last_token: int | None = None  # the token paired with the last observed tap (pending in target)
    # observations not yet run through the head: it catches up only when asked to draft, so a
    # policy that verifies other drafts most steps does not pay a head forward on every step
    pending_tokens: list[int] = field(default_factory=list)
    pending_taps: list[Tensor] = field(default_factory=list)


class Eagle3Drafter(Drafter):
    """EAGLE-3 drafting (chain or dynamic tree) as a :class:`~hvd_ray.drafters.base.Drafter`.

    Chain: greedy top-1 of the head, up to ``min(depth, max_tokens)`` tokens (``depth`` default 5),
    stopping early once the head's own path probability (the product of its top-1 probabilities)
    falls below ``min_prob`` (EAGLE-2's observation: the head's confidence tracks acceptance, so a
    low-confidence tail costs head forwards and verify width for tokens the target rejects).
    Tree (EAGLE-2 style dynamic tree): the root's top-k children form level 1; at each level the
    current frontier (k nodes) runs through the head in one forward with a tree attention mask, each
    frontier node gets its top-k children, and the k best children by cumulative log prob become the
    next frontier; after ``depth`` levels the ``min(max_nodes, max_tokens)`` best nodes of the whole
    pool by cumulative log prob form the draft, listed best-first (a child never scores above its
    parent, so parents come first and every prefix is the best tree of that size).
    ``depth`` defaults to 8 for trees (the paper setting, with top-k 4 and ~32 nodes).

    ``Draft.probs[i]`` is the head's softmax probability of token i given its parent; ``score`` is
    the sum over draft nodes of their path probabilities (the head's own expected accepted length).
    """

    name = "eagle3"

    def __init__(
        self,
        target: Transformer,
        head: Eagle3Head,
        *,
        tree: bool = False,
        top_k: int = 4,
        depth: int | None = None,
        max_nodes: int = 32,
        min_prob: float = 0.0,
        slots: int | None = None,
        max_len: int | None = None,
    ):
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob}")
        self.target, self.head = target, head
        self.min_prob = min_prob
        self.tree = tree
        self.top_k = max(1, min(top_k, head.cfg.draft_vocab_size))
        self.depth = depth if depth is not None else (8 if tree else 5)
        if self.depth < 1 or max_nodes < 1:
            raise ValueError("depth and max_nodes must be >= 1")
        self.max_nodes = max_nodes
        self.needs_taps: tuple[int, ...] = head.tap_layers
        self._slots, self._max_len = slots, max_len
        self._reqs: dict[str, _ReqState] = {}

    # ----------------------------------------------------------------------------- bookkeeping
    @property
    def draft_room(self) -> int:
        """Cache rows past the committed length that one propose may write."""
        return max(self.depth, self.top_k * self.depth)

    def _ensure_cache(self) -> Eagle3Cache:
        """The head's cache, sized like the target's (plus drafting room), made on first use and
        remade while no request is live if the target's cache has outgrown it."""
        head, tc = self.head, self.target.cache
        slots = self._slots or (tc.slots if tc is not None else None)
        max_len = self._max_len or (tc.max_len if tc is not None else None)
        if head.cache is not None and (self._reqs or slots is None or max_len is None):
            return head.cache
        if slots is None or max_len is None:
            raise RuntimeError("set up the target's cache first, or pass slots= and max_len=")
        c = head.cache
        if c is None or c.slots < slots or c.max_len < max_len + self.draft_room:
            head.setup_cache(slots, max_len + self.draft_room)
        return head.cache

    def begin(self, req_id: str, prompt: Sequence[int], slot: int) -> None:
        cache = self._ensure_cache()
        if not 0 <= slot < cache.slots:
            raise ValueError(f"slot {slot} is outside the head's cache ({cache.slots} slots)")
        cache.lengths[slot] = 0
        self._reqs[req_id] = _ReqState(slot)

    def accept(self, req_id: str, tokens: Sequence[int]) -> None:
        # Everything the head needs arrives through observe_target (tokens paired with taps).
        self._state(req_id)

    def live_requests(self) -> int:
        return len(self._reqs)

    def end(self, req_id: str) -> None:
        st = self._reqs.pop(req_id, None)
        if st is not None and self.head.cache is not None:
            self.head.cache.lengths[st.slot] = 0

    def _state(self, req_id: str) -> _ReqState:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is unknown to the eagle3 drafter (call begin first)") from None

    def committed(self, req_id: str) -> int:
        """The head's committed cache length for a request (= the target's committed length)."""
        st = self._state(req_id)
        return self.head.cache.lengths[st.slot] + len(st.pending_tokens)

    def rollback(self, req_id: str, length: int) -> None:
        """Forget observed positions from ``length`` on (the next observe must re-supply them)."""
        st = self._state(req_id)
        self._catch_up(req_id, st)
        self.head.cache.truncate(st.slot, length)
        st.hidden = st.logp = st.last_token = None

    # --------------------------------------------------------------------------------- observe
    def _order_taps(self, taps: Tensor) -> Tensor:
        """Taps in ``needs_taps`` order; also accepts the sorted distinct layers (an engine that
        taps the union of its drafters' layers once and this is its only tap drafter)."""
        Ht = self.head.cfg.target_hidden_size
        width = taps.shape[-1]
        if width == len(self.needs_taps) * Ht:
            return taps
        distinct = sorted(set(self.needs_taps))
        if width == len(distinct) * Ht:
            parts = taps.split(Ht, dim=-1)
            return torch.cat([parts[distinct.index(t)] for t in self.needs_taps], dim=-1)
        raise ValueError(f"taps are {width} wide; expected {len(self.needs_taps)} x {Ht} "
                         f"(the target's layers {self.needs_taps} concatenated in that order)")

    def observe_target(self, req_id: str, next_tokens: Sequence[int], taps: Tensor) -> None:
        """Record ``n`` committed positions: ``taps [n, 3*H_target]`` with the tokens that follow
        them. The head runs over them (appending n rows to its cache, at the target's positions)
        the next time it drafts for this request."""
        st = self._state(req_id)
        n = len(next_tokens)
        if taps.dim() != 2 or taps.shape[0] != n:
            raise ValueError(f"taps must be [n, width] with n = len(next_tokens) = {n}; got {tuple(taps.shape)}")
        if n == 0:
            return
        st.pending_tokens.extend(int(t) for t in next_tokens)
        st.pending_taps.append(self._order_taps(taps))

    @torch.inference_mode()
    def _catch_up(self, req_id: str, st: _ReqState) -> None:
        """Run the head over the observations recorded since it last drafted for this request."""
        if not st.pending_tokens:
            return
        head = self.head
        cache = self._ensure_cache()
        n = len(st.pending_tokens)
        if cache.lengths[st.slot] + n + self.draft_room > cache.max_len:
            raise ValueError(f"request {req_id!r} would overflow the head's cache ({cache.max_len} rows)")
        fused = head.fuse(torch.cat(st.pending_taps))[None]
        tokens = torch.tensor([st.pending_tokens], device=head.device)
        prenorm, logits = head(tokens, fused, [st.slot])
        st.hidden = prenorm[0, -1]
        st.logp = torch.log_softmax(logits[0, -1].float(), dim=-1)
        st.last_token = st.pending_tokens[-1]
        st.pending_tokens, st.pending_taps = [], []

    # --------------------------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        drafts = [Draft(source=self.name) for _ in reqs]
        live: list[tuple[int, _ReqState, int, int]] = []  # (index, state, committed, budget)
        for i, r in enumerate(reqs):
            st = self._state(r.req_id)
            if r.max_tokens <= 0:
                continue
            self._catch_up(r.req_id, st)
            if st.logp is None:
                continue
            n = self.head.cache.lengths[st.slot]
            if r.slot != st.slot:
                raise ValueError(f"request {r.req_id!r} began in slot {st.slot} but drafts in slot {r.slot}")
            if len(r.tokens) - 1 != n or r.tokens[-1] != st.last_token:
                raise RuntimeError(
                    f"eagle3 head is out of step with request {r.req_id!r}: it observed {n} positions "
                    f"ending in token {st.last_token}, the request has {len(r.tokens) - 1} committed "
                    f"tokens and pending token {r.tokens[-1]} (call observe_target after every target "
                    "forward with the accepted positions)")
            live.append((i, st, n, r.max_tokens))
        if live:
            made = self._tree(live) if self.tree else self._chain(live)
            for (i, *_), d in zip(live, made):
                drafts[i] = d
        return drafts

    def _chain(self, live: list[tuple[int, _ReqState, int, int]]) -> list[Draft]:
        head = self.head
        want = [min(self.depth, budget) for *_, budget in live]
        logp = torch.stack([st.logp for _, st, _, _ in live])
        hidden = torch.stack([st.hidden for _, st, _, _ in live])
        lp, tok = logp.max(dim=-1)  # [B]
        toks, lps = [tok], [lp]
        floor = math.log(self.min_prob) if self.min_prob > 0 else None
        cum = lp.clone()
        rows = list(range(len(live)))
        for s in range(1, max(want) + 1):
            if floor is not None:  # token s-1 is kept only while the path stays above the floor
                for b, ok in enumerate((cum >= floor).tolist()):
                    if not ok and want[b] > s - 1:
                        want[b] = s - 1
            rows = [b for b in rows if want[b] > s]
            if not rows:
                break
            sel = torch.tensor(rows, device=head.device)
            prenorm, logits = head(
                head.to_target_ids(toks[-1][sel])[:, None], hidden[sel][:, None],
                [live[b][1].slot for b in rows], starts=[live[b][2] + s - 1 for b in rows], advance=False)
            step_lp, step_tok = torch.log_softmax(logits[:, 0].float(), -1).max(dim=-1)
            hidden = hidden.clone()
            hidden[sel] = prenorm[:, 0]
            nt, nl = toks[-1].clone(), lps[-1].clone()
            nt[sel], nl[sel] = step_tok, step_lp
            toks.append(nt)
            lps.append(nl)
            cum = cum + nl
        tok_t = head.to_target_ids(torch.stack(toks, 1)).tolist()  # [B, steps]
        lp_t = torch.stack(lps, 1).tolist()
        out = []
        for b, n in enumerate(want):
            probs = [math.exp(x) for x in lp_t[b][:n]]
            score = sum(_running_products(probs))
            out.append(Draft.chain(tok_t[b][:n], probs, score=score, source=self.name))
        return out

    def _tree(self, live: list[tuple[int, _ReqState, int, int]]) -> list[Draft]:
        head = self.head
        dev = head.device
        B, k, H = len(live), self.top_k, head.cfg.hidden_size
        budgets = [min(self.max_nodes, budget) for *_, budget in live]
        depths_b = [min(self.depth, n) for n in budgets]
        D = max(depths_b)
        slots = [st.slot for _, st, _, _ in live]
        committed = torch.tensor([n for _, _, n, _ in live], device=dev)
        logp = torch.stack([st.logp for _, st, _, _ in live])

        # Level 1: the root's top-k. Pool arrays are lists of [B, m] tensors, concatenated at the end.
        f_lp, f_tok = logp.topk(k, dim=-1)
        pool_tok, pool_lp, pool_score = [f_tok], [f_lp], [f_lp]
        pool_parent = [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        pool_depth = [torch.ones(B, k, dtype=torch.long, device=dev)]
        f_score, f_pool = f_lp, torch.arange(k, device=dev).expand(B, k)
        f_hidden = torch.stack([st.hidden for _, st, _, _ in live])[:, None].expand(B, k, H)
        anc = torch.zeros(B, k, max(D - 1, 1) * k, dtype=torch.bool, device=dev)  # draft rows seen
        offset = k
        ar_k = torch.arange(k, device=dev)
        for lvl in range(1, D):  # run the depth-lvl frontier; its children are depth lvl + 1
            base = (lvl - 1) * k
            anc[:, ar_k, base + ar_k] = True  # each node sees itself
            span = int(committed.max()) + lvl * k
            kpos = torch.arange(span, device=dev)
            mask = (kpos[None, :] < committed[:, None])[:, None, :].expand(B, k, span).clone()
            cols = (committed[:, None] + torch.arange(lvl * k, device=dev))[:, None, :].expand(B, k, lvl * k)
            mask.scatter_(2, cols, anc[:, :, : lvl * k])
            prenorm, logits = head(
                head.to_target_ids(f_tok), f_hidden, slots, starts=(committed + base).tolist(),
                positions=(committed + lvl - 1)[:, None].expand(B, k), attn_mask=mask, advance=False)
            c_lp, c_tok = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k, k]
            c_score = f_score[:, :, None] + c_lp
            pool_tok.append(c_tok.reshape(B, k * k))
            pool_lp.append(c_lp.reshape(B, k * k))
            pool_score.append(c_score.reshape(B, k * k))
            pool_parent.append(f_pool[:, :, None].expand(B, k, k).reshape(B, k * k))
            pool_depth.append(torch.full((B, k * k), lvl + 1, dtype=torch.long, device=dev))
            if lvl < D - 1:
                f_score, sel = c_score.reshape(B, k * k).topk(k, dim=-1)
                par = sel // k
                f_tok = c_tok.reshape(B, k * k).gather(1, sel)
                f_hidden = prenorm.gather(1, par[:, :, None].expand(B, k, H))
                anc = anc.gather(1, par[:, :, None].expand(B, k, anc.shape[-1]))
                f_pool = offset + sel
            offset += k * k

        tok = head.to_target_ids(torch.cat(pool_tok, 1)).tolist()
        lp = torch.cat(pool_lp, 1).tolist()
        score = torch.cat(pool_score, 1).tolist()
        parent = torch.cat(pool_parent, 1).tolist()
        depth = torch.cat(pool_depth, 1).tolist()
        out = []
        for b in range(B):
            order = sorted((i for i in range(len(tok[b])) if depth[b][i] <= depths_b[b]),
                           key=lambda i: (-score[b][i], depth[b][i], i))
            nodes: list[int] = []  # best-first, so every prefix is the best tree of its size
            where: dict[int, int] = {}
            for i in order:
                if len(nodes) == budgets[b]:
                    break
                if parent[b][i] == -1 or parent[b][i] in where:
                    where[i] = len(nodes)
                    nodes.append(i)
            out.append(Draft(
                token_ids=[tok[b][i] for i in nodes],
                parents=[-1 if parent[b][i] == -1 else where[parent[b][i]] for i in nodes],
                probs=[math.exp(lp[b][i]) for i in nodes],
                score=sum(math.exp(score[b][i]) for i in nodes),
                source=self.name,
            ))
        return out

    # -------------------------------------------------------------------------------- utilities
    @torch.inference_mode()
    def score_path(self, req_id: str, tokens: Sequence[int]) -> list[float]:
        """The head's probability of each target token along a path from the pending token, by
        plain sequential head steps (nothing is committed). Tokens outside the draft vocab get 0."""
        st = self._state(req_id)
        self._catch_up(req_id, st)
        if st.logp is None:
            raise RuntimeError(f"request {req_id!r} has no observed positions yet")
        head = self.head
        n = head.cache.lengths[st.slot]
        logp, hidden, probs = st.logp, st.hidden, []
        for s, t in enumerate(tokens):
            if not bool(head.t2d[t]):
                return probs + [0.0] * (len(tokens) - s)
            d = int(torch.searchsorted(torch.arange(head.cfg.draft_vocab_size, device=head.device)
                                       + head.d2t, torch.tensor(t, device=head.device)))
            probs.append(math.exp(float(logp[d])))
            if s + 1 < len(tokens):
                prenorm, logits = head(torch.tensor([[t]], device=head.device), hidden[None, None],
                                       [st.slot], starts=[n + s], advance=False)
                hidden, logp = prenorm[0, 0], torch.log_softmax(logits[0, 0].float(), -1)
        return probs


def _running_products(xs: Sequence[float]) -> list[float]:
    """Running products: the path probability of each node of a chain."""
    out, acc = [], 1.0
    for x in xs:
        acc *= x
        out.append(acc)
    return out


SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "assets" / "eagle3-smollm2"


def shipped_head(target: Transformer) -> Eagle3Head:
    """The EAGLE-3 head trained for the default model by jobs/train_eagle3.py, checksum-pinned."""
    import hashlib

    pin_file = SHIPPED_HEAD / "checksum.json"
    if not pin_file.exists():
        raise ValueError("no EAGLE-3 head is shipped for this model: pass --eagle3-head FOLDER")
    pin = json.loads(pin_file.read_text())
    digest = hashlib.sha256((SHIPPED_HEAD / WEIGHTS_FILE).read_bytes()).hexdigest()
    if digest != pin["sha256"]:
        raise ValueError(f"shipped EAGLE-3 head fails its checksum ({digest} != {pin['sha256']})")
    if target.cfg.dim != pin.get("target_hidden_size", target.cfg.dim) or target.cfg.vocab_size != pin.get(
            "target_vocab_size", target.cfg.vocab_size):
        raise ValueError("the shipped EAGLE-3 head is for SmolLM2-135M-Instruct; pass --eagle3-head for this model")
    return Eagle3Head.load(SHIPPED_HEAD, target)
