"""The suffix-history regimes HVD is measured in (a policy tuned in one can be wrong in another).

* ``cold``: every method's global tree starts empty (it fills with the run's own outputs);
* ``warm-repeat``: the same prompts again on the same engines (retries, agent loops re-sending a
  request), so the global tree holds each prompt's answer;
* ``agent``: a second turn on the same engines: the conversation so far (the prompt and the first
  answer) plus a follow-up that asks for a revision, as an agent loop re-sends earlier outputs;
  each method decodes the first turn again, unmeasured, just before (the previous turn of a live
  loop has just run, so its K/V is still in the engine's slot: prefix reuse);
* ``warm-history``: fresh engines whose global trees hold outputs of *other* requests of the same
  workloads (train-split traces, or train-split prompts decoded here): the realistic serving case.
"""

from __future__ import annotations

from ..workloads import Prompt, render
from ..workloads.turns import second_turn

REGIMES = ("cold", "warm-repeat", "agent", "warm-history")


def agent_turn(prompt: Prompt, answer: str, tokenizer) -> list[int]:
    """Token ids of the second turn: ``prompt``'s messages, ``answer`` as the assistant, a follow-up."""
    return tokenizer(render(second_turn(prompt, answer), tokenizer), add_special_tokens=False)["input_ids"]


__all__ = ["REGIMES", "agent_turn"]
