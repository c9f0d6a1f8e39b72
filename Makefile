# Two commands on a fresh machine, each creating the virtual environment $(VENV) when it is missing:
#   make test    ruff check, ruff format --check and the test suite (exactly what CI runs: .ci/run)
#   make train   the default training run (examples/train_clip.py; extra flags: make train ARGS="--help")
# The environment is rebuilt when pyproject.toml changes. On a CUDA machine: make test EXTRAS=dev,triton

VENV ?= .venv
PYTHON ?= python3
# torch first and pinned: 2.13.0 is the CPU build CI tests (a bare "torch" would pull a multi-GB CUDA build).
TORCH ?= torch==2.13.0
EXTRAS ?= dev
ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test train

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

train: $(STAMP)
	$(BIN)/accelerate launch examples/train_clip.py $(ARGS)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@
