"""Rewards under a wall-clock bound, computed in child processes.

A reward may hang (sympy simplifying a hostile expression can take hours)
and the Trainer calls it from a thread, where SIGALRM cannot interrupt it.
So :class:`RewardRunner` sends the items to persistent child processes (the
``forkserver`` start method, or ``spawn`` where there is none: never
``fork``, the caller holds threads and torch) in chunks; each child answers
item by item, and an item whose answer has not come ``timeout_s`` after the
previous one scores 0.0: its child is killed, a fresh one started, and the
rest of its chunk goes back in the queue. A reward that raises, or returns
something that is not a finite number, scores 0.0 with one warning line per
kind of fault (later ones at DEBUG, and counted in :attr:`RewardRunner.stats`).
Finite numbers are returned as they are (not clamped: a task may use any scale).

The task is pickled to each child, so it must be picklable and importable
there (a top-level class of a module on ``sys.path``, not of ``__main__``:
the children do not import the caller's main module). A task with a
``warm_up()`` method has it called in each child before the child counts as
started (the math task imports sympy there), so start-up never counts
against the bound.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import multiprocessing as mp
import numbers
import pickle
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

from aurora_store.errors import ConfigError
from workers.task.base import Problem, Task

__all__ = ["RewardRunner"]

log = logging.getLogger(__name__)

_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


@dataclass(eq=False)
class _Child:
    proc: Any  # multiprocessing.process.BaseProcess of the chosen context
    conn: Connection
    ready: bool = False
    deadline: float = math.inf
    pending: collections.deque[int] = field(default_factory=collections.deque)


class RewardRunner:
    """``task.reward`` of many (completion, problem) pairs, each bounded by ``timeout_s``.

    ``workers`` children score in parallel. Construction starts them and
    waits (up to ``start_timeout_s``) until each has unpickled the task and
    run its ``warm_up``; :meth:`score` may be called from any thread (one
    call at a time; others wait). Use as a context manager, or :meth:`close`.
    """

    def __init__(
        self,
        task: Task,
        timeout_s: float,
        workers: int = 1,
        *,
        chunk: int = 64,
        start_timeout_s: float = 120.0,
    ) -> None:
        if not timeout_s > 0 or workers < 1 or chunk < 1 or not start_timeout_s > 0:
            raise ConfigError(
                f"reward runner: timeout_s and start_timeout_s must be > 0, workers and chunk >= 1 "
                f"(got {timeout_s}, {start_timeout_s}, {workers}, {chunk})"
            )
        self.name = str(getattr(task, "name", type(task).__name__))
        try:
            self._blob = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ConfigError(
                f"task {self.name!r} cannot be pickled to the reward process "
                f"({type(e).__name__}: {_first_line(e)}): define it as a top-level class of a module"
            ) from None
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._chunk = chunk
        self._ctx: Any = mp.get_context(_START_METHOD)  # a start-method context: typeshed's BaseContext lacks Process
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._closed = False
        #: Counts of ``timeouts``, ``errors`` (the reward raised), ``invalid`` (not a finite
        #: number), ``died`` (the child exited) and ``restarts``, over the runner's life.
        self.stats: collections.Counter[str] = collections.Counter()
        self._children: list[_Child] = []
        try:
            for _ in range(workers):
                self._children.append(self._start())
            for c in self._children:
                self._await_ready(c)
        except BaseException:
            self.close()
            raise

    # -- public ---------------------------------------------------------------

    def score(self, pairs: Sequence[tuple[str, Problem]]) -> list[float]:
        """The reward of each ``(completion, problem)``, in order (0.0 for a fault, see the module)."""
        with self._lock:
            if self._closed:
                raise ValueError("RewardRunner.score called after close()")
            scores = [0.0] * len(pairs)
            try:
                self._run(pairs, scores)
            except BaseException:
                # Interrupted (KeyboardInterrupt, a start failure): no child may keep
                # half a chunk, or the next call would read its stale answers.
                for c in list(self._children):
                    if c.pending or not c.ready:
                        self._restart(c, count=False)
                raise
            return scores

    def close(self) -> None:
        """Stop the children (idempotent)."""
        self._closed = True
        for c in self._children:
            self._stop(c)
        self._children = []

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- the loop -------------------------------------------------------------

    def _run(self, pairs: Sequence[tuple[str, Problem]], scores: list[float]) -> None:
        queue = collections.deque(range(len(pairs)))
        share = max(1, min(self._chunk, -(-len(pairs) // len(self._children))))
        while True:
            now = time.monotonic()
            for c in self._children:
                if c.ready and not c.pending and queue:
                    idx = [queue.popleft() for _ in range(min(share, len(queue)))]
                    try:
                        c.conn.send([(i, pairs[i][0], pairs[i][1]) for i in idx])
                    except OSError:  # it died while idle (killed from outside): replace it
                        queue.extendleft(reversed(idx))
                        self.stats["died"] += 1
                        self._restart(c)
                        continue
                    c.pending.extend(idx)
                    c.deadline = now + self.timeout_s
            busy = [c for c in self._children if c.pending or not c.ready]
            if not busy:
                return
            soonest = min(c.deadline for c in busy)
            for conn in wait([c.conn for c in busy], timeout=max(0.0, soonest - now)):
                c = next(c for c in busy if c.conn is conn)
                try:
                    msg = c.conn.recv()
                except (EOFError, OSError):
                    self._lost(c, pairs, queue, scores, "died", f"killed its process (exit code {self._exitcode(c)})")
                    continue
                if not c.ready:
                    self._on_start_message(c, msg)
                    continue
                i, kind, value = msg
                if not c.pending or c.pending[0] != i:  # cannot happen: one child, one order
                    raise RuntimeError(f"reward child answered item {i}, expected {list(c.pending)[:1]}")
                c.pending.popleft()
                if kind == "ok":
                    scores[i] = value
                else:
                    self.stats["errors" if kind == "raised" else "invalid"] += 1
                    verb = "raised" if kind == "raised" else "returned"
                    self._warn(f"{kind}:{value.split(':', 1)[0]}", pairs[i][1], f"{verb} {value}")
                c.deadline = time.monotonic() + self.timeout_s if c.pending else math.inf
            now = time.monotonic()
            for c in busy:
                if c in self._children and now >= c.deadline:
                    if not c.ready:
                        raise ConfigError(f"reward process of task {self.name!r} did not start within {self.start_timeout_s:g}s")
                    self._lost(c, pairs, queue, scores, "timeouts", f"took longer than {self.timeout_s:g}s")

    def _lost(
        self,
        c: _Child,
        pairs: Sequence[tuple[str, Problem]],
        queue: collections.deque[int],
        scores: list[float],
        stat: str,
        why: str,
    ) -> None:
        """``c``'s current item scores 0 (``why``); the rest of its chunk goes back in the queue."""
        if not c.ready:
            raise ConfigError(f"reward process of task {self.name!r} stopped while starting (exit code {self._exitcode(c)})")
        i = c.pending.popleft()
        scores[i] = 0.0
        self.stats[stat] += 1
        self._warn(stat, pairs[i][1], f"{why}; a fresh process takes over")
        queue.extendleft(reversed(c.pending))
        c.pending.clear()
        self._restart(c)

    # -- children -------------------------------------------------------------

    def _start(self) -> _Child:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_child_main,
            args=(child, self._blob, list(sys.path)),
            name=f"aurora-reward-{self.name}",
            daemon=True,
        )
        with _main_module_hidden():
            proc.start()
        child.close()
        return _Child(proc, parent, deadline=time.monotonic() + self.start_timeout_s)

    def _await_ready(self, c: _Child) -> None:
        if not c.conn.poll(max(0.0, c.deadline - time.monotonic())):
            raise ConfigError(f"reward process of task {self.name!r} did not start within {self.start_timeout_s:g}s")
        try:
            msg = c.conn.recv()
        except (EOFError, OSError):
            raise ConfigError(f"reward process of task {self.name!r} exited with code {self._exitcode(c)} while starting") from None
        self._on_start_message(c, msg)

    def _on_start_message(self, c: _Child, msg: Any) -> None:
        if msg[0] != "ready":
            raise ConfigError(f"reward process of task {self.name!r} failed to start: {msg[1]}")
        c.ready = True
        c.deadline = math.inf

    def _restart(self, c: _Child, count: bool = True) -> None:
        self._stop(c, kill=True)
        k = self._children.index(c)
        self._children[k] = self._start()
        if count:
            self.stats["restarts"] += 1

    def _stop(self, c: _Child, kill: bool = False) -> None:
        if not kill:
            with contextlib.suppress(OSError, ValueError):
                c.conn.send(None)
            c.proc.join(2.0)
        if c.proc.is_alive():
            c.proc.kill()
            c.proc.join(5.0)
        c.conn.close()

    @staticmethod
    def _exitcode(c: _Child) -> object:
        c.proc.join(1.0)
        return c.proc.exitcode

    def _warn(self, key: str, problem: Problem, what: str) -> None:
        msg = f"reward of task {self.name!r} on problem {getattr(problem, 'id', '?')!r} {what}: scored 0"
        if key in self._warned:
            log.debug(msg)
        else:
            self._warned.add(key)
            log.warning("%s (further ones like it are logged at DEBUG)", msg)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a child without re-running the caller's ``__main__`` in it.

    multiprocessing's spawn and forkserver children import the parent's main
    module first (to find objects pickled from it): for ``aurora trainer``
    that is the CLI and torch, seconds per restart, and a script without the
    ``if __name__ == "__main__"`` guard would start a runner in its child.
    The task never lives in ``__main__`` (it is pickled by module name), so
    the child is started while ``sys.modules["__main__"]`` is a bare module:
    the preparation data then names no main module to import.
    """
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = saved


# -- the child ------------------------------------------------------------------


def _child_main(conn: Connection, blob: bytes, path: list[str]) -> None:
    """Unpickle the task, warm it up, say ``ready``, then score chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    sys.path[:] = path
    try:
        task = pickle.loads(blob)
        warm = getattr(task, "warm_up", None)
        if callable(warm):
            warm()
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {_first_line(e)}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for i, completion, problem in chunk:
            try:
                r = task.reward(completion, problem)
            except Exception as e:
                conn.send((i, "raised", f"{type(e).__name__}: {_first_line(e)}"))
                continue
            conn.send((i, *_as_score(r)))


def _as_score(r: object) -> tuple[str, Any]:
    if isinstance(r, numbers.Real):
        f = float(r)
        return ("ok", f) if math.isfinite(f) else ("invalid", f"a non-finite {f}")
    return "invalid", f"a {type(r).__name__}, not a number"


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return line if len(line) <= 200 else line[:200] + "…"
