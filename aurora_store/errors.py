"""Every error Aurora raises on purpose.

One root, :class:`AuroraError`. Subclasses also inherit the builtin a caller
would naturally catch (``FileNotFoundError``, ``ValueError`` …), so code that
knows nothing about Aurora still handles them sensibly. Messages name the
object, version and field at fault; callers never need to parse them.
"""

from __future__ import annotations

__all__ = [
    "AuroraError",
    "FormatError",
    "SegmentError",
    "EntryError",
    "ManifestError",
    "ModelMismatchError",
    "IntegrityError",
    "VersionNotFound",
    "ChainError",
    "VersionConflict",
    "StoreError",
    "ObjectNotFound",
    "ConfigError",
]


class AuroraError(Exception):
    """Root of all Aurora errors."""


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


class ModelMismatchError(FormatError):
    """A payload names a parameter the model lacks, or one of another shape/dtype."""


class IntegrityError(AuroraError, ValueError):
    """Bytes read back do not match the digest or size recorded for them."""


class StoreError(AuroraError, OSError):
    """The object store failed in a way retries did not fix."""


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
