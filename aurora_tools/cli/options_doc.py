"""``docs/OPTIONS.md``: every option and environment variable, generated from their declarations.

    python -m aurora_tools.cli.options_doc > docs/OPTIONS.md

The workers' options come from their config dataclasses
(:func:`aurora_store.config.declared`), the variables every worker shares
from :data:`aurora_store.options.SHARED`, the library's and the engines'
settings from their config dataclasses' fields (each field's docstring is
its description), and the process-wide switches from their
:class:`~aurora_store.config.Switch` declarations. ``tests/test_options.py``
checks that the committed page is this output and that every variable on
it takes effect.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aurora_store.config import Declared, Switch, declared, env_name

__all__ = ["Command", "Settings", "commands", "settings", "switches", "variables", "render", "main"]


@dataclass(frozen=True)
class Command:
    """A worker command and where its options are declared."""

    name: str
    """``trainer``, ``actor``, ``relay``, ``follow``."""
    config: type
    """Its config dataclass."""
    prefix: str
    """Prefix of its variables."""
    extra: Mapping[str, tuple[str, str]]
    """Variables of its own not on the dataclass: variable -> (flag, help)."""

    def options(self) -> tuple[Declared, ...]:
        return declared(self.config, self.prefix)


@dataclass(frozen=True)
class Settings:
    """A config dataclass of the library or an engine, read from the environment where it is used."""

    title: str
    config: type
    prefix: str
    where: str
    """Who reads it."""

    def fields(self) -> Iterator[tuple[dataclasses.Field[Any], str]]:
        """Its fields read from the environment, with their variables."""
        for f in dataclasses.fields(self.config):
            if f.init and not (f.metadata and f.metadata.get("env") is False):
                yield f, env_name(f, self.prefix)


def commands() -> tuple[Command, ...]:
    """``aurora trainer``, ``actor``, ``relay`` and ``follow`` (importing the workers)."""
    from aurora_store.options import SHARED
    from workers.actor.cli import MIRROR_OPTIONS_ENV
    from workers.actor.config import ENV_PREFIX as ACTOR
    from workers.actor.config import ActorConfig
    from workers.follow.follow import ENV_PREFIX as FOLLOW
    from workers.follow.follow import FollowConfig
    from workers.relay.config import ENV_PREFIX as RELAY
    from workers.relay.config import RelayConfig
    from workers.trainer.config import ENV_PREFIX as TRAINER
    from workers.trainer.config import TrainerConfig

    shared = dict(SHARED)
    actor = {
        **shared,
        MIRROR_OPTIONS_ENV: ("--mirror-option", "fsspec options of the mirror store, a JSON object (credentials off the command line)"),
    }
    trainer = {k: v for k, v in shared.items() if v[0] != "--trust-key"}
    return (
        Command("trainer", TrainerConfig, TRAINER, trainer),
        Command("actor", ActorConfig, ACTOR, actor),
        Command("relay", RelayConfig, RELAY, shared),
        Command("follow", FollowConfig, FOLLOW, shared),
    )


def settings() -> tuple[Settings, ...]:
    """The library's and the engines' config dataclasses read from the environment."""
    from aurora_store.codec.encode_options import EncodeOptions
    from aurora_store.coordination.ledger.core import LEDGER_ENV_PREFIX, LedgerConfig
    from aurora_store.coordination.redisconn import REDIS_ENV_PREFIX, RedisConfig
    from aurora_store.lineage.publish import PublishConfig
    from aurora_store.storage.base import ENV_PREFIX as STORE
    from aurora_store.storage.base import StoreConfig
    from workers.engine.torch_config import ENV_PREFIX as ENGINE
    from workers.engine.torch_config import EngineConfig
    from workers.engine.vllm_engine import ENV_PREFIX as VLLM
    from workers.engine.vllm_engine import VLLMConfig
    from workers.trainer.config import ENCODE_ENV_PREFIX

    return (
        Settings(
            "Encodings",
            EncodeOptions,
            ENCODE_ENV_PREFIX,
            "the Trainer (`aurora trainer`), `aurora delta create` and `aurora_store.Publisher`, resolved by each and passed to the encoder",
        ),
        Settings(
            "Publishing",
            PublishConfig,
            "AURORA_",
            "`aurora_store.Publisher` (`PublishConfig.from_env`); the Trainer takes streams and segment size from its own options",
        ),
        Settings("Object store", StoreConfig, STORE, "every process that opens a store"),
        Settings("Redis clients", RedisConfig, REDIS_ENV_PREFIX, "every process that connects to Redis"),
        Settings("Ledger", LedgerConfig, LEDGER_ENV_PREFIX, "every process that opens the run's ledger"),
        Settings("Torch engine", EngineConfig, ENGINE, "the Actor's `--engine torch`"),
        Settings("vLLM engine", VLLMConfig, VLLM, "the Actor's `--engine vllm`"),
    )


def switches() -> tuple[Switch, ...]:
    """The process-wide switches (importing the modules that declare them)."""
    from aurora_store.codec.kernels.jit import NO_JIT
    from aurora_store.coordination.commit import TRUST_PERSISTENCE
    from aurora_store.coordination.records import DIGEST_LOG
    from aurora_tools.synthetic.workload import SYNTHETIC_CACHE
    from aurora_tools.wan.proxy.workers import PROXY_WORKERS
    from workers.engine.vllm_config import VLLM_PREPARE
    from workers.process import TORCH_THREADS
    from workers.trainer.crash import CRASH_AT

    return (NO_JIT, TORCH_THREADS, DIGEST_LOG, TRUST_PERSISTENCE, CRASH_AT, VLLM_PREPARE, SYNTHETIC_CACHE, PROXY_WORKERS)


def variables() -> list[str]:
    """Every variable the page lists, in its order."""
    out: list[str] = []
    for c in commands():
        out += [d.env for d in c.options() if d.env] + list(c.extra)
    for s in settings():
        out += [var for _f, var in s.fields()]
    out += [s.env for s in switches()]
    return list(dict.fromkeys(out))


def _field_docs(cls: type) -> dict[str, str]:
    """The first sentence of the docstring under each field of ``cls`` (its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)):
            continue
        if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            text = " ".join(nxt.value.value.split())
            out[node.target.id] = text.split(". ")[0].rstrip(".")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "computed"
    v = f.default
    scale = f.metadata.get("scale") if f.metadata else None
    if v is None:
        return "none"
    if scale and isinstance(v, (int, float)):
        return f"{v / scale:g} MiB"
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def render() -> str:
    """The whole page."""
    lines = [
        "# Options and environment variables",
        "",
        "<!-- Generated by `python -m aurora_tools.cli.options_doc > docs/OPTIONS.md` from the declarations;",
        "     do not edit: tests/test_options.py checks this page against them. -->",
        "",
        "Each worker option is declared once, on the worker's config dataclass",
        "(`aurora_store.config.option`: name, type, default, help, variable). A",
        "worker resolves it as defaults < environment variable < `--config` file <",
        "command-line flag (`aurora_store.options.resolve`); flags have no default",
        "of their own. A variable marked with no flag is read from the environment",
        "only. Secrets are never flags: a Redis password is read from a file",
        "(`--redis-password-file`), store credentials from the environment or the",
        "`KEY=VALUE` storage options. Byte counts are set in MiB where the flag or",
        'variable says so. See docs/WORKERS.md, "Configuration files".',
    ]
    for c in commands():
        lines += ["", f"## `aurora {c.name}`", "", "| flag | variable | default | what |", "|---|---|---|---|"]
        for d in c.options():
            lines.append(
                f"| {f'`{d.flag}`' if d.flag else '(none)'} | {f'`{d.env}`' if d.env else '(none)'} | {_cell(d.shown_default)} | {_cell(d.help)} |"
            )
        for var, (flag, help) in c.extra.items():
            lines.append(f"| `{flag}` | `{var}` | none | {_cell(help)} |")
    lines += ["", "## Settings of the library and the engines", "", "Read from the environment where they are used; no flags."]
    for s in settings():
        docs = _field_docs(s.config)
        lines += [
            "",
            f"### {s.title} (`{s.config.__name__}`)",
            "",
            f"Read by {s.where}.",
            "",
            "| variable | default | what |",
            "|---|---|---|",
        ]
        for f, var in s.fields():
            lines.append(f"| `{var}` | {_cell(_default(f))} | {_cell(docs.get(f.name, ''))} |")
    lines += [
        "",
        "## Process switches",
        "",
        "Per process, not per run: debugging aids and measurement modes, declared beside their one reader.",
        "",
        "| variable | default | what |",
        "|---|---|---|",
    ]
    for w in switches():
        lines.append(f"| `{w.env}` | {'none' if w.default is None else w.default} | {_cell(w.help)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
