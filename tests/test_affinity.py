"""Conversation affinity (serving/affinity.py): the request key's prefix property, and on a real Serve
app with two replicas of the default model, every later turn of a conversation lands on the replica
that holds its earlier turns' K/V (seen in the usage's cached prompt tokens)."""

from __future__ import annotations

import pytest
from conftest import serve_app

from hvd_ray.serving.affinity import block_keys, request_text


def test_a_next_turn_extends_its_previous_turn_key():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    turn1 = {"messages": [{"role": "user", "content": "plan a trip " * 40}], "tools": tools}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "sure " * 30},
            {"role": "user", "content": "and back " * 30},
        ],
        "tools": tools,
    }
    other = {"messages": [{"role": "user", "content": "write a poem " * 40}], "tools": tools}
    k1, k2, ko = (block_keys(request_text(p), 64) for p in (turn1, turn2, other))
    assert len(k2) > len(k1) > 2 and k2[: len(k1)] == k1  # every block of turn 1 is a block of turn 2
    assert not set(ko) & set(k1[1:])  # another conversation shares at most the block holding the tools
    ids = list(range(100))
    assert (
        block_keys(request_text({"prompt_token_ids": ids + [7] * 60}), 64)[:2]
        == block_keys(request_text({"prompt_token_ids": ids}), 64)[:2]
    )


CONFIG = {
    "model": "default",
    "dtype": "bfloat16",
    "drafter": "none",
    "max_batch": 2,
    "reuse_slots": 4,
    "max_model_len": 2048,
    "torch_threads": 1,
    "num_replicas": 2,
    "ray_actor_options": {"num_cpus": 0.5},
    "request_router": "affinity",
}


@pytest.mark.slow
def test_conversations_stay_on_the_replica_holding_their_prefix(default_folder):
    import httpx

    topics = ["a trip to Kyoto", "a sorting algorithm", "a birthday party", "a garden in spring"]
    convs = [[{"role": "user", "content": f"Tell me about {t}, in detail, step by step."}] for t in topics]
    prev: dict[int, int] = {}  # conversation -> its last turn's prompt tokens
    with serve_app(CONFIG, "affinity-test") as url, httpx.Client(base_url=url, timeout=300) as http:
        for turn in range(3):
            for i, conv in enumerate(convs):
                r = http.post(
                    "/v1/chat/completions",
                    json={"model": "default", "messages": conv, "max_tokens": 24, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                usage = body["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if turn:  # the previous turn's prompt and answer are in this replica's cache
                    assert cached >= prev[i] - 8, (turn, cached, prev[i])
                conv += [
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Go on, and add one more example."},
                ]
                prev[i] = usage["prompt_tokens"]
