"""Every option and environment variable: declared once, listed in docs/OPTIONS.md, and each one taking effect.

Each ``AURORA_*`` variable the page lists is set and shown to change the
resolved config of its command (through the real ``aurora`` parser and the
worker's ``config_from_args``); for a variable with a flag, a ``--config``
file beats it and the flag beats the file. A variable that is listed but
checked by none of the tests below fails :func:`test_every_listed_variable_is_checked`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aurora_store.config import Declared, from_env
from aurora_store.options import debug_logger_names
from aurora_tools.cli import config_file, options_doc
from aurora_tools.cli.main import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md"
MIB = 1 << 20

BASE = {
    "trainer": ["--store", "file:///tmp/r", "--redis", "redis://127.0.0.1:1/0", "--run", "r"],
    "actor": ["--store", "file:///tmp/r", "--redis", "redis://127.0.0.1:1/0", "--run", "r"],
    "relay": ["--store", "file:///tmp/o", "--redis", "redis://127.0.0.1:1/0", "--run", "r", "--region", "eu", "--mirror", "file:///tmp/m"],
    "follow": ["--store", "file:///tmp/r", "--out", "/tmp/served"],
}

#: Two values for options whose type alone does not give valid ones: (a, b), a != b, a not the default.
SAMPLES: dict[str, tuple[Any, Any]] = {
    "actor_id": ("a-one", "a-two"),
    "region": ("eu", "us"),
    "mirror": ("file:///tmp/m1", "file:///tmp/m2"),
    "min_batch_fraction": (0.5, 0.25),
    "momentum": (0.5, 0.25),
    "device": ("cuda:1", "cuda:2"),
    "activation": ("swap", "auto"),
    "serve_dtype": ("fp8-block128", "bf16"),
    "dtype": ("float32", "bfloat16"),
    "index_encodings": (("leb128",), ("u32", "u64")),
    "value_modes": (("new",), ("xor",)),
    "codecs": (("none",), ("zstd",)),
    "format": (1, 2),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for var in list(os.environ):
        if var.startswith("AURORA_"):
            monkeypatch.delenv(var)


def _samples(name: str, tp: Any, default: Any, choices: tuple[str, ...] | None) -> tuple[Any, Any]:
    """Two valid values of an option, the first not its default."""
    if name in SAMPLES:
        return SAMPLES[name]
    base = typing.get_args(tp)[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    if choices:
        other = next(c for c in choices if c != default)
        return other, default if default is not None else next(c for c in choices if c != other)
    if base is bool:
        return (not default), bool(default)
    if base is int:
        d = default or 0
        return d + 1, d + 2
    if base is float:
        d = default or 0.0
        return d + 0.5, d + 1.5
    return "v-one", "v-two"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def parse(*argv: str) -> argparse.Namespace:
    """What ``aurora`` parses (as :func:`aurora_tools.cli.main.main` does)."""
    from aurora_tools.cli import run_cmds

    fills = {
        "trainer": run_cmds.add_trainer_arguments,
        "actor": run_cmds.add_actor_arguments,
        "relay": run_cmds.add_relay_arguments,
        "follow": run_cmds.add_follow_arguments,
    }
    return config_file.parse_worker_args(build_parser(list(argv)), list(argv), fills)


def resolve(command: str, args: argparse.Namespace, environ: dict[str, str]) -> Any:
    """The command's resolved config, with ``environ`` as its environment."""
    if command == "trainer":
        from workers.trainer.cli import config_from_args as trainer

        return trainer(args, environ)
    if command == "actor":
        from workers.actor.cli import config_from_args as actor

        return actor(args, environ=environ)
    if command == "follow":
        from workers.follow.cli import config_from_args as follow

        return follow(args, environ=environ)
    from workers.relay.cli import config_from_args as relay

    return relay(args, environ)


#: Variables checked by a test of their own below (not generated from a declaration).
CHECKED_APART = {
    "AURORA_REDIS_URL",
    "AURORA_REDIS_PASSWORD_FILE",
    "AURORA_DEBUG_LOGGERS",
    "AURORA_TRUST_KEYS",
    "AURORA_ACTOR_MIRROR_OPTIONS",
}


def _declared() -> list[tuple[str, Declared]]:
    return [(c.name, d) for c in options_doc.commands() for d in c.options() if d.env]


# -- the page --
def test_committed_page_is_the_generated_one() -> None:
    assert DOC.read_text() == options_doc.render(), "run: python -m aurora_tools.cli.options_doc > docs/OPTIONS.md"


def test_every_listed_variable_is_checked() -> None:
    listed = set(re.findall(r"`(AURORA_[A-Z0-9_]+)`", DOC.read_text()))
    assert listed == set(options_doc.variables())
    checked = {d.env for _c, d in _declared()} | CHECKED_APART
    checked |= {var for s in options_doc.settings() for _f, var in s.fields()}
    checked |= {w.env for w in options_doc.switches()}
    assert listed <= checked, f"listed but never checked: {sorted(listed - checked)}"
    assert {"AURORA_ACTOR_REGION", "AURORA_RELAY_HEARTBEAT_S"} <= listed


# -- the workers' options: environment < config file < flag --
@pytest.mark.parametrize(("command", "d"), _declared(), ids=lambda x: x if isinstance(x, str) else x.env)
def test_variable_takes_effect_and_file_and_flag_beat_it(command: str, d: Declared, tmp_path: Path) -> None:
    a, b = _samples(d.name, d.type, d.default, d.choices)
    scale = d.scale or 1
    expect: Callable[[Any], Any] = (lambda v: int(v * scale)) if d.scale else (lambda v: v)
    assert getattr(resolve(command, parse(command, *BASE[command]), {}), d.name) != expect(a)
    env = {d.env: _text(a)}
    assert getattr(resolve(command, parse(command, *BASE[command]), env), d.name) == expect(a), f"{d.env} ignored"
    if d.flag is None:
        return
    f = tmp_path / "run.toml"
    f.write_text(f"[{command}]\n{d.flag[2:]} = {_toml(b)}\n")
    assert getattr(resolve(command, parse(command, *BASE[command], "--config", str(f)), env), d.name) == expect(b), "file < env"
    flag = [d.flag] if isinstance(a, bool) else [d.flag, _text(a)]
    if isinstance(a, bool) and not a:
        return  # a store_true flag can only say yes
    got = resolve(command, parse(command, *BASE[command], "--config", str(f), *flag), env)
    assert getattr(got, d.name) == expect(a), "flag < file"


def test_actor_region_and_relay_heartbeat_from_the_environment() -> None:
    """The bug of issue 23: flags with the dataclass defaults hid these variables."""
    env = {"AURORA_ACTOR_REGION": "eu", "AURORA_RELAY_HEARTBEAT_S": "0.5"}
    assert resolve("actor", parse("actor", *BASE["actor"]), env).region == "eu"
    assert resolve("actor", parse("actor", *BASE["actor"], "--region", "us"), env).region == "us"
    assert resolve("relay", parse("relay", *BASE["relay"]), env).heartbeat_s == 0.5
    assert resolve("relay", parse("relay", *BASE["relay"], "--heartbeat-s", "1.5"), env).heartbeat_s == 1.5


# -- the variables every worker shares --
def test_redis_url_from_the_environment_file_and_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AURORA_REDIS_URL", "redis://env-host:6379/0")
    base = ["--store", "file:///tmp/r", "--run", "r"]
    assert parse("actor", *base).redis == "redis://env-host:6379/0"
    f = tmp_path / "run.toml"
    f.write_text('redis = "redis://file-host:6379/0"\n')
    assert parse("actor", *base, "--config", str(f)).redis == "redis://file-host:6379/0"
    assert parse("actor", *base, "--config", str(f), "--redis", "redis://flag-host:1/0").redis == "redis://flag-host:1/0"


def test_redis_password_file_from_the_environment(tmp_path: Path) -> None:
    from aurora_store.credentials import resolve_redis_url

    env_pw, flag_pw = tmp_path / "env.pw", tmp_path / "flag.pw"
    env_pw.write_text("from-env-123\n")
    flag_pw.write_text("from-flag-456\n")
    env = {"AURORA_REDIS_PASSWORD_FILE": str(env_pw)}
    assert resolve_redis_url("redis://h:1/0", None, env) == "redis://:from-env-123@h:1/0"
    assert resolve_redis_url("redis://h:1/0", str(flag_pw), env) == "redis://:from-flag-456@h:1/0"


def test_debug_loggers_from_the_environment_and_flags() -> None:
    assert debug_logger_names(None, {"AURORA_DEBUG_LOGGERS": "botocore, s3fs"}) == {"botocore", "s3fs"}
    assert debug_logger_names(["urllib3"], {"AURORA_DEBUG_LOGGERS": "botocore"}) == {"botocore", "urllib3"}
    assert debug_logger_names(None, {}) == frozenset()


def test_trust_keys_from_the_environment_file_and_flag(tmp_path: Path) -> None:
    keys = []
    for name in ("env", "file", "flag"):
        k = tmp_path / f"{name}.key"
        k.write_bytes(name.encode() * 40)
        keys.append(f"{name}={k}")
    env = {"AURORA_TRUST_KEYS": keys[0]}
    for command in ("actor", "relay"):
        assert resolve(command, parse(command, *BASE[command]), {}).trust is None
        assert resolve(command, parse(command, *BASE[command]), env).trust.key_ids == ("env",)
        f = tmp_path / "run.toml"
        f.write_text(f'trust-key = ["{keys[1]}"]\n')
        assert resolve(command, parse(command, *BASE[command], "--config", str(f)), env).trust.key_ids == ("file",)
        got = resolve(command, parse(command, *BASE[command], "--config", str(f), "--trust-key", keys[2]), env)
        assert got.trust.key_ids == ("flag",)


def test_actor_mirror_options_from_the_environment_and_flags() -> None:
    env = {"AURORA_ACTOR_MIRROR_OPTIONS": '{"anon": true, "endpoint_url": "http://env:9000"}'}
    args = parse("actor", *BASE["actor"], "--mirror", "file:///tmp/m")
    assert resolve("actor", args, env).mirror_options == {"anon": True, "endpoint_url": "http://env:9000"}
    args = parse("actor", *BASE["actor"], "--mirror", "file:///tmp/m", "--mirror-option", "anon=false")
    assert resolve("actor", args, env).mirror_options["anon"] is False


# -- the library's and the engines' settings, and the process switches --
@pytest.mark.parametrize("settings", options_doc.settings(), ids=lambda s: s.config.__name__)
def test_library_settings_take_effect(settings: options_doc.Settings) -> None:
    hints = typing.get_type_hints(settings.config)
    for f, var in settings.fields():
        default = None if f.default is dataclasses.MISSING else f.default
        scale = f.metadata.get("scale") if f.metadata else None
        a, _b = _samples(f.name, hints[f.name], default / scale if scale and default else default, None)
        got = getattr(from_env(settings.config, settings.prefix, {var: _text(a)}), f.name)
        assert got == (int(a * scale) if scale else a), f"{var} ignored"


def test_trainer_passes_the_encoder_variables_in() -> None:
    env = {"AURORA_CODECS": "none", "AURORA_ZSTD_LEVEL": "7", "AURORA_VALUE_MODES": ""}
    cfg = resolve("trainer", parse("trainer", *BASE["trainer"]), env)
    assert (cfg.options.codecs, cfg.options.zstd_level, cfg.options.value_modes) == (("none",), 7, ("new", "xor"))
    assert cfg.publish_config().options == cfg.options


@pytest.mark.parametrize("switch", options_doc.switches(), ids=lambda s: s.env)
def test_switches_take_effect(switch: Any) -> None:
    a, _b = _samples(switch.env, switch.type, switch.default, None)
    assert switch.get({}) == switch.default
    assert switch.get({switch.env: _text(a)}) == a != switch.default


# -- benchmark-only flags are not the production commands' --
@pytest.mark.parametrize("command", ["trainer", "actor"])
def test_production_commands_carry_no_benchmark_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser([command]).parse_args([command, "--help"])
    text = capsys.readouterr().out
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
    assert "--store" in flags and "--config" in flags
    bad = sorted(f for f in flags if f.startswith(("--workload", "--params", "--density")))
    assert not bad, f"aurora {command} --help lists benchmark flags: {bad}"


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("synthetic-trainer", ["--params", "--density", "--transfer", "--steps", "--streams", "--max-lag"]),
        ("synthetic-actor", ["--transfer", "--hold-weights", "--region", "--claim", "--streams"]),
    ],
)
def test_synthetic_commands_have_the_workers_and_the_workload_options(
    command: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser(["bench", command]).parse_args(["bench", command, "--help"])
    text = capsys.readouterr().out
    for flag in flags:
        assert flag in text
