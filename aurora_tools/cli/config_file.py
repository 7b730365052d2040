"""``--config FILE.toml`` of ``aurora trainer|actor|relay``, and the record of what a worker ran with.

The file rule (docs/WORKERS.md, "Configuration files"):

- keys are the workers' long option names, with dashes or underscores
  (``kl-coef = 0.01``, ``trust-key = ["a.pem"]``); a repeatable option takes a
  list (or one value), a ``KEY=VALUE`` option (``storage-option``) a list of
  strings or a table;
- a top-level key applies to every worker that has the option and is skipped
  by the others (``region`` serves the Actor and the Relay, not the Trainer),
  so one file can serve a whole run; a top-level key no worker has is an error;
- ``[trainer]``, ``[actor]``, ``[relay]`` and ``[follow]`` hold one worker's keys and win over
  the top level; a key in this worker's table that is not its option is an
  error; the other workers' tables are not read;
- precedence: command-line flag > this worker's table > top level > the
  environment (for the options whose default reads it) > the built-in default.

The file's values become the parser's defaults before the command line is
parsed, so argparse itself keeps flag over file; values are checked here
against the option's ``type``, ``choices`` and action, with one-line errors
naming the file and the key.

At start each worker prints its effective options (:func:`render`, secrets
masked by :mod:`aurora_store.redact`) and writes them, masked, as a create-only
``config/<worker>-<UTC time>-<pid>-<random>.json`` into the run root
(:func:`write_record`): the run documents every start, resumes included. A
store that refuses or does not answer costs one warning line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora_store import __version__
from aurora_store.errors import AuroraError, ConfigError
from aurora_store.redact import MASK, is_secret_name, redact_text, redact_url

__all__ = [
    "WORKERS",
    "CONFIG_PREFIX",
    "ConfigFile",
    "parse_worker_args",
    "load_config_file",
    "effective_options",
    "resolved",
    "render",
    "config_record",
    "record_key",
    "write_record",
    "announce",
]

WORKERS = ("trainer", "actor", "relay", "follow")
"""The subcommands that take ``--config`` (and the names of the file's tables)."""

CONFIG_PREFIX = "config/"
"""Where the records of the workers' starts go, under the run root."""

_PATH_OPTIONS = frozenset({"sign_key", "trust_key", "redis_password_file"})
"""Options named like secrets whose values are only file paths: shown as they are
(the file's contents never are)."""

_PAIR_OPTIONS = frozenset({"storage_option", "mirror_option"})
"""``KEY=VALUE`` options: the value of a secret-named key is masked."""

_SKIP = frozenset({"help", "config", "version"})

#: Option names of a worker, by long name with dashes (``kl-coef``): the other workers' sets.
OtherOptions = Callable[[], Mapping[str, frozenset[str]]]


@dataclass
class ConfigFile:
    """What a ``--config`` file set: its path and the parser destinations it gave defaults to."""

    path: str
    values: dict[str, Any] = field(default_factory=dict)
    """dest -> value, as set as the parser's default."""


def _long_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option name without dashes (``kl-coef``) -> its action, for every option but help and --config."""
    out: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.dest in _SKIP or isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        for s in a.option_strings:
            if s.startswith("--"):
                out[s[2:]] = a
    return out


def option_names(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The keys a config file may give ``parser`` (long names, dashes)."""
    return frozenset(_long_names(parser))


def _config_path(argv: Sequence[str]) -> str | None:
    """The ``--config`` value in a worker's arguments, before they are parsed."""
    # Abbreviations as the real parser takes them (`--conf`): a prefix only --config has is --config there too.
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--config", default=None)
    try:
        known, _ = pre.parse_known_args(list(argv))
    except argparse.ArgumentError:
        raise ConfigError("--config: expected a file name") from None
    path: str | None = known.config
    return path


def _scalar(value: Any, action: argparse.Action, where: str) -> Any:
    """One value for ``action``: typed as its ``type`` and within its ``choices``."""
    tp = action.type
    if isinstance(value, (bool, dict, list)):
        raise ConfigError(f"{where}: expected {_expected(action)}, got {type(value).__name__} {value!r}")
    if tp is int:
        if not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        out: Any = value
    elif tp is float:
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        out = float(value)
    elif tp is None or tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        out = value
    elif callable(tp):
        try:
            out = tp(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{where}: {e}") from None
    else:  # pragma: no cover - argparse types are callables or registered names
        out = value
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"{where}: expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    return out


def _expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    if action.type is int:
        return "an integer"
    return "a number" if action.type is float else "a string"


def _convert(value: Any, action: argparse.Action, where: str) -> Any:
    """The TOML value for ``action``, as argparse would have stored it from the command line."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        # store_false stores False when given: the file says the flag's meaning, not the value.
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):
        if action.dest in _PAIR_OPTIONS and isinstance(value, dict):
            return [f"{k}={_pair_value(v, f'{where}.{k}')}" for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        return [_scalar(v, action, where) for v in items]
    if isinstance(action, argparse._CountAction):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if action.nargs not in (None, "?"):
        raise ConfigError(f"{where}: this option cannot be set from a file")  # pragma: no cover - none of the workers'
    return _scalar(value, action, where)


def _pair_value(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, int, float)):
        return str(v)
    raise ConfigError(f"{where}: expected a string, number or boolean, got {v!r}")


def load_config_file(parser: argparse.ArgumentParser, worker: str, path: str, others: OtherOptions | None = None) -> ConfigFile:
    """Read ``path`` and make its values ``parser``'s defaults (``worker``: the table it reads).

    ``others()`` gives the other workers' option names, asked only for a top-level
    key this worker lacks (it builds their parsers): such a key is skipped if one
    of them has it, an error otherwise. Without ``others`` every such key is an error.
    """
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        raise ConfigError(f"--config {path}: reading TOML needs Python 3.11 or later (tomllib)") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not valid TOML: not UTF-8") from None
    mine = _long_names(parser)
    top = {k: v for k, v in data.items() if k not in WORKERS}
    table = data.get(worker, {})
    for name in WORKERS:
        if name in data and not isinstance(data[name], dict):
            raise ConfigError(f"--config {path}: {name!r} must be a table ([{name}]) of that worker's options")
    chosen: dict[str, tuple[Any, str]] = {}  # long name -> (value, where)
    other_names: Mapping[str, frozenset[str]] | None = None
    for key, value in top.items():
        name = key.replace("_", "-")
        if name == "config":
            raise ConfigError(f"--config {path}: key 'config': a config file cannot name another")
        if name in mine:
            chosen[name] = (value, f"--config {path}: {key}")
            continue
        if others is not None and other_names is None:
            other_names = others()
        if other_names and any(name in names for names in other_names.values()):
            continue  # another worker's option: theirs
        raise ConfigError(f"--config {path}: unknown key {key!r}: no option --{name} of aurora {worker} (nor of any worker)")
    for key, value in table.items():
        name = key.replace("_", "-")
        if name not in mine:
            raise ConfigError(f"--config {path}: unknown key {key!r} in [{worker}]: no option --{name} of aurora {worker}")
        chosen[name] = (value, f"--config {path}: [{worker}] {key}")
    out = ConfigFile(path)
    for name, (value, where) in chosen.items():
        action = mine[name]
        out.values[action.dest] = _convert(value, action, where)
    parser.set_defaults(**out.values)
    for a in parser._actions:
        if a.dest in out.values:
            a.required = False  # the file gave it
    return out


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            sub = a.choices.get(name)
            return sub if isinstance(sub, argparse.ArgumentParser) else None
    return None


#: Declares a worker's options on a parser (``aurora_tools.cli.run_cmds.add_*_arguments``).
Fill = Callable[[argparse.ArgumentParser], None]


def _other_workers(worker: str, fills: Mapping[str, Fill]) -> Mapping[str, frozenset[str]]:
    """The option names of the workers other than ``worker`` (builds their parsers: imports them)."""
    out: dict[str, frozenset[str]] = {}
    for name, fill in fills.items():
        if name != worker:
            p = argparse.ArgumentParser(add_help=False)
            fill(p)
            out[name] = option_names(p)
    return out


def parse_worker_args(parser: argparse.ArgumentParser, argv: Sequence[str], fills: Mapping[str, Fill] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the ``--config`` file of a worker subcommand applied first.

    ``fills``: worker name -> what declares its options, to tell another worker's
    top-level keys from unknown ones (without it, every key this worker lacks is an error).
    Sets ``args.config_file`` (a :class:`ConfigFile`, or None) on the result.
    """
    words = [a for a in argv if not a.startswith("-")]
    worker = words[0] if words and words[0] in WORKERS else None
    cfg: ConfigFile | None = None
    if worker is not None:
        sub = _subparser(parser, worker)
        rest = list(argv)[list(argv).index(worker) + 1 :]
        if sub is not None:
            try:
                path = _config_path(rest)
                if path is not None:
                    others = None if fills is None else (lambda: _other_workers(worker, fills))
                    cfg = load_config_file(sub, worker, path, others)
            except ConfigError as e:
                sub.exit(2, f"aurora {worker}: error: {e}\n")  # a usage error: exit 2, one line, no usage block
    args = parser.parse_args(argv)
    if cfg is not None:
        try:
            _finish(args, cfg)
        except ConfigError as e:  # the file's --redis-password-file cannot be read
            parser.exit(2, f"aurora {worker}: error: {e}\n")
    args.config_file = cfg
    return args


def _finish(args: argparse.Namespace, cfg: ConfigFile) -> None:
    """What ``parse_args`` leaves undone for values that came from the file."""
    for dest, value in cfg.values.items():
        got = getattr(args, dest, None)
        if isinstance(value, list) and isinstance(got, list) and got is not value:
            # An append flag on the command line appended to the file's list: the flag replaces it.
            setattr(args, dest, got[len(value) :])
    pfile = getattr(args, "redis_password_file", None)
    url = getattr(args, "redis", None)
    if pfile and url and ("redis" in cfg.values or "redis_password_file" in cfg.values):
        from aurora_store.credentials import resolve_redis_url

        args.redis = resolve_redis_url(url, pfile)  # argparse folds it only for flags


# -- the effective configuration --
def _mask(dest: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if dest in _PAIR_OPTIONS and isinstance(value, list):
        out = []
        for p in value:
            k, sep, v = str(p).partition("=")
            out.append(f"{k}={MASK}" if sep and is_secret_name(k) else redact_text(str(p)))
        return out
    if is_secret_name(dest) and dest not in _PATH_OPTIONS:
        return MASK
    if isinstance(value, (list, tuple)):
        return [_mask(dest, v) for v in value]
    text = str(value)
    return redact_url(text) if "://" in text else redact_text(text)


def effective_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every option of ``parser`` (long name with dashes) -> its value in ``args``, secrets masked.

    None means "not given": the worker then reads its environment variable or its default.
    """
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for name, action in _long_names(parser).items():  # one entry per option, by its first long name
        if action.dest in seen or not hasattr(args, action.dest):
            continue
        seen.add(action.dest)
        out[name] = _mask(action.dest, getattr(args, action.dest))
    return dict(sorted(out.items()))


def resolved(config: Any) -> dict[str, Any]:
    """A worker's config dataclass (flags, file and environment applied) as plain, masked JSON values.

    Nested dataclasses become objects; other objects (trust keys, clocks) their type's name.
    """
    import dataclasses

    def plain(name: str, v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, Mapping):
            from aurora_store.redact import redact_options

            return {str(k): plain(str(k), x) for k, x in redact_options(dict(v)).items()}
        if isinstance(v, (list, tuple)):
            return [plain(name, x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return _mask(name, v)
        return type(v).__name__

    return {f.name: plain(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)}


def render(worker: str, options: Mapping[str, Any], source: str | None = None) -> str:
    """One compact block: ``key = value`` lines in TOML syntax for the options that have a value,
    then one comment line naming those left to the environment or the default."""
    head = f"aurora {worker}: effective configuration" + (f" (--config {source})" if source else "")
    lines = [head] + [f"  {k} = {json.dumps(v)}" for k, v in options.items() if v is not None]
    unset = [k for k, v in options.items() if v is None]
    if unset:
        lines.append(f"  # from the environment or the defaults: {', '.join(unset)}")
    return "\n".join(lines)


def _worker_id(worker: str, args: argparse.Namespace) -> str:
    if worker == "actor":
        return str(getattr(args, "actor_id", None) or "")  # chosen before the record (aurora_tools.cli.run_cmds)
    if worker == "relay":
        return str(getattr(args, "region", "") or "")
    return str(getattr(args, "run", "") or "")


def config_record(
    worker: str,
    args: argparse.Namespace,
    options: Mapping[str, Any],
    now: _dt.datetime | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON record of one start: who, when, which package, from which file, with what options
    (and, as ``resolved``, the worker's whole config once the environment is applied: :func:`resolved`)."""
    t = now or _dt.datetime.now(_dt.timezone.utc)
    cfg = getattr(args, "config_file", None)
    return {
        "worker": worker,
        "id": _worker_id(worker, args),
        "region": getattr(args, "region", None),
        "run": getattr(args, "run", None),
        "time": t.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "version": __version__,
        "config_file": cfg.path if isinstance(cfg, ConfigFile) else None,
        "options": dict(options),
        "resolved": None if config is None else dict(config),
    }


def record_key(worker: str, now: _dt.datetime | None = None, pid: int | None = None) -> str:
    """``config/<worker>-<UTC time to the microsecond>-<pid>-<6 random hex>.json``: never the same
    twice, across restarts, processes and machines."""
    t = now or _dt.datetime.now(_dt.timezone.utc)
    return f"{CONFIG_PREFIX}{worker}-{t.strftime('%Y%m%dT%H%M%S%fZ')}-{os.getpid() if pid is None else pid}-{secrets.token_hex(3)}.json"


def write_record(store: Any, record: Mapping[str, Any], key: str | None = None) -> str | None:
    """Write ``record`` as a create-only object; its key, or None after one warning line on stderr.

    ``store``: an :class:`aurora_store.storage.Store`. Failing to document a start never stops it.
    """
    key = key or record_key(str(record.get("worker", "worker")))
    data = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()
    try:
        store.put(key, data, mode="create")
    except (AuroraError, OSError) as e:
        from aurora_tools.cli.console import say

        say(f"aurora {record.get('worker')}: warning: could not write {key} into the run root: {redact_text(str(e))}")
        return None
    return key


def announce(
    worker: str,
    parser: argparse.ArgumentParser | None,
    args: argparse.Namespace,
    storage_options: Mapping[str, Any],
    *,
    background: bool = False,
    config: Any = None,
    print_block: Callable[[str], None] | None = None,
) -> str | None:
    """At a worker's start: print its effective options and record them under ``config/`` of ``--store``.

    ``parser``: the worker's options (the record's keys); None records every
    plain value of ``args``. ``config``: the worker's resolved config dataclass, recorded too. ``background``: write from a daemon thread, so a
    store that is away (its retries, its timeouts) never delays the start; the
    worker rides the outage out on its own. Returns the record's key (None: not
    written, or written in the background).
    """
    if parser is not None:
        options = effective_options(parser, args)
    else:
        options = {
            k.replace("_", "-"): _mask(k, v)
            for k, v in sorted(vars(args).items())
            if not callable(v) and k not in ("command", "config_file", "config")
        }
    cfg = getattr(args, "config_file", None)
    block = render(worker, options, cfg.path if isinstance(cfg, ConfigFile) else None)
    if print_block is None:
        from aurora_tools.cli.console import say

        say(block)
    else:
        print_block(block)
    record = config_record(worker, args, options, config=None if config is None else resolved(config))
    if background:
        import threading

        threading.Thread(
            target=_open_and_write, args=(worker, args.store, dict(storage_options), record), name="aurora-config-record", daemon=True
        ).start()
        return None
    return _open_and_write(worker, args.store, dict(storage_options), record)


def _open_and_write(worker: str, url: str, storage_options: dict[str, Any], record: Mapping[str, Any]) -> str | None:
    from aurora_store.storage import StoreConfig, open_store

    try:
        # One retry and short timeouts: this record must not hold a start up for minutes.
        store = open_store(
            url, storage_options, StoreConfig.from_env(retries=1, connect_timeout_s=5.0, read_timeout_s=15.0, op_timeout_s=30.0)
        )
    except (AuroraError, OSError, ValueError) as e:
        from aurora_tools.cli.console import say

        say(f"aurora {worker}: warning: could not open {redact_url(url)} to record the configuration: {redact_text(str(e))}")
        return None
    return write_record(store, record)
