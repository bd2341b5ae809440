"""Draft-source selection for HVD: features φ_t, the yield predictor g_θ, and policies."""

from .cost_policy import CostPolicy
from .features import FEATURES, SPEC, FeatureSpec, VocabFlags, features, history_from_steps
from .policy import AlwaysCache, AlwaysModel, OraclePolicy, ScoreRule, TauPolicy
from .predictor import YieldPredictor

__all__ = [
    "FEATURES",
    "SPEC",
    "AlwaysCache",
    "AlwaysModel",
    "CostPolicy",
    "FeatureSpec",
    "OraclePolicy",
    "ScoreRule",
    "TauPolicy",
    "VocabFlags",
    "YieldPredictor",
    "features",
    "history_from_steps",
]
