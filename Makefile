# Two commands on a fresh machine, each creating the virtual environment $(VENV) when it is missing:
#   make test    ruff check, ruff format --check and the test suite (exactly what CI runs: .ci/run)
#   make train   the default training run (examples/train_clip.py; extra flags: make train ARGS="--help")
# The environment is rebuilt when pyproject.toml changes. On a CUDA machine: make test EXTRAS=dev,triton
# `make test` also checks the lower end of the dependency ranges: a second environment $(VENV)-lowest with
# pyproject.toml's lower bounds pinned (constraints-lowest.txt) runs the tests of the code that calls those
# libraries (LOWEST_TESTS). `make test-newest` skips it. The tests run in $(TEST_WORKERS) processes (pytest-xdist;
# 2 = CI's cores, where the suite takes about 10 minutes instead of 14; TEST_WORKERS=0 runs them in this process).

VENV ?= .venv
PYTHON ?= python3
# torch first and pinned: 2.13.0 is the CPU build CI tests (a bare "torch" would pull a multi-GB CUDA build).
TORCH ?= torch==2.13.0
EXTRAS ?= dev
ARGS ?=
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOW_VENV := $(VENV)-lowest
LOW_STAMP := $(LOW_VENV)/.installed
LOWEST_TESTS ?= tests/training tests/test_hub.py tests/test_quantizer.py tests/test_convert.py tests/test_siglip.py \
	tests/test_lora.py tests/test_metrics.py tests/test_adapters.py tests/test_precision_summary.py

.PHONY: test test-newest test-lowest train

test: test-newest test-lowest

test-newest: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test-lowest: $(LOW_STAMP)
	$(LOW_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" -p no:cacheprovider $(LOWEST_TESTS)

train: $(STAMP)
	$(BIN)/accelerate launch examples/train_clip.py $(ARGS)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

$(LOW_STAMP): pyproject.toml constraints-lowest.txt
	test -x $(LOW_VENV)/bin/python || $(PYTHON) -m venv $(LOW_VENV)
	$(LOW_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOW_VENV)/bin/python -m pip install -q $(TORCH)
	$(LOW_VENV)/bin/python -m pip install -q -e ".[$(EXTRAS)]" -c constraints-lowest.txt
	touch $@
