"""Incremental detokenisation and stop strings (text-level concerns kept out of the loop)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

_UNFINISHED = "\ufffd"  # what a decoder makes of an unfinished UTF-8 character (and of invalid bytes)


class IncrementalDecoder:
    """``decode(ids) -> str`` made incremental: ``push`` returns the text its tokens add, ``flush`` the rest.

    The pieces concatenate to ``decode(all ids)``; each call decodes a window of the last 8 to 16 settled
    tokens plus the unsettled ones (prefix / read offsets, as in vLLM and TGI), so a stream costs O(tokens),
    not O(tokens^2). A trailing U+FFFD (an unfinished character) waits for the token that settles it; text-less
    tokens (skipped special tokens) leave the window. Unlike ``tokenizers``' ``DecodeStream`` it can flush, holds
    back only the unfinished character, and works over any decode function (the engine's detokenizer).
    """

    CONTEXT = 8  # settled tokens kept for context (a decoder may join or strip across token boundaries)

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []  # the window: the settled context tokens, then the unsettled ones
        self.last = ""  # decode(ids)
        self.sent = 0  # characters of ``last`` returned

    def push(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        self.ids += tokens
        text = self.decode(self.ids)
        if text == self.last and self.sent == len(text):  # no text, nothing unfinished (skipped special tokens)
            del self.ids[len(self.ids) - len(tokens) :]
            return ""
        end = len(text)
        while end > self.sent and text[end - 1] == _UNFINISHED:
            end -= 1
        piece = text[self.sent : end]
        self.last, self.sent = text, max(self.sent, end)
        if end == len(text) and len(self.ids) >= 2 * self.CONTEXT:  # all settled: slide the window
            del self.ids[: len(self.ids) - self.CONTEXT]
            self.last = self.decode(self.ids)
            self.sent = len(self.last)
        return piece

    def flush(self) -> str:
        piece, self.sent = self.last[self.sent :], len(self.last)
        return piece


class TextStreamer:
    """Incremental detokenisation that never emits text a stop string might still swallow.

    Holds back an unfinished UTF-8 character and the longest tail that is a prefix of a stop
    string; once a stop string appears the text is cut before it (OpenAI semantics) and
    ``stopped`` is set. Each ``push`` costs O(its tokens + the longest stop string): only the
    held-back tail and the new text can hold a new match. Used by the CLI and the serving replica.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.skip = skip_special_tokens
        self.decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        self.held = ""  # decoded but not yet returned: it ends like the start of a stop string
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        return self._release(self.decoder.push(tokens), final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._release(self.decoder.flush(), final=True)

    def _release(self, new: str, final: bool) -> str:
        text = self.held + new
        cut = trim_at_stop(text, self.stops)
        if cut is not None:
            self.stopped, self.held = True, ""
            return cut
        hold = 0 if final else stop_prefix_len(text, self.stops)
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold]


def trim_at_stop(text: str, stops: list[str]) -> str | None:
    """``text`` cut before the earliest stop string, or None when no stop string occurs."""
    hits = [text.find(s) for s in stops if s]
    hits = [h for h in hits if h >= 0]
    return text[: min(hits)] if hits else None


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (0 if none)."""
    best = 0
    for s in stops:
        j = text.find(s[0], max(0, len(text) - len(s) + 1))
        while j != -1 and len(text) - j > best:
            if s.startswith(text[j:]):
                best = len(text) - j
                break
            j = text.find(s[0], j + 1)
    return best


class StopScanner:
    """Whether a stop string has appeared in the text of the tokens pushed so far.

    Keeps the last ``len(longest stop) - 1`` characters, so a match spanning earlier and new text is
    found, at O(new tokens + longest stop) per ``push``: the engine's per-request stop-string check.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self.decoder = IncrementalDecoder(decode)
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.tail = ""

    def push(self, tokens: Sequence[int]) -> bool:
        text = self.tail + self.decoder.push(tokens)
        self.tail = text[max(0, len(text) - self.keep) :] if self.keep else ""
        return any(s in text for s in self.stops)
