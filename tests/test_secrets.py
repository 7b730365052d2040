"""Secrets stay secret (issue 13, point 5).

The fast tests cover the pieces: URL, option and text redaction, the reprs of
config objects, ``--redis`` from the environment and ``--redis-password-file``,
and logging (``-v`` leaves vendor loggers at INFO; every record is masked).

The slow one runs the system demo (Trainer, Relay, two Actors as processes)
against a redis-server whose only user has a password and an S3 server
reached with non-default keys and a session token, then scans every place a
secret could leak to: the argv of every process the test started (read
from /proc while they run), every log file, every object of the store and of
the mirror, every Redis key and stream entry, and what the demo printed. The
scanner is shown to find a secret planted on purpose in each of those.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from aurora_store.coordination.redisconn import connect, redis_child_env, resolve_redis_url
from aurora_store.errors import ConfigError
from aurora_store.options import add_common_args
from aurora_store.redact import (
    MASK,
    RedactingFilter,
    redact_options,
    redact_text,
    redact_url,
    register_secret,
)
from aurora_store.testing.wait import wait_until

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# the pieces


def test_redact_url_masks_the_password_and_secret_query_values() -> None:
    assert redact_url("redis://trainer:s3cr%40t@10.0.0.1:6379/0") == "redis://trainer:***@10.0.0.1:6379/0"
    assert redact_url("rediss://:pw-only-1@host/2") == "rediss://:***@host/2"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redact_url("unix:///tmp/r.sock?db=0&password=hunter22") == "unix:///tmp/r.sock?db=0&password=***"
    assert "sig-value" not in redact_url("https://b.s3.amazonaws.com/k?X-Amz-Signature=sig-value&X-Amz-Expires=60")
    assert redact_url("s3://bucket/run") == "s3://bucket/run"


def test_redact_options_and_text() -> None:
    opts = {
        "key": "AKIAEXAMPLE",
        "secret": "wJalr",
        "token": "FQo",
        "anon": False,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "aws_session_token": "tok"},
    }
    out = redact_options(opts)
    assert out["key"] == out["secret"] == out["token"] == out["client_kwargs"]["aws_session_token"] == MASK
    assert out["anon"] is False and out["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"
    assert opts["secret"] == "wJalr"  # a copy
    text = "cannot reach redis://a:pass-word-1@h:1/0 (x-amz-security-token: SESSIONTOKEN123)"
    assert redact_text(text, secrets=["SESSIONTOKEN123"]) == "cannot reach redis://a:***@h:1/0 (x-amz-security-token: ***)"
    register_secret("registered-secret-42")
    assert "registered-secret-42" not in redact_text("it was registered-secret-42, really")


def test_reprs_of_configs_hide_urls_passwords_and_options() -> None:
    from aurora_tools.demo.system import DemoConfig
    from workers.common import Endpoints
    from workers.relay.config import RelayConfig

    pw = "repr-pass-" + secrets.token_hex(4)
    ep = Endpoints("s3://b/run", f"redis://u:{pw}@h:6379/0", "run", {"secret": "opt-secret-1", "key": "AKIA1"})
    relay = RelayConfig(
        origin="s3://o/r", mirror="s3://m/r", redis=f"redis://u:{pw}@h/0", run="r", region="eu", origin_options={"secret": "opt-secret-1"}
    )
    demo = DemoConfig(redis=f"redis://u:{pw}@h/0")
    for obj in (ep, relay, demo):
        shown = repr(obj) + str(obj)
        assert pw not in shown and "opt-secret-1" not in shown, shown
        assert "redis://u:***@h" in shown


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_args(p)
    return p.parse_args(argv)


def test_redis_from_the_environment_and_a_password_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pw = tmp_path / "redis.pw"
    pw.write_text("p@ss/w:rd-1\n")
    monkeypatch.delenv("AURORA_REDIS_URL", raising=False)
    monkeypatch.delenv("AURORA_REDIS_PASSWORD_FILE", raising=False)
    with pytest.raises(SystemExit):  # neither flag nor environment: argparse says --redis is required
        _parse(["--store", "x", "--run", "r"])
    # Either order: the password is folded into the URL, percent-encoded.
    for argv in (
        ["--redis", "redis://actor@h:1/0", "--redis-password-file", str(pw)],
        ["--redis-password-file", str(pw), "--redis", "redis://actor@h:1/0"],
    ):
        a = _parse(["--store", "x", "--run", "r", *argv])
        assert a.redis == "redis://actor:p%40ss%2Fw%3Ard-1@h:1/0"
    monkeypatch.setenv("AURORA_REDIS_URL", "redis://actor@h:1/0")
    assert _parse(["--store", "x", "--run", "r"]).redis == "redis://actor@h:1/0"
    monkeypatch.setenv("AURORA_REDIS_PASSWORD_FILE", str(pw))
    assert resolve_redis_url(None) == "redis://actor:p%40ss%2Fw%3Ard-1@h:1/0"
    assert resolve_redis_url("redis://u:given@h/0") == "redis://u:given@h/0"  # a URL's own password wins
    with pytest.raises(ConfigError, match="password file") as e:
        resolve_redis_url(None, str(tmp_path / "absent"))
    assert "p@ss" not in str(e.value)
    assert redis_child_env("redis://actor@h:1/0", str(pw)) == {
        "AURORA_REDIS_URL": "redis://actor@h:1/0",
        "AURORA_REDIS_PASSWORD_FILE": str(pw),
    }
    with pytest.raises(ConfigError, match="must start with") as e2:
        connect("http://u:pw-in-a-bad-url@h/0")
    assert "pw-in-a-bad-url" not in str(e2.value)


def test_the_filter_masks_messages_arguments_and_tracebacks() -> None:
    register_secret("filter-secret-77")
    rec = logging.LogRecord("botocore", logging.INFO, __file__, 1, "header %s url %s", ("filter-secret-77", "redis://u:pw-12345@h/0"), None)
    try:
        raise RuntimeError("boom filter-secret-77")
    except RuntimeError:
        rec.exc_info = sys.exc_info()
    RedactingFilter().filter(rec)
    text = logging.Formatter().format(rec)
    assert "filter-secret-77" not in text and "pw-12345" not in text and "boom ***" in text


_LOGGING_PROBE = """
import logging, os, sys
from workers.process import setup_logging
setup_logging("probe", verbose=True, debug_loggers=sys.argv[1:])
logging.getLogger("botocore.endpoint").debug("botocore debug: x-amz-security-token %s", os.environ["AWS_SESSION_TOKEN"])
logging.getLogger("s3fs").debug("s3fs debug line")
logging.getLogger("urllib3.connectionpool").debug("urllib3 debug line")
logging.getLogger("aurora.actor").debug("aurora debug line")
logging.getLogger("aurora.actor").info("connecting to redis://actor:%s@h/0, secret %s", "pw-logged-9", os.environ["AWS_SECRET_ACCESS_KEY"])
"""


@pytest.mark.slow
def test_verbose_keeps_vendor_loggers_at_info_and_masks_every_record() -> None:
    token, secret = "TOKEN" + secrets.token_hex(12), "SECRET" + secrets.token_hex(12)
    env = dict(os.environ, AWS_SESSION_TOKEN=token, AWS_SECRET_ACCESS_KEY=secret, PYTHONPATH=str(REPO))
    env.pop("AURORA_DEBUG_LOGGERS", None)

    def run(*asked: str) -> str:
        p = subprocess.run([sys.executable, "-c", _LOGGING_PROBE, *asked], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert p.returncode == 0, p.stderr
        return p.stderr

    out = run()
    assert "aurora debug line" in out  # -v: Aurora's own loggers at DEBUG
    assert "botocore debug" not in out and "s3fs debug" not in out and "urllib3 debug" not in out
    assert "pw-logged-9" not in out and secret not in out and "redis://actor:***@h/0" in out
    out = run("botocore", "s3fs")  # asked for by name: shown, but masked
    assert "botocore debug" in out and "s3fs debug line" in out and "urllib3 debug" not in out
    assert token not in out and "x-amz-security-token ***" in out


# ---------------------------------------------------------------------------
# the whole system, scanned


def _descendants(root: int) -> set[int]:
    """Pids of every live descendant of ``root`` (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out |= frontier
    return out


class ArgvWatcher:
    """Records the argv of every descendant of this process, polled until stopped."""

    def __init__(self, poll_s: float = 0.1) -> None:
        self.poll_s = poll_s
        self.argvs: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="argv-watcher", daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            self.sweep(me)
            self._stop.wait(self.poll_s)

    def sweep(self, root: int | None = None) -> None:
        for pid in _descendants(os.getpid() if root is None else root):
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if raw:
                self.argvs.setdefault(pid, raw.replace(b"\0", b" ").decode("utf-8", "replace"))

    def __enter__(self) -> ArgvWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _redis_texts(client: Any) -> Iterable[tuple[str, bytes]]:
    """(where, bytes) for every key name and value of every key (strings, hashes, lists, sets, zsets, streams)."""
    for key in client.scan_iter(count=500):
        kind = client.type(key).decode()
        name = key.decode("utf-8", "replace")
        yield f"redis key name {name}", key
        if kind == "string":
            parts = [client.get(key) or b""]
        elif kind == "hash":
            parts = [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == "list":
            parts = client.lrange(key, 0, -1)
        elif kind == "set":
            parts = list(client.smembers(key))
        elif kind == "zset":
            parts = client.zrange(key, 0, -1)
        elif kind == "stream":
            parts = [x for _eid, fields in client.xrange(key) for kv in fields.items() for x in kv]
        else:
            parts = []
        for p in parts:
            yield f"redis {kind} {name}", p if isinstance(p, bytes) else str(p).encode()


def _file_texts(root: Path) -> Iterable[tuple[str, bytes]]:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            yield f"file {p}", p.read_bytes()


def _s3_texts(client: Any, bucket: str) -> Iterable[tuple[str, bytes]]:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            yield (
                f"s3://{bucket}/{obj['Key']}",
                obj["Key"].encode() + b"\n" + client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read(),
            )


def scan(secret_values: dict[str, str], sources: Iterable[tuple[str, bytes]]) -> list[str]:
    """Where each secret appears, in clear or percent-encoded: ``["<secret name> in <where>", ...]``."""
    from urllib.parse import quote

    needles = {name: {v.encode(), quote(v, safe="").encode()} for name, v in secret_values.items()}
    found = []
    for where, data in sources:
        for name, forms in needles.items():
            if any(f in data for f in forms):
                found.append(f"{name} in {where}")
    return found


@pytest.mark.slow
@pytest.mark.server
def test_demo_with_a_password_and_s3_keys_leaks_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    import redis

    from aurora_store.testing.servers import RedisServer, S3Server
    from aurora_tools.demo.system import DemoConfig, run_system_demo

    redis_pw = "rpw-" + secrets.token_urlsafe(18)
    s3_key_id = "AKIA" + secrets.token_hex(8).upper()
    s3_secret = "s3sec-" + secrets.token_urlsafe(24)
    s3_token = "s3tok-" + secrets.token_urlsafe(32)
    secret_values = {"redis password": redis_pw, "S3 secret key": s3_secret, "S3 session token": s3_token, "S3 access key id": s3_key_id}
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(redis_pw + "\n")
    pw_file.chmod(0o600)
    workdir = tmp_path / "demo"
    printed: list[str] = []

    with ArgvWatcher() as argv, RedisServer() as rs, S3Server(process=True) as s3:
        # The only way in: a user with a password (the default user is switched off).
        boot = redis.Redis(host="127.0.0.1", port=rs.port)
        boot.execute_command("ACL", "SETUSER", "aurora", "on", f">{redis_pw}", "~*", "&*", "+@all")
        boot.execute_command("ACL", "SETUSER", "default", "off")
        boot.close()
        for k, v in {
            "AWS_ACCESS_KEY_ID": s3_key_id,
            "AWS_SECRET_ACCESS_KEY": s3_secret,
            "AWS_SESSION_TOKEN": s3_token,
            "AWS_ENDPOINT_URL": s3.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        for k in ("AURORA_REDIS_URL", "AURORA_REDIS_PASSWORD_FILE", "AURORA_DEBUG_LOGGERS"):
            monkeypatch.delenv(k, raising=False)
        client = boto3.client("s3", endpoint_url=s3.endpoint)
        bucket = "secrets-" + secrets.token_hex(4)
        client.create_bucket(Bucket=bucket)
        url = f"redis://aurora@127.0.0.1:{rs.port}/0"
        cfg = DemoConfig(
            steps=2,
            batch=4,
            group=2,
            actors_relay=1,
            actors_origin=0,
            kill_at=-1,
            join_at=-1,
            snapshot_every=2,
            store=f"s3://{bucket}/run",
            redis=url,
            redis_password_file=str(pw_file),
            run="secrets",
            workdir=str(workdir),
            display=True,
            mirror_grace_s=0.5,
            tiny_hidden=64,
            tiny_intermediate=192,
        )
        res = run_system_demo(cfg, say=lambda *a, **k: printed.append(" ".join(map(str, a))))
        argv.sweep()
        assert len(res.logs) == 2 and res.bit_identical, res.mismatches
        assert len(argv.argvs) >= 3, argv.argvs  # the Relay, the Actor, the S3 server (and redis-server)

        admin = connect(resolve_redis_url(url, str(pw_file)))
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=rs.port).get("x")  # the password was needed

        def sources() -> Iterable[tuple[str, bytes]]:
            yield from ((f"argv of pid {pid}", a.encode()) for pid, a in sorted(argv.argvs.items()))
            yield from _file_texts(workdir)  # logs, the file mirror, the local copy of the run
            yield from _s3_texts(client, bucket)
            yield from _redis_texts(admin)
            yield from (("demo output", line.encode()) for line in printed)

        leaks = scan(secret_values, sources())
        assert not leaks, leaks
        assert any("redis://aurora:***@" in line or "redis://aurora@" in line for line in printed), printed

        # The scanner is not blind: a secret planted in each kind of place is found there.
        planted = "planted-" + secrets.token_hex(8)
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--redis=redis://x:{planted}@h/0"])
        try:

            def seen() -> bool:
                argv.sweep()
                return any(planted in a for a in argv.argvs.values())

            wait_until(seen, "the planted argv")
            (workdir / "logs" / "planted.log").write_text(f"oops {planted}\n")
            client.put_object(Bucket=bucket, Key="run/planted.bin", Body=planted.encode())
            admin.xadd("aurora:{secrets}:events", {"kind": "note", "text": planted})
            admin.hset("aurora:{secrets}:planted", "f", planted)
            found = scan({"planted": planted}, sources())
        finally:
            sleeper.kill()
            sleeper.wait()
        for where in ("argv of pid", "planted.log", f"s3://{bucket}/run/planted.bin", "redis stream", "redis hash"):
            assert any(where in f for f in found), (where, found)
        admin.close()
