"""The one error of trace collection: a run that cannot proceed as asked (the jobs exit 2 on it)."""

from __future__ import annotations


class CollectError(RuntimeError):
    """A collection that cannot proceed as asked (the message says why and what to do)."""
