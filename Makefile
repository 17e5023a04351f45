# The two commands that work on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install the project with what it needs. Which torch: see
# scripts/torch_build.sh — without an NVIDIA driver the CPU build torch==2.13.0 (a plain `torch`
# requirement would pull a multi-GB CUDA build); with one, the CUDA build (cu126/cu128/cu130) of
# torch 2.11-2.14 that the driver supports, from the PyTorch index, and it says which.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pentatron-installed
# Where the CPU build of torch comes from (empty: pip's default index, which holds it here). Elsewhere PyPI's
# torch is the CUDA build: `make test TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_CPU_INDEX ?=
# Test processes: each runs whole files (module-scoped set-ups run once); 2 fills a 2-core machine.
TEST_WORKERS ?= 2

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  spec="$$(TORCH_CPU_INDEX='$(TORCH_CPU_INDEX)' bash scripts/torch_build.sh)" && $(PY) -m pip install $$spec; \
	fi
	$(PY) -m pip install -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pentatron.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests research/tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks research

clean:
	rm -rf runs .cache
