# The two commands that work on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install the project with what it needs. Without a CUDA GPU the
# CPU build torch==2.13.0 is installed (a plain `torch` requirement would pull a multi-GB CUDA build).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pentatron-installed

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(PY) -m pip install 'torch>=2.11,<2.15'; \
	  else \
	    $(PY) -m pip install torch==2.13.0; \
	  fi; \
	fi
	$(PY) -m pip install -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pentatron.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf runs .cache
