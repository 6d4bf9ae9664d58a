# Two commands are all a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-pure lint docs bench bench-all clean install

# The version lives in commd_protocol/__init__.py (pyproject reads it): a new version
# reinstalls, so the installed metadata says the same as the source.
$(STAMP): pyproject.toml protocol/commd_protocol/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# dev, plus the optional framework extras so their tests run here and in CI, and the docs
	$(BIN)/pip install -q -e '.[dev,lightning,accelerate,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# What CI runs (.ci/run): lint, the docs site, then each tier of tests/ as its own pytest run,
# so that the log gives each tier's time on pytest's summary line (see CONTRIBUTING.md) and its
# ten slowest tests, then test-pure.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy commd client/commd_client protocol/commd_protocol
	$(MAKE) --no-print-directory docs
	$(BIN)/python -m pytest -q --durations=10 tests/unit
	$(BIN)/python -m pytest -q --durations=10 tests/daemon
	$(BIN)/python -m pytest -q --durations=10 tests/system
	$(MAKE) --no-print-directory test-pure

# The unit tier alone: in-process tests, no process or socket (tests/unit/conftest.py checks).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The compression and DDP tests with the compiled loops switched off (COMMD_NATIVE=0, read by
# commd/compression/native.py; the ranks and daemons the tests start inherit it): the numpy
# path a machine without a C compiler runs, end to end.
PURE_NAMES := compression compressed_pipeline compact_wire fused_select topk_kernels \
	topk_offline native_loops momentum_correction momentum_correction_daemons rank_momentum \
	ratio_pick selection_messages torch_ddp ddp_dropin ddp_surface ddp_twice ddp_porting
# each name's file, in whichever tier it lives; a name with no file stops test-pure
PURE_TESTS := $(foreach name,$(PURE_NAMES),$(wildcard tests/*/test_$(name).py))
PURE_MISSING := $(strip $(foreach name,$(PURE_NAMES),$(if $(wildcard tests/*/test_$(name).py),,$(name))))

test-pure: $(STAMP)
	$(if $(PURE_MISSING),$(error test-pure: no tests/*/test_NAME.py for: $(PURE_MISSING)))
	COMMD_NATIVE=0 $(BIN)/python -m pytest -q $(PURE_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy commd client/commd_client protocol/commd_protocol

# The docs site (mkdocs.yml) into site/, offline; --strict fails on a warning: a broken link or
# anchor, a page left out of the nav, a docstring mkdocstrings cannot read (not --quiet: it drops
# the warnings before --strict counts them). Open site/index.html.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

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
	rm -rf $(VENV) build site *.egg-info commd/compression/_native*.so
