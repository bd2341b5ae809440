"""Incremental detokenisation and stop strings (text-level concerns kept out of the loop)."""

from __future__ import annotations


class TextStreamer:
    """Turns a growing token list into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._sent = 0

    def push(self, tokens: list[int]) -> str:
        self.ids += tokens
        self.text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        end = len(self.text)
        while end > self._sent and self.text[end - 1] == "\ufffd":  # an unfinished multi-byte char
            end -= 1
        piece, self._sent = self.text[self._sent : end], end
        return piece

    def flush(self) -> str:
        piece, self._sent = self.text[self._sent :], len(self.text)
        return piece


def trim_at_stop(text: str, stops: list[str]) -> str | None:
    """``text`` cut before the earliest stop string, or None when no stop string occurs."""
    hits = [text.index(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else None
