"""The trace folder: complete ``part-*.parquet`` files, written atomically, read as one table.

The folder is a local path or a storage URI (``storage.py``: ``file://``, ``s3://``, an NFS
mount), read and written through ``pyarrow.fs``. Only the collection's driver writes
(:class:`TraceWriter`), so "nothing lost, nothing duplicated" reduces to: a prompt is done iff its
row is in a complete part file. A part is written to a temp name and renamed (on a POSIX file
system fsync'ed first, under a lock that keeps two collections out of one folder); readers ignore
temp files.
"""

from __future__ import annotations

import fcntl
import os
import posixpath
import time
import uuid
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from . import storage
from .errors import CollectError
from .schema import TRACE_SCHEMA

PART_GLOB = "part-*.parquet"
TEMP_PREFIX = ".part-"
TEMP_SUFFIX = ".parquet.tmp"
LOCK_NAME = ".collect.lock"


def part_files(out_dir: str | os.PathLike) -> list[str]:
    """The complete part files of a folder, as paths on its file system (temp files are not parts)."""
    return storage.files(out_dir, PART_GLOB)


def read_traces(out_dir: str | os.PathLike, columns: Sequence[str] | None = None) -> pa.Table:
    """All traces of ``out_dir`` (its ``part-*.parquet`` files) as one table sorted by ``seq``.

    ``columns`` selects a subset (in TRACE_SCHEMA order). A folder without parts gives an empty
    table; a missing folder raises ``FileNotFoundError``. Should a prompt id occur twice (two
    collections run into one folder by hand), the row with the lower ``seq`` wins.
    """
    if not storage.is_dir(out_dir):
        raise FileNotFoundError(f"trace directory {out_dir} not found")
    want = list(TRACE_SCHEMA.names) if columns is None else [c for c in TRACE_SCHEMA.names if c in set(columns)]
    unknown = set(columns or ()) - set(TRACE_SCHEMA.names)
    if unknown:
        raise ValueError(f"unknown trace columns {sorted(unknown)}; known: {TRACE_SCHEMA.names}")
    read = list(dict.fromkeys([*want, "prompt_id", "seq"]))
    schema = pa.schema([TRACE_SCHEMA.field(c) for c in TRACE_SCHEMA.names if c in read])
    fs, _ = storage.resolve(out_dir)
    tables = [
        pq.read_table(p, columns=read, filesystem=fs).select(schema.names).cast(schema) for p in part_files(out_dir)
    ]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = table.sort_by([("seq", "ascending"), ("prompt_id", "ascending")])
    ids = table.column("prompt_id").to_pylist()
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        keep = [not (i in seen or seen.add(i)) for i in ids]
        table = table.filter(pa.array(keep))
    return table.select(want)


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

    Each part is written to ``.part-<uuid>.parquet.tmp`` and renamed: a crash leaves only complete
    parts (plus a temp file, which readers ignore and the next writer deletes). On a POSIX file
    system (a local disk, an NFS mount, ``file://``) the temp file is fsync'ed before the rename and
    an exclusive ``flock`` on ``<dir>/.collect.lock`` keeps two collections out of one folder, so the
    resume plan made under the lock stays true until the writer closes. An object store (``s3://``)
    has no lock: run one collection per prefix.
    """

    def __init__(self, out_dir: str | os.PathLike, rows_per_file: int = 256, flush_s: float = 60.0):
        self.where = storage.normalize(out_dir)
        self.fs, self.path = storage.resolve(out_dir)
        self.local = storage.is_local(self.fs)
        self.fs.create_dir(self.path, recursive=True)
        self.rows_per_file = max(1, rows_per_file)
        self.flush_s = flush_s
        self._lock = None
        if self.local:
            self._lock = open(os.path.join(self.path, LOCK_NAME), "a")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                raise CollectError(
                    f"another collection is writing to {self.where}; wait for it or use another --out"
                ) from None
        self.removed_temps = []
        for tmp in storage.files(self.where, TEMP_PREFIX + "*" + TEMP_SUFFIX):  # leftovers of a crashed run
            self.fs.delete_file(tmp)
            self.removed_temps.append(posixpath.basename(tmp))
        self._buf: list[pa.Table] = []
        self._buf_rows = 0
        self._since = 0.0
        self.rows_written = 0
        self.files: list[str] = []  # the parts written, as paths on the file system

    def add(self, table: pa.Table | Iterable[dict]) -> str | None:
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

    def flush(self) -> str | None:
        if not self._buf:
            return None
        table = pa.concat_tables(self._buf).sort_by("seq")
        name = uuid.uuid4().hex
        tmp = posixpath.join(self.path, f"{TEMP_PREFIX}{name}{TEMP_SUFFIX}")
        final = posixpath.join(self.path, f"part-{name}.parquet")
        if self.local:
            with open(tmp, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.path)
        else:
            with self.fs.open_output_stream(tmp) as f:
                pq.write_table(table, f)
            self.fs.move(tmp, final)  # an object store's copy makes the part appear whole
        self._buf, self._buf_rows = [], 0
        self.rows_written += table.num_rows
        self.files.append(final)
        return final

    def close(self) -> None:
        """Write what is buffered and release the lock (call in ``finally``: buffered rows are work)."""
        try:
            self.flush()
        finally:
            if self._lock is not None and not self._lock.closed:
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                self._lock.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(d: str) -> None:
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
