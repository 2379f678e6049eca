# kvgate: `make run` starts a local fleet, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: run test bench install install-worker install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# One stamp per extra set, redone whenever pyproject.toml changes.
$(VENV)/.installed-core: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e .
	touch $@

# torch first, pinned: any other version would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

$(VENV)/.installed-worker: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[worker]'
	touch $@

# The suite covers the NIXL transport too (`transfer`: nixl-cu12 runs CPU-only over UCX).
$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[test,worker,transfer]'
	touch $@

install: $(VENV)/.installed-core
install-worker: $(VENV)/.installed-worker
install-test: $(VENV)/.installed-test

run: $(VENV)/.installed-worker
	$(VENV)/bin/kvgate up

# Finds a Redis server that answers (KVGATE_REDIS_URL, then 127.0.0.1:6379) or starts
# one on a free port, and runs pytest with KVGATE_REDIS_URL pointing at it.
test: $(VENV)/.installed-test
	$(PY) scripts/ensure_redis.py --exec $(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed-core
	$(PY) bench/indexer.py --quick

clean:
	rm -rf $(VENV) .redis-test .pytest_cache
