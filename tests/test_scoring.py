"""run_tests' sandbox with real subprocesses: a pass needs exit 0 and the appended token (early
exits fail), output and written files are bounded, timeouts hold, and no descendant outlives it."""

from __future__ import annotations

import secrets
import socket
import time

import psutil
import pytest

from hvd_ray.bench.scoring import FILE_SIZE, run_tests, sandbox_info

CHECK = """
def add(a, b):
    return a + b

def check(candidate):
    assert candidate(2, 3) == 5
    assert candidate(-1, 1) == 0
"""


def test_correct_program_passes():
    assert run_tests(CHECK + "\ncheck(add)\n")


def test_failing_assert_fails():
    assert not run_tests(CHECK.replace("a + b", "a - b") + "\ncheck(add)\n")


@pytest.mark.parametrize(
    "exit_line", ["import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit", "raise SystemExit(0)"]
)
def test_early_exit_before_the_tests_fails(exit_line):
    assert not run_tests(CHECK.replace("a + b", "a - b") + f"\n{exit_line}\ncheck(add)\n")


def test_print_loop_is_bounded_and_fails():
    rss0 = psutil.Process().memory_info().rss
    t0 = time.monotonic()
    assert not run_tests('while True:\n    print("x" * 10**6)\n', timeout=5)
    assert time.monotonic() - t0 < 8
    assert psutil.Process().memory_info().rss - rss0 < 100 << 20


def test_print_loop_that_swallows_errors_times_out():
    program = 'while True:\n    try:\n        print("x" * 10**6)\n    except OSError:\n        pass\n'
    rss0 = psutil.Process().memory_info().rss
    t0 = time.monotonic()
    assert not run_tests(program, timeout=2)
    assert time.monotonic() - t0 < 5
    assert psutil.Process().memory_info().rss - rss0 < 100 << 20


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    assert not run_tests("while True:\n    pass\n", timeout=1)
    assert time.monotonic() - t0 < 4


def test_writing_a_large_file_fails():
    assert FILE_SIZE < 100 << 20
    assert not run_tests('with open("big", "wb") as f:\n    f.write(b"x" * (100 << 20))\n' + CHECK + "\ncheck(add)\n")


def _alive(arg: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["cmdline"] == ["sleep", arg] and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _none_survive(arg: str) -> bool:
    deadline = time.monotonic() + 2  # SIGKILL is delivered asynchronously
    while _alive(arg) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(arg)


def _leaves_no_sleeper(program_for, passes: bool, timeout: float = 10.0) -> None:
    """Run ``program_for(arg)`` (it starts ``sleep arg`` children); it passes or fails as
    ``passes`` says, and no ``sleep arg`` outlives the run."""
    arg = f"300.{secrets.randbelow(10**6)}"  # a unique command line to look for
    try:
        assert run_tests(program_for(arg), timeout=timeout) is passes
        assert _none_survive(arg)
    finally:
        for p in _alive(arg):
            p.kill()


def test_background_child_does_not_survive():
    _leaves_no_sleeper(
        lambda arg: f'import subprocess\nsubprocess.Popen(["sleep", "{arg}"])\n' + CHECK + "\ncheck(add)\n", passes=True
    )


def test_many_children_with_a_timeout_do_not_survive():
    _leaves_no_sleeper(
        lambda arg: (
            f'import subprocess, time\nfor _ in range(20):\n    subprocess.Popen(["sleep", "{arg}"])\ntime.sleep(60)\n'
        ),
        passes=False,
        timeout=2,
    )


def test_child_in_its_own_session_dies_with_the_pid_namespace():
    if not sandbox_info()["pid_namespace"]:
        pytest.skip("no PID namespace here: a descendant that leaves the process group can outlive the run")
    _leaves_no_sleeper(
        lambda arg: (
            f'import subprocess\nsubprocess.Popen(["sleep", "{arg}"], start_new_session=True)\n'
            + CHECK
            + "\ncheck(add)\n"
        ),
        passes=True,
    )


def test_no_network_when_isolated():
    if not sandbox_info()["network_isolated"]:
        pytest.skip("unshare -rn is not available here")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        program = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    reached = True\nexcept OSError:\n    reached = False\nassert not reached\n"
        )
        assert run_tests(program)


def test_sandbox_info_reports_the_limits():
    info = sandbox_info(timeout=7)
    assert isinstance(info["network_isolated"], bool) and isinstance(info["pid_namespace"], bool)
    lim = info["limits"]
    assert lim["RLIMIT_AS"] == 2 << 30 and lim["RLIMIT_CPU"] == 7 and lim["RLIMIT_FSIZE"] == FILE_SIZE
    assert lim["RLIMIT_CORE"] == 0 and 0 < lim["RLIMIT_NOFILE"] <= 64 and 0 < lim["RLIMIT_NPROC"] <= 256
    assert ("network isolated" if info["network_isolated"] else "NETWORK NOT ISOLATED") in info["summary"]
    # the child really runs under them
    program = "import resource\n" + "".join(
        f"assert resource.getrlimit(resource.{k}) == ({v}, {v}), '{k}'\n" for k, v in lim.items()
    )
    assert run_tests(program, timeout=7)
