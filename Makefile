# Two commands are all a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-all clean install

# The version lives in commd_protocol/__init__.py (pyproject reads it): a new version
# reinstalls, so the installed metadata says the same as the source.
$(STAMP): pyproject.toml protocol/commd_protocol/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# dev, plus the optional framework extras so their tests run here and in CI
	$(BIN)/pip install -q -e '.[dev,lightning,accelerate]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy commd client/commd_client protocol/commd_protocol
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy commd client/commd_client protocol/commd_protocol

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

# Every benchmark (the netns ones need root; several minutes on 2 cores): see docs/benchmarks.md.
bench-all: $(STAMP)
	$(BIN)/python bench/overhead.py --ready both
	$(BIN)/python bench/planner_quality.py
	$(BIN)/python bench/replay.py
	$(BIN)/python bench/ddp_compare.py
	$(BIN)/python bench/compression.py

clean:
	rm -rf $(VENV) build *.egg-info commd/compression/_native*.so
