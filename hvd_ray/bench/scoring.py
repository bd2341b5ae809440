"""Task scoring of generated text: HumanEval pass@1 and BFCL exact match.

* HumanEval: the completion's ```python block (prefixed with the prompt when it lacks the
  function, and with the prompt's imports) + the problem's tests run in a subprocess by
  ``run_tests``. The model's code is untrusted, so the child runs with ``python -I`` in a fresh
  temp dir (its cwd, ``TMPDIR`` and ``HOME``), stdin from /dev/null, and these limits:
  address space 2 GiB, CPU time = the timeout rounded up, 16 MiB per written file (stdout included, so
  a print loop cannot fill the parent's memory or the disk through it: stdout goes to a file the
  parent scans in chunks, stderr to /dev/null), 32 open files, 64 processes, no core dumps. The
  process limit counts every process of the real uid and the kernel does not apply it to root,
  so the child also gets its own session, and its whole process group is killed when it exits
  or times out; where the kernel allows, it runs in new user + network + PID namespaces
  (``unshare -rn --pid --fork --kill-child``): no network (only a downed loopback), and every
  descendant, even one that left the process group, dies with it. Without the PID namespace
  only ``unshare -rn``, or nothing when that fails too; ``sandbox_info()`` says which, for the
  reports. The filesystem is not isolated: the child keeps the caller's file permissions.
  A pass needs exit status 0 *and* a random per-run token on stdout, written by a line appended
  after the tests, so a program that exits early (``sys.exit(0)``, ``os._exit(0)``) fails;
* BFCL: the ``<tool_call>`` JSON list parsed and compared with the packaged ``possible_answer``
  ground truth (same number of calls, matched in any order; same function names; every given
  argument is a known parameter whose value is one of the accepted values; a missing argument is
  allowed only when ``""`` is among its accepted values, i.e. optional). Strings are compared
  case-insensitively after trimming; ints equal floats of the same value. This is our compact
  re-implementation of BFCL's AST check, not the bfcl-eval checker itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TIMEOUT = 10.0  # seconds of wall clock per program
ADDRESS_SPACE = 2 << 30  # bytes
FILE_SIZE = 16 << 20  # bytes per file the child writes, stdout included
OPEN_FILES = 32
PROCESSES = 64  # per real uid, not enforced for root (see the module docstring)


def extract_code(completion: str, prompt: str, entry_point: str) -> str:
    """The program to test: the completion's first python block (or the whole text), with the
    prompt's imports, and the prompt itself in front when the block lacks the function."""
    m = re.search(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", completion, re.S)
    code = m.group(1) if m else completion
    if not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        code = prompt + code
    imports = [ln for ln in prompt.splitlines() if ln.startswith(("import ", "from "))]
    return "\n".join(imports) + "\n" + code


def _limits(timeout: float) -> dict[str, int]:
    return {
        "RLIMIT_AS": ADDRESS_SPACE,
        "RLIMIT_CPU": max(1, math.ceil(timeout)),
        "RLIMIT_FSIZE": FILE_SIZE,
        "RLIMIT_NOFILE": OPEN_FILES,
        "RLIMIT_NPROC": PROCESSES,
        "RLIMIT_CORE": 0,
    }


def _set_limits(limits: dict[str, int]):
    pairs = [(getattr(resource, name), v) for name, v in limits.items()]

    def apply() -> None:  # runs in the forked child before exec: no imports or allocation-heavy work here
        for r, v in pairs:
            resource.setrlimit(r, (v, v))

    return apply


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _has_token(path: Path, token: bytes) -> bool:
    """Whether ``token`` occurs in the file, read in 1 MiB chunks and at most ``FILE_SIZE`` bytes."""
    tail, left = b"", FILE_SIZE + len(token)
    with open(path, "rb") as f:
        while left > 0 and (chunk := f.read(min(1 << 20, left))):
            if token in tail + chunk:
                return True
            tail, left = chunk[-len(token) :], left - len(chunk)
    return False


def _run(cmd: list[str], cwd: str, timeout: float, stdout) -> tuple[int | None, bool]:
    """(exit status, timed out) of ``cmd`` in its own session under ``_limits``; the whole process
    group is SIGKILLed before the child is reaped, so its id cannot have been reused."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": cwd, "HOME": cwd}
    p = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_set_limits(_limits(timeout)),
    )
    deadline, delay, timed_out = time.monotonic() + timeout, 0.001, False
    try:
        while os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
    finally:
        _kill_group(p.pid)
        rc = p.wait()
    return rc, timed_out


def run_tests(program: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """True when ``program`` runs to its end and exits 0 within ``timeout`` seconds in the sandbox
    of the module docstring: a line appended after it writes a fresh random token to stdout, and
    that token must be there."""
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="hvd-score-") as d:
        path = Path(d) / "prog.py"
        path.write_text(program + f'\n\n__import__("os").write(1, b"\\n{token}\\n")\n')
        out = Path(d) / "stdout"
        with open(out, "wb") as f:
            rc, timed_out = _run(SANDBOX + [sys.executable, "-I", str(path)], d, timeout, f)
        return not timed_out and rc == 0 and _has_token(out, token.encode())


def _probe(prefix: list[str]) -> bool:
    if not shutil.which(prefix[0]):
        return False
    with tempfile.TemporaryDirectory(prefix="hvd-score-") as d:
        try:
            rc, timed_out = _run(prefix + [sys.executable, "-I", "-c", "pass"], d, DEFAULT_TIMEOUT, subprocess.DEVNULL)
        except OSError:
            return False
    return rc == 0 and not timed_out


def _sandbox() -> list[str]:
    for prefix in (["unshare", "-rn", "--pid", "--fork", "--kill-child"], ["unshare", "-rn"]):
        if _probe(prefix):
            return prefix
    return []


SANDBOX = _sandbox()  # the command prefix run_tests puts in front of python
NO_NET = bool(SANDBOX)  # the child has no network


def sandbox_info(timeout: float = DEFAULT_TIMEOUT) -> dict:
    """How ``run_tests`` isolates a program on this machine, for the reports: network and PID
    namespace on or off, the command prefix, and the resource limits for ``timeout``."""
    pid_ns = "--pid" in SANDBOX
    limits = _limits(timeout)
    summary = (
        ("network isolated" if NO_NET else "NETWORK NOT ISOLATED (unshare unavailable)")
        + (f" ({' '.join(SANDBOX)})" if SANDBOX else "")
        + f", python -I, {timeout:g} s timeout, {ADDRESS_SPACE >> 30} GiB address space, "
        f"{FILE_SIZE >> 20} MiB per file, {OPEN_FILES} open files, "
        + (f"{PROCESSES} processes" if os.getuid() != 0 else "process limit not enforced (root)")
        + ", descendants killed with the process group"
        + (" and the PID namespace" if pid_ns else "")
    )
    return {
        "network_isolated": NO_NET,
        "pid_namespace": pid_ns,
        "command_prefix": list(SANDBOX),
        "timeout_s": timeout,
        "limits": limits,
        "process_limit_enforced": os.getuid() != 0,
        "summary": summary,
    }


def parse_tool_calls(text: str) -> list[dict] | None:
    """``[{"name": ..., "arguments": {...}}, ...]`` from the model's ``<tool_call>`` output, or None."""
    m = re.search(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S)
    body = (m.group(1) if m else text).strip()
    candidates = [body]
    if "[" in body and "]" in body:
        candidates.append(body[body.index("[") : body.rindex("]") + 1])
    if "{" in body and "}" in body:
        candidates.append("[" + body[body.index("{") : body.rindex("}") + 1] + "]")
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
        ((fname, params),) = gt.items()
        hit = next((c for c in left if c["name"] == fname and _args_ok(c["arguments"], params)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True
