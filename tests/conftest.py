"""Shared fixtures: tiny randomly initialised HF models saved as real safetensors folders."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

# `make test` runs the files on parallel pytest-xdist workers: each gets its share of the cores
# (oversubscribed torch threads on a busy 2-core box run many times slower, docs/design.md)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_tiny(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``kind`` (llama | qwen2 | qwen3) model as a HF safetensors folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = classes[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    cfg = cfg_cls(**{**TINY, **extra, **overrides}, tie_word_embeddings=kind != "qwen2")
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():  # random norms so q/k-norm and layer norms are actually exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory) -> Path:
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def default_folder() -> Path:
    from hvd_ray.model.registry import resolve

    return resolve("default")


# ------------------------------------------------------------------------------ a live Serve application
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STEP_COSTS = Path(__file__).resolve().parents[1] / ".pytest_cache" / "step_costs.json"


@contextlib.contextmanager
def serve_app(config: dict, name: str, api_key: str | None = None):
    """The application ``build_app(config)`` on a real local Ray + Serve; yields its base URL. An
    ``api_key`` reaches the ingress as the README says: the env HVD_RAY_API_KEY of the Ray instance.
    Replicas share one step-costs file (the first hvd replica of a run times its forwards, later
    ones and their replacements read the table), as replicas of one machine type in production."""
    import ray
    from ray import serve

    from hvd_ray.serving import build_app

    config = {"step_costs": str(STEP_COSTS), **config}

    old = os.environ.get("HVD_RAY_API_KEY")
    if api_key:
        os.environ["HVD_RAY_API_KEY"] = api_key  # inherited by the local Ray instance's workers
    started = False
    try:
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            started = True
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=name, route_prefix="/")
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            if started:
                ray.shutdown()
    finally:
        if old is None:
            os.environ.pop("HVD_RAY_API_KEY", None)
        else:
            os.environ["HVD_RAY_API_KEY"] = old


# ------------------------------------------------- real-model lossless references (test_speculative, test_tiered)
MAX_NEW = 24
MAX_PROMPT = 600


@pytest.fixture(scope="session")
def target(default_folder):
    """The default model in fp32: the exactness reference for lossless tests."""
    from hvd_ray.model import load

    return load(str(default_folder), "float32")


@pytest.fixture(scope="session")
def prompts(target):
    """12 real held-out prompts: 4 each of code, chat and function calling."""
    from hvd_ray.workloads import load_workload, render

    _, tok = target
    out = []
    for w in ("code", "chat", "function_calling"):
        taken = 0
        for p in load_workload(w, split="test"):
            ids = tok(render(p, tok), add_special_tokens=False)["input_ids"]
            if len(ids) <= MAX_PROMPT:
                out.append(ids)
                taken += 1
            if taken == 4:
                break
    assert len(out) == 12
    return out


@pytest.fixture(scope="session")
def plain(target, prompts):
    """Plain greedy outputs of the same engine (batch 4)."""
    from hvd_ray.engine import Engine, SamplingParams

    model, _ = target
    reqs = Engine(model, max_batch=4, max_len=1024).generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    return [r.output for r in reqs]


# ------------------------------------------------------------ sampling checks (test_speculative, test_tiered)
def second_token_marginal(model, prompt: list[int], temperature: float = 1.0):
    """Exact marginal of the 2nd sampled token: sum_a p(a | prompt) p(b | prompt, a)."""
    V = model.cfg.vocab_size
    with torch.no_grad():
        model.cache.truncate(0, 0)
        p1 = model(torch.tensor([prompt]), [0]).logits[0, -1].div(temperature).softmax(-1)
        exact = torch.zeros(V)
        for a in range(V):
            model.cache.truncate(0, 0)
            exact += p1[a] * model(torch.tensor([prompt + [a]]), [0]).logits[0, -1].div(temperature).softmax(-1)
    return exact


def second_token_pvalue(reqs, exact) -> tuple[float, list[int]]:
    """Chi-square p-value of the requests' 2nd output tokens against ``exact`` (bins with < 5
    expected draws pooled), and the observed counts."""
    import collections

    from scipy.stats import chisquare

    n, V = len(reqs), len(exact)
    counts = collections.Counter(r.output[1] for r in reqs)
    obs = [counts.get(v, 0) for v in range(V)]
    exp = (exact * n).tolist()
    keep = [i for i, e in enumerate(exp) if e >= 5]
    o, e = [obs[i] for i in keep], [exp[i] for i in keep]
    other_o, other_e = n - sum(o), n - sum(e)
    if other_e >= 5:
        o, e = o + [other_o], e + [other_e]
    else:  # the pooled rest is too small a bin itself (0 where the kept bins hold all the mass): merge it
        o[-1], e[-1] = o[-1] + other_o, e[-1] + other_e
    return chisquare(o, e).pvalue, obs
