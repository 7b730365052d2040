"""Announcements on Redis streams: segments, versions, commits.

One stream per run (the origin) and one per region (what a Relay re-announces
for its Actors). Announcements are hints that make staging fast; the store
stays the source of truth. A consumer resumes from the last id it saw; when
the entries it missed were trimmed, or Redis lost the stream altogether, the
read raises :class:`BusGap` and the consumer lists the store instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.coordination.decode import as_str
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.redisconn import is_cluster_client, translate_redis_errors
from aurora_store.errors import BusGap

__all__ = ["Event", "Bus", "BusGap", "SEGMENT", "VERSION", "COMMIT", "RESYNC"]

SEGMENT = "segment"
"""A segment object of version ``version`` is durable: ``key``, ``bytes``, ``sha256``, ``index``."""
VERSION = "version"
"""Version ``version`` is committed: ``kind``, ``state``, ``base_state``, ``bytes``, ``segments``."""
COMMIT = "commit"
"""Commit(v): Actors on ``version - 1`` with ``version`` staged activate it at their next safe point."""
RESYNC = "resync"


@dataclass(frozen=True, slots=True)
class Event:
    """One announcement."""

    id: str
    """Stream entry id (``ms-seq``); resume after it."""
    type: str
    version: int
    fields: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str, default: str = "") -> str:
        return self.fields.get(name, default)


def _parse_id(x: str) -> tuple[int, int]:
    a, _, b = x.partition("-")
    return int(a), int(b or 0)


class Bus:
    """Streams of one run. ``maxlen`` bounds each stream (approximate trimming)."""

    def __init__(self, redis: Any, run: str, maxlen: int = 100_000) -> None:
        self.r = redis
        self.run = run
        self.keys = RunKeys(run)
        self.p = self.keys.prefix
        self.maxlen = maxlen

    def stream(self, region: str | None = None) -> str:
        """The origin stream, or ``region``'s (what its Relay re-announces)."""
        return self.keys.events(region)

    @translate_redis_errors("Bus.announce")
    def announce(self, type: str, version: int, region: str | None = None, **fields: Any) -> str:
        """Append an event; returns its id."""
        body = {"type": type, "version": str(version), **{k: str(v) for k, v in fields.items()}}
        eid = self.r.xadd(self.stream(region), body, maxlen=self.maxlen, approximate=True)
        return as_str(eid)

    @translate_redis_errors("Bus.tail_id")
    def tail_id(self, region: str | None = None) -> str:
        """Id of the newest entry ever added to a stream, or ``"0"``.

        A consumer that is about to list the store takes this *first* and then
        reads after it, so nothing announced in between is missed.
        """
        key = self.stream(region)
        if not self.r.exists(key):
            return "0"
        info = self.r.xinfo_stream(key)
        lg = info.get("last-generated-id") or info.get(b"last-generated-id")
        if lg is None:
            return "0"
        return as_str(lg)

    @translate_redis_errors("Bus.read")
    def read(self, last_id: str = "0", block_ms: int | None = None, count: int = 1000, region: str | None = None) -> list[Event]:
        """Events after ``last_id`` (``"0"``: from the start), waiting up to ``block_ms``.

        Raises :class:`BusGap` when entries after ``last_id`` can no longer be
        read: the consumer must then rebuild its view from the store.
        """
        key = self.stream(region)
        if last_id in ("0", "0-0"):
            res = self.r.xread({key: last_id}, count=count, block=block_ms)
        elif is_cluster_client(self.r):
            self._check_continuity(key, last_id)
            res = self.r.xread({key: last_id}, count=count, block=block_ms)
        else:
            # The continuity check and the read in one round trip (on a far link each is one):
            # Redis runs them in order on the connection, so the check sees the stream as it was
            # just before the read, as when they were sent one after the other. A stream that is
            # gone is reported when the read returns (after at most ``block_ms``).
            pipe = self.r.pipeline(transaction=False)
            pipe.exists(key)
            pipe.xinfo_stream(key)
            pipe.xread({key: last_id}, count=count, block=block_ms)
            exists, info, res = pipe.execute(raise_on_error=False)
            for r in (exists, res):
                if isinstance(r, Exception):
                    raise r
            if not exists:
                raise BusGap(f"{key}: stream is gone (Redis restarted?); resume from the store")
            if isinstance(info, Exception):
                raise info
            self._continuity(key, last_id, info)
        out: list[Event] = []
        for _, entries in res or []:
            for eid, body in entries:
                f = {as_str(k): as_str(v) for k, v in body.items()}
                try:
                    version = int(f.get("version", ""))
                except ValueError:
                    continue  # not ours, or damaged: the store is the truth anyway
                out.append(Event(as_str(eid), f.get("type", ""), version, f))
        return out

    def _check_continuity(self, key: str, last_id: str) -> None:
        if not self.r.exists(key):
            raise BusGap(f"{key}: stream is gone (Redis restarted?); resume from the store")
        self._continuity(key, last_id, self.r.xinfo_stream(key))

    @staticmethod
    def _continuity(key: str, last_id: str, info: Mapping[Any, Any]) -> None:
        """Raise :class:`BusGap` when ``info`` (the stream's XINFO STREAM) shows entries after ``last_id`` lost."""
        first = info.get("first-entry") or info.get(b"first-entry")
        last_gen = info.get("last-generated-id") or info.get(b"last-generated-id")
        if last_gen is not None:
            lg = as_str(last_gen)
            if _parse_id(lg) < _parse_id(last_id):
                raise BusGap(f"{key}: stream was recreated (its newest id {lg} is older than {last_id}); resume from the store")
            length = int(info.get("length", info.get(b"length", 0)))
            if length == 0 and _parse_id(lg) > _parse_id(last_id):
                raise BusGap(f"{key}: entries after {last_id} up to {lg} were trimmed away; resume from the store")
        if first:
            fid = as_str(first[0])
            if _parse_id(fid) > _parse_id(last_id) and int(info.get("length", info.get(b"length", 0))) >= 1:
                # Something between last_id and the first retained entry may be lost.
                entries_added = info.get("entries-added") or info.get(b"entries-added")
                raise BusGap(
                    f"{key}: entries after {last_id} were trimmed (oldest kept {fid}, added {entries_added}); resume from the store"
                )
