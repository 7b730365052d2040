"""What an entry encoder may choose from: :class:`EncodeOptions` and its presets.

FORMAT.md §3: "a writer chooses per entry, and should choose the smallest";
the options bound that choice (index encodings, value modes, codecs).
The codec layer reads no environment: the worker that publishes resolves
these options (``AURORA_INDEX_ENCODINGS`` …, docs/OPTIONS.md) and passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora_store.codec import encodings as enc
from aurora_store.codec import v2
from aurora_store.errors import ConfigError

__all__ = ["EncodeOptions", "PAPER", "NAIVE", "AUTO_V2"]


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    """What an encoder may choose from. The default allows everything."""

    index_encodings: tuple[str, ...] = ("leb128", "bitmask", "dense", "u32", "u64")
    """Index encodings the encoder may pick (``dense`` also covers all-changed ranges)."""
    value_modes: tuple[str, ...] = ("new", "xor")
    """``new`` is the paper's raw new values; ``xor`` needs the exact base."""
    codecs: tuple[str, ...] = ("none", "zstd")
    """``zstd`` costs CPU (about 200 MB/s per core); drop it on fast links."""
    zstd_level: int = 1
    """zstd compression level; 1 is the fast end."""

    def __post_init__(self) -> None:
        for name, allowed, given in (
            ("index encoding", enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS, self.index_encodings),
            ("value mode", enc.VALUE_MODES, self.value_modes),
            ("codec", enc.CODECS + v2.FORMAT2_CODECS, self.codecs),
        ):
            if not given:
                raise ConfigError(f"EncodeOptions: at least one {name} is required")
            for g in given:
                if g not in allowed:
                    raise ConfigError(f"EncodeOptions: unknown {name} {g!r} (allowed: {', '.join(allowed)})")
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"EncodeOptions: zstd_level must be 1..22, got {self.zstd_level}")

    @property
    def format(self) -> int:
        """The segment format these options write: 2 as soon as a format-2
        encoding (``rice``) or codec (``planes``) is allowed, else 1."""
        if any(e in v2.FORMAT2_INDEX_ENCODINGS for e in self.index_encodings) or any(c in v2.FORMAT2_CODECS for c in self.codecs):
            return 2
        return 1


#: The paper's encoding: LEB128 gaps and raw new values, nothing else.
PAPER = EncodeOptions(index_encodings=("leb128",), value_modes=("new",), codecs=("none",))
#: The naive baseline: absolute 32/64-bit indices and raw new values.
NAIVE = EncodeOptions(index_encodings=("u32", "u64"), value_modes=("new",), codecs=("none",))
#: Everything format 1 allows and format 2's ``rice`` gaps and ``planes``
#: values, smallest per entry: segments written with it are format 2.
AUTO_V2 = EncodeOptions(
    index_encodings=enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS,
    codecs=enc.CODECS + v2.FORMAT2_CODECS,
)
