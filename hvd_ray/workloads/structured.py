"""Structured-output tasks: BFCL's function schemas as ``response_format: json_schema``.

Each task asks for the arguments of one call to a BFCL function as a JSON object, constrained to
the function's parameter schema. BFCL writes its schemas in a Python-flavoured dialect (``dict``,
``float``, ``tuple``, ``any``); :func:`json_schema` turns them into JSON Schema.
"""

from __future__ import annotations

from .datasets import load_bfcl

_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "int": "integer", "bool": "boolean"}
_KEEP = ("properties", "required", "items", "enum", "description", "additionalProperties")

SYSTEM = (
    "You fill in the arguments of a function call. Answer with one JSON object holding the "
    "arguments of a call to this function and nothing else:\n{function}"
)


def json_schema(bfcl: dict) -> dict:
    """A BFCL parameter schema as JSON Schema (unknown keys dropped; ``any`` accepts anything)."""
    out: dict = {}
    kind = bfcl.get("type")
    if kind is not None and kind != "any":
        out["type"] = _TYPES.get(kind, kind)
    for key in _KEEP:
        if key not in bfcl:
            continue
        val = bfcl[key]
        if key == "properties":
            val = {name: json_schema(sub) for name, sub in val.items()}
        elif key == "items":
            val = json_schema(val)
        out[key] = val
    if out.get("type") == "object" and "properties" in out and "required" in out:
        out["required"] = [r for r in out["required"] if r in out["properties"]]
    return out


def bfcl_schema_tasks(n: int = 20, category: str = "simple_python") -> list[dict]:
    """The first ``n`` BFCL ``category`` prompts as ``{"id", "messages", "schema"}``: the question,
    answered by the arguments of its (first) function as JSON."""
    import json

    tasks = []
    for p in load_bfcl(category)[:n]:
        fn = p.meta["functions"][0]
        system = SYSTEM.format(function=json.dumps(fn, ensure_ascii=False))
        question = next(m["content"] for m in p.messages if m["role"] == "user")
        tasks.append(
            {
                "id": p.id,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "schema": json_schema(fn["parameters"]),
            }
        )
    return tasks
