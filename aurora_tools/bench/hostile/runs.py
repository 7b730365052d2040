"""Runs the hostile cases share: one tiny Trainer run (the real ``aurora trainer``), cloned per case.

A case that attacks a Trainer's run needs a real one: the model description,
a chain of versions, checkpoints and the run's records in Redis. One is made
once per bench (:func:`trainer_run`: the real Trainer in a child process, an
in-process "settler" standing in for the Actors) and each case works on a
clone of it (:func:`clone_run`: the run root copied, the run's Redis keys
copied under a new run name), so cases neither see nor disturb each other.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aurora_tools.bench.hostile.cases import Context

__all__ = ["TRAINER_ARGS", "trainer_cmd", "settler", "trainer_run", "clone_run", "redis_server", "STEPS"]

STEPS = 3
"""Versions the shared run publishes after v0."""

TRAINER_ARGS = (
    "--batch",
    "2",
    "--group",
    "2",
    "--max-new-tokens",
    "4",
    "--eval-every",
    "0",
    "--snapshot-every",
    "0",
    "--checkpoint-every",
    "1",
    "--keep-checkpoints",
    "8",
    "--streams",
    "2",
    "--batch-deadline-s",
    "600",
)
"""The tiny Trainer's settings: every run of it in the bench (fresh or resumed) uses the same."""


def child_env() -> dict[str, str]:
    """The bench's environment for a worker child: no AURORA_* settings inherited, one torch thread."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    e.update(AURORA_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    return e


def trainer_cmd(store: str, redis_url: str, run: str, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "aurora_tools.cli",
        "trainer",
        "--store",
        store,
        "--redis",
        redis_url,
        "--run",
        run,
        "--steps",
        str(steps),
        *TRAINER_ARGS,
        *extra,
    ]


@contextmanager
def settler(redis_url: str, run: str, actor: str = "settler", poll_s: float = 0.02) -> Iterator[threading.Event]:
    """A thread that settles every open step's prompts with well-formed completions (tokens 1..3)
    on the version and state the run records, as an honest Actor would; set the event to stop it."""
    from aurora_store.coordination.ledger import Ledger
    from aurora_store.coordination.records import RunRecords
    from aurora_store.coordination.redisconn import connect

    client = connect(redis_url)
    ledger, records = Ledger(client, run), RunRecords(client, run)
    stop = threading.Event()

    def loop() -> None:
        registered = False
        while not stop.wait(poll_s):
            try:
                if not registered:
                    ledger.register(actor)
                    registered = True
                for b in ledger.open_steps():
                    v = ledger.step_version(b)
                    state = records.expected_state(v) if v is not None else None
                    if v is None or state is None:
                        continue
                    if not ledger.heartbeat(actor, active=v, staged=v, active_state=state):
                        registered = False
                        continue
                    status, leases = ledger.claim(actor, b, 16)
                    for lease in leases if status == "ok" else []:
                        body = {"completions": [[1, 2, 3]] * lease.group, "gen_s": 0.01}
                        ledger.settle(actor, lease, v, state, json.dumps(body).encode())
            except Exception:  # noqa: BLE001 - a stand-in Actor rides out whatever the run does
                time.sleep(poll_s)

    t = threading.Thread(target=loop, name=f"settler-{run}", daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(10)
        client.close()


def redis_server(ctx: Context) -> Any:
    """One plain redis-server for every case that needs no ACL."""
    if "redis" not in ctx.resources:
        from aurora_store.testing.servers import RedisServer

        server = RedisServer().start()
        ctx.closers.append(server.stop)
        ctx.resources["redis"] = server
    return ctx.resources["redis"]


def trainer_run(ctx: Context) -> dict[str, Any]:
    """The shared tiny run: ``aurora trainer`` for :data:`STEPS` steps, a checkpoint before each.

    The run is signed (``sign_key``, ``trust_key``: the key pair's files), as
    the runs these attacks matter for are: what an attacker without the key
    writes is unsigned. Returns ``dir`` (the run root's folder), ``run`` (its
    name), ``redis`` (the server's URL), the key files and ``seconds``.
    """
    if "trainer-run" in ctx.resources:
        return ctx.resources["trainer-run"]
    from aurora_store.format.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keypair

    server = redis_server(ctx)
    base = ctx.dir("trainer-run")
    root = base / "run"
    log = base / "trainer.log"
    keys = ctx.dir("trainer-key")
    generate_keypair(keys, overwrite=True)  # the run is signed: what an attacker without the key plants is unsigned
    sign_key = str(keys / PRIVATE_KEY_FILE)
    t0 = time.monotonic()
    with settler(server.url, "base"), open(log, "wb") as out:
        p = subprocess.run(
            trainer_cmd(f"file://{root}", server.url, "base", STEPS, "--sign-key", sign_key),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(),
            timeout=240,
            check=False,
        )
    if p.returncode != 0:
        raise RuntimeError(f"the shared Trainer run failed (exit {p.returncode}): {log.read_text(errors='replace')[-400:]}")
    res = {
        "dir": root,
        "run": "base",
        "redis": server.url,
        "seconds": round(time.monotonic() - t0, 1),
        "sign_key": sign_key,
        "trust_key": str(keys / PUBLIC_KEY_FILE),
    }
    ctx.resources["trainer-run"] = res
    return res


def clone_run(ctx: Context, name: str) -> dict[str, Any]:
    """A copy of the shared run for one case: its root under ``name/run``, its Redis keys under run ``name``."""
    from aurora_store.coordination.keys import key_prefix
    from aurora_store.coordination.redisconn import connect

    src = trainer_run(ctx)
    dst = ctx.dir(name) / "run"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src["dir"], dst)
    for p in dst.rglob("*"):  # the store writes read-only files; a case may plant over them
        if p.is_file():
            p.chmod(0o644)
    client = connect(src["redis"])
    try:
        old, new = key_prefix(src["run"]), key_prefix(name)
        for key in client.scan_iter(match=old.replace("{", "\\{").replace("}", "\\}") + "*", count=1000):
            k = key.decode() if isinstance(key, bytes) else key
            dumped = client.dump(k)
            if dumped is not None:
                client.restore(new + k[len(old) :], 0, dumped, replace=True)
    finally:
        client.close()
    return {
        "dir": dst,
        "url": f"file://{dst}",
        "run": name,
        "redis": src["redis"],
        "sign_key": src["sign_key"],
        "trust_key": src["trust_key"],
    }
