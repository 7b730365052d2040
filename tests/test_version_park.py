"""Parking a version (:mod:`workers.trainer.park`): its pages leave the process while parked and
come back bit for bit; small storages and a snapshot in flight park nothing."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from workers.trainer.park import MIN_PARK_BYTES, VersionParking, parkable

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED as Linux has it")


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def test_parked_pages_leave_and_come_back_bit_for_bit(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    block = torch.randn(64 << 20, generator=g).to(torch.bfloat16)  # 128 MiB, two views into it
    a, b = block[: 40 << 20].view(1024, -1), block[40 << 20 :]
    small = torch.randn(16, generator=g).to(torch.bfloat16)
    want = [t.clone() for t in (a, b, small)]
    parking = VersionParking(str(tmp_path))
    before = _rss()
    with parking.parked([a, b, small]):
        inside = _rss()
        assert parking.parked_bytes > (128 << 20) - (1 << 13)  # the block once, whole pages of it
        assert before - inside > 100 << 20, (before, inside)
        assert torch.equal(small, want[2])  # below MIN_PARK_BYTES: never parked
    for got, w in zip((a, b, small), want, strict=True):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16))
    parking.close()


def test_small_storages_and_no_spool_park_nothing(tmp_path) -> None:
    parking = VersionParking(str(tmp_path))
    with parking.parked([torch.zeros(MIN_PARK_BYTES // 4 - 1, dtype=torch.bfloat16)]):
        assert parking.parked_bytes == 0
    held = SimpleNamespace(weights={"w": torch.zeros(4)})
    assert len(parkable(SimpleNamespace(held=held, publisher=SimpleNamespace(snapshot_in_flight=10)))) == 1
    with VersionParking(None).parked([torch.zeros(1 << 20)]) as _:  # no spool: nothing parked, nothing lost
        pass


def test_a_snapshot_reading_the_version_waits_while_it_is_parked(tmp_path) -> None:
    """A background snapshot reads the version it uploads (a shard at a time, inside the gate's
    ``reading``); parked, the version's pages read zeros, so the snapshot waits until they are back."""
    import threading

    from aurora_store.lineage.shards import ReadGate
    from aurora_store.testing.wait import wait_until

    g = torch.Generator().manual_seed(2)
    version = torch.randn(8 << 20, generator=g).to(torch.bfloat16)
    want = version.clone()
    gate = ReadGate()
    got: list[torch.Tensor] = []

    def snapshot_shard() -> None:
        with gate.reading():
            got.append(version.clone())

    parking = VersionParking(str(tmp_path))
    reader = threading.Thread(target=snapshot_shard)
    with parking.parked([version], gate.paused):
        assert parking.parked_bytes > 0
        assert gate.state()[1] == 1
        reader.start()
        wait_until(lambda: gate.state()[2] == 1, "the snapshot's read to wait", timeout=30)
        assert not got
    reader.join(30)
    assert len(got) == 1 and torch.equal(got[0].view(torch.int16), want.view(torch.int16))
    assert gate.state() == (0, 0, 0)
    parking.close()


def test_an_older_version_reads_right_while_the_newest_is_parked(tmp_path) -> None:
    """One-step asynchrony: the behaviour pass reads version v - 1 while v is parked (GrpoPolicy.train);
    that is safe only while the view reads the old tensors alone (``reads_newest`` False), not once
    the undo is compacted into positions applied to the newest version's bytes."""
    from workers.trainer.held import HeldWeights, bf16_version

    g = torch.Generator().manual_seed(1)
    v1 = {"a": torch.randn(512, 512, generator=g), "b": torch.randn(300_000, generator=g)}
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["a"][0, :3] += 1.0  # few changes: compaction makes them positions
    held = HeldWeights()
    held.hold(1, bf16_version(v1.items()))
    held.hold(2, bf16_version(v2.items()))
    want = {n: t.to(torch.bfloat16) for n, t in v1.items()}
    view = held.view(1)
    assert not view.reads_newest
    assert held.view(2).reads_newest  # the newest itself: never parked under its own reader
    parking = VersionParking(str(tmp_path))
    with parking.parked(list(held.weights.values())):
        assert parking.parked_bytes > 0
        assert float((held.weights["b"].view(torch.int16) == 0).float().mean()) > 0.9  # parked: its whole pages read zeros
        for n, w in want.items():
            assert torch.equal(view[n].view(torch.int16), w.view(torch.int16)), n
    held.compact()
    assert held.view(1).reads_newest  # positions over the newest: it must stay resident
    for n, w in want.items():
        assert torch.equal(held.view(1)[n].view(torch.int16), w.view(torch.int16)), n
    parking.close()
