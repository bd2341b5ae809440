"""A compact Llama / Qwen2 / Qwen3 decoder on Hugging Face weights, built for speculative decoding.

In the spirit of gpt-fast: the module tree and its forward are here; the KV cache is ``kv_cache.py``,
how a forward attends (kernel choice, masks, runs of slots) ``step.py`` over ``attention.py``'s
kernels, RoPE ``rope.py``, CPU linear layers ``linear.py``, checkpoint conversion ``convert.py``.
What a speculative engine needs beyond a plain model:

* a preallocated KV cache with one *slot* per sequence and explicit per-slot lengths, so a forward
  can score several new tokens at once and a rollback is just ``lengths[slot] = n`` (O(1));
* an optional attention mask over the new tokens (tree drafts) on top of the cached prefix;
* a routing mask that skips whole layers or only their attention / MLP sub-layer (a "slim" view
  that shares every weight: layer-skip drafting and the VIA-SD slim verifier);
* hidden-state taps (the residual stream after chosen layers, for EAGLE-3 heads);
* batches of sequences of different lengths in one forward.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import cascade_attend
from .config import ModelConfig
from .convert import load_hf_state_dict
from .kv_cache import KVCache
from .linear import linear, pack_linears
from .registry import check_folder
from .rope import apply_rope, rope_cos_sin, rope_tables
from .step import StepContext, plan_rows, plan_step

SubLayer = tuple[int, str]  # (layer index, "attn" | "mlp")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def reduce_shards(x: Tensor, group) -> Tensor:
    """Sum a row-parallel projection's partial outputs over its tensor-parallel group (see tp.py);
    a no-op for an unsharded module (``group`` None)."""
    if group is not None:
        torch.distributed.all_reduce(x, group=group)
    return x


class Attention(nn.Module):
    tp_group = None  # set by tp.apply_tensor_parallel: this module then holds only its ranks' heads

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, ctx: StepContext, layer: int) -> Tensor:
        # Plain F.linear / views rather than module calls: the per-token op count is what a
        # 135M model's decode step pays for on CPU.
        H, KV, D = self.n_heads, self.n_kv, self.hd
        qkv = linear(x, self.wqkv)
        if ctx.valid is not None:  # packed rows: pad q/k/v back to [B, T] for the per-row cache work
            B, T = ctx.padded
            qkv = qkv.new_zeros(B * T, qkv.shape[-1]).index_copy_(0, ctx.valid, qkv[0]).view(B, T, -1)
        B, T, _ = qkv.shape
        v = qkv[..., (H + KV) * D :].view(B, T, KV, D)
        if self.q_norm is None:
            qk = apply_rope(qkv[..., : (H + KV) * D].view(B, T, H + KV, D), ctx.cos, ctx.sin)
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            q = self.q_norm(qkv[..., : H * D].view(B, T, H, D))
            k = self.k_norm(qkv[..., H * D : (H + KV) * D].view(B, T, KV, D))
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        kc, vc = ctx.cache.k[layer], ctx.cache.v[layer]
        if ctx.contiguous is not None:  # one sequence: plain slice writes and views, no gathers
            slot, start = ctx.contiguous
            kc[slot, :, start : start + T] = k[0].transpose(0, 1)
            vc[slot, :, start : start + T] = v[0].transpose(0, 1)
            if ctx.fresh_prefill:  # no prefix, causal: the fused SDPA kernel on the new K/V is fastest
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=H != KV
                )
                return reduce_shards(linear(out.transpose(1, 2).reshape(B, T, H * D), self.wo), self.tp_group)
            keys, vals = kc[slot : slot + 1, :, : ctx.span], vc[slot : slot + 1, :, : ctx.span]
            if ctx.pad_queries:  # the rest of a prompt after a short kept prefix, attended as a fresh
                # prefill is: SDPA's causal kernel over the whole span, in the model's dtype, with zero
                # queries for the kept prefix's rows (dropped after), so the lower-right causal chunk
                # is a top-left causal one. Long chunks take several times as long through the masked
                # fp32 path below; an fp32 cache's copies of bf16 K/V convert back exactly. Past a
                # kept prefix of 1.5x the chunk the padding costs more than the mask saves.
                P = ctx.pad_queries
                qp = torch.cat([q.new_zeros(B, P, H, D), q], 1).transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    qp, keys.to(q.dtype), vals.to(q.dtype), is_causal=True, enable_gqa=H != KV
                )[:, :, P:]
                out = out.transpose(1, 2).reshape(B, T, H * D)
                return reduce_shards(linear(out, self.wo), self.tp_group)
            if ctx.prefix_prefill is not None:  # SDPA's fused kernel: attend's [G*T, S] scores would be
                # materialised per layer, costing a long rest of a prompt more than a whole fresh prefill
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2).to(keys.dtype), keys, vals, attn_mask=ctx.prefix_prefill, enable_gqa=H != KV
                )
                out = out.transpose(1, 2).reshape(B, T, H * D).to(q.dtype)
                return reduce_shards(linear(out, self.wo), self.tp_group)
        else:
            idx = (ctx.slot_idx[:, None, :], ctx.head_idx, ctx.write_pos[:, None, :])  # [B, KV, T]
            kc.index_put_(idx, k.transpose(1, 2).to(kc.dtype))
            vc.index_put_(idx, v.transpose(1, 2).to(vc.dtype))
            # each run of consecutive slots reads its cache rows as a view: gathering the rows of
            # scattered slots (requests finish at different steps) would copy every layer's K/V
            # (packed rows: a run holds rows of one real length w and attends with its w queries only)
            if ctx.cascade:
                return reduce_shards(linear(self._cascade(q, kc, vc, ctx), self.wo), self.tp_group)
            parts = ctx.attend_runs(q, kc, vc, ctx.mask, T)
            if ctx.valid is not None:  # the runs' real rows, in row order: the packed layout
                out = torch.cat([p.reshape(-1, H * D) for p in parts]).unsqueeze(0)
            else:
                out = parts[0] if len(parts) == 1 else torch.cat(parts)
            return reduce_shards(linear(out, self.wo), self.tp_group)
        return reduce_shards(linear(ctx.attend(q, keys, vals, ctx.mask), self.wo), self.tp_group)

    @staticmethod
    def _cascade(q: Tensor, kc: Tensor, vc: Tensor, ctx: StepContext) -> Tensor:
        """Attention of a batch some of whose rows share a prefix copy (``ctx.cascade``); the other
        rows attend per run as usual. Packed rows come back packed."""
        B, T, H, D = q.shape
        out = q.new_empty(B * T if ctx.valid is None else ctx.valid.numel(), H * D)
        for rows, src, n, slots, bias, real, dest in ctx.cascade:
            if isinstance(slots, range):  # consecutive slots: a view, no copy
                own_k, own_v = (
                    kc[slots.start : slots.stop, :, n : ctx.span],
                    vc[slots.start : slots.stop, :, n : ctx.span],
                )
            else:
                own_k = kc[:, :, n : ctx.span].index_select(0, slots)
                own_v = vc[:, :, n : ctx.span].index_select(0, slots)
            part = cascade_attend(q.index_select(0, rows), kc[src, :, :n], vc[src, :, :n], own_k, own_v, bias, real)
            out.index_copy_(0, dest, part)
        if ctx.rest is not None:
            parts = [
                p.reshape(-1, H * D) for p in ctx.attend_runs(q.index_select(0, ctx.rest), kc, vc, ctx.rest_mask, T)
            ]
            out.index_copy_(0, ctx.rest_dest, parts[0] if len(parts) == 1 else torch.cat(parts))
        return out.unsqueeze(0) if ctx.valid is not None else out.view(B, T, H * D)


class MLP(nn.Module):
    tp_group = None  # set by tp.apply_tensor_parallel: this module then holds a slice of the intermediate

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)  # gate ++ up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = linear(x, self.w13).split(self.inter, -1)
        return reduce_shards(linear(F.silu(gate) * up, self.w2), self.tp_group)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)


@dataclass
class ForwardOutput:
    logits: Tensor  # [B, T, V] (or [B, 1, V] with last_only; [N, V] with packed_logits, see offsets)
    taps: list[Tensor]  # residual stream after each requested layer, [B, T, dim]
    offsets: list[int] | None = None  # packed logits: row b's are logits[offsets[b]:offsets[b + 1]]

    def row(self, b: int) -> Tensor:
        """Row ``b``'s logits: [T, V] padded, [n_new[b], V] packed."""
        return self.logits[b] if self.offsets is None else self.logits[self.offsets[b] : self.offsets[b + 1]]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.cache: KVCache | None = None
        self._rope_len = 0

    # ----------------------------------------------------------------------------------- setup
    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def setup_cache(self, slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """Allocate the KV cache (and RoPE tables) for ``slots`` sequences of up to ``max_len`` tokens.

        The cache defaults to the model dtype, except on a CPU without bf16 dot-product instructions
        (``avx512_bf16``, AMX), where it is fp32: attention there runs ``attend``'s matmuls in the
        cache dtype, and CPU bf16 batched matmuls are slower than fp32 ones there (bf16 values are
        stored exactly either way). A bf16 cache on CPU attends with SDPA's kernel
        (``sdpa_attend``; decode forwards where ``attend`` is faster take that, ``bf16_decode_sdpa``),
        which reads half the bytes of an fp32 cache (gains measured: docs/results-engine.md).
        """
        if max_len > self.cfg.max_position:
            raise ValueError(f"max_len {max_len} exceeds the model's context ({self.cfg.max_position})")
        if dtype is None:
            dtype = self.dtype
            if self.device.type == "cpu" and not (dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported()):
                dtype = torch.float32
        kv_heads = self.layers[0].attn.n_kv if len(self.layers) else None  # per rank under tensor parallel
        self.cache = KVCache(self.cfg, slots, max_len, dtype, self.device, kv_heads)
        if self._rope_len < max_len:
            cos, sin = rope_tables(self.cfg, max_len)
            self.rope_cos, self.rope_sin = cos.to(self.device), sin.to(self.device)
            self._rope_len = max_len
        return self.cache

    def with_own_cache(self) -> Transformer:
        """The same weights (shared, not copied) with no KV cache yet: engines on it keep their own
        slots, e.g. benchmark methods side by side, where prefix reuse must not find the K/V another
        method left."""
        twin = copy.copy(self)
        twin.cache = None
        return twin

    # --------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        slots: Sequence[int],
        *,
        n_new: Sequence[int] | None = None,
        depths: Tensor | None = None,
        attn_mask: Tensor | None = None,
        skip: Iterable[SubLayer] | None = None,
        taps: Sequence[int] = (),
        last_only: bool = False,
        logit_rows: Tensor | None = None,
        packed_logits: bool = False,
    ) -> ForwardOutput:
        """Score ``tokens [B, T]`` appended to the cached prefix of ``slots[b]``; advance the lengths.

        ``n_new[b]`` (default T) is how many of row b's tokens are real; the rest is padding that is
        written past the slot's length and never attended to. ``depths [B, T]`` gives RoPE offsets
        from the slot length (default ``0..T-1``; tree drafts pass node depths). ``attn_mask
        [B, T, T]`` says which new tokens each new token sees (default causal). ``skip`` lists
        ``(layer, "attn"|"mlp")`` sub-layers to bypass. ``logit_rows [B]`` picks one row per sequence
        for the LM head (prefill needs only the last), as does ``last_only``.

        Rows of different real lengths (a batch verifying drafts of different lengths) are packed:
        every token-wise layer (projections, MLP, norms, LM head) runs on the real tokens only, so a
        row pays for its own tokens, not for the longest row's; attention runs per run of rows of
        one width, and only the K/V cache writes see the padded layout. ``packed_logits`` returns such
        rows' logits packed too (``ForwardOutput.row``), without computing the padding's logits.
        """
        cache = self.cache
        if cache is None:
            raise RuntimeError("call setup_cache() before forward()")
        B, T = tokens.shape
        dev = tokens.device
        starts = [cache.lengths[s] for s in slots]
        n_new = [T] * B if n_new is None else list(n_new)
        if max(starts) + T > cache.max_len:
            raise ValueError(f"sequence would exceed the cache length {cache.max_len}")
        start_t = torch.tensor(starts, device=dev)
        offs = torch.arange(T, device=dev).expand(B, T) if depths is None else depths
        pos = start_t[:, None] + offs
        cos, sin = rope_cos_sin(self.rope_cos, self.rope_sin, pos, self.dtype)

        ctx = plan_step(cache, self.cfg, slots, starts, start_t, n_new, T, cos, sin, attn_mask)
        for b, s in enumerate(slots):
            cache.rewritten(s, starts[b])
        plan_rows(ctx, self.cfg, slots, starts, start_t, n_new, T, attn_mask)

        skipped = set(skip or ())
        tap_set = set(taps)
        tapped: dict[int, Tensor] = {}
        h = self.tok_embeddings(tokens if ctx.valid is None else tokens.reshape(-1)[ctx.valid].unsqueeze(0))
        for i, layer in enumerate(self.layers):
            if (i, "attn") not in skipped:
                h = h + layer.attn.forward(layer.attn_norm.forward(h), ctx, i)
            if (i, "mlp") not in skipped:
                h = h + layer.mlp.forward(layer.mlp_norm.forward(h))
            if i in tap_set:
                tapped[i] = h
        for b, s in enumerate(slots):
            cache.lengths[s] = starts[b] + n_new[b]

        if ctx.valid is not None:
            unpack = lambda x: x.new_zeros(B * T, x.shape[-1]).index_copy_(0, ctx.valid, x[0]).view(B, T, -1)  # noqa: E731
            tapped = {i: unpack(x) for i, x in tapped.items()}
            if packed_logits and logit_rows is None and not last_only:
                offsets = list(itertools.accumulate(n_new, initial=0))
                return ForwardOutput(linear(self.norm(h[0]), self.output), [tapped[i] for i in taps], offsets)
            h = unpack(h)
        if logit_rows is not None:
            h = h[torch.arange(B, device=dev), logit_rows].unsqueeze(1)
        elif last_only:
            h = h[:, -1:]
        logits = linear(self.norm(h), self.output)
        return ForwardOutput(logits, [tapped[i] for i in taps])

    def pack_weights(self) -> bool:
        """Give every Linear a oneDNN-prepacked copy of its weight (CPU: bf16 where the CPU has
        bf16 instructions, and fp32).

        Decode on CPU is memory-bound; the blocked layout streams faster than a plain row-major
        GEMV and gives bit-identical bf16 results. Above all, plain BLAS switches from a
        matrix-vector to a matrix-matrix path at 2 rows, which made a 2-token forward cost far
        more than a 1-token one; prepacked, verifying a draft costs what speculative decoding
        assumes (measured: docs/results-engine.md). Each row's result is bit-identical whatever the number of
        rows, so speculative fp32 output stays token-identical to plain greedy; against other
        engines' fp32 it differs in the last bits (accumulation order). Call again after changing
        weights (e.g. sharding).
        """
        return pack_linears(self, self.device, self.dtype, fp32=True)

    # ----------------------------------------------------------------------------------- load
    @classmethod
    def from_pretrained(
        cls, folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
    ) -> Transformer:
        """Load a Hugging Face Llama / Qwen2 / Qwen3 safetensors folder."""
        folder = Path(folder)
        cfg = ModelConfig.from_hf(check_folder(folder))
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(load_hf_state_dict(folder, cfg), assign=True, strict=True)
        if cfg.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        model = model.to(device=device, dtype=dtype).eval()
        model.pack_weights()
        return model
