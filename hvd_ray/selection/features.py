"""The feature vector φ_t the yield predictor g_θ reads, computed by ONE function online and offline.

At a decoding step the request's context is ``prompt + output`` (the last output token is the
pending one), the cache drafter has produced a draft for it, and the request has a history of
earlier steps. :func:`features` maps exactly that to a float32 vector; the engine-side policy
(``selection/policy.py``) and trace replay (``traces/replay.py``) both call it, so a predictor
trained on replayed traces sees the same numbers at serving time.

Feature groups (names in :data:`FEATURES`, version :data:`FEATURE_VERSION`):

* draft: ``score`` (the suffix tree's expected accepted length: sum of path probabilities),
  ``match_len``, ``draft_len``, ``is_global`` (1 when the draft came from the global tree of past
  outputs, 0 for the request's own tree), ``mean_prob`` (score / draft_len), ``last_prob`` (the
  path probability of the draft's last token, its least likely one);
* position: ``prompt_len``, ``generated`` (output tokens so far, pending one included),
  ``rel_pos`` (generated / max_tokens);
* history (see :func:`history_features`): ``acc_mean4`` (mean accepted draft tokens over the last
  4 decoding steps, any source), ``cache_acc_mean4`` (the same over the last 4 steps that verified
  a cache draft), ``cache_rate16`` (share of the last 16 steps that verified a cache draft),
  ``n_steps16`` (how many steps the 16-window holds, so "no history yet" is distinguishable);
* structure: for the last context token, its flags (0/1); for the draft, the share of draft tokens
  carrying each flag. Flags come from each token's decoded text (:class:`VocabFlags`, one table
  per tokenizer built once): whitespace-only, newline, leading space, punctuation, opening
  bracket, closing bracket, quote, JSON delimiter (``:`` / ``,``), code marker (a fence or a
  keyword such as ``def``/``return``), digit, word (alphabetic), special token.

A "step" here is one verify forward. History entries are ``(cache_chosen, accepted)`` pairs:
``cache_chosen`` means the verified draft came from the suffix drafter (source ``suffix-*``),
``accepted`` is the number of draft tokens accepted (bonus token excluded) — exactly what the
engine records in ``StepRecord`` (see :func:`history_from_steps`).
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

FEATURE_VERSION = 1

FLAGS = (
    "ws",
    "newline",
    "space_start",
    "punct",
    "open_br",
    "close_br",
    "quote",
    "json_delim",
    "code",
    "digit",
    "word",
    "special",
)

DRAFT_FEATURES = ("score", "match_len", "draft_len", "is_global", "mean_prob", "last_prob")
POSITION_FEATURES = ("prompt_len", "generated", "rel_pos")
HISTORY_FEATURES = ("acc_mean4", "cache_acc_mean4", "cache_rate16", "n_steps16")
FEATURES = (
    DRAFT_FEATURES
    + POSITION_FEATURES
    + HISTORY_FEATURES
    + tuple(f"last_{f}" for f in FLAGS)
    + tuple(f"draft_{f}" for f in FLAGS)
)

HISTORY_SLICE = slice(
    len(DRAFT_FEATURES) + len(POSITION_FEATURES), len(DRAFT_FEATURES) + len(POSITION_FEATURES) + len(HISTORY_FEATURES)
)
_LAST = HISTORY_SLICE.stop
_DRAFT = _LAST + len(FLAGS)

CODE_WORDS = frozenset(
    {
        "def",
        "return",
        "import",
        "from",
        "class",
        "self",
        "lambda",
        "function",
        "const",
        "let",
        "var",
        "if",
        "else",
        "elif",
        "for",
        "while",
        "in",
        "try",
        "except",
        "raise",
        "print",
        "None",
        "True",
        "False",
        "null",
        "true",
        "false",
    }
)
_OPEN, _CLOSE, _QUOTES = set("([{"), set(")]}"), set("\"'`")
_PUNCT = set(string.punctuation) - _OPEN - _CLOSE - _QUOTES


@dataclass(frozen=True)
class FeatureSpec:
    """Ordered feature names + version: a predictor artifact records it and refuses a mismatch."""

    names: tuple[str, ...] = FEATURES
    version: int = FEATURE_VERSION

    def __len__(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict:
        return {"version": self.version, "names": list(self.names)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> FeatureSpec:
        return cls(tuple(d["names"]), int(d["version"]))

    def check(self, other: FeatureSpec) -> None:
        if self != other:
            raise ValueError(
                f"feature spec mismatch: artifact has v{other.version} with "
                f"{len(other.names)} features, code computes v{self.version} with "
                f"{len(self.names)}: relabel and retrain"
            )


SPEC = FeatureSpec()


def token_flags(text: str, special: bool = False) -> tuple[int, ...]:
    """The 0/1 structure flags (order of :data:`FLAGS`) of one token's decoded text."""
    s = text.strip()
    chars = set(text)
    return (
        int(bool(text) and not s),  # ws
        int("\n" in text),  # newline
        int(text[:1] == " "),  # space_start
        int(bool(chars & _PUNCT)),  # punct
        int(bool(chars & _OPEN)),  # open_br
        int(bool(chars & _CLOSE)),  # close_br
        int(bool(chars & _QUOTES)),  # quote
        int(":" in text or "," in text),  # json_delim
        int("```" in text or s in CODE_WORDS),  # code
        int(any(c.isdigit() for c in text)),  # digit
        int(s.isalpha()),  # word
        int(special),  # special
    )


class VocabFlags:
    """A ``[vocab, len(FLAGS)]`` float32 table of per-token flags, built once per tokenizer."""

    def __init__(self, table: np.ndarray):
        if table.ndim != 2 or table.shape[1] != len(FLAGS):
            raise ValueError(f"flag table must be [vocab, {len(FLAGS)}], got {table.shape}")
        self.table = np.ascontiguousarray(table, dtype=np.float32)

    @classmethod
    def from_texts(
        cls, texts: Sequence[str], special_ids: Iterable[int] = (), vocab_size: int | None = None
    ) -> VocabFlags:
        """Flags of ``texts[i]`` for token i; rows past ``len(texts)`` (up to ``vocab_size``) are 0."""
        n = max(len(texts), vocab_size or 0)
        table = np.zeros((n, len(FLAGS)), np.float32)
        special = set(special_ids)
        for i, t in enumerate(texts):
            table[i] = token_flags(t, i in special)
        return cls(table)

    @classmethod
    def from_decode(cls, decode_one: Callable[[int], str], vocab_size: int) -> VocabFlags:
        return cls.from_texts([decode_one(i) for i in range(vocab_size)])

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> VocabFlags:
        """Each token's text as the tokenizer decodes it alone (special tokens kept)."""
        n = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(n)])
        return cls.from_texts(texts, getattr(tokenizer, "all_special_ids", ()), vocab_size)

    def __len__(self) -> int:
        return self.table.shape[0]

    def of(self, token: int) -> np.ndarray:
        return self.table[token] if 0 <= token < len(self.table) else np.zeros(len(FLAGS), np.float32)

    def share(self, tokens: Sequence[int]) -> np.ndarray:
        """Per flag, the fraction of ``tokens`` that carry it (zeros for no tokens)."""
        if not len(tokens):
            return np.zeros(len(FLAGS), np.float32)
        ids = np.asarray(tokens, dtype=np.int64)
        ok = (ids >= 0) & (ids < len(self.table))
        return self.table[ids[ok]].sum(0, dtype=np.float32) / np.float32(len(ids))


History = Sequence[tuple[bool, int]]


def history_from_steps(steps: Sequence) -> list[tuple[bool, int]]:
    """Engine ``StepRecord``s -> history pairs (only the last 16 are ever read)."""
    return [(s.source.startswith("suffix"), int(s.accepted)) for s in steps[-16:]]


def history_features(history: History) -> np.ndarray:
    """``[acc_mean4, cache_acc_mean4, cache_rate16, n_steps16]``; means of nothing are 0."""
    last4 = history[-4:]
    acc4 = sum(a for _, a in last4) / len(last4) if last4 else 0.0
    cache_acc = []
    for c, a in reversed(history):
        if c:
            cache_acc.append(a)
            if len(cache_acc) == 4:
                break
    cacc4 = sum(cache_acc) / len(cache_acc) if cache_acc else 0.0
    win = history[-16:]
    rate = sum(1 for c, _ in win if c) / len(win) if win else 0.0
    return np.array([acc4, cacc4, rate, len(win)], np.float32)


def features(
    draft, *, prompt_len: int, generated: int, max_tokens: int, last_token: int, history: History, flags: VocabFlags
) -> np.ndarray:
    """φ_t for one request at one step (see the module docstring for every entry).

    ``draft`` is the cache drafter's draft for this step (a ``Draft``; possibly empty),
    ``generated`` the output length so far (pending token included), ``last_token`` the pending
    token, ``history`` the ``(cache_chosen, accepted)`` pairs of the request's earlier steps.
    """
    n = len(draft.token_ids)
    phi = np.empty(len(FEATURES), np.float32)
    phi[0] = draft.score
    phi[1] = draft.match_len
    phi[2] = n
    phi[3] = 1.0 if draft.source == "suffix-global" else 0.0
    phi[4] = draft.score / n if n else 0.0
    phi[5] = draft.probs[-1] if n else 0.0
    phi[6] = prompt_len
    phi[7] = generated
    phi[8] = generated / max_tokens if max_tokens > 0 else 0.0
    phi[HISTORY_SLICE] = history_features(history)
    phi[_LAST:_DRAFT] = flags.of(last_token)
    phi[_DRAFT:] = flags.share(draft.token_ids)
    return phi


def with_history(phi: np.ndarray, history: History) -> np.ndarray:
    """A copy of ``phi`` whose history features are recomputed for another decoding run (offline
    policy simulation: everything else in φ depends only on the trace position)."""
    out = np.array(phi, np.float32, copy=True)
    out[HISTORY_SLICE] = history_features(history)
    return out


__all__ = [
    "FEATURES",
    "FEATURE_VERSION",
    "FLAGS",
    "FeatureSpec",
    "HISTORY_SLICE",
    "SPEC",
    "VocabFlags",
    "features",
    "history_features",
    "history_from_steps",
    "token_flags",
    "with_history",
]
