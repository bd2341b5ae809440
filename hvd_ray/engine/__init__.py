"""The decoding loop, per-request state and text handling."""

from .engine import Choice, Engine, StepOutput
from .request import Request, RequestStats, SamplingParams, StepRecord
from .text import TextStreamer, trim_at_stop

__all__ = [
    "Choice",
    "Engine",
    "Request",
    "RequestStats",
    "SamplingParams",
    "StepOutput",
    "StepRecord",
    "TextStreamer",
    "trim_at_stop",
]
