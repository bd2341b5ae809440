"""Where the offline jobs read and write: a local path or a storage URI, through ``pyarrow.fs``.

A job's folder (traces, labels, a predictor, Ray Tune's ``storage_path``) is one string: a plain
local path (made absolute), ``file:///abs/path``, ``s3://bucket/prefix`` or anything else
``pyarrow.fs.FileSystem.from_uri`` knows. On a cluster every node resolves the same string to the
same place (an object store, or an NFS mount at the same path), so actors and workers on any node
read and write it; a plain local path means each node's own disk, as on one machine.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pyarrow.fs as pafs


def is_uri(where: str | os.PathLike) -> bool:
    return "://" in str(where)


def normalize(where: str | os.PathLike) -> str:
    """The string every node is handed: a URI as given (no trailing ``/``), a local path absolute."""
    s = str(where)
    if is_uri(s):
        u = urlsplit(s)
        return urlunsplit(u._replace(path=u.path.rstrip("/") or ("/" if u.scheme == "file" else "")))
    return str(Path(s).expanduser().resolve())


def resolve(where: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path on it)``: what ``pyarrow``, ``pyarrow.dataset`` and Ray Data take."""
    s = normalize(where)
    if is_uri(s):
        fs, path = pafs.FileSystem.from_uri(s)
        return fs, path.rstrip("/") or "/"
    return pafs.LocalFileSystem(), s


def is_local(fs: pafs.FileSystem) -> bool:
    """A POSIX file system here (a local disk or an NFS mount): renames are atomic, ``flock`` works."""
    return isinstance(fs, pafs.LocalFileSystem)


def join(where: str | os.PathLike, *names: str) -> str:
    s = normalize(where)
    if not is_uri(s):
        return str(Path(s, *names))
    u = urlsplit(s)  # names go into the path, before a query such as ?region=... or ?endpoint_override=...
    return urlunsplit(u._replace(path=posixpath.join(u.path or "/", *names)))


def is_dir(where: str | os.PathLike) -> bool:
    """A folder that exists (on an object store: a prefix with at least one object under it)."""
    fs, path = resolve(where)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def files(where: str | os.PathLike, pattern: str = "*") -> list[str]:
    """The files directly in ``where`` whose name matches ``pattern``, as paths on its file system, sorted."""
    fs, path = resolve(where)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.base_name, pattern))


def read_text(where: str | os.PathLike) -> str:
    fs, path = resolve(where)
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text(where: str | os.PathLike, text: str) -> None:
    fs, path = resolve(where)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def upload(local_dir: str | os.PathLike, where: str | os.PathLike) -> None:
    """Copy a local folder's files into ``where`` (``pyarrow.fs.copy_files``)."""
    fs, path = resolve(where)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(str(local_dir), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
