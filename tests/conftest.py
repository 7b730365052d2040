"""Shared fixtures and hypothesis strategies for the whole test suite.

Sections, so additions stay easy to find:

1. hypothesis profiles (modest example counts, no deadlines: CI boxes are slow)
2. model fixtures (a tiny Qwen3-shaped model and its fusion plan)
3. store fixtures (``memory://`` and ``file://`` run roots, fresh per test)
4. hypothesis strategies (index sets, uint64 arrays)

Fixtures that start servers or build models live in their own modules,
registered below through ``pytest_plugins`` so every test module can ask for
them by name without importing them:

- ``redis_fixtures``: ``redis_server`` (one per session, per xdist worker),
  ``redis_url``, ``redis_client``, ``run_name``, ``own_redis_server``,
  ``dead_redis_url``;
- ``server_fixtures``: ``s3_server``, ``s3_bucket``, ``s3_store``, ``any_store``;
- ``ledger_fixtures``: ``clock`` (a :class:`~aurora_store.testing.clock.ManualClock`)
  and ``ledger``;
- ``hf_fixtures``: ``pretrained`` (tiny fine-tuned Hugging Face checkpoints);
- ``vllm_fixtures``: ``vllm_run`` (a tiny Trainer's run) and ``vllm_engine``
  (vLLM over it, one per module; vLLM is imported only when a test asks).

Session-scoped fixtures start nothing until a test asks for them. Waiting on
a condition: :func:`aurora_store.testing.wait.wait_until`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from aurora_store.codec.extract import plan_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.storage import Store, open_store
from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights

pytest_plugins = ["redis_fixtures", "server_fixtures", "ledger_fixtures", "hf_fixtures", "vllm_fixtures"]

# ---------------------------------------------------------------------------
# 1. hypothesis profiles
#
# "default" keeps the whole suite fast on two cores; "thorough" is for a
# nightly run (HYPOTHESIS_PROFILE=thorough). No deadlines: the first example
# of a property often pays for torch/numpy warm-up.

settings.register_profile(
    "default",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# ---------------------------------------------------------------------------
# 1b. parallel runs (pytest-xdist: ``make test`` runs ``-n 2 --dist loadfile``)
#
# A file's tests run on one worker, in order, so its module-scoped fixtures
# are built once. Session-scoped servers are one per worker (free ports).
# What must not run on two workers at once takes a lock in the run's shared
# temporary folder (``shared_tmp``): tests marked ``netns`` one at a time.


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op torch thread per xdist worker: two workers of two threads each on a two-core
    # box spin against each other (the reason for ``one_torch_thread`` below, for the whole run).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this run shares (the run's own base folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True)
def _one_netns_testbed_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """Network-namespace testbeds use fixed addresses: a test marked ``netns`` waits for the others."""
    if request.node.get_closest_marker("netns") is None:
        yield
        return
    with FileLock(request.getfixturevalue("shared_tmp") / "netns.lock"):
        yield


# ---------------------------------------------------------------------------
# 2. model fixtures


@pytest.fixture(scope="session")
def _tiny_weights_master() -> dict[str, torch.Tensor]:
    return make_weights(QWEN3_TINY, seed=0)


@pytest.fixture
def tiny_weights(_tiny_weights_master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face-named bf16 weights of ``QWEN3_TINY``; a fresh copy per test."""
    return {n: t.clone() for n, t in _tiny_weights_master.items()}


@pytest.fixture
def tiny_plan(tiny_weights: dict[str, torch.Tensor]) -> FusionPlan:
    """The fusion plan of ``tiny_weights`` (qkv_proj, gate_up_proj)."""
    return plan_of(tiny_weights, tied=False)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module: two on a shared two-core box spin against each
    other (10x slower). Use as ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------
# 3. store fixtures


@pytest.fixture
def memory_store() -> Iterator[Store]:
    """A ``memory://`` run root unique to the test (the memory filesystem is
    process-wide, so a fixed name would leak objects between tests)."""
    url = f"memory://aurora-test-{uuid.uuid4().hex}"
    store = open_store(url)
    yield store
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm(store.root, recursive=True)


@pytest.fixture
def file_store(tmp_path) -> Store:
    """A ``file://`` run root in the test's temporary folder."""
    root = tmp_path / "run"
    root.mkdir()
    return open_store(f"file://{root}")


@pytest.fixture(params=["memory", "file"])
def local_store(request: pytest.FixtureRequest) -> Store:
    """Each serverless backend in turn."""
    return request.getfixturevalue(f"{request.param}_store")


# ---------------------------------------------------------------------------
# 4. hypothesis strategies


@st.composite
def index_ranges(draw: st.DrawFn, max_start: int = 1 << 20, max_span: int = 4096, min_nnz: int = 0) -> tuple[int, int, np.ndarray]:
    """(start, stop, indices): sorted unique int64 indices inside ``[start, stop)``.

    Densities from empty to full, so every encoding gets its best and worst case.
    """
    start = draw(st.integers(0, max_start))
    span = draw(st.integers(max(1, min_nnz), max_span))
    stop = start + span
    mode = draw(st.sampled_from(["sparse", "dense", "full", "runs"]))
    if mode == "full":
        idx = np.arange(start, stop, dtype=np.int64)
    elif mode == "runs":
        # a few contiguous runs: what a row-block update looks like
        cuts = sorted(draw(st.lists(st.integers(0, span), min_size=2, max_size=8)))
        parts = [np.arange(start + a, start + b) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
        idx = np.unique(np.concatenate(parts)).astype(np.int64) if parts else np.empty(0, np.int64)
    else:
        density = 0.02 if mode == "sparse" else 0.6
        seed = draw(st.integers(0, 2**32 - 1))
        mask = np.random.default_rng(seed).random(span) < density
        idx = (np.flatnonzero(mask) + start).astype(np.int64)
    if idx.size < min_nnz:
        idx = np.arange(start, start + min_nnz, dtype=np.int64)
    return start, stop, idx


@st.composite
def uint64_arrays(draw: st.DrawFn, max_size: int = 64, max_value: int = 1 << 63) -> np.ndarray:
    """uint64 arrays with values in ``[0, max_value]``, biased to byte-length edges."""
    edges = [0, 1, 127, 128, 16383, 16384, (1 << 56) - 1, 1 << 56, (1 << 63) - 1, 1 << 63]
    value = st.one_of(
        st.sampled_from([e for e in edges if e <= max_value]),
        st.integers(0, max_value),
    )
    return np.array(draw(st.lists(value, max_size=max_size)), dtype=np.uint64)
