"""``aurora snapshot create``, ``aurora delta create``, ``aurora delta apply``: weights files in and out of a run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from aurora_store.credentials import REDIS_URL_ENV
from aurora_store.errors import ConfigError
from aurora_store.options import sign_key_path, storage_options
from aurora_tools.cli.console import say

__all__ = [
    "add_encode_args",
    "add_commit_args",
    "cmd_snapshot_create",
    "cmd_delta_create",
    "cmd_delta_apply",
]


def add_encode_args(p: argparse.ArgumentParser) -> None:
    """How a version is encoded: index encodings, value modes, compression, segment size, streams."""
    p.add_argument(
        "--encodings",
        metavar="LIST",
        help="index encodings allowed (default: leb128,bitmask,dense,u32,u64,rice; rice is format 2)",
    )
    p.add_argument("--values", metavar="LIST", help="value modes allowed (default: new,xor)")
    p.add_argument("--no-zstd", action="store_true", help="never compress streams, nor code planes (fast links, spare CPU)")
    p.add_argument(
        "--format",
        type=int,
        choices=(1, 2),
        default=None,
        help="segment format: 2 (rice gaps, planes values), or 1 for readers that know only format 1 (default 2, env AURORA_FORMAT)",
    )
    p.add_argument(
        "--paper",
        action="store_true",
        help="the paper's encoding only: leb128 indices, raw new values",
    )
    p.add_argument(
        "--segment-mib",
        type=float,
        default=None,
        help="target segment size in MiB (default: adaptive to the delta, 64 KiB..16 MiB; env AURORA_SEGMENT_MIB)",
    )
    p.add_argument("--streams", type=int, default=None, help="parallel uploads (default 8, env AURORA_STREAMS)")


def _publish_config(args: argparse.Namespace) -> Any:
    from aurora_store.codec.entries import PAPER
    from aurora_store.lineage.publish import PublishConfig, encode_options_from_env

    opts = encode_options_from_env()  # AURORA_FORMAT and the other encoder variables
    kw: dict[str, Any] = {}
    if args.paper:
        kw = {f: getattr(PAPER, f) for f in ("index_encodings", "value_modes", "codecs", "format")}
    else:
        if args.encodings:
            kw["index_encodings"] = tuple(x.strip() for x in args.encodings.split(","))
        if args.values:
            kw["value_modes"] = tuple(x.strip() for x in args.values.split(","))
        if args.no_zstd:
            kw["codecs"] = ("none",)
    if getattr(args, "format", None) is not None:
        kw["format"] = args.format
    if kw:
        opts = dataclasses.replace(opts, **kw)
    # Flags win over AURORA_STREAMS / AURORA_SEGMENT_MIB; no size anywhere: adaptive.
    seg = None if args.segment_mib is None else int(args.segment_mib * (1 << 20))
    return PublishConfig.from_env(streams=args.streams, segment_bytes=seg, options=opts)


def add_commit_args(p: argparse.ArgumentParser) -> None:
    """``--commit-via {store,redis}`` and the ``--redis URL`` that Redis-commit mode needs (FORMAT.md §1)."""
    p.add_argument(
        "--commit-via",
        choices=("store", "redis"),
        default="store",
        help="store (default): the create-only manifest write commits a version, and the store is first "
        "checked to honour create-only writes; redis: a Redis record commits it, for S3-compatible servers "
        "that ignore conditional writes (needs --redis and --run; Redis must persist its data)",
    )
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="the run's Redis, with --commit-via redis (default: $AURORA_REDIS_URL)",
    )


def _commit(args: argparse.Namespace, store: Any) -> tuple[Any, Any]:
    """``(commit callback, commit records)`` of this publish; ``(None, None)`` when the store commits.

    Runs the checks of :func:`~aurora_store.coordination.commit.prepare_commit`
    before any weight is read or byte uploaded: a store that does not honour
    create-only writes is refused (unless ``--commit-via redis``), and so is
    a Redis that does not persist its data. Sets ``args.run`` to its default
    (``run``) when the store commits.
    """
    via = getattr(args, "commit_via", "store")
    if via != "redis":
        from aurora_store.storage.probe import require_create_only

        require_create_only(store)
        if args.run is None:
            args.run = "run"
        return None, None
    if args.run is None:
        raise ConfigError("--commit-via redis needs --run NAME (the commit records live under the run's Redis keys)")
    url = getattr(args, "redis", None) or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise ConfigError(f"--commit-via redis needs --redis URL (or {REDIS_URL_ENV})")
    from aurora_store.coordination.commit import RedisCommitLog, prepare_commit
    from aurora_store.coordination.redisconn import connect

    client = connect(url)  # closed when the command's process ends
    return prepare_commit(store, client, args.run, "redis"), RedisCommitLog(client, args.run)


def _signer(args: argparse.Namespace) -> Any:
    """The Signer of ``--sign-key`` / ``AURORA_SIGN_KEY`` (None: write unsigned)."""
    from aurora_store.format.signing import signer_from_option

    return signer_from_option(sign_key_path(getattr(args, "sign_key", None)), getattr(args, "key_id", None))


def _trust(args: argparse.Namespace, store: Any = None) -> Any:
    from aurora_tools.cli.store_cmds import trust_of

    return trust_of(args, store)


def _load_plan(path: str, tied_flag: bool) -> tuple[dict[str, Any], Any]:
    """(tensors, fusion plan) of a safetensors file or a model directory (its shards; family and tying from its config.json).

    Expert tensors are checked here, before anything is written: per layer,
    every expert present, one form, shapes that agree with each other and
    with config.json's E, I and H (FORMAT.md §2).
    """
    from aurora_store.codec.experts import check_config
    from aurora_store.codec.extract import plan_of
    from workers.pretrained import read_checkpoint

    ck = read_checkpoint(path)
    plan = plan_of(ck.tensors, tied_flag or ck.tied, path, ck.family)
    if ck.config:
        check_config(plan.specs(), ck.config, path)
    return ck.tensors, plan


def _shape(spec: Any) -> str:
    return "absent" if spec is None else f"{list(spec.shape)} {spec.dtype}"


def cmd_snapshot_create(args: argparse.Namespace) -> int:
    from aurora_store.codec.extract import fuse_weights
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.plan import scan_versions
    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage import open_store

    store = open_store(args.store, storage_options(args.storage_option))
    signer = _signer(args)  # a bad key fails before any work
    commit, commits = _commit(args, store)  # so does a store that cannot commit
    w, plan = _load_plan(args.weights, args.tied_lm_head)
    fused = fuse_weights(w, plan)
    index = scan_versions(store)
    v = args.version
    if v in index.deltas:
        state = read_manifest(store, "delta", v, commits=commits).state
    elif index.latest is None or v == 0:
        state = None  # first version of the run: its own content digest
    else:
        raise ConfigError(
            f"snapshot {v}: the store already holds versions up to {index.latest} but no delta {v}; "
            "a snapshot must capture a version the chain reaches (or be the first of the run)"
        )
    t0 = time.perf_counter()
    m = publish_snapshot(store, args.run, v, fused, state, _publish_config(args), signer=signer, commit=commit)
    say(
        f"snapshot {v}: {len(m.segments)} shard(s), {m.total_bytes} bytes, state {m.state[:19]}… in {time.perf_counter() - t0:.2f}s -> {store.url}"
    )
    return 0


def cmd_delta_create(args: argparse.Namespace) -> int:
    from aurora_store.codec.extract import extract, fuse_weights, unfuse_weights
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.plan import scan_versions
    from aurora_store.lineage.publish import publish_delta
    from aurora_store.storage import open_store

    store = open_store(args.store, storage_options(args.storage_option))
    signer = _signer(args)  # a bad key fails before any work
    v = args.version
    if v < 1:
        raise ConfigError(f"delta {v}: version must be >= 1")
    commit, commits = _commit(args, store)  # a store that cannot commit fails before any work
    index = scan_versions(store)
    if v - 1 in index.deltas:
        base_m = read_manifest(store, "delta", v - 1, commits=commits)
    elif v - 1 in index.snapshots:
        base_m = read_manifest(store, "snapshot", v - 1, commits=commits)
    else:
        raise ConfigError(f"delta {v}: its base version {v - 1} is not committed in {store.url}")
    (base, plan), (new, new_plan) = _load_plan(args.base, args.tied_lm_head), _load_plan(args.new, args.tied_lm_head)
    have, got = plan.specs(), new_plan.specs()
    if got != have:
        diff = [
            f"{n}: {_shape(have.get(n))} vs {_shape(got.get(n))}"
            for n in [*have, *(x for x in got if x not in have)]
            if have.get(n) != got.get(n)
        ]
        raise ConfigError(f"delta {v}: the new weights are not the model of {args.base} ({args.new}; base vs new: {'; '.join(diff[:3])})")
    if {b.source for p in plan for b in p.blocks} != {b.source for p in new_plan for b in p.blocks}:
        new = unfuse_weights(fuse_weights(new, new_plan), plan)  # experts per-expert on one side, packed on the other
    snaps = [s for s in index.snapshots if s <= v - 1]
    if snaps:
        model = read_manifest(store, "snapshot", max(snaps)).param_specs()
        if model != plan.specs():
            diff = [
                f"{n}: store {list(model[n].shape) if n in model else None}, file {list(plan.specs()[n].shape) if n in plan.specs() else None}"
                for n in sorted(set(model) | set(plan.specs()))
                if model.get(n) != plan.specs().get(n)
            ][:3]
            raise ConfigError(f"delta {v}: {args.base} does not describe the run's model (first differences: {diff})")
    t0 = time.perf_counter()
    from aurora_store.apply.sink import weights_digest

    # The digest of the new weights binds a snapshot of this version (`aurora snapshot create`, FORMAT.md §4.1).
    m = publish_delta(
        store,
        args.run,
        v,
        extract(plan, base, new),
        base_m.state,
        _publish_config(args),
        signer=signer,
        commit=commit,
        weights_digest=weights_digest(new, plan),
    )
    numel = plan_numel = sum(p.spec.numel for p in plan)
    say(
        f"delta {v}: {m.nnz} changed of {plan_numel} elements ({100 * m.nnz / max(1, numel):.3f}%), "
        f"{len(m.segments)} segment(s), {m.total_bytes} bytes ({m.total_bytes / max(1, m.nnz):.2f} B/changed) "
        f"in {time.perf_counter() - t0:.2f}s -> {store.url}"
    )
    return 0


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, fsync it, rename it to ``path``, fsync the folder.

    ``path`` appears whole or not at all: on any error (a full disk, Ctrl-C)
    the temporary file is removed and ``path`` is left as it was.
    """
    folder = os.path.dirname(os.path.abspath(path)) or "."
    # Hidden, unique, in the same folder (a rename across filesystems is not atomic);
    # created by ``write`` itself, so it gets the usual permissions.
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.partial")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def cmd_delta_apply(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from aurora_store.lineage.materialize import materialize
    from aurora_store.storage import open_store

    if os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out}: is a folder; give a file name")
    store = open_store(args.store, storage_options(args.storage_option))
    trust = _trust(args, store)
    from aurora_tools.cli.store_cmds import commits_of

    tensors, state = materialize(store, args.version, progress=say, trust=trust, commits=commits_of(args, store))
    meta = {"aurora.version": str(args.version), "aurora.state": state}

    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata=meta)
        except SafetensorError as e:  # its I/O errors (a full disk) come wrapped
            raise OSError(f"{args.out}: cannot write: {e}") from None

    _write_atomically(args.out, write)
    say(f"version {args.version} (state {state[:19]}…) -> {args.out}")
    return 0
