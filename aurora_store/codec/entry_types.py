"""The records of an entry: a parameter's :class:`ParamSpec`, an
:class:`EncodedEntry` ready for a segment, a validated :class:`DecodedEntry`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ParamSpec", "EncodedEntry", "DecodedEntry"]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """Shape and dtype of one parameter under its fused name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class EncodedEntry:
    """One entry, encoded, ready to be placed in a segment."""

    param: str
    spec: ParamSpec
    start: int
    stop: int
    nnz: int
    encoding: str
    values: str
    idx_codec: str
    val_codec: str
    idx: bytes | None
    """Index stream (after its codec); ``None`` for dense."""
    val: bytes
    """Value stream (after its codec)."""
    val_dtype: str = field(default="")
    """safetensors dtype code of the value tensor."""

    @property
    def nbytes(self) -> int:
        return len(self.val) + (len(self.idx) if self.idx is not None else 0)

    def metadata(self, idx_name: str | None, val_name: str) -> dict[str, Any]:
        m: dict[str, Any] = {
            "param": self.param,
            "shape": list(self.spec.shape),
            "dtype": self.spec.dtype,
            "start": self.start,
            "stop": self.stop,
            "nnz": self.nnz,
            "encoding": self.encoding,
            "val": val_name,
        }
        if idx_name is not None:
            m["idx"] = idx_name
        if self.values != "new":
            m["values"] = self.values
        if self.idx_codec != "none":
            m["idx_codec"] = self.idx_codec
        if self.val_codec != "none":
            m["val_codec"] = self.val_codec
        return m


@dataclass(frozen=True, slots=True)
class DecodedEntry:
    """A validated entry: what to write where."""

    param: str
    spec: ParamSpec
    """The whole parameter's shape and dtype, as the entry declares them."""
    start: int
    stop: int
    nnz: int
    """Changed elements in the range, as the entry declares (checked where possible)."""
    indices: np.ndarray | None
    """Absolute flat indices (int64), or ``None`` for a dense range."""
    bits: np.ndarray
    """Raw bit patterns (uint16/uint32): new values, or XOR masks."""
    values: str
    """``new`` (overwrite) or ``xor``."""
