"""The DIMR objective: VIA-SD's KL-type cost ``R`` and the plain ``KL(q‖q')`` baseline, per position.

The paper writes the cost for an approximating distribution ``p`` against a reference ``q``::

    R(p, q) = Σ_v p(v)·ReLU(log(1−α) + log p(v) − log q(v))  +  Σ_v q(v)·ReLU(log β + log p(v) − log q(v))

**Mapping in the slim-verifier setting.** The slim verifier ``q'`` is the approximation that the
full target ``q`` checks, exactly as a drafter is in speculative sampling, so ``p ← q'`` (slim) and
``q ← q`` (full target): ``R = R(q', q)``.

* Term 1 is q'-weighted: mass the slim tier puts on tokens with ``q(v)/q'(v) < 1−α``, i.e. tokens the
  target would reject with probability above ``α`` — what the slim tier would wrongly accept.
* Term 2 is q-weighted: target mass on tokens where ``q'(v) > q(v)/β`` — the slim tier over-confident
  by more than a factor ``1/β`` on what the target actually produces.

With ``0 ≤ α < 1`` and ``0 < β ≤ 1`` both thresholds are ``≤ 0``, so ``R ≥ 0`` and ``R = 0`` when
``q' = q`` (defaults ``α = 0.1``, ``β = 0.5``). ``R`` is one-sided (it only punishes q' exceeding q),
which is what matters for a verifier that must not accept what the target would reject;
``KL(q‖q')`` (q-weighted log-ratio) is the symmetric-purpose baseline objective.

All functions take log-probabilities ``[..., V]`` (any V: the full vocabulary, or the target's top-k
plus one "rest of the vocabulary" bucket, see :func:`coarse_logprobs`) and return per-position values
``[...]``. Zero-probability entries contribute nothing (``0·log 0 = 0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_ALPHA = 0.1
DEFAULT_BETA = 0.5
# Log-prob floor for the folded remainder: keeps KL finite when the top-k hold (numerically) all mass.
LOG_FLOOR = -60.0


def check_alpha_beta(alpha: float, beta: float) -> None:
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")


def _weighted(prob: Tensor, value: Tensor) -> Tensor:
    """Σ prob·value over the last axis with 0·anything = 0 (value may be ±inf where prob is 0)."""
    return torch.where(prob > 0, prob * value, torch.zeros_like(value)).sum(-1)


def kl(logq: Tensor, logq_slim: Tensor) -> Tensor:
    """``KL(q‖q') = Σ q (log q − log q')`` per position (q = full target, q' = slim)."""
    logq, logq_slim = logq.float(), logq_slim.float()
    return _weighted(logq.exp(), logq - logq_slim)


def r_cost(logq_slim: Tensor, logq: Tensor, alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA) -> Tensor:
    """VIA-SD's ``R(p = q', q)`` per position (see the module docstring for the mapping)."""
    check_alpha_beta(alpha, beta)
    logp, logq = logq_slim.float(), logq.float()
    diff = logp - logq
    la = torch.log1p(torch.tensor(-alpha, dtype=torch.float64)).item()
    lb = torch.log(torch.tensor(beta, dtype=torch.float64)).item()
    return _weighted(logp.exp(), torch.relu(la + diff)) + _weighted(logq.exp(), torch.relu(lb + diff))


def coarse_logprobs(logprobs: Tensor, ids: Tensor) -> Tensor:
    """Log-probs at ``ids [..., k]`` plus one bucket for the rest of the vocabulary -> ``[..., k+1]``.

    Folding the tail keeps a calibration set small (the target's top-k, not 49k floats per
    position). KL and R on the folded distributions are lower bounds of the full-vocabulary values
    (data-processing inequality for KL; each tail term's ReLU is convex), tight when the top-k
    hold most of the mass.
    """
    top = logprobs.float().gather(-1, ids.long())
    return with_remainder(top)


def with_remainder(top: Tensor) -> Tensor:
    """Append ``log(1 − Σ exp(top))`` (floored at LOG_FLOOR) to top-k log-probs ``[..., k]``."""
    lse = torch.logsumexp(top, dim=-1, keepdim=True).clamp(max=0.0)
    rest = torch.log(-torch.expm1(lse)).clamp(min=LOG_FLOOR)
    return torch.cat([top, rest], dim=-1)
