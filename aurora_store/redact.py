"""Keeping secrets out of logs, messages, status output and reprs.

Credentials reach an Aurora process in three shapes: inside a URL
(``redis://user:password@host``), as storage options (``secret``, ``token``,
``key`` of s3fs), and in the environment (``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, a Redis password file). Anything that turns such a
value into text goes through this module:

- :func:`redact_url` masks a URL's password and secret-looking query values;
- :func:`redact_options` masks the values of secret-looking keys of a
  (nested) mapping of storage options;
- :func:`redact_text` masks every URL password in free text and every secret
  value this process knows (:func:`register_secret`, plus the environment's);
- :func:`redacted_repr` is a dataclass ``__repr__`` built from those;
- :class:`RedactingFilter` applies :func:`redact_text` to every log record
  (installed by ``workers.process.setup_logging`` on the root handlers).

Masking is by value as well as by shape because a secret can travel where no
shape is recognisable: a botocore debug line, an exception's text.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "MASK",
    "SECRET_ENV_VARS",
    "is_secret_name",
    "redact_url",
    "redact_options",
    "redact_text",
    "redacted_repr",
    "register_secret",
    "known_secrets",
    "RedactingFilter",
    "VENDOR_LOGGERS",
    "install_redaction",
]

MASK = "***"

SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AURORA_REDIS_PASSWORD")
"""Environment variables whose values are secrets wherever they appear."""

_SECRET_NAME = re.compile(r"(secret|token|password|passwd|credential|signature|(^|_)key$|^auth)", re.IGNORECASE)

# scheme://user:password@  (the password stops at the last '@' before the host part)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/:@]*:)(?P<pw>[^\s@/]+)(?P<at>@)")
# ?password=…, &token=…, X-Amz-Signature=… in query strings
_QUERY_SECRET = re.compile(
    r"(?P<k>[?&;](?:[A-Za-z0-9_.-]*(?:password|passwd|secret|token|signature|credential)[A-Za-z0-9_.-]*))=(?P<v>[^&;\s'\"]+)",
    re.IGNORECASE,
)
_MIN_SECRET_LEN = 4
"""Values shorter than this are never registered: masking "a" everywhere would wreck every line."""

_lock = threading.Lock()
_secrets: set[str] = set()


def is_secret_name(name: str) -> bool:
    """Whether an option or field called ``name`` holds a secret (``secret``, ``token``, ``key``, ``password``…)."""
    return bool(_SECRET_NAME.search(str(name)))


def register_secret(value: str | bytes | None) -> None:
    """Mask ``value`` in every later :func:`redact_text` (and so every log record) of this process."""
    if value is None:
        return
    s = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if len(s) >= _MIN_SECRET_LEN:
        with _lock:
            _secrets.add(s)


def known_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every secret value to mask: registered ones and those of :data:`SECRET_ENV_VARS`; longest first
    (so a secret containing another is masked whole)."""
    env = os.environ if environ is None else environ
    with _lock:
        found = set(_secrets)
    for var in SECRET_ENV_VARS:
        v = env.get(var)
        if v and len(v) >= _MIN_SECRET_LEN:
            found.add(v)
    for var in ("AURORA_REDIS_URL",):
        v = env.get(var)
        if v:
            pw = _url_password(v)
            if pw:
                found.add(pw)
    return sorted(found, key=len, reverse=True)


def _url_password(url: str) -> str | None:
    try:
        pw = urlsplit(url).password
    except ValueError:
        return None
    return pw if pw and len(pw) >= _MIN_SECRET_LEN else None


def redact_url(url: str | None) -> str:
    """``url`` with its password and secret query values masked: ``redis://u:***@h:6379/0``.

    Works on the text (no parse and rebuild), so whatever it does not mask is
    left exactly as it was.
    """
    return "None" if url is None else redact_text(str(url))


def redact_options(options: Any) -> Any:
    """A copy of storage options (nested mappings and lists) with secret-named values masked."""
    if isinstance(options, Mapping):
        return {
            k: (MASK if is_secret_name(str(k)) and v not in (None, "") and not isinstance(v, Mapping) else redact_options(v))
            for k, v in options.items()
        }
    if isinstance(options, (list, tuple)):
        return type(options)(redact_options(v) for v in options)
    if isinstance(options, str):
        return redact_text(options)
    return options


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """``text`` with URL passwords, secret query values and every known secret value masked."""
    if not text:
        return text
    out = _URL_PASSWORD.sub(lambda m: m.group("head") + MASK + m.group("at"), text)
    out = _QUERY_SECRET.sub(lambda m: m.group("k") + "=" + MASK, out)
    for s in known_secrets() if secrets is None else secrets:
        if s in out:
            out = out.replace(s, MASK)
    return out


def _redact_value(v: Any) -> str:
    if isinstance(v, str):
        return repr(redact_url(v) if "://" in v else redact_text(v))
    if isinstance(v, Mapping):
        return repr(redact_options(dict(v)))
    return redact_text(repr(v))


def redacted_repr(self: Any) -> str:
    """A dataclass ``__repr__`` that masks URL passwords, secret options and known secrets.

    Use as ``__repr__ = redacted_repr`` in the class body (``dataclass`` keeps
    a ``__repr__`` the class defines itself). Fields with ``repr=False`` stay
    out, as with the generated one; a field whose name says secret is masked whole.
    """
    parts = []
    for f in dataclasses.fields(self):
        if not f.repr:
            continue
        v = getattr(self, f.name)
        shown = MASK if is_secret_name(f.name) and isinstance(v, (str, bytes)) and v else _redact_value(v)
        parts.append(f"{f.name}={shown}")
    return f"{type(self).__qualname__}({', '.join(parts)})"


class RedactingFilter(logging.Filter):
    """Masks secrets in a record's message, arguments and exception text (see :func:`redact_text`).

    Attach it to *handlers* (a logger's own filters do not see records its
    children propagate). The record is formatted once here, so the message
    that reaches any handler after it is the masked one.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the logging module's to report
            return True
        masked = redact_text(msg)
        if masked != msg or record.args:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


VENDOR_LOGGERS = ("botocore", "boto3", "s3transfer", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp", "asyncio", "filelock")
"""Loggers of libraries whose DEBUG lines may carry credentials (botocore logs request headers)."""


def install_redaction(logger: logging.Logger | None = None) -> RedactingFilter:
    """A :class:`RedactingFilter` on every handler of ``logger`` (default: the root logger).

    Idempotent: a handler that already has one is left alone. Returns the filter.
    """
    target = logging.getLogger() if logger is None else logger
    for h in target.handlers:
        for f in h.filters:
            if isinstance(f, RedactingFilter):
                break
        else:
            h.addFilter(_FILTER)
    return _FILTER


_FILTER = RedactingFilter()
