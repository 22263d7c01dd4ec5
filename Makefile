# `make serve` and `make test` work on a fresh machine: they create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install serve test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build that lies on the dev machines' disk; elsewhere pip fetches it.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.4,<3"
	$(BIN)/pip install -q -e ".[dev,cluster]"
	# The cpu extra builds llama.cpp (the ggml backend the default model runs on): ~3.5 min once,
	# needs a C++ compiler and cmake. Without it everything runs on the torch backend.
	$(BIN)/pip install -q -e ".[dev,cluster,cpu]" || echo "adaserve: llama-cpp-python did not build;" \
		"the default model will run on the (slower) torch backend"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/adaserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check adaserve tests
	$(BIN)/python -m mypy adaserve

clean:
	rm -rf $(VENV)
