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

__all__ = ["FORMATS", "DEFAULT_FORMAT", "FORMAT_ENV", "EncodeOptions", "PAPER", "NAIVE", "AUTO_V1", "AUTO_V2"]

#: Segment formats a writer can write (FORMAT.md §3 and §3.1).
FORMATS = (1, 2)
#: What writers write unless asked for format 1 (FORMAT.md §3.1: "Writers write format 2 by
#: default and format 1 when asked, for readers that know only format 1").
DEFAULT_FORMAT = 2
#: The variable every publisher reads it from (the encoder's ``AURORA_`` prefix + ``FORMAT``);
#: the Trainer's ``--format`` and ``aurora delta create --format`` override it.
FORMAT_ENV = "AURORA_FORMAT"
_FORMAT2_ONLY = v2.FORMAT2_INDEX_ENCODINGS + v2.FORMAT2_CODECS


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    """What an encoder may choose from. The default allows everything, in format 2.

    ``format`` caps the lists: at format 1 their format-2 items (``rice``,
    ``planes``) are left out of the choice (:attr:`index_choices`,
    :attr:`codec_choices`), so one set of lists serves both formats and
    ``dataclasses.replace(options, format=1)`` is all a writer for
    format-1 readers needs."""

    index_encodings: tuple[str, ...] = enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS
    """Index encodings the encoder may pick (``dense`` also covers all-changed ranges)."""
    value_modes: tuple[str, ...] = ("new", "xor")
    """``new`` is the paper's raw new values; ``xor`` needs the exact base."""
    codecs: tuple[str, ...] = enc.CODECS + v2.FORMAT2_CODECS
    """``zstd`` costs CPU (about 200 MB/s per core); drop it on fast links. ``planes`` (format 2)
    codes each byte plane of the values raw, constant, Huffman or zstd."""
    zstd_level: int = 1
    """zstd compression level; 1 is the fast end."""
    format: int = DEFAULT_FORMAT
    """Segment format written: 2 (``rice`` gaps, ``planes`` values, FORMAT.md §3.1), or 1 for
    readers that know only format 1 (the lists' format-2 items are then not used)."""

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
        if self.format not in FORMATS:
            raise ConfigError(f"format must be 1 or 2 (--format, {FORMAT_ENV}), got {self.format!r}")
        for name, left in (("index encoding", self.index_choices), ("codec", self.codec_choices)):
            if not left:
                raise ConfigError(
                    f"EncodeOptions: format 1 leaves no {name} (format 2 only: {', '.join(_FORMAT2_ONLY)}); "
                    "allow a format-1 one or write format 2"
                )

    @property
    def index_choices(self) -> tuple[str, ...]:
        """The index encodings this format lets the encoder pick."""
        return self.index_encodings if self.format >= 2 else tuple(e for e in self.index_encodings if e not in _FORMAT2_ONLY)

    @property
    def codec_choices(self) -> tuple[str, ...]:
        """The codecs this format lets the encoder pick."""
        return self.codecs if self.format >= 2 else tuple(c for c in self.codecs if c not in _FORMAT2_ONLY)


#: The paper's encoding: LEB128 gaps and raw new values, nothing else (format 1).
PAPER = EncodeOptions(index_encodings=("leb128",), value_modes=("new",), codecs=("none",), format=1)
#: The naive baseline: absolute 32/64-bit indices and raw new values (format 1).
NAIVE = EncodeOptions(index_encodings=("u32", "u64"), value_modes=("new",), codecs=("none",), format=1)
#: Everything format 1 allows, smallest per entry: what a writer for format-1 readers writes.
AUTO_V1 = EncodeOptions(format=1)
#: Everything format 1 allows and format 2's ``rice`` gaps and ``planes``
#: values, smallest per entry: the default, its segments are format 2.
AUTO_V2 = EncodeOptions()
