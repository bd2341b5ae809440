"""Incremental detokenisation and stop strings (text-level concerns kept out of the loop)."""

from __future__ import annotations

from typing import Sequence


class TextStreamer:
    """Incremental detokenisation that never emits text a stop string might still swallow.

    Holds back an unfinished UTF-8 character and the longest tail that is a prefix of a stop
    string; once a stop string appears the text is cut before it (OpenAI semantics) and
    ``stopped`` is set. Used by the CLI and the serving replica alike.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += tokens
        self.text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        cut = trim_at_stop(self.text, self.stops)
        if cut is not None:
            self.stopped = True
            self.text = cut
            return self._advance(len(cut))
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, end), hold, -1):
                if self.text.endswith(s[:k], 0, end):
                    hold = k
                    break
        return self._advance(end - hold)

    def flush(self) -> str:
        return self._advance(len(self.text))

    def _advance(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece


def trim_at_stop(text: str, stops: list[str]) -> str | None:
    """``text`` cut before the earliest stop string, or None when no stop string occurs."""
    hits = [text.index(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else None
