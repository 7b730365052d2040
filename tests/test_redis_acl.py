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
