"""The decoding loop, per-request state and text handling."""

from .engine import DraftPlan, Engine, StepOutput
from .policy import Choice, DraftPolicy
from .request import Request, RequestStats, SamplingParams, StepRecord
from .text import TextStreamer, trim_at_stop

__all__ = [
    "Choice",
    "DraftPlan",
    "DraftPolicy",
    "Engine",
    "Request",
    "RequestStats",
    "SamplingParams",
    "StepOutput",
    "StepRecord",
    "TextStreamer",
    "trim_at_stop",
]
