"""One way to configure every component: frozen dataclasses read from the environment.

Each component keeps a ``Config`` dataclass beside it (frozen, slotted, a
docstring under each field, validated in ``__post_init__``). This module is
the one place that turns environment variables into such a dataclass:

    cfg = from_env(StoreConfig, "AURORA_STORE_", retries=3)

reads ``AURORA_STORE_RETRIES``, ``AURORA_STORE_BACKOFF_S`` … for every field
by its upper-cased name (or the exact variable a field names in its
metadata, ``field(default=8, metadata={"env": "AURORA_STREAMS"})``), parses
it by the field's annotated type, and lets keyword overrides win (``None``
means "not given"). A value that does not parse raises :class:`ConfigError`
naming the variable, never a bare ``ValueError``.

A field that is also a worker's option is declared once, with
:func:`option`: its name, type and default are the field's, its help, flag
and variable the metadata's. :func:`declared` lists them, for the command
line (:func:`aurora_store.options.add_declared`, flags generated with no
default of their own) and for the generated list of every variable
(``docs/OPTIONS.md``). A process-wide switch that belongs to no config
(``AURORA_NO_JIT``) is a :class:`Switch`, declared beside its one reader.

:class:`Backoff` is the retry delay policy shared by every loop that waits
for a dependency to come back (store retries, Relay and stager loops).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import socket
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aurora_store.errors import ConfigError

__all__ = [
    "Declared",
    "Switch",
    "declared",
    "option",
    "free_port",
    "port_is_free",
    "from_env",
    "env_name",
    "parse_value",
    "Backoff",
    "DEFAULT_STREAMS",
    "STREAMS_ENV",
    "SEGMENT_MIB_ENV",
    "streams_field",
]

T = TypeVar("T")

#: Parallel connections per version, publishing and fetching alike: the one
#: default every component (Trainer, Actor, Relay, CLI, library) starts from.
DEFAULT_STREAMS = 8
#: The environment variable that overrides it everywhere.
STREAMS_ENV = "AURORA_STREAMS"
#: Segment size in MiB (fractions allowed); unset means adaptive
#: (:func:`aurora_store.lineage.publish.segment_bytes_for`).
SEGMENT_MIB_ENV = "AURORA_SEGMENT_MIB"


def streams_field() -> Any:
    """A dataclass field for a stream count: :data:`DEFAULT_STREAMS`, env :data:`STREAMS_ENV`."""
    return dataclasses.field(default=DEFAULT_STREAMS, metadata={"env": STREAMS_ENV})


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = "",
    env: str | bool | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    scale: int | None = None,
    default_text: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    repr: bool = True,
) -> Any:
    """A config field that is also an option of the worker's command, declared once.

    ``help``: the flag's help (the default and the variable are appended to
    it). ``flag``: the long flag; ``""`` derives it from the field's name
    (``mirror_grace_s`` -> ``--mirror-grace-s``), None declares a variable
    without a flag. ``env``: the variable when it is not prefix + NAME.
    ``scale``: the flag and the variable are in larger units (MiB of a byte
    count). ``default_text``: how ``--help`` states a default that is not a
    plain value (a random id).
    """
    meta: dict[str, Any] = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "default_text": default_text}
    if env is not None:
        meta["env"] = env
    if scale is not None:
        meta["scale"] = scale
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta, repr=repr)
    return dataclasses.field(default=default, metadata=meta, repr=repr)


@dataclass(frozen=True, slots=True)
class Declared:
    """One declared option of a config dataclass, as :func:`declared` reads it."""

    name: str
    """The field's name."""
    flag: str | None
    """Its long flag (``--mirror-grace-s``); None: a variable only."""
    env: str | None
    """Its environment variable; None: a flag only."""
    type: Any
    """The field's annotated type, ``X | None`` included."""
    default: Any
    """The default value (None for a default computed per instance)."""
    help: str
    """What it does, one line."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    scale: int | None = None
    """The flag and the variable are in units of ``scale`` (MiB of a byte count)."""
    default_text: str | None = None

    @property
    def shown_default(self) -> str:
        """The default as ``--help`` and the docs state it."""
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "none"
        value = self.default / self.scale if self.scale and isinstance(self.default, (int, float)) else self.default
        if isinstance(value, float) and value.is_integer():
            value = int(value) if self.scale else value
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return str(value)


def declared(cls: type, prefix: str) -> tuple[Declared, ...]:
    """The options of config dataclass ``cls`` (its fields made with :func:`option`), in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.metadata or "help" not in f.metadata:
            continue
        m = f.metadata
        flag = m["flag"]
        if flag == "":
            flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        out.append(
            Declared(
                f.name,
                flag,
                None if m.get("env") is False else env_name(f, prefix),
                hints.get(f.name, str),
                default,
                m["help"],
                m["metavar"],
                m["choices"],
                m.get("scale"),
                m["default_text"],
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Switch:
    """A process-wide switch read from one environment variable, declared beside its one reader.

    For what belongs to no worker's config and is set per process, not per
    run (a debugging aid, a measurement mode): ``NO_JIT.get()``.
    """

    env: str
    """The variable."""
    type: Any
    """Its type: ``bool``, ``int``, ``float``, ``str`` or ``X | None``."""
    default: Any
    """The value when the variable is unset or empty."""
    help: str
    """What it does, one line (docs/OPTIONS.md)."""

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The switch's value now (read on every call: a test may set the variable).

        An unset or empty variable gives the default; a value that does not parse
        raises :class:`ConfigError` naming the variable."""
        raw = (os.environ if environ is None else environ).get(self.env)
        if raw is None or not raw.strip():
            return self.default
        return parse_value(self.type, raw, self.env)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(f: dataclasses.Field[Any], prefix: str) -> str:
    """The environment variable of one field: its metadata ``env``, else prefix + NAME."""
    explicit = f.metadata.get("env") if f.metadata else None
    return str(explicit) if explicit else prefix + f.name.upper()


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_value(tp: Any, raw: str, var: str) -> Any:
    """``raw`` (an environment string) as a value of annotated type ``tp``."""
    tp, optional = _strip_optional(tp)
    text = raw.strip()
    if optional and text.lower() in ("", "none"):
        return None
    try:
        if tp is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is str:
            return raw
        if typing.get_origin(tp) is tuple:
            (item, *_rest) = typing.get_args(tp) or (str,)
            parts = [p.strip() for p in text.split(",") if p.strip()]
            return tuple(parse_value(item, p, var) for p in parts)
    except ValueError as e:
        raise ConfigError(f"{var}={raw!r}: {e}") from None
    raise ConfigError(f"{var}: fields of type {tp!r} cannot be set from the environment")


def from_env(
    cls: type[T],
    prefix: str,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> T:
    """An instance of dataclass ``cls``: defaults, then the environment, then ``overrides``.

    Fields whose metadata sets ``env=False`` are never read from the
    environment (objects, callables, clocks).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    names = set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        if not f.init or (f.metadata and f.metadata.get("env") is False):
            continue
        var = env_name(f, prefix)
        raw = env.get(var)
        if raw is None:
            continue
        tp = hints.get(f.name, str)
        scale = f.metadata.get("scale") if f.metadata else None
        base, optional = _strip_optional(tp)
        if scale is not None and base is int:
            # Written in larger units (MiB of a byte count): the text may be fractional.
            tp = float | None if optional else float
        value = parse_value(tp, raw, var)
        if scale is not None and value is not None:
            value = int(value * scale) if base is int else value * scale
        kw[f.name] = value
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**kw)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential back-off with jitter between attempts to reach a dependency."""

    initial_s: float = 0.1
    """First delay."""
    max_s: float = 5.0
    """Cap on one delay."""
    factor: float = 2.0
    """Growth of the delay per attempt."""
    jitter: float = 0.5
    """Each delay is drawn from ``[d * (1 - jitter), d]``, so many clients do not retry in step."""

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < self.initial_s or self.factor < 1.0:
            raise ConfigError(f"Backoff: need 0 <= initial_s <= max_s and factor >= 1 ({self})")
        if not 0.0 <= self.jitter <= 1.0:
            raise ConfigError(f"Backoff: jitter must be within [0, 1] ({self})")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The delay before retry number ``attempt`` (0 for the first retry)."""
        # Grow in log space and stop at the cap: ``factor ** attempt`` alone overflows a
        # float after a few thousand attempts (an Actor idle for minutes).
        if self.initial_s <= 0:
            return 0.0
        n = max(0, attempt)
        if self.factor > 1.0:
            n = min(n, math.ceil(math.log(max(self.max_s / self.initial_s, 1.0)) / math.log(self.factor)) + 1)
        d = min(self.max_s, self.initial_s * self.factor**n)
        r = (rng or random).random()
        return d * (1.0 - self.jitter * r)

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Endless delays: ``delay(0)``, ``delay(1)`` …"""
        attempt = 0
        while True:
            yield self.delay(attempt, rng)
            attempt += 1


_LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (closed again at once).

    For servers that cannot be asked to bind port 0 themselves (redis-server,
    minio, torch.distributed's rendezvous); anything that can should.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (a port asked for by a user, checked before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((_LOOPBACK, port))
        except OSError:
            return False
    return True
