"""Credentials from the environment and files, never from a command line.

A process's argv is world-readable (``ps``, ``/proc/PID/cmdline``); its
environment and a mode-0600 file are not. So the Redis URL can come from
``$AURORA_REDIS_URL`` and its password from a file
(``--redis-password-file`` or ``$AURORA_REDIS_PASSWORD_FILE``), and a parent
hands both to its children through their environment
(:func:`redis_child_env`). Every password read here is registered with
:mod:`aurora_store.redact`, so logs mask it.

Shared by every layer (argparse in :mod:`aurora_store.options`, clients in
:mod:`aurora_store.coordination.redisconn`): imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

from aurora_store.errors import ConfigError
from aurora_store.redact import register_secret

__all__ = [
    "REDIS_URL_ENV",
    "REDIS_PASSWORD_FILE_ENV",
    "read_password_file",
    "resolve_redis_url",
    "redis_child_env",
]

REDIS_URL_ENV = "AURORA_REDIS_URL"
"""The Redis URL when no ``--redis`` is given: how child processes get it (never argv, which ``ps`` shows)."""
REDIS_PASSWORD_FILE_ENV = "AURORA_REDIS_PASSWORD_FILE"
"""A file holding the Redis password (first line), for a URL that has none."""


def read_password_file(path: str) -> str:
    """The password in ``path``: its first line, without the line end (registered as a secret).

    A missing or unreadable file is a :class:`ConfigError` naming the file, never its contents.
    """
    try:
        with open(path, encoding="utf-8") as f:
            pw = f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"Redis password file {path}: cannot read it ({type(e).__name__})") from None
    if not pw:
        raise ConfigError(f"Redis password file {path} is empty")
    register_secret(pw)
    return pw


def _with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its userinfo password (kept user; percent-encoded)."""
    register_secret(quote(password, safe=""))  # its form inside a URL, masked too
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"{url}{'&' if '?' in url else '?'}password={quote(password, safe='')}"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else ""
    return urlunsplit((parts.scheme, f"{user}:{quote(password, safe='')}@{hostport}", parts.path, parts.query, parts.fragment))


def _has_password(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return bool(parts.password) or "password" in parse_qs(parts.query)
    except ValueError:
        return False


def resolve_redis_url(url: str | None = None, password_file: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The Redis URL to connect to, with its password folded in.

    ``url``: the ``--redis`` flag, else ``$AURORA_REDIS_URL``. A URL without a
    password takes one from ``password_file`` (``--redis-password-file``), else
    from ``$AURORA_REDIS_PASSWORD_FILE``. So a password never has to be on a
    command line. The password is registered with :mod:`aurora_store.redact`,
    so logs mask it. No URL at all is a :class:`ConfigError`.
    """
    env = os.environ if environ is None else environ
    u = url or env.get(REDIS_URL_ENV)
    if not u:
        raise ConfigError(f"no Redis given: pass --redis URL or set {REDIS_URL_ENV}")
    if _has_password(u):
        pw = urlsplit(u).password
        register_secret(unquote(pw) if pw else None)
        return u
    pfile = password_file or env.get(REDIS_PASSWORD_FILE_ENV)
    if pfile:
        return _with_password(u, read_password_file(pfile))
    return u


def redis_child_env(url: str, password_file: str | None = None) -> dict[str, str]:
    """Environment variables that give a child process this Redis (instead of ``--redis`` in its argv).

    Give them to ``subprocess.Popen(env=...)``: unlike argv (``ps``,
    ``/proc/PID/cmdline``, world-readable), a process's environment is
    readable only by its user.
    """
    env = {REDIS_URL_ENV: url}
    if password_file:
        env[REDIS_PASSWORD_FILE_ENV] = password_file
    return env
