"""What an Actor holds and has staged: the one piece of state its threads share.

The stager thread appends staged versions; the main thread activates them at
its safe points; the heartbeat thread reports both. :class:`Holding` keeps
that state and its invariants behind one lock, and a second lock for the
engine's weights:

- ``staged_version >= active`` once bootstrapped; ``staged_version`` is the
  version of the newest entry, or ``active`` when nothing is staged;
- the entries are in version order, and each delta declares the version
  before it as its base (a whole version replaces every entry up to it);
- ``staged_state`` is the state of ``staged_version``, ``active_state`` the
  state of ``active``; each pair changes together, under the lock;
- ``commit_seen`` (written by the stager) and ``want`` (by the main thread)
  are single values with one writer each, read without the lock.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from workers.actor.quarantine import StagedFull, staged_nbytes

__all__ = ["Holding", "Staged", "StagedItem"]


class StagedItem(Protocol):
    """What the queue holds: a delta decoded in this process (prepared or not), the engine's
    handle of one staged in its own processes, or a whole version (:class:`StagedFull`)."""

    @property
    def version(self) -> int: ...

    @property
    def base_version(self) -> int:
        """The version it applies on; -1 for a whole version (it replaces whatever is active)."""
        ...


@dataclass(frozen=True, slots=True)
class Staged:
    """One version staged for activation."""

    item: StagedItem
    """The delta (prepared or not), the engine's handle of one, or a whole version."""
    state: str
    """The state digest the version reaches (its manifest's)."""
    stage_s: float
    """Seconds it took to stage."""
    digest: str | None = None
    """The ``weights_digest`` its record carries (FORMAT.md §4.1), if any: what the weights
    can be verified against once it is active (workers.actor.verify)."""

    @property
    def version(self) -> int:
        return self.item.version

    @property
    def whole(self) -> bool:
        """Whether it is a whole version (swapped in) rather than a delta (applied on its base)."""
        return isinstance(self.item, StagedFull)


class Holding:
    """The active and staged versions, and the staged queue, under one lock (see the module's invariants)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.weights = threading.Lock()
        """Held while the engine's weights change, and while (version, digest) is read as a pair:
        the heartbeat thread must never label one version's digest with another's number."""
        self.active = -1
        """The version the engine holds and generates on; -1 before bootstrap."""
        self.active_state = ""
        self.staged_version = -1
        """The newest version staged (``active`` when nothing is)."""
        self.staged_state = ""
        self.commit_seen = -1
        """The newest version a Commit asked for."""
        self.want = -1
        """The version the main loop last wanted: the stager's catch-up target when behind it."""
        self.verified: tuple[int, str] | None = None
        """(version, digest) of the last weights verified: what a heartbeat that registers again records."""
        self._queue: deque[Staged] = deque()

    @property
    def bootstrapped(self) -> bool:
        return self.active >= 0

    def start_at(self, version: int, state: str) -> None:
        """The engine holds ``version`` (bootstrap, or a reload): nothing staged on top of it."""
        with self.lock:
            self._queue.clear()
            self.active, self.active_state = version, state
            self.staged_version, self.staged_state = version, state

    def stage(self, entry: Staged) -> None:
        """Append the next version (a delta on ``staged_version``, or a whole version after it)."""
        with self.lock:
            self._queue.append(entry)
            self.staged_version, self.staged_state = entry.version, entry.state

    def stage_whole(self, entry: Staged) -> None:
        """A whole version: it replaces every entry up to it; entries after it stay."""
        with self.lock:
            kept = [e for e in self._queue if e.version > entry.version]
            self._queue.clear()
            self._queue.append(entry)
            self._queue.extend(kept)
            self.staged_version, self.staged_state = entry.version, entry.state

    def drop_staged(self) -> None:
        """Forget everything staged: the stager stages again from the active version."""
        with self.lock:
            self._queue.clear()
            self.staged_version, self.staged_state = self.active, self.active_state

    def next_for(self, wanted: int) -> Staged | None:
        """The entry that moves the active version towards ``wanted`` (taken off the queue), or None."""
        with self.lock:
            q = self._queue
            while q and q[0].version <= self.active:
                q.popleft()  # behind the active version: of no use any more
            wholes = [i for i, e in enumerate(q) if e.whole and e.version <= wanted]
            if wholes:
                # A whole version the run needs: jump to it (what it supersedes is dropped).
                for _ in range(wholes[-1]):
                    q.popleft()
                return q.popleft()
            if q and not q[0].whole and q[0].item.base_version == self.active:
                return q.popleft()
            return None

    def activated(self, version: int, state: str) -> None:
        """The engine now holds ``version`` (call with ``weights`` held)."""
        with self.lock:
            self.active, self.active_state = version, state

    def entries(self) -> list[Staged]:
        """What is staged now, oldest first (a copy)."""
        with self.lock:
            return list(self._queue)

    def staged_bytes(self) -> int:
        with self.lock:
            return sum(staged_nbytes(e.item) for e in self._queue)
