"""Training an EAGLE-3 head: feature extraction from the target, and the training-time-test loss.

Features: for each target-regenerated sequence (a trace's prompt + greedy output) one teacher-forced
target forward gives the three tapped residual streams at every position and the target's greedy
prediction there. They are stored in safetensors shards, so training never runs the target.

Training-time test (EAGLE-3): the head is unrolled ``steps`` times over the whole sequence. Step 1
sees the target's fused features; step k > 1 sees, at index i, the head's own step-(k-1) output at
index i-1 -- exactly what drafting feeds it. Attention reproduces drafting too: a step-k query at
index i sees step-1 keys at indices <= i-k+1 (the committed cache) and the step-j key at index
i-k+j for 1 < j <= k (the draft steps before it, and itself). Every step at index i predicts the
target's greedy token after position i+1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..model.eagle3_head import Eagle3Head
from ..model.rope import apply_rope, rope_cos_sin, rope_tables
from ..model.transformer import Transformer

IGNORE = -100


# ------------------------------------------------------------------------------------ features
@torch.inference_mode()
def extract_features(
    target: Transformer,
    sequences: Sequence[Sequence[int]],
    taps: Sequence[int],
    max_len: int = 1024,
    starts: Sequence[int] | None = None,
) -> Iterator[dict[str, Tensor]]:
    """Per sequence: ``tokens [L]``, ``taps [L, 3H]`` (bf16), ``pred [L]`` (target argmax) and
    ``start [1]``: where the response begins (the prompt's length; ``starts``, default 0)."""
    target.setup_cache(1, max_len)
    for n, seq in enumerate(sequences):
        seq = list(seq)[:max_len]
        target.cache.truncate(0, 0)
        out = target(torch.tensor([seq], device=target.device), [0], taps=taps)
        yield {
            "tokens": torch.tensor(seq, dtype=torch.int32),
            "taps": torch.cat([t[0] for t in out.taps], dim=-1).to(torch.bfloat16).cpu(),
            "pred": out.logits[0].argmax(-1).to(torch.int32).cpu(),
            "start": torch.tensor([starts[n] if starts is not None else 0], dtype=torch.int32),
        }


def write_shards(samples: Iterator[dict[str, Tensor]], folder: Path, per_shard: int = 64) -> list[Path]:
    """Safetensors shards ``shard-00000.safetensors`` with keys ``{i}.tokens / .taps / .pred``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, buf = [], {}
    for i, s in enumerate(samples):
        buf.update({f"{i % per_shard}.{k}": v.contiguous() for k, v in s.items()})
        if (i + 1) % per_shard == 0:
            paths.append(_flush(buf, folder, len(paths)))
            buf = {}
    if buf:
        paths.append(_flush(buf, folder, len(paths)))
    return paths


def _flush(buf: dict[str, Tensor], folder: Path, n: int) -> Path:
    path = folder / f"shard-{n:05d}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file(buf, str(tmp))
    tmp.rename(path)
    return path


def read_shard(path: Path) -> list[dict[str, Tensor]]:
    flat = load_file(str(path))
    n = len({k.split(".")[0] for k in flat})
    zero = torch.zeros(1, dtype=torch.int32)  # shards written before ``start`` existed: all response
    return [{k: flat.get(f"{i}.{k}", zero) for k in ("tokens", "taps", "pred", "start")} for i in range(n)]


def shard_size(path: Path) -> int:
    """How many samples a shard holds, from its header alone (no tensor is read)."""
    with safe_open(str(path), framework="pt") as f:
        return len({k.split(".")[0] for k in f.keys()})


def draft_vocab_from_counts(counts: Tensor, size: int) -> list[int]:
    """The ``size`` most frequent target predictions (ties by id): EAGLE-3's reduced vocabulary."""
    size = min(size, counts.numel())
    return sorted(torch.topk(counts.double() - torch.arange(counts.numel()) * 1e-9, size).indices.tolist())


# ------------------------------------------------------------------------------------ the loss
def ttt_logits(head: Eagle3Head, taps: Tensor, tokens: Tensor, steps: int = 3) -> list[Tensor]:
    """The head unrolled ``steps`` times over one sequence (``taps [L+1, 3H]``, ``tokens [L+1]``):
    per step, draft-vocabulary logits ``[L, V_draft]`` at indices ``0..L-1``. Differentiable."""
    L = tokens.shape[0] - 1  # index i pairs taps[i] with tokens[i+1]
    dev, dt = head.device, head.dtype
    layer, att = head.midlayer, head.midlayer.self_attn
    if head._rope_len < L:
        cos, sin = rope_tables(head.cfg.model_config(), L)
        head.rope_cos, head.rope_sin = cos.to(dev), sin.to(dev)
        head._rope_len = L
    cos, sin = rope_cos_sin(head.rope_cos, head.rope_sin, torch.arange(L, device=dev)[None], dt)
    emb = layer.input_layernorm(head.embed(tokens[1 : L + 1].long()[None]))
    hidden = head.fc(taps[:L].to(device=dev, dtype=dt)[None])
    idx = torch.arange(L, device=dev)
    keys, vals, out_logits = [], [], []
    for k in range(1, steps + 1):
        hn = layer.hidden_norm(hidden)
        x = torch.cat([emb, hn], dim=-1)
        q = apply_rope(att.q_proj(x).view(1, L, att.n_heads, att.hd), cos, sin)
        keys.append(apply_rope(att.k_proj(x).view(1, L, att.n_kv, att.hd), cos, sin))
        vals.append(att.v_proj(x).view(1, L, att.n_kv, att.hd))
        blocks = [idx[None, :] <= idx[:, None] - (k - 1)]  # the committed cache (step-1 keys)
        blocks += [idx[None, :] == idx[:, None] - (k - j) for j in range(2, k + 1)]  # earlier draft steps
        mask = torch.cat(blocks, dim=1)
        mask |= ~mask.any(-1, keepdim=True)  # indices i < k-1 see nothing real; they carry no loss
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            torch.cat(keys, 1).transpose(1, 2),
            torch.cat(vals, 1).transpose(1, 2),
            attn_mask=mask[None, None],
            enable_gqa=att.n_heads != att.n_kv,
        )
        resid = (hn if layer.norm_before_residual else hidden) + att.o_proj(out.transpose(1, 2).reshape(1, L, -1))
        prenorm = resid + layer.mlp(layer.post_attention_layernorm(resid))
        out_logits.append(head.lm_head(head.norm(prenorm))[0].float())
        hidden = torch.cat([torch.zeros_like(prenorm[:, :1]), prenorm[:, :-1]], dim=1)  # feed back, shifted
    return out_logits


def response_weights(L: int, start: int, prompt_weight: float, device=None) -> Tensor:
    """Loss weight of each index i < L: 1 where the token drafted there belongs to the response
    (i >= start - 1: what the head drafts live), ``prompt_weight`` inside the prompt."""
    w = torch.ones(L, device=device)
    w[: max(0, min(L, start - 1))] = prompt_weight
    return w


def ttt_loss(
    head: Eagle3Head,
    taps: Tensor,
    tokens: Tensor,
    pred: Tensor,
    steps: int = 3,
    decay: float = 0.8,
    start: int = 0,
    prompt_weight: float = 1.0,
) -> tuple[Tensor, list[float]]:
    """Decay-weighted cross-entropy of every unrolled step against the target's greedy token after
    position i+1 (``pred[i+1]``, mapped into the draft vocabulary; others ignored), and each step's
    top-1 accuracy. Prompt positions (before ``start``, the response) weigh ``prompt_weight``: the
    head only ever drafts responses, and long structured prompts (tool schemas) would otherwise
    dominate the loss with text that is easy to predict and never drafted."""
    L = tokens.shape[0] - 1
    if L < steps:
        raise ValueError(f"sequence too short ({L + 1} tokens) for {steps} steps")
    draft_index = torch.cumsum(head.t2d.long(), 0) - 1
    label_t = pred[1 : L + 1].long().to(head.device)
    labels = torch.where(head.t2d[label_t], draft_index[label_t], torch.full_like(label_t, IGNORE))
    weight = response_weights(L, start, prompt_weight, head.device)
    total = torch.zeros((), device=head.device)
    accs = []
    for k, logits in enumerate(ttt_logits(head, taps, tokens, steps), start=1):
        lab = labels.clone()
        lab[: k - 1] = IGNORE
        ok = lab != IGNORE
        if ok.any():
            ce = F.cross_entropy(logits, lab, ignore_index=IGNORE, reduction="none")
            w = weight * ok
            total = total + (decay ** (k - 1)) * (ce * w).sum() / w.sum().clamp_min(1e-6)
            accs.append((logits[ok].argmax(-1) == lab[ok]).float().mean().item())
        else:
            accs.append(0.0)
    return total, accs


class TTTLoss(nn.Module):
    """``ttt_loss`` as a module's ``forward``, so that ``DistributedDataParallel`` can wrap it: DDP
    all-reduces gradients only in a backward that follows its own ``forward`` (which arms its hooks),
    so the whole unroll -- the head's layers applied ``steps`` times -- must run inside one forward.
    Every trainable parameter of the head takes part in every unroll (no unused parameters)."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.head = head

    def forward(
        self, taps: Tensor, tokens: Tensor, pred: Tensor, steps: int = 3, start: int = 0, prompt_weight: float = 1.0
    ) -> tuple[Tensor, list[float]]:
        return ttt_loss(self.head, taps, tokens, pred, steps=steps, start=start, prompt_weight=prompt_weight)


def state_digest(state: nn.Module | dict[str, Tensor]) -> str:
    """sha256 of a module's state or a state dict (names, dtypes, shapes and exact bytes): equal
    digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in (state.state_dict() if isinstance(state, nn.Module) else state).items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_meta(folder: Path, meta: dict) -> None:
    (folder / "training.json").write_text(json.dumps(meta, indent=1))
