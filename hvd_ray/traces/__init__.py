"""Parquet schemas of the offline pipeline, trace collection (writer, resume, reader) and replay."""

from .errors import CollectError
from .model_info import model_revision
from .schema import TRACE_SCHEMA
from .store import TraceWriter, read_traces

__all__ = ["TRACE_SCHEMA", "CollectError", "TraceWriter", "model_revision", "read_traces"]
