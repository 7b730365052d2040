"""Where the stager reads a version: the region's mirror while its Relay heartbeats, else origin.

The Relay's key in Redis says whether the Relay is alive, never where to
read: the mirror is the one configured (``--mirror``); a URL that is not it
is logged once and ignored. The mirror may lag: origin is the truth, once
the Relay had its chance (:meth:`Sources.mirror_missing`).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from aurora_store.coordination.keys import mirror_token
from aurora_store.storage import Store
from workers.actor.breaker import MirrorBreaker
from workers.actor.context import ActorContext

__all__ = ["Sources"]

log = logging.getLogger("aurora.actor")


class Sources:
    """The mirror-or-origin choice of one Actor, and what it remembers of the mirror's progress.

    Used by the stager thread only.
    """

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self._mirror: Store | None = None
        """The configured mirror (``cfg.mirror``), opened at its first use."""
        self._ignored: set[str] = set()
        """Mirror URLs read from Redis that are not the configured one (each logged once)."""
        self._missing_since: dict[int, float] = {}
        """version -> when the stager first found it missing from the region's mirror."""
        self._relay_progress: dict[int, float] = {}
        """version -> when the region's Relay last announced a segment of it."""
        self.mirror_behind = False
        """The mirror missed the grace once: skipped without waiting until it has a version first again."""
        self.breaker = MirrorBreaker(ctx.cfg.mirror_timeout_s, ctx.clock, f"the mirror of region {ctx.cfg.region}")
        """Sends versions to origin while the mirror fails or stalls (:mod:`workers.actor.breaker`)."""

    @property
    def mirror_opened(self) -> bool:
        return self._mirror is not None

    def source(self, relay_url: str | None) -> tuple[Store, str | None]:
        """(store, region): the configured mirror while the region's Relay heartbeats with its URL
        and the mirror's breaker is closed, else (origin, None)."""
        if not self.trusted(relay_url) or self.breaker.open:
            return self.ctx.origin, None
        if self._mirror is None:
            self._mirror = self.breaker.attach(self.ctx.open_mirror())
        return self._mirror, self.ctx.cfg.region

    def mirror_failed(self, e: BaseException, what: str) -> None:
        """The mirror erred or stalled at ``what``: origin serves until the breaker's cool-down has passed.

        Never charged to the store's outage budget: that is origin's.
        """
        self.breaker.failed(e, what)

    def trusted(self, relay_url: str | None) -> bool:
        """Whether the region's Relay heartbeats (``relay_url`` set) with the configured mirror."""
        cfg = self.ctx.cfg
        if not relay_url:
            return False
        if cfg.mirror is not None and _same_root(relay_url, cfg.mirror):
            return True
        if relay_url not in self._ignored and len(self._ignored) < 64:
            self._ignored.add(relay_url)
            why = "it is not this Actor's --mirror" if cfg.mirror is not None else "this Actor has no --mirror"
            log.warning(
                "%s: the Relay key of region %s names mirror %s; ignored (%s): reading origin",
                cfg.actor_id,
                cfg.region,
                _shown_url(relay_url),
                why,
            )
        return False

    def relay_progress(self, version: int, now: float) -> None:
        """The region's Relay announced a segment of ``version`` (it is copying it): the grace restarts."""
        self._relay_progress[version] = now

    def mirror_missing(self, version: int, region: str | None) -> bool:
        """``version`` is not in the mirror: True once origin is to serve it, False to wait for the Relay.

        It is read from origin after it has been missing ``mirror_grace_s`` with
        no sign of the Relay copying it (each segment the Relay announces for it
        restarts the wait). A mirror that missed the grace once (a Relay that
        died and whose key has not expired yet, or one slower than the run) is
        skipped without waiting until it has a version first again: a grace per
        version would keep this Actor one grace behind the run for as long as
        the key lives.
        """
        if self.mirror_behind:
            return True
        cfg = self.ctx.cfg
        now = self.ctx.clock.monotonic()
        since = max(self._missing_since.setdefault(version, now), self._relay_progress.get(version, 0.0))
        if now - since < cfg.mirror_grace_s:
            return False
        log.warning(
            "mirror of region %s lacks v%d after %.1fs; reading from origin until it catches up", region, version, cfg.mirror_grace_s
        )
        self.mirror_behind = True
        return True

    def staged(self, version: int, from_mirror: bool, region: str | None) -> None:
        """``version`` was staged: forget its wait, and use the mirror again once it served one."""
        if from_mirror:
            self.breaker.succeeded()
        if from_mirror and self.mirror_behind:
            log.info("mirror of region %s caught up (v%d); reading from it again", region, version)
            self.mirror_behind = False
        for d in (self._missing_since, self._relay_progress):
            for old in [k for k in d if k <= version]:
                del d[old]

    def wait_for_relay(self) -> None:
        """``relay_wait_s``: give the region's Relay that long to appear before staging from origin."""
        c = self.ctx
        cfg = c.cfg
        if cfg.relay_wait_s <= 0 or cfg.mirror is None:
            return  # no mirror of our own: origin it is
        deadline = c.clock.monotonic() + cfg.relay_wait_s
        while not c.stop.is_set() and c.clock.monotonic() < deadline:
            with c.redis_dep.guard("look for the region's Relay"):
                if c.redis.exists(c.keys.relay(cfg.region)):
                    return
            c.clock.wait(c.stop, cfg.join_poll_s)
        if not c.stop.is_set():
            log.warning("no Relay for region %s after %.0fs; staging from origin", cfg.region, cfg.relay_wait_s)


def _same_root(relay_value: str, mirror: str) -> bool:
    """Whether the Relay key's value is the token of ``mirror`` (the same run root, a trailing ``/`` aside)."""
    return relay_value == mirror_token(mirror)


def _shown_url(url: str) -> str:
    """``url`` fit for a log line: no user or password, no query, at most 200 characters.

    It came from Redis: untrusted, and possibly carrying credentials.
    """
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
        shown = f"{u.scheme}://{host}{port}{u.path}" if u.scheme else "(not a URL)"
    except ValueError:
        shown = "(not a URL)"
    return repr(shown[:200])
