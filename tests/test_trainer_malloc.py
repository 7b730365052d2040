"""The Trainer's C allocator calls (:mod:`workers.trainer.malloc`), in this process.

What must hold: :func:`~workers.trainer.malloc.trim` gives back the pages of
memory freed inside the heap (which glibc keeps resident on its own, below
blocks still in use) and nothing that is live: the block still held keeps
its bytes.
"""

from __future__ import annotations

import sys

import pytest

from workers.trainer.malloc import trim

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_trim_gives_back_the_free_pages_inside_the_heap_and_keeps_what_is_live() -> None:
    # 64 KiB blocks come from the heap whatever the mmap threshold; the last one, held, sits above them.
    freed = [bytearray(b"\x5a" * (64 << 10)) for _ in range(1600)]
    held = bytearray(b"\xa5" * (64 << 10))
    del freed
    before = _rss()
    assert trim()
    after = _rss()
    assert before - after > 50 << 20, (before, after)
    assert held == bytearray(b"\xa5" * (64 << 10))
