"""HVD inside vLLM (optional extra ``hvd-ray[vllm]``): our suffix trees and yield predictor as a
vLLM speculative proposer (``method: custom_class``), and a worker extension that counts target
forwards. Nothing else in hvd_ray imports this package; it imports no vLLM module itself (vLLM
builds the proposer from its config and calls it), so it loads wherever hvd_ray does.

    speculative_config={"method": "custom_class", "model": "hvd_ray.vllm.HvdProposer",
                        "num_speculative_tokens": 32}
"""

from .proposer import HvdProposer, HvdStaticProposer, HvdTauProposer, SuffixProposer
from .worker import HvdWorkerExtension

__all__ = ["HvdProposer", "HvdStaticProposer", "HvdTauProposer", "HvdWorkerExtension", "SuffixProposer"]
