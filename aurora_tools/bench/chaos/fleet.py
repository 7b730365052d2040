"""The processes of a chaos run: servers that can be broken, workers that can be killed, and what they say.

- :class:`AofRedis`: ``redis-server`` with an append-only file (fsync every
  second) in its folder, so it can crash and come back with its data, or be
  wiped and come back empty, on the same port;
- :class:`Fleet`: the workers (``python -m aurora_tools.cli trainer|actor|relay``),
  each start of a worker one :class:`Incarnation` with its own log and
  digest file; signals go to the worker's process group; a watcher thread
  reads every log as it grows and notes, with the harness's own clock, when
  each version was published and each process exited.

The run's progress is read from the Trainer's log (``step B -> vV`` lines),
not from Redis: Redis is one of the things the benchmark erases.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora_store.testing.servers import RedisServer

__all__ = ["AofRedis", "Incarnation", "Fleet", "Expired", "STEP_RE", "STEP_JSON_MARKER", "BOOT_RE", "ACTIVATED_RE"]

STEP_RE = re.compile(r"\bstep (\d+) -> v(\d+)\b")
"""The Trainer's per-step log line (``workers/trainer/trainer.py``)."""
V0_RE = re.compile(r"\bv0 snapshot published\b")
BOOT_RE = re.compile(r"\bbootstrapped at v(\d+)\b")
ACTIVATED_RE = re.compile(r"\bactivated v(\d+)\b")
STEP_JSON_MARKER = "step-json "
"""Marks the Trainer's machine-readable per-step line: the marker, then one JSON object."""


class Expired(Exception):
    """The benchmark's global deadline passed."""


class AofRedis(RedisServer):
    """``redis-server`` persisting to an AOF (``appendfsync everysec``) in its folder.

    :meth:`crash` is a SIGKILL (up to a second of acknowledged writes may be
    lost, as after a real crash); :meth:`wipe` deletes the folder's files so
    the next :meth:`start` comes up empty, on the same port either way.
    """

    def start(self) -> AofRedis:
        import tempfile

        from aurora_store.config import free_port

        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix="aurora-chaos-redis-")
        if not self.port:
            self.port = free_port()
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                self.dir,
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()
        return self

    def crash(self) -> None:
        """SIGKILL: no shutdown, no final fsync."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def wipe(self) -> None:
        """Delete every file of the server's folder (it must be stopped)."""
        if self.proc is not None:
            raise RuntimeError("stop redis-server before wiping its data")
        for root, _dirs, files in os.walk(self.dir):
            for f in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, f))


@dataclass(eq=False)
class Incarnation:
    """One start of one worker: its process, its log, what the watcher read from it."""

    name: str
    """Worker name: ``trainer``, ``relay-eu``, an Actor id."""
    role: str
    """``trainer``, ``actor`` or ``relay``."""
    n: int
    """0 for the first start of ``name``, then 1, 2 …"""
    argv: list[str]
    log_path: str
    digest_path: str
    proc: subprocess.Popen[bytes]
    started: float
    """Harness monotonic time of the start."""
    resumed: bool = False
    """A Trainer started with ``--resume``."""
    ended: float | None = None
    rc: int | None = None
    ended_by: str | None = None
    """What the harness did to end it (``SIGKILL``, ``SIGTERM``); None: it exited on its own."""
    stopped_since: float | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    """(harness monotonic time the line was read, line)."""
    _pos: int = 0
    _partial: bytes = b""

    @property
    def label(self) -> str:
        return self.name if self.n == 0 else f"{self.name}#{self.n}"

    @property
    def alive(self) -> bool:
        return self.ended is None

    def lines_since(self, t: float, pattern: re.Pattern[str] | None = None) -> list[tuple[float, str]]:
        return [(ts, ln) for ts, ln in self.lines if ts >= t and (pattern is None or pattern.search(ln))]

    def last_line(self) -> str:
        return self.lines[-1][1] if self.lines else ""


class Fleet:
    """The workers of one run; :meth:`watch` in a thread keeps its view current.

    ``env`` is every worker's environment (S3 endpoint and credentials …);
    ``extra_env`` per role is added to it. Each incarnation's digest file is
    named by ``AURORA_DIGEST_LOG`` in its environment.
    """

    def __init__(self, workdir: str, env: dict[str, str], deadline: float, poll_s: float = 0.2) -> None:
        self.logdir = os.path.join(workdir, "logs")
        self.digestdir = os.path.join(workdir, "digests")
        os.makedirs(self.logdir, exist_ok=True)
        os.makedirs(self.digestdir, exist_ok=True)
        self.env = env
        self.deadline = deadline
        self.poll_s = poll_s
        self.all: list[Incarnation] = []
        self.current: dict[str, Incarnation] = {}
        self.versions: dict[int, tuple[float, float, Incarnation]] = {}
        """version -> (harness monotonic, wall clock, Trainer incarnation) of the first log line saying it was published."""
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.stop_watch = threading.Event()
        self._thread: threading.Thread | None = None

    # -- processes ------------------------------------------------------------------
    def start(
        self, name: str, role: str, args: Sequence[str], extra_env: dict[str, str] | None = None, resumed: bool = False
    ) -> Incarnation:
        with self.lock:
            n = sum(1 for i in self.all if i.name == name)
            stem = name if n == 0 else f"{name}.{n}"
            log_path = os.path.join(self.logdir, f"{stem}.log")
            digest_path = os.path.join(self.digestdir, f"{stem}.jsonl")
            env = dict(self.env, AURORA_DIGEST_LOG=digest_path, **(extra_env or {}))
            argv = [sys.executable, "-m", "aurora_tools.cli", *args]
            out = open(log_path, "wb")  # noqa: SIM115 - the child owns it; closed below once handed over
            try:
                proc = subprocess.Popen(
                    argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            finally:
                out.close()
            inc = Incarnation(name, role, n, list(args), log_path, digest_path, proc, time.monotonic(), resumed=resumed)
            self.all.append(inc)
            self.current[name] = inc
            return inc

    def signal(self, inc: Incarnation, sig: signal.Signals) -> None:
        """``sig`` to the incarnation's process group (the worker and anything it started)."""
        if inc.ended is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(inc.proc.pid, sig)
        if sig == signal.SIGSTOP:
            inc.stopped_since = time.monotonic()
        elif sig == signal.SIGCONT:
            inc.stopped_since = None

    def _gone(self, inc: Incarnation) -> bool:
        """Whether it already ended (noted now if it exited since the last poll)."""
        if inc.ended is None and inc.proc.poll() is not None:
            self.poll()
        return inc.ended is not None

    def kill(self, inc: Incarnation) -> None:
        """SIGKILL and reap."""
        if not self._gone(inc):
            inc.ended_by = "SIGKILL"
            self.signal(inc, signal.SIGKILL)
            inc.proc.wait()
            self.poll()

    def terminate(self, inc: Incarnation, timeout_s: float = 20.0) -> None:
        """SIGTERM (a graceful leave), SIGKILL after ``timeout_s``."""
        if self._gone(inc):
            return
        inc.ended_by = "SIGTERM"
        if inc.stopped_since is not None:
            self.signal(inc, signal.SIGCONT)
        self.signal(inc, signal.SIGTERM)
        try:
            inc.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            inc.ended_by = "SIGKILL (no exit after SIGTERM)"
            self.signal(inc, signal.SIGKILL)
            inc.proc.wait()
        self.poll()

    def close(self, timeout_s: float = 20.0) -> None:
        """Every live incarnation: SIGCONT, SIGTERM, SIGKILL after ``timeout_s``."""
        with self.lock:
            live = [i for i in self.all if not self._gone(i)]
        for inc in live:
            if inc.stopped_since is not None:
                self.signal(inc, signal.SIGCONT)
            inc.ended_by = inc.ended_by or "SIGTERM"
            self.signal(inc, signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for inc in live:
            try:
                inc.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                inc.ended_by = "SIGKILL (no exit after SIGTERM)"
                self.signal(inc, signal.SIGKILL)
                inc.proc.wait()
        self.poll()

    # -- watching ---------------------------------------------------------------------
    def watch(self) -> None:
        """Start the watcher thread."""
        self._thread = threading.Thread(target=self._watch, name="chaos-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self.stop_watch.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Read what every log gained, note exits and published versions; wake waiters."""
        with self.lock:
            now = time.monotonic()
            for inc in self.all:
                self._read(inc, now)
                if inc.ended is None and inc.proc.poll() is not None:
                    self._read(inc, now)
                    inc.ended, inc.rc = now, inc.proc.returncode
            self.changed.notify_all()

    def _read(self, inc: Incarnation, now: float) -> None:
        try:
            with open(inc.log_path, "rb") as f:
                f.seek(inc._pos)
                data = f.read()
        except OSError:
            return
        if not data:
            return
        inc._pos += len(data)
        chunks = (inc._partial + data).split(b"\n")
        inc._partial = chunks.pop()
        for raw in chunks:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            inc.lines.append((now, line))
            if inc.role == "trainer":
                m = STEP_RE.search(line)
                v = int(m.group(2)) if m else (0 if V0_RE.search(line) else None)
                if v is not None and v not in self.versions:
                    self.versions[v] = (now, time.time(), inc)

    def wait_for(self, cond: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Wait until ``cond()`` (checked under the lock after every poll); False after ``timeout_s``.

        Raises :class:`Expired` once the benchmark's deadline passes.
        """
        end = self.deadline if timeout_s is None else min(self.deadline, time.monotonic() + timeout_s)
        with self.lock:
            while not cond():
                left = end - time.monotonic()
                if left <= 0:
                    if time.monotonic() >= self.deadline:
                        raise Expired
                    return False
                self.changed.wait(min(left, 1.0))
            return True

    def sleep(self, seconds: float) -> None:
        """Sleep, but never past the deadline (:class:`Expired`)."""
        end = time.monotonic() + seconds
        if end > self.deadline:
            time.sleep(max(0.0, self.deadline - time.monotonic()))
            raise Expired
        time.sleep(max(0.0, seconds))

    # -- what the logs say --------------------------------------------------------------
    @property
    def head(self) -> int:
        """The newest version a Trainer's log says was published (-1: none yet)."""
        with self.lock:
            return max(self.versions, default=-1)

    def trainer(self) -> Incarnation | None:
        return self.current.get("trainer")

    def trainer_done(self) -> bool:
        """The current Trainer exited (on its own or not): nobody is training."""
        t = self.trainer()
        return t is None or t.ended is not None

    def incarnations(self, role: str | None = None, name: str | None = None) -> list[Incarnation]:
        with self.lock:
            return [i for i in self.all if (role is None or i.role == role) and (name is None or i.name == name)]

    def step_records(self) -> list[tuple[Incarnation, dict[str, Any]]]:
        """Every Trainer's machine-readable per-step lines (:data:`STEP_JSON_MARKER`), in log order."""
        out = []
        for inc in self.incarnations("trainer"):
            for _, ln in inc.lines:
                i = ln.find(STEP_JSON_MARKER)
                if i < 0:
                    continue
                j = ln.find("{", i)
                try:
                    rec = json.loads(ln[j:]) if j >= 0 else None
                except ValueError:
                    rec = None
                if isinstance(rec, dict):
                    out.append((inc, rec))
        return out
