"""A checkpoint copied into a local spool while training goes on (issue 25's overhead target).

What must hold: once the live tensors are in the spool, ``optimizer.step()``
runs even while the store does not answer at all (an S3 server stopped with
SIGSTOP), and the checkpoint committed afterwards holds the tensors as they
were when it began, bit for bit, each object checked against its record's
size and SHA-256; without room for a spool the checkpoint is the same, the
step then waiting for the upload; an Adam optimizer given its state before
the first step (so that the first checkpoint is as large as the others)
trains bit for bit as one that made it itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aurora_store.storage import Store, open_store
from aurora_store.testing.servers import S3Server
from workers.trainer import spool
from workers.trainer.checkpoint import Checkpoint, checkpoint_folder, commit_checkpoint, load_checkpoint, make_optimizer_state
from workers.trainer.ckpt_async import Checkpointer
from workers.trainer.sharding import rank_state

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

STEP = 3


@pytest.fixture(scope="module")
def stoppable_s3() -> Iterator[S3Server]:
    """An S3 server in a child process, which a test may SIGSTOP and SIGCONT."""
    with S3Server(process=True) as server:
        yield server


def _model() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    opt.step()


def _begin(store: Store, ck: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Start the checkpoint before ``STEP`` the Trainer's way; returns copies of what it must hold."""
    tensors, meta = rank_state(model, opt)
    expected = {n: t.detach().clone() for n, t in tensors.items()}

    def commit(objects: Any, layout: Any) -> None:
        commit_checkpoint(store, Checkpoint(STEP, 1, meta={"optimizer": meta}), objects, layout)

    ck.begin(STEP, "attempt", tensors, commit)
    return expected


def _assert_holds(store: Store, expected: dict[str, torch.Tensor]) -> None:
    got = load_checkpoint(store, STEP)
    assert set(got.tensors) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got.tensors[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name


def test_the_step_runs_while_the_store_is_stopped_and_the_checkpoint_holds_the_tensors_at_its_start(
    stoppable_s3: S3Server, tmp_path: Path
) -> None:
    store = open_store(f"s3://{stoppable_s3.new_bucket()}/run", stoppable_s3.storage_options())
    model, opt = _model()
    _train(model, opt, 0)
    ck = Checkpointer(store, checkpoint_folder, spool_dir=str(tmp_path))
    ck.part_bytes = 4096  # several parts: the upload reads each back from the spool
    ck.attach(opt)
    assert stoppable_s3.pid is not None
    stepped = threading.Event()
    os.kill(stoppable_s3.pid, signal.SIGSTOP)
    try:
        expected = _begin(store, ck, model, opt)

        # The next step's optimizer.step() waits for the copy into the spool only, never for the store.
        def step() -> None:
            _train(model, opt, 1)
            stepped.set()

        worker = threading.Thread(target=step, daemon=True)
        worker.start()
        worker.join(120)
        assert stepped.is_set(), "optimizer.step() waited for a store that does not answer"
        assert ck.pending is not None and not ck.pending.uploaded  # the upload is still waiting for the store
        assert ck.spool_bytes >= sum(t.numel() * t.element_size() for t in expected.values())
    finally:
        os.kill(stoppable_s3.pid, signal.SIGCONT)
    assert not torch.equal(dict(model.named_parameters())["0.weight"].detach(), expected["model.0.weight"])  # the tensors moved on
    ck.finish()
    _assert_holds(store, expected)
    ck.close()
    assert ck.spool_bytes == 0


def test_without_room_for_a_spool_the_step_waits_and_the_checkpoint_is_the_same(
    file_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(spool, "RESERVE_BYTES", 1 << 62)  # no disk is that large
    model, opt = _model()
    _train(model, opt, 0)
    ck = Checkpointer(file_store, checkpoint_folder, spool_dir=str(tmp_path))
    ck.attach(opt)
    with caplog.at_level(logging.WARNING, logger="aurora.trainer"):
        expected = _begin(file_store, ck, model, opt)
        _train(model, opt, 1)  # held until the upload has read the live tensors
    assert any("checkpoint spool" in r.getMessage() for r in caplog.records)
    assert ck.spool_bytes == 0
    ck.finish()
    _assert_holds(file_store, expected)


@pytest.mark.parametrize("fused", [False, True])
def test_adam_given_its_state_before_the_first_step_trains_bit_for_bit_as_one_that_made_it(fused: bool) -> None:
    runs = []
    for eager in (False, True):
        model, _ = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=fused)
        if eager:
            assert make_optimizer_state(opt) and not make_optimizer_state(opt)  # once: a state is never replaced
            assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in opt.state.values())
        for seed in range(3):
            _train(model, opt, seed)
        runs.append(rank_state(model, opt)[0])
    lazy, eager_run = runs
    assert set(lazy) == set(eager_run)
    assert all(torch.equal(lazy[n], eager_run[n]) for n in lazy)
    assert not make_optimizer_state(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
