"""Values read back from Redis, as Python values.

Aurora's clients keep ``decode_responses=False`` (payloads are bytes), so
hash fields and ids arrive as ``bytes``; tests and fakes may hand in ``str``
or ``int``. These two functions are the one place the coordination layer
turns them into text and numbers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_str", "as_int"]


def as_str(x: Any, errors: str = "strict") -> str:
    """``x`` as text: bytes decoded as UTF-8 (``errors`` as in :meth:`bytes.decode`), anything else ``str(x)``."""
    return x.decode(errors=errors) if isinstance(x, bytes) else str(x)


def as_int(x: Any, default: int | None = None, *, lenient: bool = False) -> int | None:
    """``x`` as an int; ``default`` when it is missing (``None`` or empty).

    ``lenient``: a value that is not a number also gives ``default`` (for
    displays of keys another process writes); otherwise it raises
    ``ValueError``.
    """
    if x is None or x == b"" or x == "":
        return default
    if not lenient:
        return int(x)
    try:
        return int(x)
    except (TypeError, ValueError):
        return default
