"""Second turns of a conversation: the answer sent back with a follow-up, as an agent loop does.

An agent re-sends the conversation so far (the prompt and the model's answer) with a new user turn
that asks for the answer again, revised. The benchmark's agent regime (``bench/regimes.py``) and
agent-turn trace collection (``collect_traces.py --second-turns``) build their turns here, so the
predictor is trained on the same kind of turn it is measured on.
"""

from __future__ import annotations

from .prompts import Prompt

# the follow-up user turn, per workload: each asks for the answer again, revised
FOLLOW_UPS = {
    "function_calling": "The call returned an error: the service timed out. Make the same call again.",
    "code": "Add a docstring and type hints, then give the whole function again.",
    "code_edit": "Also add a short comment above each changed line, and show the whole code again.",
    "chat": "Please give your answer again, improved and a little shorter.",
}
DEFAULT_FOLLOW_UP = "Please answer again, improved."
SUFFIX = "/again"  # the id of a prompt's second turn: ``<id>/again`` (MT-Bench's own ``/turn2`` prompts
# carry a reference first answer, not the model's, so they are not agent turns)


def second_turn(prompt: Prompt, answer: str) -> Prompt:
    """``prompt``'s messages, ``answer`` as the assistant's turn, then the workload's follow-up; id
    ``<id>/again`` (``split_of`` drops the suffix, so both turns share a split)."""
    follow = FOLLOW_UPS.get(prompt.workload, DEFAULT_FOLLOW_UP)
    return Prompt(
        prompt.id + SUFFIX,
        prompt.workload,
        [*prompt.messages, {"role": "assistant", "content": answer}, {"role": "user", "content": follow}],
        meta=dict(prompt.meta),
    )


def is_second_turn(prompt_id: str) -> bool:
    """Whether ``prompt_id`` names a :func:`second_turn`."""
    return prompt_id.endswith(SUFFIX)


__all__ = ["DEFAULT_FOLLOW_UP", "FOLLOW_UPS", "SUFFIX", "is_second_turn", "second_turn"]
