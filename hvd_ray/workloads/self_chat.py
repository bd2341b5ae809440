"""Chat prompts written by the target itself (Magpie-style), to train a drafter on more chat.

An instruct model given only the chat template up to the start of a user turn writes a plausible
user message. Sampling that prefix gives as many in-distribution chat prompts as there is time for,
with no dataset to license or download; the target's greedy replies to them are then collected
like any other traces. The packaged chat set (MT-Bench) has 80 questions, too few to train on.
"""

from __future__ import annotations

import re
from typing import Any

_MARKER = "\x00QUERY\x00"
_WORDS = re.compile(r"\w+")


def user_turn_prefix(tokenizer: Any) -> str:
    """The rendered chat up to where a user message's text starts (system prompt included)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARKER}], tokenize=False, add_generation_prompt=False
    )
    if _MARKER not in text:
        raise ValueError("the chat template does not place the user message verbatim")
    return text[: text.index(_MARKER)]


def clean_query(text: str, min_words: int = 4, max_words: int = 120) -> str | None:
    """The sampled user message, stripped, or ``None`` when it is unusable as a prompt.

    Rejected: too short or too long, or holding chat markup (the sample ran past its turn).
    """
    text = text.strip()
    if "<|" in text or "|>" in text:
        return None
    n = len(_WORDS.findall(text))
    if n < min_words or n > max_words:
        return None
    return text


def dedup_key(text: str) -> str:
    """Case- and spacing-insensitive key, so near-identical samples count once."""
    return " ".join(_WORDS.findall(text.lower()))
