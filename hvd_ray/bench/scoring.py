"""Task scoring of generated text: HumanEval pass@1 and BFCL exact match.

* HumanEval: the completion's ```python block (prefixed with the prompt when it lacks the
  function, and with the prompt's imports) + the problem's tests run in a subprocess: a fresh temp
  dir, ``python -I``, a timeout, address-space / CPU limits, and no network (``unshare -rn``, a
  new user + network namespace with only a downed loopback, when the kernel allows it);
* BFCL: the ``<tool_call>`` JSON list parsed and compared with the packaged ``possible_answer``
  ground truth (same number of calls, matched in any order; same function names; every given
  argument is a known parameter whose value is one of the accepted values; a missing argument is
  allowed only when ``""`` is among its accepted values, i.e. optional). Strings are compared
  case-insensitively after trimming; ints equal floats of the same value. This is our compact
  re-implementation of BFCL's AST check, not the bfcl-eval checker itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def extract_code(completion: str, prompt: str, entry_point: str) -> str:
    """The program to test: the completion's first python block (or the whole text), with the
    prompt's imports, and the prompt itself in front when the block lacks the function."""
    m = re.search(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", completion, re.S)
    code = m.group(1) if m else completion
    if not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        code = prompt + code
    imports = [ln for ln in prompt.splitlines() if ln.startswith(("import ", "from "))]
    return "\n".join(imports) + "\n" + code


def _limits() -> None:  # runs in the child before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))


def run_tests(program: str, timeout: float = 10.0) -> bool:
    """True when ``program`` exits 0 in an isolated subprocess (see the module docstring)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prog.py"
        path.write_text(program)
        cmd = [sys.executable, "-I", str(path)]
        if NO_NET:
            cmd = ["unshare", "-rn"] + cmd
        try:
            r = subprocess.run(cmd, cwd=d, capture_output=True, timeout=timeout, preexec_fn=_limits,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0


def _no_net_available() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


NO_NET = _no_net_available()


def parse_tool_calls(text: str) -> list[dict] | None:
    """``[{"name": ..., "arguments": {...}}, ...]`` from the model's ``<tool_call>`` output, or None."""
    m = re.search(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S)
    body = (m.group(1) if m else text).strip()
    candidates = [body]
    if "[" in body and "]" in body:
        candidates.append(body[body.index("["): body.rindex("]") + 1])
    if "{" in body and "}" in body:
        candidates.append("[" + body[body.index("{"): body.rindex("}") + 1] + "]")
    for c in candidates:
        try:
            calls = json.loads(c)
        except json.JSONDecodeError:
            continue
        calls = [calls] if isinstance(calls, dict) else calls
        if not isinstance(calls, list):
            continue
        out = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            out.append({"name": call["name"], "arguments": args})
        return out
    return None


def _same(v, a) -> bool:
    if isinstance(a, bool) or isinstance(v, bool):
        return v is a if isinstance(a, bool) and isinstance(v, bool) else False
    if isinstance(a, (int, float)) and isinstance(v, (int, float)):
        return float(v) == float(a)
    if isinstance(a, str) and isinstance(v, str):
        return v.strip().lower() == a.strip().lower()
    if isinstance(a, list) and isinstance(v, (list, tuple)):
        return len(a) == len(v) and all(_same(x, y) for x, y in zip(v, a))
    if isinstance(a, dict) and isinstance(v, dict):  # nested: values are lists of accepted values
        return _args_ok(v, a)
    return False


def _accepted(v, accepted) -> bool:
    return any(_same(v, a) for a in (accepted if isinstance(accepted, list) else [accepted]))


def _args_ok(args: dict, truth: dict) -> bool:
    if set(args) - set(truth):
        return False
    for name, accepted in truth.items():
        if name in args:
            if not _accepted(args[name], accepted):
                return False
        elif not (isinstance(accepted, list) and "" in accepted):
            return False
    return True


def bfcl_match(calls: list[dict] | None, truth: list[dict]) -> bool:
    """Exact match of parsed calls against BFCL ground truth ``[{func: {param: [accepted...]}}]``."""
    if calls is None or len(calls) != len(truth):
        return False
    left = list(calls)
    for gt in truth:
        (fname, params), = gt.items()
        hit = next((c for c in left if c["name"] == fname and _args_ok(c["arguments"], params)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True
