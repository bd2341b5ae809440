"""A prompt, its deterministic split, and how it becomes model text.

Every prompt set (the packaged datasets in :mod:`hvd_ray.workloads.datasets`, a user's file in
:mod:`hvd_ray.workloads.user_prompts`) yields :class:`Prompt` objects: OpenAI-style chat messages,
optionally a plain completion prompt (``raw``), and dataset metadata (tests, ground truth, ...).

Splits are a pure function of the prompt id (SHA-256, never Python's salted ``hash()``), so the
same prompt lands in the same split on every machine, process and run, and adding prompts never
moves existing ones.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("function_calling", "function_calling_multi", "code", "code_edit", "chat")
SPLITS = ("train", "validation", "test")
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)
ROLES = ("system", "user", "assistant")

# Turns of one conversation share a split (no train/test leakage between MT-Bench turn 1 and 2), and
# so does a question asked as chat (``bfcl/<category>/<id>/chat``) with its function-calling original.
_VARIANT_SUFFIX = re.compile(r"(/(turn\d+|chat|again))+$")  # all of them: "<id>/turn1/again"


@dataclass
class Prompt:
    """One prompt of a workload.

    ``id`` is stable across runs and machines (e.g. ``"humaneval/HumanEval/0"``,
    ``"bfcl/simple_python/simple_python_0"``, ``"mtbench/81/turn1"``). ``messages`` is a list of
    ``{"role": "system"|"user"|"assistant", "content": str}`` ending with a user turn. ``raw`` is a
    plain completion prompt where one is natural (HumanEval's code), else ``None``. ``meta`` holds
    JSON-serialisable dataset extras.
    """

    id: str
    workload: str
    messages: list[dict]
    raw: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"prompt {self.id!r}: workload {self.workload!r} not in {WORKLOADS}")
        check_messages(self.messages, where=f"prompt {self.id!r}")

    @property
    def split(self) -> str:
        return split_of(self.id)

    def to_record(self) -> dict[str, Any]:
        """A flat, parquet/Ray-Data friendly row (``meta`` as a JSON string)."""
        return {
            "id": self.id,
            "workload": self.workload,
            "messages": [{"role": m["role"], "content": m["content"]} for m in self.messages],
            "raw": self.raw,
            "meta_json": json.dumps(self.meta, sort_keys=True),
        }

    @classmethod
    def from_record(cls, row: dict[str, Any]) -> Prompt:
        meta = row.get("meta_json")
        return cls(
            id=row["id"],
            workload=row["workload"],
            messages=[{"role": m["role"], "content": m["content"]} for m in row["messages"]],
            raw=row.get("raw"),
            meta=json.loads(meta) if meta else {},
        )


def check_messages(messages: Any, where: str) -> None:
    """Raise ``ValueError`` (prefixed with ``where``) unless ``messages`` is a valid chat."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {i} must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}, expected one of {ROLES}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"{where}: message {i} ({m['role']}) has empty or non-string content")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must be a user turn, got {messages[-1]['role']!r}")


def conversation_id(prompt_id: str) -> str:
    """``prompt_id`` without its trailing ``/turn<N>``, ``/chat`` and ``/again`` parts: the id its
    variants share (``mtbench/81/turn1/again``: ``mtbench/81``)."""
    return _VARIANT_SUFFIX.sub("", prompt_id)


def split_of(prompt_id: str, fractions: tuple[float, float, float] = DEFAULT_FRACTIONS) -> str:
    """Deterministic ``"train" | "validation" | "test"`` for a prompt id.

    A trailing ``/turn<N>``, ``/chat`` or ``/again`` is dropped before hashing, so all turns of one
    conversation share a split (``/again``: a prompt's second turn, ``workloads/turns.py``), and a
    BFCL question asked as chat shares its function-calling prompt's split.
    The first 8 bytes of SHA-256 give a uniform number in [0, 1), cut at ``fractions``.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions}")
    key = conversation_id(prompt_id)
    u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < fractions[0]:
        return "train"
    if u < fractions[0] + fractions[1]:
        return "validation"
    return "test"


def check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")


def render(prompt: Prompt, tokenizer: Any, chat: bool = True) -> str:
    """The text the model sees.

    ``chat=False`` with a ``raw`` prompt returns ``raw`` unchanged (plain completion, e.g.
    HumanEval's code). Otherwise the tokenizer's chat template is applied with a generation
    prompt appended.
    """
    if not chat and prompt.raw is not None:
        return prompt.raw
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "render with chat=False (only prompts with a raw form) or use an instruct tokenizer"
        )
    return tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
