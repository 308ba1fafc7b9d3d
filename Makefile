# batchapi: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL := smollm2-135m-instruct
EMBEDDING_MODEL := all-minilm-l6-v2

.PHONY: install model browser demo test lint bench clean

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

bench: install
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV) batchapi-data .pytest_cache
