"""Parquet schemas of the offline pipeline, trace collection (writer, resume, reader) and replay."""

from .collect import CollectError, TraceWriter, model_revision, read_traces
from .schema import TRACE_SCHEMA

__all__ = ["TRACE_SCHEMA", "CollectError", "TraceWriter", "model_revision", "read_traces"]
