"""Prompt sets: packaged datasets (BFCL, HumanEval, MT-Bench), users' files, self-written chat, splits, rendering."""

from .datasets import (
    BFCL_MULTI_TURN,
    BFCL_SINGLE_TURN,
    INSTALL_COMMAND,
    TRAINING_POOLS,
    DatasetNotInstalledError,
    load_bfcl,
    load_bfcl_chat,
    load_bfcl_multi_turn,
    load_code_edit,
    load_humaneval,
    load_mtbench,
    load_workload,
)
from .prompts import SPLITS, WORKLOADS, Prompt, conversation_id, render, split_of
from .user_prompts import load_user_prompts

__all__ = [
    "BFCL_MULTI_TURN",
    "BFCL_SINGLE_TURN",
    "INSTALL_COMMAND",
    "SPLITS",
    "WORKLOADS",
    "DatasetNotInstalledError",
    "Prompt",
    "TRAINING_POOLS",
    "conversation_id",
    "load_bfcl",
    "load_bfcl_chat",
    "load_bfcl_multi_turn",
    "load_code_edit",
    "load_humaneval",
    "load_mtbench",
    "load_user_prompts",
    "load_workload",
    "render",
    "split_of",
]
