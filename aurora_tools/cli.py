"""``aurora``: one command line for the library and the workers.

Every failure is one line on stderr naming the file or object, the version
and the reason, with exit status 1 (2 for usage errors).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from aurora_store import __version__
from aurora_store.errors import AuroraError, ConfigError

__all__ = ["main"]


def storage_options(pairs: Sequence[str] | None, flag: str = "--storage-option") -> dict[str, Any]:
    """``key=value`` pairs; values ``true``/``false``/integers are typed."""
    out: dict[str, Any] = {}
    for p in pairs or ():
        if "=" not in p:
            raise ConfigError(f"{flag} {p!r}: expected key=value")
        k, v = p.split("=", 1)
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        elif v.isdigit():
            val = int(v)
        if k == "endpoint_url":
            out.setdefault("client_kwargs", {})["endpoint_url"] = v
        else:
            out[k] = val
    return out




def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        required=True,
        metavar="URL",
        help="run root: s3://bucket/prefix/run, file:///path, or a path",
    )
    p.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
    )


def _add_encode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encodings",
        metavar="LIST",
        help="index encodings allowed (default: leb128,bitmask,dense,u32,u64)",
    )
    p.add_argument("--values", metavar="LIST", help="value modes allowed (default: new,xor)")
    p.add_argument(
        "--no-zstd", action="store_true", help="never compress streams (fast links, spare CPU)"
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
        help="target segment size in MiB (default 16, env AURORA_SEGMENT_MIB)",
    )
    p.add_argument(
        "--streams", type=int, default=None, help="parallel uploads (default 8, env AURORA_STREAMS)"
    )


def _publish_config(args: argparse.Namespace) -> Any:
    from aurora_store.codec.entries import PAPER, EncodeOptions
    from aurora_store.lineage.publish import PublishConfig

    opts = EncodeOptions.from_env()
    if args.paper:
        opts = PAPER
    else:
        kw: dict[str, Any] = {}
        if args.encodings:
            kw["index_encodings"] = tuple(x.strip() for x in args.encodings.split(","))
        if args.values:
            kw["value_modes"] = tuple(x.strip() for x in args.values.split(","))
        if args.no_zstd:
            kw["codecs"] = ("none",)
        if kw:
            opts = EncodeOptions(
                **{
                    **{
                        f: getattr(opts, f)
                        for f in ("index_encodings", "value_modes", "codecs", "zstd_level")
                    },
                    **kw,
                }
            )
    seg_mib = (
        args.segment_mib
        if args.segment_mib is not None
        else float(os.environ.get("AURORA_SEGMENT_MIB", 16))
    )
    streams = args.streams if args.streams is not None else int(os.environ.get("AURORA_STREAMS", 8))
    return PublishConfig(streams=streams, segment_bytes=int(seg_mib * (1 << 20)), options=opts)


def _load_weights(path: str) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file")
    try:
        return dict(load_file(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable safetensors file: {e}") from None


def _plan_for(weights: dict[str, Any], tied: bool, path: str) -> Any:
    from aurora_store.codec.extract import spec_of
    from aurora_store.codec.fusion import FusionPlan

    return FusionPlan.from_specs(
        {n: spec_of(t, f"{path}: {n}") for n, t in weights.items()}, tied_lm_head=tied
    )


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
def cmd_snapshot_create(args: argparse.Namespace) -> int:
    import torch

    from aurora_store.lineage.fetch import read_manifest, scan_versions
    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage.store import open_store

    store = open_store(args.store, storage_options(args.storage_option))
    w = _load_weights(args.weights)
    plan = _plan_for(w, args.tied_lm_head, args.weights)
    fused = {
        p.name: (
            torch.cat([w[b.source].reshape(-1) for b in p.blocks]).view(p.spec.shape)
            if p.is_fused
            else w[p.blocks[0].source]
        )
        for p in plan
    }
    index = scan_versions(store)
    v = args.version
    if v in index.deltas:
        state = read_manifest(store, "delta", v).state
    elif index.latest is None or v == 0:
        state = None  # first version of the run: its own content digest
    else:
        raise ConfigError(
            f"snapshot {v}: the store already holds versions up to {index.latest} but no delta {v}; "
            "a snapshot must capture a version the chain reaches (or be the first of the run)"
        )
    t0 = time.perf_counter()
    m = publish_snapshot(store, args.run, v, fused, state, _publish_config(args))
    _say(
        f"snapshot {v}: {len(m.segments)} shard(s), {m.total_bytes} bytes, state {m.state[:19]}… in {time.perf_counter() - t0:.2f}s -> {store.url}"
    )
    return 0


def cmd_delta_create(args: argparse.Namespace) -> int:
    from aurora_store.codec.extract import extract
    from aurora_store.lineage.fetch import read_manifest, scan_versions
    from aurora_store.lineage.publish import publish_delta
    from aurora_store.storage.store import open_store

    store = open_store(args.store, storage_options(args.storage_option))
    v = args.version
    if v < 1:
        raise ConfigError(f"delta {v}: version must be >= 1")
    index = scan_versions(store)
    if v - 1 in index.deltas:
        base_m = read_manifest(store, "delta", v - 1)
    elif v - 1 in index.snapshots:
        base_m = read_manifest(store, "snapshot", v - 1)
    else:
        raise ConfigError(f"delta {v}: its base version {v - 1} is not committed in {store.url}")
    base, new = _load_weights(args.base), _load_weights(args.new)
    plan = _plan_for(base, args.tied_lm_head, args.base)
    snaps = [s for s in index.snapshots if s <= v - 1]
    if snaps:
        model = read_manifest(store, "snapshot", max(snaps)).param_specs()
        if model != plan.specs():
            diff = [
                f"{n}: store {list(model[n].shape) if n in model else None}, file {list(plan.specs()[n].shape) if n in plan.specs() else None}"
                for n in sorted(set(model) | set(plan.specs()))
                if model.get(n) != plan.specs().get(n)
            ][:3]
            raise ConfigError(
                f"delta {v}: {args.base} does not describe the run's model (first differences: {diff})"
            )
    t0 = time.perf_counter()
    m = publish_delta(
        store, args.run, v, extract(plan, base, new), base_m.state, _publish_config(args)
    )
    numel = plan_numel = sum(p.spec.numel for p in plan)
    _say(
        f"delta {v}: {m.nnz} changed of {plan_numel} elements ({100 * m.nnz / max(1, numel):.3f}%), "
        f"{len(m.segments)} segment(s), {m.total_bytes} bytes ({m.total_bytes / max(1, m.nnz):.2f} B/changed) "
        f"in {time.perf_counter() - t0:.2f}s -> {store.url}"
    )
    return 0


def cmd_delta_apply(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from aurora_store.lineage.fetch import materialize
    from aurora_store.storage.store import open_store

    store = open_store(args.store, storage_options(args.storage_option))
    tensors, state = materialize(store, args.version, progress=_say)
    tmp = args.out + ".partial"
    save_file(tensors, tmp, metadata={"aurora.version": str(args.version), "aurora.state": state})
    os.replace(tmp, args.out)
    _say(f"version {args.version} (state {state[:19]}…) -> {args.out}")
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    import json

    from aurora_store.lineage.report import read_lineage
    from aurora_store.storage.store import open_store

    lin = read_lineage(open_store(args.url, storage_options(args.storage_option)))
    if args.json:
        print(json.dumps(lin.to_json(), indent=1))
        return 0
    print(f"{lin.url}: {len(lin.rows)} version(s)")
    print(f"{'version':>8} {'kind':<8} {'base':>6} {'state':<20} {'bytes':>12} {'changed':>11} {'density':>8} {'segs':>5}  created")
    for r in lin.rows:
        dens = f"{100 * r.density:.3f}%" if r.density is not None else "-"
        base = "-" if r.base is None else str(r.base)
        print(f"{r.version:>8} {r.kind:<8} {base:>6} {r.state[7:23]:<20} {r.bytes:>12} {r.changed:>11} {dens:>8} {r.segments:>5}  {r.created_at}")
    if lin.gaps:
        print(f"GAPS: version(s) {lin.gaps[:20]} have neither a delta nor a snapshot")
    if lin.orphans:
        print(f"ORPHANS: {len(lin.orphans)} object(s) of uncommitted publish attempts (aurora gc removes them)")
    for p in lin.problems:
        print(f"PROBLEM: {p}")
    return 1 if lin.problems else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from aurora_store.lineage.verify import verify_run
    from aurora_store.storage.store import open_store

    store = open_store(args.url, storage_options(args.storage_option))
    rep = verify_run(store, args.from_version, args.to_version, deep=args.deep, progress=_say if args.verbose else None)
    for w in rep.warnings:
        _say(f"warning: {w}")
    for p in rep.problems:
        print(f"PROBLEM: {p}")
    print(
        f"{'OK' if rep.ok else 'FAILED'}: {rep.checked_versions} version(s), {rep.checked_objects} object(s), "
        f"{rep.checked_bytes} bytes re-hashed; {len(rep.problems)} problem(s)"
    )
    return 0 if rep.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from aurora_store.lineage.gc import run_gc
    from aurora_store.storage.store import open_store

    store = open_store(args.url, storage_options(args.storage_option))
    run_gc(store, args.keep_snapshots, apply=args.apply, min_orphan_age_s=args.min_orphan_age)
    return 0


def cmd_testbed(args: argparse.Namespace) -> int:
    from aurora_tools import testbed

    if args.action == "down":
        res = testbed.stop_background(args.dir)
        _say(f"testbed in {os.path.abspath(args.dir)} stopped: {'; '.join(res['stopped'])}")
        return 0
    if args.background:
        state = testbed.start_background(args.dir, args.s3_port, args.redis_port, args.bucket)
        print(testbed.banner(state, background=True), flush=True)
        _say(f"(state {os.path.join(state['dir'], testbed.STATE_FILE)}, log {state['log']})")
        return 0
    return testbed.serve(args.dir, args.s3_port, args.redis_port, args.bucket)


def cmd_status(args: argparse.Namespace) -> int:
    import json

    import redis as redis_lib

    from aurora_store.coordination.redisconn import connect
    from aurora_store.coordination.status import collect_status, render

    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch {args.watch}: the refresh period must be positive")
    client = connect(args.redis)
    where = args.redis.rsplit("@", 1)[-1]
    tty = sys.stdout.isatty()
    first = True
    try:
        while True:
            try:
                st = collect_status(client, args.run)
                text = json.dumps(st, sort_keys=True) if args.json else render(st)
            except redis_lib.RedisError as e:
                if args.watch is None:
                    raise ConfigError(f"Redis at {where}: {e}") from None
                text = f"Redis at {where}: {e} (retrying)"
            if args.watch is not None and tty and not args.json:
                text = "\x1b[H\x1b[2J" + text
            elif args.watch is not None and not first and not args.json:
                text = "\n" + text
            print(text, flush=True)
            first = False
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from aurora_tools.bench.codec import main as bench_main

    return bench_main(args)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from aurora_tools.bench.transfer import main as bench_main

    return bench_main(args)


# ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aurora", description="Versioned sparse delta checkpoints for RL policy updates."
    )
    ap.add_argument("--version", action="version", version=f"aurora {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    snap = sub.add_parser("snapshot", help="full-weight snapshots").add_subparsers(
        dest="action", required=True
    )
    sc = snap.add_parser("create", help="write WEIGHTS as snapshot V (fused names)")
    sc.add_argument("weights", metavar="WEIGHTS.safetensors")
    sc.add_argument("--version", type=int, required=True)
    sc.add_argument("--run", default="run")
    sc.add_argument(
        "--tied-lm-head",
        action="store_true",
        help="lm_head.weight is the embedding: do not carry it",
    )
    _add_store_args(sc)
    _add_encode_args(sc)
    sc.set_defaults(func=cmd_snapshot_create)

    delta = sub.add_parser("delta", help="sparse delta versions").add_subparsers(
        dest="action", required=True
    )
    dc = delta.add_parser("create", help="write delta V = NEW - BASE on top of version V-1")
    dc.add_argument("base", metavar="BASE.safetensors")
    dc.add_argument("new", metavar="NEW.safetensors")
    dc.add_argument("--version", type=int, required=True)
    dc.add_argument("--run", default="run")
    dc.add_argument("--tied-lm-head", action="store_true")
    _add_store_args(dc)
    _add_encode_args(dc)
    dc.set_defaults(func=cmd_delta_create)
    da = delta.add_parser("apply", help="materialize version V: newest snapshot <= V, then deltas")
    da.add_argument("--version", type=int, required=True)
    da.add_argument("--out", required=True, metavar="FILE.safetensors")
    _add_store_args(da)
    da.set_defaults(func=cmd_delta_apply)

    ln = sub.add_parser("lineage", help="one row per version; orphans and gaps called out")
    ln.add_argument("url", metavar="URL")
    ln.add_argument("--json", action="store_true")
    ln.add_argument("--storage-option", action="append", metavar="KEY=VALUE")
    ln.set_defaults(func=cmd_lineage)

    vf = sub.add_parser("verify", help="re-hash every object, check chain continuity and state digests")
    vf.add_argument("url", metavar="URL")
    vf.add_argument("--from", dest="from_version", type=int, default=None, metavar="V")
    vf.add_argument("--to", dest="to_version", type=int, default=None, metavar="V")
    vf.add_argument("--deep", action="store_true", help="also decode and validate every segment")
    vf.add_argument("-v", "--verbose", action="store_true")
    vf.add_argument("--storage-option", action="append", metavar="KEY=VALUE")
    vf.set_defaults(func=cmd_verify)

    gc = sub.add_parser("gc", help="remove orphans and versions no retained chain needs (dry run by default)")
    gc.add_argument("url", metavar="URL")
    gc.add_argument("--keep-snapshots", type=int, required=True, metavar="N")
    gc.add_argument("--apply", action="store_true", help="really delete (default: only print)")
    gc.add_argument("--min-orphan-age", type=float, default=3600.0, metavar="SECONDS", help="spare younger orphans: they may be a publish in flight (default 3600)")
    gc.add_argument("--storage-option", action="append", metavar="KEY=VALUE")
    gc.set_defaults(func=cmd_gc)

    from workers import actor as actor_mod  # noqa: PLC0415 - light: heavy imports are inside
    from workers.trainer import trainer as trainer_mod

    tp = sub.add_parser("trainer", help="run the GRPO Trainer: publishes every step as a delta, schedules Actors")
    trainer_mod.add_arguments(tp)
    tp.set_defaults(func=lambda a: trainer_mod.main(a, storage_options(a.storage_option)))
    ap_ = sub.add_parser("actor", help="run an Actor: bootstrap, stage, activate, generate, settle")
    actor_mod.add_arguments(ap_)
    ap_.set_defaults(func=lambda a: actor_mod.main(a, storage_options(a.storage_option)))

    from workers.relay import relay as relay_mod

    rl = sub.add_parser("relay", help="run a regional Relay: mirror versions near a region's Actors")
    relay_mod.add_arguments(rl)
    rl.set_defaults(func=relay_mod.run_from_args)

    tbp = sub.add_parser("testbed", help="local Redis and S3-protocol server on loopback for trying a run").add_subparsers(
        dest="action", required=True
    )
    tbu = tbp.add_parser("up", help="start Redis and an S3 server (minio if on PATH, else moto); run until Ctrl-C")
    tbu.add_argument("--dir", default=".aurora-testbed", help="state, logs and data (default ./.aurora-testbed)")
    tbu.add_argument("--s3-port", type=int, default=0, metavar="N", help="S3 server port (default: a free one)")
    tbu.add_argument("--redis-port", type=int, default=0, metavar="N", help="Redis port (default: a free one)")
    tbu.add_argument("--bucket", default="aurora", help="bucket to create (default aurora)")
    tbu.add_argument("--background", action="store_true", help="detach, write DIR/testbed.json and return")
    tbu.set_defaults(func=cmd_testbed)
    tbd = tbp.add_parser("down", help="stop the testbed started with --background (SIGTERM, then SIGKILL)")
    tbd.add_argument("--dir", default=".aurora-testbed", help="its folder (default ./.aurora-testbed)")
    tbd.set_defaults(func=cmd_testbed)

    stp = sub.add_parser("status", help="a run at a glance: Trainer head, Relays, Actors, open steps")
    stp.add_argument("--redis", required=True, metavar="URL")
    stp.add_argument("--run", required=True, metavar="NAME")
    stp.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS", help="refresh every SECONDS (default 2) until Ctrl-C")
    stp.add_argument("--json", action="store_true", help="one JSON object (one per refresh with --watch)")
    stp.set_defaults(func=cmd_status)

    from aurora_tools.demo import system as demo_mod

    dm = sub.add_parser("demo", help="the whole system on one machine: Redis, S3 server, Trainer, Relay, Actors (--codec: codec only)")
    demo_mod.add_arguments(dm)
    dm.set_defaults(func=demo_mod.main)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    bc = bench.add_parser("codec", help="delta size, extraction and apply rates vs baselines")
    bc.add_argument(
        "--params",
        type=float,
        default=None,
        help="model size in parameters (e.g. 6e8); default: Qwen3-0.6B shape",
    )
    bc.add_argument("--lr", type=float, default=None, help="learning rate of the measured step (default 2e-7: about 1%% density)")
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    bc.set_defaults(func=cmd_bench_codec)
    bt = bench.add_parser("transfer", help="publish-to-staged time, 1 vs S connections, vs raw S3 throughput (local S3 server)")
    from aurora_tools.bench import transfer as bench_transfer

    bench_transfer.add_arguments(bt)
    bt.set_defaults(func=cmd_bench_transfer)
    from aurora_tools.bench import ledger as bench_ledger  # light: no torch

    bl = bench.add_parser("ledger", help="lease-and-settle rate of the Redis ledger with N simulated Actors (local redis-server)")
    bench_ledger.add_arguments(bl)
    bl.set_defaults(func=lambda a: bench_ledger.main(a))
    from aurora_tools.bench import e2e as bench_e2e

    be = bench.add_parser("e2e", help="what the weight path adds to step time: the demo's workload with and without weight transfer")
    bench_e2e.add_arguments(be)
    be.set_defaults(func=bench_e2e.main)
    from aurora_tools.bench import wan as bench_wan  # light: the runs import the workers

    bw = bench.add_parser("wan", help="the paper's comparisons over an emulated WAN: delta vs full broadcast, lag bounds, streams, Relays, split, churn")
    bench_wan.add_arguments(bw)
    bw.set_defaults(func=bench_wan.main)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (AuroraError, OSError, ValueError) as e:
        print(f"aurora: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("aurora: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
