"""Attacks through Redis with a role's own credential (issue 24): what an Actor's or a reader's user can do.

Each case starts a redis-server with ``infra/redis/aurora.acl`` loaded (as
``ACL SETUSER`` lines; on Redis 6.2 without the read-only key patterns and
subcommand denials, as the file says), runs the real Trainer in this process
as the Trainer's user over a recording workload, an honest Actor settling
its batches as the Actor's user, and an attacker holding that same Actor
credential who issues plain Redis commands (``HSET`` on a step's keys,
``EVALSHA`` of the settle script naming another Actor). Refused: the
Trainer finishes its steps and never hands the attacker's result to the
workload. Every attacker payload carries :data:`MARK`.
"""

from __future__ import annotations

import hashlib
import json
import string
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aurora_tools.bench.hostile.cases import Case, Context, Result

__all__ = ["LEDGER_CASES", "acl_server", "claim_every_step", "drive", "MARK"]

MARK = b"hostile-result"
ACL_FILE = Path(__file__).resolve().parents[3] / "infra" / "redis" / "aurora.acl"
RUN = "hostile-acl"
ADMIN = "hostile-admin"
STEPS = 3
TRAINER_TIMEOUT_S = 120.0


def _redis_version(binary: str) -> tuple[int, int]:
    import re

    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    m = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _rules(run: str, passwords: Mapping[str, str], version: tuple[int, int]) -> list[tuple[str, list[str]]]:
    """(user, rules) of every ``user`` line of the ACL file, rendered for ``run`` as envsubst would."""
    values = {"RUN": run, **{f"{r.upper()}_PASSWORD_SHA256": hashlib.sha256(p.encode()).hexdigest() for r, p in passwords.items()}}
    out = []
    for raw in ACL_FILE.read_text().splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        tokens = string.Template(raw).safe_substitute(values).split()
        if tokens[0] != "user":
            continue
        rules = tokens[2:]
        if version < (7, 0):  # as the file says: no read-only patterns, no subcommand denials
            rules = [t for t in rules if not t.startswith("%") and not (t.startswith("-") and "|" in t)]
        out.append((tokens[1], rules))
    return out


def acl_server(ctx: Context) -> dict[str, Any]:
    """A fresh redis-server with the run's users loaded: ``server``, ``urls`` (role -> URL), ``admin`` (a client)."""
    import secrets

    import redis

    from aurora_store.testing.servers import RedisServer, redis_server_binary

    server = RedisServer().start()
    ctx.closers.append(server.stop)
    version = _redis_version(redis_server_binary())
    pw = {role: secrets.token_hex(12) for role in ("trainer", "actor", "relay", "readonly")}
    admin_pw = secrets.token_hex(12)
    boot = redis.Redis(host="127.0.0.1", port=server.port)
    boot.execute_command("ACL", "SETUSER", ADMIN, "on", f">{admin_pw}", "~*", "&*", "+@all")
    boot.close()
    admin = redis.Redis(host="127.0.0.1", port=server.port, username=ADMIN, password=admin_pw, socket_timeout=5)
    ctx.closers.append(admin.close)
    for user, rules in _rules(RUN, pw, version):
        admin.execute_command("ACL", "SETUSER", user, "reset", *rules)
    urls = {role: f"redis://aurora-{role}:{p}@127.0.0.1:{server.port}/0" for role, p in pw.items()}
    return {"server": server, "urls": urls, "admin": admin, "port": server.port, "passwords": pw}


class Recorder:
    """A step and weights source (one small tensor) that records every result the Trainer hands it.

    Like the GRPO workload, it needs each result's prompt to be one it issued:
    anything else is recorded as ``unknown``.
    """

    def __init__(self) -> None:
        import torch

        self.current = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8).to(torch.bfloat16)}
        self.issued: set[str] = set()
        self.steps: set[int] = set()
        self.payloads: list[bytes] = []
        self.unknown: list[str] = []
        self.trained = 0

    def first_version(self, store: Any) -> Any:
        from aurora_store.codec.extract import plan_of
        from workers.trainer.sources import FirstVersion

        return FirstVersion(self.current, plan_of(self.current, tied=False), None)

    def prompts(self, step: int) -> list[tuple[str, bytes]]:
        ids = [f"s{step}-{i}" for i in range(2)]
        self.steps.add(step)
        self.issued.update(ids)
        return [(p, b"{}") for p in ids]

    def rollouts(self, results: Mapping[str, Any]) -> Any:
        from workers.trainer.grpo import Rollouts

        out = Rollouts(tokens=len(results))
        for pid, r in results.items():
            self.payloads.append(bytes(r.payload))
            if pid not in self.issued:
                self.unknown.append(pid)
        return out

    def train(self, rollouts: Any, behaviour: Mapping[str, Any]) -> None:
        new = {n: t.clone() for n, t in self.current.items()}
        new["w"].view(-1)[self.trained % 64] += 1
        self.current = new
        self.trained += 1

    def weights(self) -> dict[str, Any]:
        return self.current


Attack = Callable[[Any, int, int, str, list[Any]], None]
"""``attack(attacker_client, step, version, state, honest_leases)``: run once per step, after the
honest Actor claimed its leases and before it settles them."""


OnLeases = Callable[[Any, int, int, str, list[Any]], None]
"""``on_leases(ledger, step, version, state, leases)``: what the stand-in Actor does with the leases it claimed."""


def claim_every_step(url: str, work: Recorder, stop: threading.Event, on_leases: OnLeases) -> None:
    """A stand-in Actor (``a0``, the Actor's Redis user) that claims every step the workload issued and
    hands its leases to ``on_leases`` (on Redis 6.2 an Actor's user cannot read the open-steps set,
    so it learns the step ids from the workload). It rides out whatever the run does."""
    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.ledger import Ledger
    from aurora_store.coordination.redisconn import connect

    client = connect(url)
    ledger, keys = Ledger(client, RUN), RunKeys(RUN)
    done: set[int] = set()
    registered = False
    try:
        while not stop.wait(0.02):
            try:
                if not registered:
                    ledger.register("a0")
                    registered = True
                for b in sorted(work.steps - done):
                    # What an Actor's user can read on any Redis: the step's own hash.
                    v = ledger.step_version(b)
                    raw = client.hget(keys.step(b), "state")
                    state = raw.decode() if raw else None
                    if v is None or state is None:
                        continue
                    if not ledger.heartbeat("a0", active=v, staged=v, active_state=state):
                        registered = False
                        break
                    status, leases = ledger.claim("a0", b, 16)
                    if status in ("closed", "no_step"):
                        done.add(b)
                    if status == "ok" and leases:
                        on_leases(ledger, b, v, state, leases)
            except Exception:  # noqa: BLE001 - the stand-in Actor rides out whatever the run does
                time.sleep(0.05)
    finally:
        client.close()


def _honest(url: str, attack: Attack, attacker_url: str, work: Recorder, stop: threading.Event, errors: list[str]) -> None:
    """The honest Actor: settles every lease it claims; ``attack`` runs once per step, before the settles."""
    from aurora_store.coordination.redisconn import connect

    attacker = connect(attacker_url)
    attacked: set[int] = set()

    def settle(ledger: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        if b not in attacked:
            attacked.add(b)
            try:
                attack(attacker, b, v, state, leases)
            except Exception as e:  # noqa: BLE001 - a refused command is the defence working
                errors.append(f"{type(e).__name__}: {str(e)[:120]}")
        for lease in leases:
            ledger.settle("a0", lease, v, state, b'{"honest": 1}')

    try:
        claim_every_step(url, work, stop, settle)
    finally:
        attacker.close()


def drive(tr: Any, actor: threading.Thread, stop: threading.Event, out: dict[str, Any]) -> None:
    """Run the Trainer ``tr`` beside the stand-in ``actor`` (stopped through ``stop``) until it ends or
    times out; ``out`` gains ``logs``, or ``error``: what stopped the Trainer is the finding."""

    def go() -> None:
        try:
            out["logs"] = tr.run()
        except BaseException as e:  # noqa: BLE001 - what stopped the Trainer is the finding
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    actor.start()
    t.start()
    t.join(TRAINER_TIMEOUT_S)
    if t.is_alive():
        tr.stop.set()
        t.join(30)
        out["error"] = out["error"] or TimeoutError(f"the Trainer did not finish {STEPS} steps in {TRAINER_TIMEOUT_S:.0f} s")
    stop.set()
    actor.join(10)


def _run_trainer(ctx: Context, name: str, attack: Attack) -> dict[str, Any]:
    """The real Trainer over :class:`Recorder`, as the Trainer's user, with the honest Actor and ``attack``."""
    from workers.common import Endpoints
    from workers.trainer import TrainerConfig
    from workers.trainer.trainer import Trainer

    srv = acl_server(ctx)
    work = Recorder()
    cfg = TrainerConfig(
        steps=STEPS,
        batch=2,
        group=2,
        checkpoint_every=0,
        eval_every=0,
        snapshot_every=0,
        poll_s=0.02,
        batch_deadline_s=3.0,
        min_batch_fraction=0.5,
    )
    tr = Trainer(Endpoints(f"file://{ctx.dir(name)}/run", srv["urls"]["trainer"], RUN), cfg, steps=work, weights=work)
    stop, errors = threading.Event(), list[str]()
    out: dict[str, Any] = {"work": work, "errors": errors, "error": None, "logs": None, "trainer": tr, "srv": srv}
    honest = threading.Thread(target=_honest, args=(srv["urls"]["actor"], attack, srv["urls"]["actor"], work, stop, errors), daemon=True)
    drive(tr, honest, stop, out)
    return out


def _judge(res: Result, out: dict[str, Any], what: str) -> None:
    work: Recorder = out["work"]
    absorbed = [p for p in work.payloads if MARK in p]
    if absorbed or work.unknown:
        res.outcome, res.applied = "applied", True
        res.how = f"the Trainer handed the workload {len(absorbed)} forged result(s), {len(work.unknown)} for unknown prompts"
    elif out["error"] is not None:
        e = out["error"]
        res.traceback = not hasattr(e, "__module__") or not type(e).__module__.startswith("aurora_store")
        res.outcome = "failed"
        res.how = f"the Trainer stopped: {type(e).__name__}: {str(e)[:120]}"
    elif out["logs"] is None or len(out["logs"]) != STEPS:
        res.outcome, res.how = "failed", f"the Trainer finished {len(out['logs'] or [])} of {STEPS} steps"
    else:
        res.outcome = "refused"
        said = f"; attacker saw: {out['errors'][0][:60]}" if out["errors"] else ""
        res.how = f"{what}; {STEPS} steps, nothing forged absorbed{said}"


def _result_json(prompt: str, actor: str, token: int, version: int, state: str) -> str:
    now = int(time.time() * 1000)
    return json.dumps([prompt, actor, token, version, now, now - 5, 1, state])


def _hset_results(ctx: Context, res: Result) -> None:
    """HSET a result for a prompt leased to another Actor, as SETTLE would have written it."""
    from aurora_store.coordination.keys import RunKeys

    keys = RunKeys(RUN)

    def attack(r: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        p = leases[0].prompt
        r.hset(keys.step(b, "done"), p, "a0")
        r.hset(keys.step(b, "results"), p, _result_json(p, "a0", leases[0].token, v, state))
        r.hset(keys.step(b, "results:payload"), p, MARK)

    _judge(res, _run_trainer(ctx, "ledger-hset", attack), "direct HSET on done/results/results:payload")


def _settle_for_another(ctx: Context, res: Result) -> None:
    """Read another Actor's lease, then settle it in that Actor's name through the settle script."""
    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.ledger import Lease, Ledger

    keys = RunKeys(RUN)

    def attack(r: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        raw = r.hgetall(keys.step(b, "lease"))  # prompt -> actor|token|expiry|leased[|claim hash]
        for prompt, value in raw.items():
            p = prompt.decode()
            actor, token, expiry = value.decode().split("|")[:3]
            forged = Lease(p, int(token), v, state, 2, int(expiry), b"", step=b)
            Ledger(r, RUN).settle(actor, forged, v, state, MARK)

    _judge(res, _run_trainer(ctx, "ledger-settle-another", attack), "EVALSHA of SETTLE naming the lease's Actor")


def _unknown_prompt(ctx: Context, res: Result) -> None:
    """A well-formed result for a prompt id the step never had."""
    from aurora_store.coordination.keys import RunKeys

    keys = RunKeys(RUN)

    def attack(r: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        p = f"nope-{b}"
        r.hset(keys.step(b, "done"), p, "a0")
        r.hset(keys.step(b, "results"), p, _result_json(p, "a0", 1, v, state))
        r.hset(keys.step(b, "results:payload"), p, MARK)

    _judge(res, _run_trainer(ctx, "ledger-unknown", attack), "a result for an unknown prompt id")


def _malformed(ctx: Context, res: Result) -> None:
    """Results entries that are not what SETTLE writes: not JSON, JSON of the wrong shape."""
    from aurora_store.coordination.keys import RunKeys

    keys = RunKeys(RUN)

    def attack(r: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        for i, junk in enumerate((b"{not json", b'{"a": 1}', b"[1, 2]")):
            p = f"junk-{b}-{i}"
            r.hset(keys.step(b, "done"), p, "a0")
            r.hset(keys.step(b, "results"), p, junk)
            r.hset(keys.step(b, "results:payload"), p, MARK)

    _judge(res, _run_trainer(ctx, "ledger-malformed", attack), "malformed results entries")


def _client_pause(ctx: Context, res: Result) -> None:
    """``CLIENT PAUSE 2147483647 ALL`` (and ``CLIENT KILL``) as the read-only user, on a server of its own
    (stopped at once if the pause takes: applied is judged by the admin's PING timing out)."""
    from aurora_store.coordination.redisconn import connect

    srv = acl_server(ctx)
    ro = connect(srv["urls"]["readonly"])
    refused = []
    for cmd in (("CLIENT", "PAUSE", "2147483647", "ALL"), ("CLIENT", "KILL", "SKIPME", "yes")):
        try:
            ro.execute_command(*cmd)
        except Exception as e:  # noqa: BLE001 - NOPERM is what we want
            refused.append(" ".join(cmd[:2]) if "NOPERM" in str(e).upper() or "permission" in str(e).lower() else "")
        else:
            refused.append("")
    ro.close()
    try:
        srv["admin"].ping()
        frozen = False
    except Exception:  # noqa: BLE001 - a timeout: the server is paused
        frozen = True
    if frozen:
        res.outcome, res.applied, res.how = "applied", True, "the read-only user paused the server: PING timed out"
        srv["server"].stop()
    elif all(refused):
        res.outcome, res.how = "refused", "NOPERM for CLIENT PAUSE and CLIENT KILL as aurora-readonly"
    else:
        res.outcome, res.how = (
            "failed",
            f"accepted from aurora-readonly: {[c for c, ok in zip(('PAUSE', 'KILL'), refused, strict=True) if not ok]}",
        )


def _valid_honest(ctx: Context, res: Result) -> None:
    """Control: with no attack the Trainer finishes and absorbs the honest Actor's results."""

    def attack(r: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        return None

    out = _run_trainer(ctx, "ledger-valid", attack)
    work: Recorder = out["work"]
    if out["error"] is None and out["logs"] is not None and len(out["logs"]) == STEPS and work.payloads:
        res.outcome, res.how = "accepted", f"{STEPS} steps, {len(work.payloads)} honest results absorbed"
    else:
        res.outcome = "failed"
        res.how = f"error {out['error']!r}, {len(work.payloads)} results"


LEDGER_CASES = [
    Case("ledger:hset-results-with-actor-credential", "ledger", "refuse", _hset_results, quick=True),
    Case("ledger:settle-another-actors-lease", "ledger", "refuse", _settle_for_another),
    Case("ledger:result-for-unknown-prompt", "ledger", "refuse", _unknown_prompt),
    Case("ledger:malformed-results", "ledger", "refuse", _malformed),
    Case("redis:client-pause-as-readonly", "ledger", "refuse", _client_pause, quick=True),
    Case("valid:ledger-honest-results-absorbed", "control", "accept", _valid_honest),
]
