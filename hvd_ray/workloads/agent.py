"""The long-prompt agent workload: one system prompt holding many tools' schemas, shared by every
request (an agent framework sends its whole tool list with each call), then one task. The tools are
those of the first function-calling prompts of the split, up to a size budget; the tasks are that
split's function-calling questions in order, so some need a listed tool and others none (as in BFCL's
irrelevance categories)."""

from __future__ import annotations

import json

from .datasets import _fc_system_prompt, load_workload
from .prompts import Prompt

TOOL_CHARS = 8000  # about 2,000 SmolLM2 tokens of schemas


def agent_prompts(split: str | None = "test", tool_chars: int = TOOL_CHARS, own_tools: bool = False) -> list[Prompt]:
    """Every function-calling question of ``split`` (Java / JavaScript ones left out: their schemas
    follow another language's conventions) under one shared system prompt of tools; with
    ``own_tools`` each task's system prompt lists the same tools in an order of its own (rotated by
    the task's index), so no two prompts share more than the prompt's opening words, as for agents
    that each carry their own tool list."""
    tasks = [
        p
        for p in load_workload("function_calling", split=split)
        if p.meta.get("functions") and "java" not in p.meta.get("category", "")
    ]
    tools: list[dict] = []
    names: set[str] = set()
    size = 0
    for p in tasks:
        new = [f for f in p.meta["functions"] if f["name"] not in names]
        cost = sum(len(json.dumps(f, ensure_ascii=False)) + 1 for f in new)
        if size + cost <= tool_chars:
            tools += new
            names |= {f["name"] for f in new}
            size += cost

    def system(i: int) -> dict:
        order = tools[i % len(tools) :] + tools[: i % len(tools)] if own_tools else tools
        return {"role": "system", "content": _fc_system_prompt(order)}

    return [
        Prompt(
            id=f"agent/{p.id}",
            workload="function_calling",
            messages=[system(i), p.messages[-1]],
            meta={"tools": len(tools), "task_tools_listed": all(f["name"] in names for f in p.meta["functions"])},
        )
        for i, p in enumerate(tasks)
    ]


__all__ = ["TOOL_CHARS", "agent_prompts"]
