"""``aurora lineage``, ``aurora verify``, ``aurora gc``: a run's stored versions, read without torch or the workers."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from aurora_store.credentials import REDIS_URL_ENV
from aurora_store.errors import ConfigError
from aurora_store.options import add_storage_option, add_trust_key_arg, storage_options, trust_key_paths
from aurora_tools.cli.console import say

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys

__all__ = [
    "add_commit_check_args",
    "add_gc_arguments",
    "cmd_lineage",
    "cmd_verify",
    "cmd_gc",
    "cmd_keygen",
    "commits_of",
    "head_of",
    "trust_of",
]


def trust_of(args: argparse.Namespace, store: Any = None) -> TrustKeys | None:
    """The :class:`~aurora_store.format.signing.TrustKeys` of ``--trust-key`` / ``AURORA_TRUST_KEYS``; None: no check.

    Bound to one run (:meth:`~aurora_store.format.signing.TrustKeys.for_run`):
    ``--run NAME`` when given, else the run version 0 of ``store`` was signed
    for. Why: a key may sign several runs, and another run's signed versions
    copied under this run's names verify like its own; only the signed
    ``run`` field tells them apart. Version 0 cannot be replaced (create-only)
    and is checked against the same keys, so its run is this store's.
    """
    from aurora_store.format.signing import trust_from_option

    trust = trust_from_option(trust_key_paths(getattr(args, "trust_key", None)))
    if trust is None:
        return None
    run = getattr(args, "run", None) or (_root_run(store, trust) if store is not None else None)
    return trust.for_run(run)


def _root_run(store: Any, trust: TrustKeys) -> str | None:
    """The signed ``run`` of ``store``'s version 0 (None: no trusted version 0, as after retention)."""
    from aurora_store.errors import StoreUnavailable
    from aurora_store.lineage.fetch import read_manifest

    try:
        return read_manifest(store, "snapshot", 0, trust).run or None
    except StoreUnavailable:
        raise
    except Exception:  # noqa: BLE001 - absent, refused or malformed: the reader's own checks say so
        return None


def _add_run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run",
        default=None,
        metavar="NAME",
        help="run name: with --redis, whose records to check; with --trust-key, accept only versions signed for "
        "this run (default: the run version 0 was signed for)",
    )


def add_commit_check_args(p: argparse.ArgumentParser) -> None:
    """``--redis URL --run NAME``: check a Redis-commit run's manifests against their records (FORMAT.md §1)."""
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="the run's Redis, for a run that commits through Redis (--commit-via redis): every manifest "
        "is checked against its commit record (with --run)",
    )
    _add_run_arg(p)


def commits_of(args: argparse.Namespace, store: Any) -> Any:
    """The commit records to check this command's manifests against, or None when the run commits in the store.

    Why: in Redis-commit mode a manifest in the store is a version only if
    it matches its Redis record; read without the records, any manifest a
    stray writer left would pass. A store that carries the marker
    ``.aurora/commit.json`` is therefore refused, in one line, unless
    ``--redis URL --run NAME`` are given.
    """
    from aurora_store.storage.probe import read_commit_marker

    url, run = getattr(args, "redis", None), getattr(args, "run", None)
    if run is not None and url is None:
        url = os.environ.get(REDIS_URL_ENV) or None
    if (url is None) != (run is None):
        raise ConfigError("--redis URL and --run NAME go together")
    marker = read_commit_marker(store)
    if url is None:
        if marker is not None:
            raise ConfigError(
                f"{store.url}: run {marker[:64]!r} commits through Redis (FORMAT.md §1): its manifests cannot be "
                "checked without --redis URL --run NAME"
            )
        return None
    from aurora_store.coordination.commit import commit_records_for
    from aurora_store.coordination.redisconn import connect

    assert run is not None  # with url (checked above)
    client = connect(url)  # closed when the command's process ends
    commits = commit_records_for(client, run)
    if commits is None and marker is not None:
        raise ConfigError(
            f"{store.url} says run {marker[:64]!r} commits through Redis, but that Redis has no commit mode "
            f"for run {run!r} (another --run, or a Redis that lost its records)"
        )
    if commits is None:
        say(f"note: run {run!r} commits in the store, not through Redis: there are no records to check")
    return commits


def head_of(args: argparse.Namespace) -> int | None:
    """The head of the Trainer's fenced record (``--redis URL --run NAME``), or None without them or a record.

    Why: it is the one trusted bound on which versions exist; a manifest listed
    above it was not published by the run's Trainer (issue 24).
    """
    url, run = getattr(args, "redis", None), getattr(args, "run", None)
    if run is not None and url is None:
        url = os.environ.get(REDIS_URL_ENV) or None
    if url is None or run is None:
        return None
    from aurora_store.coordination.records import RunRecords
    from aurora_store.coordination.redisconn import connect

    client = connect(url)
    try:
        return RunRecords(client, run).head()
    finally:
        client.close()


def _say_not_committed(ignored: list[tuple[str, int, str]], limit: int = 20) -> None:
    """Each manifest listed that does not count, once (the first ``limit``), then how many more."""
    if not ignored:
        return
    print(f"NOT COMMITTED: {len(ignored)} manifest(s) listed that do not count (planted, or beyond the run's chain); ignored:")
    for kind, v, why in ignored[:limit]:
        print(f"  {kind} {v}: {why}")
    if len(ignored) > limit:
        print(f"  … and {len(ignored) - limit} more (--json lists them all)")


def _gaps_text(gaps: list[list[int]], limit: int = 10) -> str:
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in gaps[:limit]]
    return ", ".join(parts) + (f" and {len(gaps) - limit} more range(s)" if len(gaps) > limit else "")


def cmd_keygen(args: argparse.Namespace) -> int:
    """``aurora keygen --out DIR``: a new Ed25519 signing key pair."""
    import os

    from aurora_store.format.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keypair

    signer = generate_keypair(args.out, overwrite=args.force)
    priv, pub = os.path.join(args.out, PRIVATE_KEY_FILE), os.path.join(args.out, PUBLIC_KEY_FILE)
    say(f"ed25519 key {signer.key_id}: {priv} (private, mode 0600: the Trainer's --sign-key), {pub} (readers' --trust-key)")
    print(signer.key_id)
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from aurora_store.lineage.report import read_lineage
    from aurora_store.storage import open_store

    store = open_store(args.url, storage_options(args.storage_option))
    lin = read_lineage(store, trust_of(args, store), commits_of(args, store), head_of(args))
    if args.json:
        print(json.dumps(lin.to_json(), indent=1))
        return 0
    print(f"{lin.url}: {len(lin.rows)} version(s)")
    print(f"{'version':>8} {'kind':<8} {'base':>6} {'state':<20} {'bytes':>12} {'changed':>11} {'density':>8} {'segs':>5}  created")
    for r in lin.rows:
        dens = f"{100 * r.density:.3f}%" if r.density is not None else "-"
        base = "-" if r.base is None else str(r.base)
        print(
            f"{r.version:>8} {r.kind:<8} {base:>6} {r.state[7:23]:<20} {r.bytes:>12} {r.changed:>11} {dens:>8} {r.segments:>5}  {r.created_at}"
        )
    signers = sorted({r.key_id for r in lin.rows if r.key_id})
    unsigned = sum(1 for r in lin.rows if r.key_id is None)
    if signers:
        checked = "verified" if getattr(args, "trust_key", None) or trust_key_paths(None) else "not verified: no --trust-key"
        print(f"SIGNED by key(s) {', '.join(signers)} ({checked}){f'; {unsigned} version(s) unsigned' if unsigned else ''}")
    elif lin.rows:
        print("UNSIGNED: no version carries a signature")
    _say_not_committed(lin.ignored)
    if lin.gaps:
        print(f"GAPS: version(s) {_gaps_text(lin.gaps)} have neither a delta nor a snapshot")
    if lin.orphans:
        print(f"ORPHANS: {len(lin.orphans)} object(s) of uncommitted publish attempts (aurora gc removes them)")
    for p in lin.problems:
        print(f"PROBLEM: {p}")
    return 1 if lin.problems else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from aurora_store.lineage.verify import verify_run
    from aurora_store.storage import open_store

    store = open_store(args.url, storage_options(args.storage_option))
    rep = verify_run(
        store,
        args.from_version,
        args.to_version,
        deep=args.deep,
        progress=say if args.verbose else None,
        trust=trust_of(args, store),
        commits=commits_of(args, store),
        ceiling=head_of(args),
    )
    for w in rep.warnings:
        say(f"warning: {w}")
    for p in rep.problems:
        print(f"PROBLEM: {p}")
    print(
        f"{'OK' if rep.ok else 'FAILED'}: {rep.checked_versions} version(s), {rep.checked_objects} object(s), "
        f"{rep.checked_bytes} bytes re-hashed; {len(rep.problems)} problem(s)"
    )
    return 0 if rep.ok else 1


def add_gc_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora gc``."""
    p.add_argument("url", metavar="URL")
    p.add_argument(
        "--keep-snapshots",
        type=int,
        default=2,
        metavar="K",
        help="keep the newest K snapshots and every version after the oldest of them (default %(default)s)",
    )
    p.add_argument("--apply", action="store_true", help="really delete (default: only print)")
    p.add_argument(
        "--grace-s",
        "--min-orphan-age",
        dest="grace_s",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="spare orphans and temporary files younger than this: they may be a write in flight (default 3600)",
    )
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="the run's Redis: never delete what live Actors hold or stage, or live Relays mirror",
    )
    _add_run_arg(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="delete versions live Actors or Relays still need, too (with --apply)",
    )
    p.add_argument(
        "--actor-timeout-s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="an Actor silent for longer than this holds nothing (default %(default)s)",
    )
    add_trust_key_arg(p)
    add_storage_option(p, help=None)


def cmd_gc(args: argparse.Namespace) -> int:
    from aurora_store.lineage.gc import retain
    from aurora_store.storage import open_store

    if (args.redis is None) != (args.run is None):
        raise ConfigError("aurora gc: --redis URL and --run NAME go together")
    if args.actor_timeout_s <= 0:
        raise ConfigError(f"--actor-timeout-s must be > 0, got {args.actor_timeout_s}")
    store = open_store(args.url, storage_options(args.storage_option))
    held = None
    client = None
    commits = None
    ceiling = None
    if args.redis is not None:
        from aurora_store.coordination.commit import commit_records_for
        from aurora_store.coordination.records import RunRecords
        from aurora_store.coordination.redisconn import connect
        from aurora_store.coordination.retention import run_held_versions

        client = connect(args.redis)
        held = run_held_versions(client, args.run, int(args.actor_timeout_s * 1000))
        commits = commit_records_for(client, args.run)
        ceiling = RunRecords(client, args.run).head()  # nothing above the Trainer's head counts
    else:
        say(
            "note: without --redis URL --run NAME, gc cannot see live Actors or Relays and may delete versions they hold; "
            "the versions that count are the chain from version 0"
        )
    try:
        retain(
            store,
            args.keep_snapshots,
            held,
            args.grace_s,
            force=args.force,
            dry_run=not args.apply,
            say=print,
            trust=trust_of(args, store),
            commits=commits,
            ceiling=ceiling,
        )
    finally:
        if client is not None:
            client.close()
    return 0
