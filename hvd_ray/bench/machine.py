"""What a report says about where and how it ran: the machine, the versions, the command line."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from ..engine.costs import cpu_name as cpu_name  # re-exported: reports name the CPU as cost tables do

ROOT = Path(__file__).resolve().parents[2]
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # as reports write them


def machine_line() -> str:
    import transformers

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, threads {torch.get_num_threads()}"
    )


def versions() -> str:
    import importlib.metadata as md

    def v(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return "not installed"

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        commit = "unknown"
    return (
        f"python {platform.python_version()}, {platform.system()} {platform.release()}, hvd-ray commit {commit}, "
        f"ray {v('ray')}, arctic-inference {v('arctic-inference')}, matplotlib {v('matplotlib')}"
    )


def command(script: str) -> str:
    """The command line that ran this job, as its report quotes it."""
    return " ".join(["python", script, *sys.argv[1:]])


# a neighbour's work: one-thread matmuls of the size of a small model's, as another replica would run
BUSY_LOOP = "import torch; torch.set_num_threads(1); a = torch.randn(768, 768)\nwhile True: a @ a"


@contextmanager
def busy_cpu(processes: int):
    """``processes`` other processes keeping the CPU busy for the ``with`` block (``spec
    --busy-startup``: start-up costs timed as a replica started next to busy ones times them)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        import time

        time.sleep(2.0 if procs else 0.0)  # let them import torch and start multiplying
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
