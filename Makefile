# dflash-pipeline: `make demo` runs the whole pipeline on a tiny default on CPU; `make test` runs the tests.
# `make pipeline TARGET=... DATA=... OUT=...` runs extract -> train on your model and data.

PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
# The CPU wheel of torch on this kind of machine; on a GPU host set TORCH_SPEC to your build (>=2.11).
TORCH_SPEC  ?= torch==2.13.0

TARGET       ?=
DATA         ?=
OUT          ?= runs/pipeline
CONFIG       ?=
EXTRACT_GPUS ?= 0,1,2,3,4
TRAIN_GPUS   ?= 5,6,7
EXTRACT_ARGS ?=
TRAIN_ARGS   ?=
CONFIG_FLAG  := $(if $(CONFIG),--config $(CONFIG),)

.PHONY: install test lint format demo extract train pipeline report clean-demo

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

test: install lint
	$(BIN)/python -m pytest -q

# ruff (pinned in the test extras): lint, and the formatting check; `make format` rewrites.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

demo: install
	$(BIN)/python -m dflash_pipeline.demo --out runs/demo

extract: install
	@test -n "$(TARGET)" -a -n "$(DATA)" || { echo "make extract: set TARGET=<model folder> DATA=<data file or folder>"; exit 2; }
	$(BIN)/dflash-extract $(CONFIG_FLAG) --target $(TARGET) --data $(DATA) --out $(OUT)/store --gpus $(EXTRACT_GPUS) $(EXTRACT_ARGS)

train: install
	$(BIN)/dflash-train $(CONFIG_FLAG) --store $(OUT)/store --out $(OUT)/train --gpus $(TRAIN_GPUS) $(TRAIN_ARGS)

# Stage two starts only if stage one left a complete store (dflash-train refuses anything else).
pipeline: extract train

report: install
	$(BIN)/dflash-report --run $(OUT)/train

clean-demo:
	rm -rf runs/demo
