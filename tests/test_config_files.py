"""``aurora trainer|actor|relay --config FILE.toml``, the effective-configuration block and its record.

Parse-level tests go through the real ``aurora`` parser
(:func:`aurora_tools.cli.config_file.parse_worker_args` over
:func:`aurora_tools.cli.main.build_parser`) and the workers' own
``config_from_args``, so precedence is checked where the values are used:
flag > the worker's table > top level > environment > default. The record
is written into real ``file://`` run roots, once by the function and once by
a real ``aurora relay`` process against a real ``redis-server``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aurora_store.errors import ConfigError
from aurora_store.redact import MASK
from aurora_store.storage import open_store
from aurora_store.testing.wait import wait_until
from aurora_tools.cli import config_file
from aurora_tools.cli.main import build_parser

pytestmark = pytest.mark.usefixtures("_clean_env")


@pytest.fixture
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("AURORA_TRAINER_", "AURORA_ACTOR_", "AURORA_RELAY_")) or var in (
            "AURORA_REDIS_URL",
            "AURORA_REDIS_PASSWORD_FILE",
            "AURORA_OUTAGE_BUDGET_S",
            "AURORA_STREAMS",
            "AURORA_TRUST_KEYS",
            "AURORA_SIGN_KEY",
            "RANK",
        ):
            monkeypatch.delenv(var, raising=False)


def parse(*argv: str) -> argparse.Namespace:
    """What ``aurora`` parses (aurora_tools.cli.main.main does the same)."""
    from aurora_tools.cli import run_cmds

    fills = {"trainer": run_cmds.add_trainer_arguments, "actor": run_cmds.add_actor_arguments, "relay": run_cmds.add_relay_arguments}
    return config_file.parse_worker_args(build_parser(list(argv)), list(argv), fills)


def toml(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BASE = 'store = "file:///tmp/r"\nredis = "redis://127.0.0.1:1/0"\nrun = "r1"\n'


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line a bad config file gives (exit 2, no usage block, no traceback)."""
    with pytest.raises(SystemExit) as ei:
        parse(*argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- precedence --
def test_file_gives_options_flags_win_and_worker_tables_win_over_top_level(tmp_path: Path) -> None:
    from workers.trainer import config_from_args

    f = toml(
        tmp_path,
        BASE + 'steps = 7\nkl-coef = 0.01\nbatch = 2\nregion = "eu"\n'
        'resume = true\ncommit_via = "redis"\n[trainer]\nbatch = 4\ntask = "gsm8k"\n[actor]\nclaim = 3\n',
    )
    args = parse("trainer", "--config", f, "--steps", "9")
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.batch, cfg.kl_coef, cfg.task, cfg.resume, cfg.commit_via) == (9, 4, 0.01, "gsm8k", True, "redis")
    assert (args.store, args.run) == ("file:///tmp/r", "r1")  # required flags satisfied by the file
    assert args.config_file.path == f
    # The same file serves the Actor: region (top level) and its own table apply, the Trainer's keys do not.
    a = parse("actor", "--config", f)
    assert (a.region, a.claim, a.run) == ("eu", 3, "r1")
    assert not hasattr(a, "steps")


def test_file_over_environment_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.trainer import config_from_args

    base = ["trainer", "--store", "file:///tmp/r", "--redis", "redis://127.0.0.1:1/0", "--run", "r"]
    assert config_from_args(parse(*base)).eval_every == 5  # default
    monkeypatch.setenv("AURORA_TRAINER_EVAL_EVERY", "3")
    monkeypatch.setenv("AURORA_OUTAGE_BUDGET_S", "77")
    monkeypatch.setenv("AURORA_TRAINER_DEVICE", "cuda:1")
    cfg = config_from_args(parse(*base))
    assert (cfg.eval_every, cfg.outage_budget_s, cfg.device) == (3, 77.0, "cuda:1")  # environment
    f = toml(tmp_path, "eval_every = 2\noutage-budget-s = 55\n")
    cfg = config_from_args(parse(*base, "--config", f))
    assert (cfg.eval_every, cfg.outage_budget_s, cfg.device) == (2, 55.0, "cuda:1")  # file over env
    cfg = config_from_args(parse(*base, "--config", f, "--eval-every", "1", "--device", "cpu"))
    assert (cfg.eval_every, cfg.outage_budget_s, cfg.device) == (1, 55.0, "cpu")  # flag over file


def test_file_redis_over_environment_and_password_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AURORA_REDIS_URL", "redis://env-host:6379/0")
    pw = tmp_path / "redis.pw"
    pw.write_text("pw-from-file-123\n")
    f = toml(tmp_path, f'redis = "redis://file-host:6379/0"\nredis-password-file = "{pw}"\n')
    args = parse("relay", "--config", f, "--store", "file:///o", "--mirror", "file:///m", "--run", "r", "--region", "eu")
    assert args.redis == "redis://:pw-from-file-123@file-host:6379/0"
    args = parse(
        "relay",
        "--config",
        f,
        "--store",
        "file:///o",
        "--mirror",
        "file:///m",
        "--run",
        "r",
        "--region",
        "eu",
        "--redis",
        "redis://flag-host:1/0",
    )
    assert args.redis == "redis://:pw-from-file-123@flag-host:1/0"


def test_repeatable_options_lists_tables_and_flags_replace(tmp_path: Path) -> None:
    f = toml(
        tmp_path,
        BASE + 'trust-key = ["a.pem", "b.pem"]\nmirror-option = "anon=true"\n'
        '[actor]\nstorage-option = {endpoint_url = "http://h:9000", use_ssl = false}\ndevice = "cuda:0"\n',
    )
    a = parse("actor", "--config", f)
    assert a.trust_key == ["a.pem", "b.pem"] and a.mirror_option == ["anon=true"]
    assert a.storage_option == ["endpoint_url=http://h:9000", "use_ssl=false"]
    a = parse("actor", "--config", f, "--trust-key", "c.pem")
    assert a.trust_key == ["c.pem"]  # the flag replaces the file's list, it does not add to it


def test_actor_device_reaches_the_config_and_only_the_torch_engine(tmp_path: Path) -> None:
    from workers.actor.cli import config_from_args
    from workers.engine.factory import make_engine

    f = toml(tmp_path, BASE + '[actor]\ndevice = "cuda:1"\n')
    assert config_from_args(parse("actor", "--config", f)).device == "cuda:1"
    assert config_from_args(parse("actor", "--config", f, "--device", "cpu")).device == "cpu"
    with pytest.raises(ConfigError, match="torch engine"):
        config_from_args(parse("actor", "--config", f, "--engine", "vllm"))
    with pytest.raises(ConfigError, match="torch engine"):
        make_engine("vllm", None, device="cuda")  # type: ignore[arg-type]


def test_torch_engine_device_flag_wins_over_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.factory import make_engine
    from workers.tokenizer import CharTokenizer

    monkeypatch.setenv("AURORA_ENGINE_DEVICE", "cuda:2")
    assert make_engine("torch", CharTokenizer()).config.device == "cuda:2"  # no flag: the environment
    assert make_engine("torch", CharTokenizer(), device="cpu").config.device == "cpu"  # built, never loaded: no GPU needed


def test_example_run_file_serves_every_worker(tmp_path: Path) -> None:
    from workers.trainer import config_from_args

    example = str(Path(__file__).resolve().parents[1] / "infra" / "run.example.toml")
    pw = tmp_path / "redis.pw"
    pw.write_text("example-pw-1234\n")
    t = parse("trainer", "--config", example, "--redis-password-file", str(pw))
    cfg = config_from_args(t)
    assert (cfg.task, cfg.steps, cfg.kl_coef, cfg.device, cfg.resume, t.run) == ("gsm8k", 200, 0.01, "cuda", True, "r1")
    assert t.redis == "redis://aurora:example-pw-1234@127.0.0.1:6379/0"
    a = parse("actor", "--config", example, "--redis-password-file", str(pw))
    assert (a.region, a.device, a.trust_key, a.storage_option) == (
        "eu",
        "cuda",
        ["/etc/aurora/signing-key.pub.pem"],
        ["endpoint_url=http://127.0.0.1:9000"],
    )
    r = parse("relay", "--config", example, "--redis-password-file", str(pw))
    assert (r.region, r.mirror, r.gc_every_s, r.keep_snapshots) == ("eu", "s3://aurora-eu/runs/r1", 300.0, 2)


# -- errors --
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("stepz = 1\n", "unknown key 'stepz'"),
        ('[trainer]\nregion = "eu"\n', "unknown key 'region' in [trainer]"),
        ('steps = "ten"\n', "steps: expected an integer, got 'ten'"),
        ("lr = true\n", "lr: expected a number"),
        ('commit-via = "s3"\n', "commit-via: expected one of store, redis, got 's3'"),
        ('resume = "yes"\n', "resume: expected true or false"),
        ("[trainer]\nbatch = 1.5\n", "[trainer] batch: expected an integer"),
        ('trainer = "x"\n', "must be a table"),
        ("steps = \n", "not valid TOML"),
        ('config = "other.toml"\n', "cannot name another"),
    ],
)
def test_bad_file_is_one_line_naming_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, needle: str) -> None:
    f = toml(tmp_path, BASE + body)
    err = usage_error(capsys, "trainer", "--config", f)
    assert err.startswith("aurora trainer: error: --config ") and f in err and needle in err, err


def test_other_workers_table_is_not_read_and_a_missing_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = toml(tmp_path, BASE + "[relay]\nnonsense = 1\n")
    assert parse("trainer", "--config", f).run == "r1"
    err = usage_error(capsys, "trainer", "--config", str(tmp_path / "nope.toml"))
    assert "nope.toml" in err and "No such file" in err


# -- help --
def test_trainer_help_groups_options_by_concern() -> None:
    from aurora_tools.cli.run_cmds import add_trainer_arguments

    p = argparse.ArgumentParser(prog="aurora trainer")
    add_trainer_arguments(p)  # what `aurora trainer --help` prints
    text = p.format_help()
    titles = ["where the run lives:", "model and task:", "training:", "publishing:", "recovery:", "parallelism:", "config and logging:"]
    at = [text.index(t) for t in titles]
    assert at == sorted(at)
    model_part = text[text.index("model and task:") : text.index("training:")]
    for flag in ("--model", "--task", "--data", "--eval-data", "--eval-every", "--eval-size", "--reward-timeout-s"):
        assert flag in model_part
    assert "--nproc" in text[text.index("parallelism:") :]


# -- redaction and the record --
SECRETS_TOML = (
    'store = "file:///tmp/r"\nredis = "redis://u:hunter2secret@127.0.0.1:1/0"\nrun = "r1"\n'
    'sign-key = "/keys/sign.pem"\n'
    'storage-option = {key = "AKIAEXAMPLE1", secret = "s3cr3t-value", endpoint_url = "http://h:9000"}\n'
)


def test_printed_configuration_masks_secrets_and_keeps_paths(tmp_path: Path) -> None:
    f = toml(tmp_path, SECRETS_TOML)
    args = parse("trainer", "--config", f, "--steps", "20")
    p = argparse.ArgumentParser(add_help=False)
    from aurora_tools.cli.run_cmds import add_trainer_arguments

    add_trainer_arguments(p)
    opts = config_file.effective_options(p, args)
    block = config_file.render("trainer", opts, f)
    for secret in ("hunter2secret", "AKIAEXAMPLE1", "s3cr3t-value"):
        assert secret not in block
    assert opts["redis"] == f"redis://u:{MASK}@127.0.0.1:1/0"
    assert opts["storage-option"] == [f"key={MASK}", f"secret={MASK}", "endpoint_url=http://h:9000"]
    assert opts["sign-key"] == "/keys/sign.pem"  # a path, shown; its contents are never read here
    assert "  steps = 20" in block and f in block.splitlines()[0]
    unset = block.splitlines()[-1]
    # Options not given (no flag has a default of its own) are left to the environment or the defaults.
    assert unset.startswith("  # from the environment or the defaults: ") and " model," in unset and " batch," in unset
    assert "steps" not in unset


def test_record_written_create_only_masked_and_unique(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    f = toml(tmp_path, SECRETS_TOML.replace("file:///tmp/r", f"file://{root}") + 'region = "eu"\n')
    args = parse("relay", "--config", f, "--mirror", f"file://{tmp_path / 'mirror'}")
    from aurora_tools.cli.run_cmds import add_relay_arguments

    p = argparse.ArgumentParser(add_help=False)
    add_relay_arguments(p)
    keys = [config_file.announce("relay", p, args, {}) for _ in range(2)]
    assert all(k is not None and k.startswith("config/relay-") and k.endswith(".json") for k in keys)
    assert keys[0] != keys[1]
    store = open_store(f"file://{root}")
    assert sorted(store.list("config/")) == sorted(keys)  # type: ignore[type-var]
    raw = store.get(str(keys[0])).decode()
    for secret in ("hunter2secret", "AKIAEXAMPLE1", "s3cr3t-value"):
        assert secret not in raw
    rec = json.loads(raw)
    assert (rec["worker"], rec["id"], rec["run"], rec["config_file"]) == ("relay", "eu", "r1", f)
    assert rec["version"] and rec["pid"] == os.getpid() and rec["time"].endswith("Z")
    assert rec["options"]["region"] == "eu" and rec["options"]["redis"].startswith(f"redis://u:{MASK}@")
    assert "effective configuration" in capsys.readouterr().err


def test_record_that_cannot_be_written_is_one_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "plain-file"
    blocker.write_text("not a folder")
    args = argparse.Namespace(store=f"file://{blocker}/run", run="r", config_file=None, api_token="tok-very-secret")
    assert config_file.announce("trainer", None, args, {}) is None
    err = capsys.readouterr().err
    warn = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and "config/trainer-" in warn[0] and "Traceback" not in err
    assert "tok-very-secret" not in err and f"api-token = {json.dumps(MASK)}" in err  # masked by its name


@pytest.mark.server
def test_real_relay_start_records_its_configuration(tmp_path: Path, redis_url: str) -> None:
    origin, mirror = tmp_path / "origin", tmp_path / "mirror"
    origin.mkdir()
    f = toml(
        tmp_path,
        f'store = "file://{origin}"\nredis = "{redis_url}"\nrun = "cfg-run"\nsteps = 3\n'
        f'[relay]\nregion = "eu"\nmirror = "file://{mirror}"\ngc-every-s = 0\n',
    )
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "AURORA_STREAMS": "3"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aurora_tools.cli", "relay", "--config", f, "--heartbeat-s", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: list((origin / "config").glob("relay-*.json")) or proc.poll() is not None,
            "the Relay's configuration record",
            timeout=60,
            interval=0.1,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    records = list((origin / "config").glob("relay-*.json"))
    assert len(records) == 1, err
    rec = json.loads(records[0].read_text())
    assert (rec["worker"], rec["id"], rec["options"]["heartbeat-s"], rec["options"]["gc-every-s"]) == ("relay", "eu", 0.2, 0.0)
    # Options left unset are resolved from the environment in the record's "resolved" part.
    assert rec["options"]["streams"] is None and rec["resolved"]["streams"] == 3
    assert (rec["resolved"]["region"], rec["resolved"]["mirror"]) == ("eu", f"file://{mirror}")
    assert "aurora relay: effective configuration (--config " in err and "Traceback" not in err
    assert proc.returncode == 0, err
