"""Every error Aurora raises on purpose, in one module.

One root, :class:`AuroraError`. Subclasses also inherit the builtin a caller
would naturally catch (``FileNotFoundError``, ``ValueError`` …), so code that
knows nothing about Aurora still handles them sensibly. Messages name the
object, version and field at fault; callers never need to parse them: the
fields are attributes. Vendor errors (botocore/s3fs, redis-py, safetensors,
zstandard, json) are translated into these once, at the boundary that calls
the vendor, so nothing above that boundary catches a vendor class.

Errors cross process boundaries (vLLM workers) as plain data through
:func:`error_to_wire` and :func:`error_from_wire`, fields included.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuroraError",
    "FormatError",
    "SegmentError",
    "EntryError",
    "ManifestError",
    "SignatureError",
    "ModelMismatchError",
    "IntegrityError",
    "ObjectTooLarge",
    "VersionNotFound",
    "ChainError",
    "VersionConflict",
    "StoreError",
    "StoreUnavailable",
    "ObjectNotFound",
    "ConfigError",
    "VarintError",
    "StreamError",
    "CoordinationError",
    "RedisUnavailable",
    "BusGap",
    "OutageTooLong",
    "FencedOut",
    "StepExists",
    "LedgerLost",
    "TokenizerError",
    "TaskDataError",
    "EngineError",
    "WanUnavailable",
    "TestbedError",
    "TestbedNotRunning",
    "TestbedStale",
    "error_to_wire",
    "error_from_wire",
]


class AuroraError(Exception):
    """Root of all Aurora errors.

    Subclasses with their own ``__init__`` keep their fields as attributes;
    pickling and :func:`error_to_wire` carry those attributes, so an error
    rebuilt in another process is the same class with the same fields.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[AuroraError], args: tuple[Any, ...], state: dict[str, Any]) -> AuroraError:
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class ConfigError(AuroraError, ValueError):
    """A configuration value (argument, environment variable) is invalid."""


class FormatError(AuroraError, ValueError):
    """Bytes do not follow FORMAT.md. Raised before any weight is touched."""


class SegmentError(FormatError):
    """A segment object is malformed: header, tensor table or metadata.

    ``where`` names the segment (its key or file name).
    """

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        self.reason = reason
        super().__init__(f"segment {where}: {reason}")


class EntryError(FormatError):
    """One entry of a segment is malformed or does not fit the model."""

    def __init__(self, where: str, entry: int, param: str | None, reason: str) -> None:
        self.where = where
        self.entry = entry
        self.param = param
        self.reason = reason
        what = f"entry {entry}" + (f" ({param})" if param else "")
        super().__init__(f"segment {where}, {what}: {reason}")


class ManifestError(FormatError):
    """A manifest is malformed or inconsistent."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        self.reason = reason
        super().__init__(f"manifest {where}: {reason}")


class SignatureError(ManifestError):
    """A reader with trust keys refused a manifest: unsigned, signed by a key it does not
    trust, or badly signed (FORMAT.md §4.1). Raised before any segment is decoded or used.

    A :class:`ManifestError`, so every path that routes around or quarantines a bad
    manifest does the same with this one. ``key_id`` is None when there is no usable
    signature.
    """

    def __init__(self, where: str, kind: str, version: int, key_id: str | None, reason: str) -> None:
        self.kind = kind
        self.version = version
        self.key_id = key_id
        super().__init__(where, f"{kind} {version}: {reason}")


class ModelMismatchError(FormatError):
    """A payload names a parameter the model lacks, or one of another shape/dtype."""


class IntegrityError(AuroraError, ValueError):
    """Bytes read back do not match the digest or size recorded for them."""


class ObjectTooLarge(IntegrityError):
    """An object holds more bytes than its reader allows (a manifest's limit, the size its
    manifest lists): found by a read capped one byte past the limit, never by reading it whole.

    ``where`` names the object, ``limit`` is the most bytes the reader accepts.
    """

    def __init__(self, where: str, limit: int, what: str = "") -> None:
        self.where = where
        self.limit = limit
        super().__init__(f"{where}: more than {limit} bytes{' (' + what + ')' if what else ''}; refused without reading it whole")


class StoreError(AuroraError, OSError):
    """The object store failed in a way retries did not fix."""


class StoreUnavailable(StoreError):
    """The object store did not answer (refused, timed out, 5xx, throttled) through
    every retry of one operation: a transient failure a worker may ride out."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """An object the caller needs is not in the store."""


class VersionNotFound(AuroraError, LookupError):
    """A policy version is not committed in the store."""


class ChainError(AuroraError, ValueError):
    """Versions do not form a continuous chain (missing link, wrong base)."""


class VersionConflict(AuroraError, FileExistsError):
    """A create-only write found different bytes already committed at its key."""

    def __init__(self, key: str, reason: str = "already exists with different content") -> None:
        self.key = key
        super().__init__(f"{key}: {reason}")


# ---------------------------------------------------------------------------
# codec streams (wrapped into EntryError by the entry decoder)


class VarintError(FormatError):
    """A varint stream is malformed; ``offset`` is the byte where it went wrong."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(f"{reason} at byte {offset}")


class StreamError(FormatError):
    """A stream of one entry is malformed; the message is the reason."""


# ---------------------------------------------------------------------------
# coordination (Redis)


class CoordinationError(AuroraError, ConnectionError):
    """The coordination layer could not do what was asked of Redis."""


class RedisUnavailable(CoordinationError):
    """Redis did not answer (refused, timed out, connection dropped, loading).

    Raised by the coordination layer in place of redis-py's connection and
    timeout errors; a caller may wait and try again. ``op`` names what was
    being done.
    """

    def __init__(self, op: str, reason: str) -> None:
        self.op = op
        self.reason = reason
        super().__init__(f"redis unavailable during {op}: {reason}")


class OutageTooLong(AuroraError, RuntimeError):
    """A dependency (Redis, the store) stayed away longer than the outage budget.

    ``dependency`` names it, ``seconds`` is how long it has been away.
    """

    def __init__(self, dependency: str, seconds: float, budget_s: float, last: str) -> None:
        self.dependency = dependency
        self.seconds = seconds
        self.budget_s = budget_s
        self.last = last
        super().__init__(f"{dependency} unreachable for {seconds:.0f}s (outage budget {budget_s:.0f}s); last error: {last}")


class FencedOut(AuroraError, RuntimeError):
    """A Trainer of an older epoch tried to change the run after a newer one took over."""


class BusGap(AuroraError, LookupError):
    """Entries after the consumer's last id are gone (trimmed, or Redis lost them)."""


class StepExists(AuroraError, FileExistsError):
    """``create_step`` for a version whose jobs already exist."""


class LedgerLost(AuroraError, LookupError):
    """The ledger's state for a step is gone (Redis restarted without its data)."""


# ---------------------------------------------------------------------------
# workers


class TokenizerError(AuroraError, ValueError):
    """Text or ids the tokenizer cannot represent, or an unreadable tokenizer file."""


class TaskDataError(AuroraError, ValueError):
    """A task data file or reference answer is malformed; the message names the line."""


class EngineError(AuroraError, RuntimeError):
    """An inference engine failed in a way that is not a format or chain error."""


# ---------------------------------------------------------------------------
# tools


class WanUnavailable(AuroraError, RuntimeError):
    """The netns testbed cannot run here; the message says what it needs."""


class TestbedError(AuroraError, RuntimeError):
    """The testbed could not start, or is in a state the command cannot handle."""

    __test__ = False  # not a pytest test class despite its name


class TestbedNotRunning(TestbedError, FileNotFoundError):
    """No state file: nothing runs in that folder."""


class TestbedStale(TestbedError):
    """A state file whose testbed process is gone."""


# ---------------------------------------------------------------------------
# across processes

_WIRE_SCALARS = (str, int, float, bool, type(None))


def error_to_wire(e: BaseException) -> dict[str, Any]:
    """An error as plain data: class name, message and its scalar fields."""
    fields = {k: v for k, v in vars(e).items() if isinstance(v, _WIRE_SCALARS)}
    return {"type": type(e).__name__, "message": str(e), "fields": fields}


def error_from_wire(wire: dict[str, Any]) -> AuroraError:
    """Rebuild an error of :func:`error_to_wire`: the same Aurora class with the
    same fields, looked up in this module only (never an arbitrary name); an
    unknown class becomes :class:`EngineError` carrying the original message."""
    name = str(wire.get("type", ""))
    message = str(wire.get("message", ""))
    cls = globals().get(name) if name in __all__ else None
    if not (isinstance(cls, type) and issubclass(cls, AuroraError)):
        return EngineError(f"{name or 'error'}: {message}")
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    fields = wire.get("fields")
    if isinstance(fields, dict):
        e.__dict__.update({str(k): v for k, v in fields.items() if isinstance(v, _WIRE_SCALARS)})
    return e
