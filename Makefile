# `make serve` and `make test` work on a fresh machine: they create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64 amd64,$(shell uname -m)),-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8,)

.PHONY: install serve test lint clean

$(STAMP): pyproject.toml
	@echo "adaserve: [1/4] creating $(VENV) (first run only)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build that lies on the dev machines' disk; elsewhere pip fetches it.
	@echo "adaserve: [2/4] installing torch (a download of up to ~200 MB where it is not cached)"
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.4,<3"
	@echo "adaserve: [3/4] installing adaserve and its dependencies (transformers, fastapi, ray, ...)"
	$(BIN)/pip install -q -e ".[dev,cluster]"
	# The cpu extra builds llama.cpp (the ggml backend the default model runs on): ~3.5 min once,
	# needs a C++ compiler and cmake. Without it everything runs on the torch backend.
	# ggml's AMX kernels die with SIGILL (tileloadd) on some AMX-capable virtual machines; the
	# build keeps every other native instruction (AVX-512, VNNI) and leaves AMX out on x86-64.
	@echo "adaserve: [4/4] building llama.cpp for the ggml backend (about 3.5 minutes on 2 cores, once)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$CMAKE_ARGS" $(BIN)/pip install -q -e ".[dev,cluster,cpu]" || echo "adaserve: llama-cpp-python did not build;" \
		"the default model will run on the (slower) torch backend"
	@echo "adaserve: set up"
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
