"""infra/redis/aurora.acl: each role's Redis user does its work and nothing more.

The ACL file is rendered for one run and loaded into a real redis-server
(``ACL SETUSER``, line by line, as ``ACL LOAD`` would). The Actor's user
registers, claims, settles and records its digest, but a write to the
Trainer's hash, the epoch, the Trainer's digests or the origin stream is
refused (``NOPERM``), directly or through a ledger script. Read-only key
patterns (``%R~``) need Redis 7; on Redis 6.2 the test drops them (the file
says so), and then the Actor cannot read those keys either.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import string
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.exceptions as rx

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.versioned import record_versioned
from aurora_store.errors import CoordinationError
from aurora_store.testing.servers import RedisServer, redis_server_binary

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
ACL_FILE = REPO / "infra" / "redis" / "aurora.acl"
RUN = "acl-run"
H = "sha256:" + "a" * 64
PASSWORDS = {role: f"{role}-pw-{os.getpid()}-x9" for role in ("trainer", "actor", "relay", "readonly")}
ADMIN = ("acl-test-admin", "admin-pw-x9")


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _binary() -> tuple[str, tuple[int, ...]]:
    """A Redis >= 7 if the machine has one (read-only patterns), else the usual one.

    ``AURORA_TEST_ACL_REDIS``: a binary to use instead (to run the 6.2 path on a machine with 7).
    """
    forced = os.environ.get("AURORA_TEST_ACL_REDIS")
    if forced:
        return forced, _version(forced)
    for cand in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if cand and os.path.exists(cand) and _version(cand) >= (7, 0):
            return cand, _version(cand)
    b = redis_server_binary()
    return b, _version(b)


def render_acl(text: str, run: str, passwords: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(user, rules) per ``user`` line of the file, with ``${RUN}`` and ``${ROLE_PASSWORD_SHA256}`` filled (as envsubst would)."""
    values = {"RUN": run, **{f"{r.upper()}_PASSWORD_SHA256": hashlib.sha256(p.encode()).hexdigest() for r, p in passwords.items()}}
    out = []
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        line = string.Template(raw).substitute(values)
        tokens = line.split()
        assert tokens[0] == "user", line
        out.append((tokens[1], tokens[2:]))
    return out


def for_redis6(rules: list[str]) -> list[str]:
    """Redis 6.2 has neither read-only key patterns nor subcommand denials: drop them (less access, never more)."""
    return [t for t in rules if not t.startswith("%") and not (t.startswith("-") and "|" in t)]


def load_acl(server: RedisServer, run: str, version: tuple[int, ...]) -> Any:
    """Load infra/redis/aurora.acl for ``run`` (with PASSWORDS) into a fresh server: an admin client, to close."""
    boot = redis.Redis(host="127.0.0.1", port=server.port)
    boot.execute_command("ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "~*", "&*", "+@all")
    boot.close()
    admin = redis.Redis(host="127.0.0.1", port=server.port, username=ADMIN[0], password=ADMIN[1])
    for user, rules in render_acl(ACL_FILE.read_text(), run, PASSWORDS):
        admin.execute_command("ACL", "SETUSER", user, "reset", *(rules if version >= (7, 0) else for_redis6(rules)))
    return admin


@pytest.fixture(scope="module")
def acl_server() -> Iterator[tuple[RedisServer, tuple[int, ...]]]:
    binary, version = _binary()
    with RedisServer(binary) as server:
        load_acl(server, RUN, version).close()
        yield server, version


def _client(server: RedisServer, role: str) -> Any:
    return connect(f"redis://aurora-{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0")


@pytest.fixture(scope="module")
def prepared(acl_server: tuple[RedisServer, tuple[int, ...]]) -> tuple[RedisServer, tuple[int, ...]]:
    """The Trainer, as its own user, takes the run and opens step 1."""
    server, version = acl_server
    tr = _client(server, "trainer")
    keys = RunKeys(RUN)
    ledger = Ledger(tr, RUN)
    ledger.enter_epoch(1)
    ledger.fenced_hset(keys.trainer, {"head": "1", "head_state": H}, epoch=1)
    ledger.create_step(1, H, [(f"p{i}", f"prompt {i}".encode()) for i in range(4)], {}, group=1, lease_ms=60_000, epoch=1)
    tr.xadd(keys.events(), {"kind": "version", "version": "1"})
    record_versioned(tr, keys, keys.trainer_digests, "1", H, 1)
    tr.close()
    return server, version


def test_anonymous_access_is_refused(acl_server: tuple[RedisServer, tuple[int, ...]]) -> None:
    server, _ = acl_server
    anon = redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=2)
    with pytest.raises((rx.AuthenticationError, rx.NoPermissionError, rx.ResponseError, rx.ConnectionError)):
        anon.get(RunKeys(RUN).epoch)
    anon.close()


def test_actor_works_but_cannot_write_the_trainers_keys(prepared: tuple[RedisServer, tuple[int, ...]]) -> None:
    server, version = prepared
    keys = RunKeys(RUN)
    actor = _client(server, "actor")
    ledger = Ledger(actor, RUN)
    # Its own work: register, heartbeat its active version, claim, settle, record its digest.
    ledger.register("a1")
    assert ledger.heartbeat("a1", active=1, staged=1, active_state=H)
    status, leases = ledger.claim("a1", 1, 2)
    assert status == "ok" and len(leases) == 2
    assert ledger.settle("a1", leases[0], 1, H, b"result").reason == "accepted"
    record_versioned(actor, keys, keys.actor_digests, "a1|1", H, 1)
    record_versioned(actor, keys, keys.activations, "a1|1", "{}", 1)
    if version >= (7, 0):
        # Read only, but read: the head it follows, announcements, Relays' keys.
        assert actor.hget(keys.trainer, "head") == b"1"
        assert actor.xrange(keys.events())
        assert actor.get(keys.epoch) == b"1"
    # The Trainer's keys: refused, directly and through a ledger script.
    for write in (
        lambda: actor.hset(keys.trainer, "head", "99"),
        lambda: actor.hset(keys.trainer, "head_state", "sha256:" + "f" * 64),
        lambda: actor.set(keys.epoch, "999"),
        lambda: actor.incr(keys.epoch),
        lambda: actor.hset(keys.trainer_digests, "1", "sha256:" + "f" * 64),
        lambda: actor.xadd(keys.events(), {"kind": "version", "version": "2"}),
        lambda: actor.set(keys.relay("eu"), "file:///attacker"),
        lambda: actor.delete(keys.trainer),
        lambda: actor.hset("aurora:{other-run}:trainer", "head", "1"),
        lambda: actor.hset(keys.prefix + "state:trainer", "1", "sha256:" + "f" * 64),
    ):
        with pytest.raises(rx.NoPermissionError):
            write()
    with pytest.raises(CoordinationError, match="NoPermission|NOPERM|no permissions"):
        ledger.fenced_hset(keys.trainer, {"head": "99"}, epoch=99)
    with pytest.raises(CoordinationError, match="NoPermission|NOPERM|no permissions"):
        ledger.enter_epoch(99)
    for cmd in (("FLUSHALL",), ("CONFIG", "SET", "appendonly", "no"), ("ACL", "SETUSER", "aurora-actor", "~*")):
        with pytest.raises(rx.NoPermissionError):
            actor.execute_command(*cmd)
    actor.close()
    # Nothing the Actor tried changed the Trainer's view.
    admin = redis.Redis(host="127.0.0.1", port=server.port, username=ADMIN[0], password=ADMIN[1])
    assert admin.hget(keys.trainer, "head") == b"1"
    assert admin.get(keys.epoch) == b"1"
    assert admin.hget(keys.trainer_digests, "1") == H.encode()
    assert admin.get(keys.relay("eu")) is None
    admin.close()


def test_relay_and_readonly_users(prepared: tuple[RedisServer, tuple[int, ...]]) -> None:
    server, version = prepared
    keys = RunKeys(RUN)
    relay = _client(server, "relay")
    relay.set(keys.relay("eu"), "s3://mirror-eu/run", px=5000)
    relay.set(keys.relay_held("eu"), '{"versions": [1]}', px=5000)
    relay.xadd(keys.events("eu"), {"kind": "version", "version": "1"})
    for write in (
        lambda: relay.hset(keys.trainer, "head", "9"),
        lambda: relay.xadd(keys.events(), {"kind": "x"}),
        lambda: relay.set(keys.epoch, "9"),
    ):
        with pytest.raises(rx.NoPermissionError):
            write()
    relay.close()
    ro = _client(server, "readonly")
    if version >= (7, 0):
        assert ro.hget(keys.trainer, "head") == b"1"
        assert ro.get(keys.relay("eu")) == b"s3://mirror-eu/run"
    for write in (
        lambda: ro.hset(keys.trainer, "head", "9"),
        lambda: ro.set(keys.relay("eu"), "x"),
        lambda: ro.hset(keys.actor("a1"), "status", "dead"),
    ):
        with pytest.raises(rx.NoPermissionError):
            write()
    ro.close()


def test_a_password_file_reaches_the_server(
    prepared: tuple[RedisServer, tuple[int, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AURORA_REDIS_URL without a password plus AURORA_REDIS_PASSWORD_FILE: nothing secret on a command line."""
    server, _ = prepared
    pw = tmp_path / "actor.pw"
    pw.write_text(PASSWORDS["actor"] + "\n")
    pw.chmod(0o600)
    monkeypatch.setenv("AURORA_REDIS_URL", f"redis://aurora-actor@127.0.0.1:{server.port}/0")
    monkeypatch.setenv("AURORA_REDIS_PASSWORD_FILE", str(pw))
    client = connect()
    Ledger(client, RUN).register("a-env")  # logged in as the Actor: its work is allowed, the Trainer's not
    with pytest.raises(rx.NoPermissionError):
        client.hset(RunKeys(RUN).trainer, "head", "9")
    client.close()
    monkeypatch.setenv("AURORA_REDIS_PASSWORD_FILE", str(tmp_path / "missing"))
    from aurora_store.errors import ConfigError

    with pytest.raises(ConfigError, match="password file") as e:
        connect()
    assert PASSWORDS["actor"] not in str(e.value)


# Commands no role may run: each would let one credential freeze, cut, watch, reconfigure or
# wipe everyone (issue 24, hole 9). (command, needs Redis >= 7)
REFUSED: list[tuple[tuple[str, ...], bool]] = [
    (("CLIENT", "PAUSE", "10"), False),
    (("CLIENT", "PAUSE", "2147483647", "ALL"), True),
    (("CLIENT", "UNPAUSE"), False),
    (("CLIENT", "KILL", "ID", "999999"), False),
    (("CLIENT", "KILL", "127.0.0.1:1"), False),
    (("CLIENT", "LIST"), False),
    (("CLIENT", "NO-EVICT", "on"), False),
    (("CLIENT", "UNBLOCK", "1"), False),
    (("DEBUG", "SLEEP", "0"), False),
    (("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"), False),
    (("CONFIG", "RESETSTAT"), False),
    (("FLUSHALL",), False),
    (("FLUSHDB",), False),
    (("SWAPDB", "0", "1"), False),
    (("KEYS", "*"), False),
    (("MONITOR",), False),
    (("SLOWLOG", "GET"), False),
    (("ACL", "LIST"), False),
    (("ACL", "SETUSER", "aurora-actor", "+@all"), False),
    (("SCRIPT", "FLUSH"), False),
    (("SCRIPT", "KILL"), False),
    (("FUNCTION", "FLUSH"), True),
    (("FUNCTION", "DELETE", "x"), True),
    (("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', function() return 1 end)"), True),
    (("RESTORE", "aurora:{acl-run}:x", "0", "x"), False),
    (("SAVE",), False),
    (("BGSAVE",), False),
    (("REPLICAOF", "127.0.0.1", "1"), False),
    (("SHUTDOWN", "NOSAVE"), False),
]


@pytest.mark.parametrize("role", ["trainer", "actor", "relay", "readonly"])
def test_no_role_can_pause_kill_or_administer_redis(prepared: tuple[RedisServer, tuple[int, ...]], role: str) -> None:
    server, version = prepared
    for cmd, needs7 in REFUSED:
        if needs7 and version < (7, 0):
            continue
        client = _client(server, role)  # one connection each: a MONITOR let through would capture it
        with pytest.raises(rx.ResponseError) as e:
            client.execute_command(*cmd)
        # DEBUG: Redis 7 refuses it before the ACL unless enable-debug-command is set.
        assert isinstance(e.value, rx.NoPermissionError) or (cmd[0] == "DEBUG" and "DEBUG command not allowed" in str(e.value)), (
            cmd,
            e.value,
        )
        client.close()
    # What every role keeps: connection upkeep that affects only its own connection.
    client = _client(server, role)
    assert client.ping()
    assert client.execute_command("ECHO", "x") == b"x"
    assert client.execute_command("CLIENT", "SETNAME", f"aurora-{role}-test")
    assert client.execute_command("CLIENT", "GETNAME") == f"aurora-{role}-test".encode()
    assert int(client.execute_command("CLIENT", "ID")) > 0
    assert client.execute_command("CLIENT", "INFO")
    assert client.execute_command("SELECT", "0")
    assert client.time()
    client.close()
    # The server still serves everyone.
    admin = redis.Redis(host="127.0.0.1", port=server.port, username=ADMIN[0], password=ADMIN[1], socket_timeout=5)
    assert admin.ping() and admin.get(RunKeys(RUN).epoch) == b"1"
    admin.close()


class _StepClock:
    """A local clock whose every wait runs the next step of a script."""

    def __init__(self, play: Any) -> None:
        self.now, self.waits, self.play = 0.0, 0, play

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def wait(self, event: Any, timeout_s: float) -> bool:
        self.now += timeout_s
        self.waits += 1
        assert self.waits < 20, "the batch never completed"
        self.play(self.waits)
        return bool(event.is_set())


def test_the_actor_credential_cannot_settle_for_another_nor_inject_results(prepared: tuple[RedisServer, tuple[int, ...]]) -> None:
    """What the ACL cannot refuse (an Actor's user must write step keys for its scripts),
    the ledger does: a lease read from Redis does not settle, a result written directly is ignored."""
    import threading

    from aurora_store.coordination.ledger import Lease
    from workers.trainer.scheduling import Collected, collect_batch

    server, _ = prepared
    keys = RunKeys(RUN)
    tr = Ledger(_client(server, "trainer"), RUN)
    actor = _client(server, "actor")
    led = Ledger(actor, RUN)
    ids = [f"q{i}" for i in range(3)]
    tr.create_step(2, H, [(p, p.encode()) for p in ids], {}, group=1, lease_ms=60_000, version=1, epoch=1)
    led.register("a2")
    assert led.heartbeat("a2", active=1, staged=1, active_state=H)
    _, leases = led.claim("a2", 2, 3)
    assert len(leases) == 3
    # Read a2's lease of q0 (the credential reads every lease) and settle it in a2's name.
    who, token, expiry = actor.hget(keys.step(2, "lease"), "q0").decode().split("|")[:3]
    assert who == "a2"
    forged = Lease("q0", int(token), 1, H, 1, int(expiry), b"", step=2)
    assert led.settle("a2", forged, 1, H, b"stolen").reason == "stale_token"
    # Write a result for q1 with plain HSETs: the ACL lets it through (the settle script needs it) ...
    actor.hset(keys.step(2, "done"), "q1", "evil|1")
    actor.hset(keys.step(2, "results"), "q1", '["q1", "evil", 1, "1", "1", "0", 1, "' + H + '"]')
    actor.hset(keys.step(2, "results:payload"), "q1", b"forged")

    def play(n: int) -> None:
        if n == 1:
            # The Trainer took the forged q1 out and offered it again: a2's old lease of it is gone.
            got = [led.settle("a2", x, 1, H, b"honest").reason for x in leases]
            assert got == ["accepted", "not_leased", "accepted"], got
            _, again = led.claim("a2", 2, 3)
            assert [x.prompt for x in again] == ["q1"]
            assert led.settle("a2", again[0], 1, H, b"honest").accepted

    # ... and the Trainer, as its own user, ignores and counts it; a2's own settles go through.
    collected: dict[str, Any] = {}
    counts = Collected()
    closed = collect_batch(
        tr, 2, 1, 3, collected, [], counts, 60_000, 30.0, 1.0, threading.Event(), _StepClock(play), lambda: None,
        epoch=1, prompts=ids, state=H,
    )  # fmt: skip
    assert closed.reason == "complete"
    assert {p: (r.actor, r.payload) for p, r in collected.items()} == {p: ("a2", b"honest") for p in ids}
    assert counts.ignored == {"unproven": 1}
    actor.close()
    tr.r.close()


@pytest.mark.slow
def test_the_workers_run_under_their_own_users(tmp_path: Path) -> None:
    """The real Trainer, Relay and Actor processes, each logged in as its role (URL in the
    environment, password in a file), finish a run with no command or key refused."""
    import sys

    binary, version = _binary()
    if version < (7, 0):
        pytest.skip(f"the Actor reads the Trainer's head through a read-only pattern: needs Redis >= 7 ({binary} is {version})")
    run = "acl-workers"
    with RedisServer(binary) as server:
        admin = load_acl(server, run, version)
        store, mirror = f"file://{tmp_path / 'store'}", f"file://{tmp_path / 'mirror'}"
        base = dict(os.environ, AURORA_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
        base.pop("AURORA_REDIS_URL", None)
        cli = [sys.executable, "-m", "aurora_tools.cli"]

        def start(role: str, argv: list[str]) -> subprocess.Popen[bytes]:
            pw = tmp_path / f"{role}.pw"
            pw.write_text(PASSWORDS[role] + "\n")
            env = dict(base, AURORA_REDIS_URL=f"redis://aurora-{role}@127.0.0.1:{server.port}/0", AURORA_REDIS_PASSWORD_FILE=str(pw))
            return subprocess.Popen([*cli, *argv], env=env, cwd=REPO, stdout=open(tmp_path / f"{role}.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115

        procs = {
            "trainer": start(
                "trainer",
                ["trainer", "--store", store, "--run", run, "--steps", "3", "--batch", "4", "--group", "2", "--snapshot-every", "2"],
            ),
            "relay": start("relay", ["relay", "--store", store, "--mirror", mirror, "--run", run, "--region", "eu"]),
            "actor": start("actor", ["actor", "--store", store, "--run", run, "--region", "eu", "--id", "a1", "--mirror", mirror]),
        }
        try:
            rc = procs["trainer"].wait(timeout=300)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        logs = {role: (tmp_path / f"{role}.log").read_text(errors="replace") for role in procs}
        assert rc == 0, logs["trainer"][-3000:]
        assert procs["actor"].returncode == 0 and procs["relay"].returncode == 0, (logs["actor"][-2000:], logs["relay"][-2000:])
        assert re.search(r"a1 left: [1-9]\d* settled", logs["actor"]), logs["actor"][-2000:]
        assert "mirrored" in logs["relay"], logs["relay"][-2000:]
        denied = admin.execute_command("ACL", "LOG", "100")
        assert denied == [], denied
        for role, text in logs.items():
            assert PASSWORDS[role] not in text
        admin.close()
