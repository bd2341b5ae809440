"""HVD inside vLLM (optional extra ``hvd-ray[vllm]``): our suffix trees and yield predictor as a
vLLM speculative proposer (``method: custom_class``), a worker extension that counts target
forwards, and the plug-in (``plugin.py``, vLLM's entry point ``hvd``) that makes the whole hybrid,
cache and EAGLE-3 head, the speculative method ``hvd``. Nothing else in hvd_ray imports this
package but ``generate.py`` (vLLM as a plain batch generator: the traces' vLLM backend, the benchmark
peers' environment). vLLM itself is imported only inside functions (``plugin.register``, which vLLM
calls, and ``generate.py``'s backend), so the package loads wherever hvd_ray does.

    speculative_config={"method": "custom_class", "model": "hvd_ray.vllm.HvdProposer",
                        "num_speculative_tokens": 32}
    speculative_config={"method": "hvd", "num_speculative_tokens": 32}   # with the plug-in
"""

from .proposer import HvdProposer, HvdStaticProposer, HvdTauProposer, SuffixProposer
from .worker import HvdWorkerExtension

__all__ = ["HvdProposer", "HvdStaticProposer", "HvdTauProposer", "HvdWorkerExtension", "SuffixProposer"]
