"""EAGLE-3 draft head: one decoder layer over fused low / mid / high target features.

The head is a model like the target (weights, a KV cache, a forward); its checkpoint (config,
weight layout, target taps) is ``eagle3_checkpoint.py``, drafting with it
``hvd_ray/drafters/eagle3.py``, training it ``hvd_ray/training/eagle3.py``.

One step of the head, for a feature ``h`` (fused target taps, or the head's own previous output)
and the embedding ``e`` of the token that follows it, at RoPE position ``pos``::

    x        = [input_layernorm(e), hidden_norm(h)]             # 2H wide
    r        = h + o_proj(attn(q/k/v_proj(x), pos))             # (hidden_norm(h) + ... when
    prenorm  = r + mlp(post_attention_layernorm(r))             #  norm_before_residual)
    logits   = lm_head(norm(prenorm))                           # over the draft vocab

``prenorm`` is what the head feeds itself when it drafts further (EAGLE's autoregression on
features; vLLM feeds back the second output of the draft model, the pre-norm hidden state).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .eagle3_checkpoint import (
    WEIGHTS_FILE,
    Eagle3Config,
    default_aux_layer_ids,
    read_checkpoint,
    taps_for,
    write_checkpoint,
)
from .kv_cache import KVCache
from .linear import linear, pack_linears
from .rope import apply_rope, rope_cos_sin, rope_tables
from .transformer import RMSNorm, Transformer


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

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: KVCache | None = None,
        slots: Sequence[int] = (),
        starts: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Attention over the cache (writing the new K/V rows), or, without a cache, plain causal
        self-attention over ``x`` (the differentiable teacher-forced path)."""
        B, T, _ = x.shape
        q = apply_rope(linear(x, self.q_proj).view(B, T, self.n_heads, self.hd), cos, sin)
        k = apply_rope(linear(x, self.k_proj).view(B, T, self.n_kv, self.hd), cos, sin)
        v = linear(x, self.v_proj).view(B, T, self.n_kv, self.hd)
        if cache is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=self.n_heads != self.n_kv,
            )
            return linear(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd), self.o_proj)
        span = mask.shape[-1]
        kc, vc = cache.k[0], cache.v[0]  # the head's one layer: [slots, kv_heads, max_len, head_dim]
        if B == 1:
            s, a = slots[0], int(starts[0])
            kc[s, :, a : a + T] = k[0].transpose(0, 1)
            vc[s, :, a : a + T] = v[0].transpose(0, 1)
            keys, vals = kc[s : s + 1, :, :span], vc[s : s + 1, :, :span]
        else:
            slots_t = torch.tensor(list(slots), device=x.device)
            write = starts[:, None] + torch.arange(T, device=x.device)
            rows = slots_t[:, None].expand(B, T)
            kc[rows, :, write] = k
            vc[rows, :, write] = v
            keys, vals = kc[slots_t, :, :span], vc[slots_t, :, :span]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            vals,
            attn_mask=mask.unsqueeze(1),
            enable_gqa=self.n_heads != self.n_kv,
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
        self.cache: KVCache | None = None
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
    def setup_cache(self, slots: int, max_len: int) -> KVCache:
        self.cache = KVCache(self.cfg.model_config(), slots, max_len, self.dtype, self.device)
        if self._rope_len < max_len:
            cos, sin = rope_tables(self.cfg.model_config(), max_len)
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
        logits_at: Sequence[int] | None = None,
        floors: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One head step over ``tokens [B, T]`` (target ids) and ``hidden [B, T, H]``.

        K/V are written at cache rows ``starts[b] + t`` (default: the slot's length). ``positions
        [B, T]`` are the RoPE positions (default: the write rows). ``attn_mask [B, T, S]`` says which
        cache rows ``0..S-1`` each token sees, ``S = max(starts) + T`` (default: causal, everything
        below its own row). ``advance`` commits the new rows (``lengths = starts + T``); drafting
        passes ``False`` so nothing needs rolling back. Returns ``(prenorm [B,T,H], logits [B,T,Vd])``;
        with ``logits_at`` only row ``b``'s logits at position ``logits_at[b]`` (``[B,1,Vd]``):
        catching up on a 1,000-token prompt, the other 999 rows of the draft-vocabulary head would
        cost more than the layer itself. ``floors[b]``: cache rows below it are hidden from row
        ``b`` (a head that caught up on the last part of a long context only: the rows before were
        never written).
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
        if floors is not None and any(floors):
            floor_t = torch.tensor(list(floors), device=dev)
            mask = mask & (torch.arange(span, device=dev)[None, None, :] >= floor_t[:, None, None])

        prenorm, logits = self._step(tokens, hidden, cos, sin, cache, slots, start_t, mask, logits_at=logits_at)
        if advance:
            for b, s in enumerate(slots):
                cache.lengths[s] = starts[b] + T
        return prenorm, logits

    def _step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        *attn_args,
        logits_at: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        layer = self.midlayer
        h = hidden.to(device=self.device, dtype=self.dtype)
        hn = layer.hidden_norm(h)
        x = torch.cat([layer.input_layernorm(self.embed(tokens)), hn], dim=-1)
        resid = hn if layer.norm_before_residual else h
        resid = resid + layer.self_attn(x, cos, sin, *attn_args)
        prenorm = resid + layer.mlp(layer.post_attention_layernorm(resid))
        out = prenorm
        if logits_at is not None:
            at = torch.tensor(list(logits_at), device=prenorm.device)
            out = prenorm[torch.arange(len(at), device=prenorm.device), at][:, None]
        return prenorm, linear(self.norm(out), self.lm_head)

    def teacher_forward(self, next_tokens: Tensor, taps: Tensor) -> Tensor:
        """Differentiable training forward: logits ``[B, T, V_draft]`` for sequences of pairs
        (``taps [B, T, 3*H_target]`` at positions ``0..T-1``, ``next_tokens [B, T]`` the tokens that
        follow them), causal, no cache. Row i should predict the target's token at position i + 2.
        This is EAGLE-3's first training step only (no training-time test over fed-back features).
        """
        T = next_tokens.shape[1]
        if self._rope_len < T:
            cos, sin = rope_tables(self.cfg.model_config(), T)
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
    ) -> Eagle3Head:
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
            hidden_size=t.dim,
            intermediate_size=intermediate_size or t.intermediate_size,
            num_attention_heads=t.n_heads,
            num_key_value_heads=t.n_kv_heads,
            head_dim=t.head_dim,
            vocab_size=t.vocab_size,
            draft_vocab_size=len(ids),
            target_hidden_size=t.dim,
            aux_layer_ids=tuple(aux_layer_ids or default_aux_layer_ids(t.n_layers)),
            rms_norm_eps=t.norm_eps,
            rope_theta=t.rope_theta,
            rope_scaling=t.rope_scaling,
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
                head.fc.weight[:, 2 * H :] = torch.eye(H)  # aux ids are low, mid, high: the high tap
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
            problems.append(
                f"hidden_size {c.hidden_size} != target embedding width {t.dim} "
                "(the head shares the target's embeddings)"
            )
        if any(not 1 <= j <= t.n_layers for j in c.aux_layer_ids):
            problems.append(f"aux layer ids {c.aux_layer_ids} outside 1..{t.n_layers}")
        if problems:
            raise ValueError("EAGLE-3 head does not fit the target: " + "; ".join(problems))

    # ---------------------------------------------------------------------------------- save/load
    def save(self, folder: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the published EAGLE-3 layout."""
        return write_checkpoint(folder, self.cfg, self.state_dict(), self.dtype)

    @classmethod
    def load(cls, folder: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> Eagle3Head:
        """Load a head folder (ours or a published one: safetensors, or ``pytorch_model.bin``)."""
        cfg, state = read_checkpoint(folder, target.cfg)
        head = cls(cfg, target.tok_embeddings)
        if "embed_tokens.weight" in state:
            w = state["embed_tokens.weight"]
            head.embed_tokens = nn.Embedding(w.shape[0], w.shape[1])
        expected = set(head.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(
                f"EAGLE-3 checkpoint keys do not match: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        head.check_target(target)
        head.load_state_dict(state, strict=True)
        head = head.to(device=target.device, dtype=dtype or target.dtype).eval()
        pack_linears(head, head.device, head.dtype)  # bf16 CPU: oneDNN-prepacked, as the target's
        return head


SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "assets" / "eagle3-smollm2"


def shipped_head(target: Transformer) -> Eagle3Head:
    """The EAGLE-3 head trained for the default model by jobs/train_eagle3.py, checksum-pinned."""
    pin_file = SHIPPED_HEAD / "checksum.json"
    if not pin_file.exists():
        raise ValueError("no EAGLE-3 head is shipped for this model: pass --eagle3-head FOLDER")
    pin = json.loads(pin_file.read_text())
    digest = hashlib.sha256((SHIPPED_HEAD / WEIGHTS_FILE).read_bytes()).hexdigest()
    if digest != pin["sha256"]:
        raise ValueError(f"shipped EAGLE-3 head fails its checksum ({digest} != {pin['sha256']})")
    if target.cfg.dim != pin.get("target_hidden_size", target.cfg.dim) or target.cfg.vocab_size != pin.get(
        "target_vocab_size", target.cfg.vocab_size
    ):
        raise ValueError("the shipped EAGLE-3 head is for SmolLM2-135M-Instruct; pass --eagle3-head for this model")
    return Eagle3Head.load(SHIPPED_HEAD, target)
