"""Entries: the sparse change of one flat-index range of one parameter.

Encoding picks, per entry, the smallest combination of index encoding, value
mode and codec that the caller allows (FORMAT.md §3: "a writer chooses per
entry, and should choose the smallest"). Decoding validates every field of
an untrusted entry and returns plain arrays ready to apply.

This module is the codec's entry API; the parts live in
:mod:`~aurora_store.codec.encode_options` (what an encoder may choose),
:mod:`~aurora_store.codec.entry_types` (the records),
:mod:`~aurora_store.codec.encode` and :mod:`~aurora_store.codec.decode`.
"""

from __future__ import annotations

from aurora_store.codec.decode import MAX_NUMEL, Claim, decode_entry, decoded_cost
from aurora_store.codec.encode import encode_entry
from aurora_store.codec.encode_options import AUTO_V1, AUTO_V2, NAIVE, PAPER, EncodeOptions
from aurora_store.codec.entry_types import DecodedEntry, EncodedEntry, ParamSpec

__all__ = [
    "EncodeOptions",
    "PAPER",
    "NAIVE",
    "AUTO_V1",
    "AUTO_V2",
    "ParamSpec",
    "EncodedEntry",
    "DecodedEntry",
    "encode_entry",
    "decode_entry",
    "decoded_cost",
    "Claim",
    "MAX_NUMEL",
]
