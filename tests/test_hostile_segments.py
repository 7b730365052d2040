"""Hostile segments are refused with an error naming segment and entry, and no
weight changes (FORMAT.md §3, "A reader must reject ...").

Each hostile segment is a valid one with its header rewritten. Every case is
checked twice: staged directly (``stage_segments``) and end to end through a
store (``lineage.fetch_delta``, with a manifest that matches the hostile bytes
so they get past the sha256 check), where a recording sink proves apply was
never reached and the weights digest proves nothing changed.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from codec_helpers import (
    RecordingSink,
    assert_bit_identical,
    bits_digest,
    publish_raw_delta,
    read_safetensors,
    rewrite_segment,
    write_safetensors,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora_store.apply.sink import FusedWeights, apply_delta
from aurora_store.codec.entries import PAPER, EncodeOptions
from aurora_store.codec.extract import spec_of
from aurora_store.errors import (
    EntryError,
    FormatError,
    IntegrityError,
    ModelMismatchError,
    SegmentError,
)
from aurora_store.format.checkpoint import stage_segments
from aurora_store.format.manifest import version_dir
from aurora_store.format.segment import (
    MAX_HEADER_BYTES,
    decode_segment,
    parse_safetensors,
)
from aurora_store.lineage.fetch import fetch_delta
from aurora_tools.bench.hostile.forge import (
    BITMASK,
    DELETE,
    M_CHANGED,
    NAIVE_U32,
    ZSTD_ONLY,
    Mut,
    bit_past_range,
    drop_tensor,
    flip_in,
    frame,
    leb,
    lengthen_val,
    model,
    mutated_segment,
    retype_val,
    set_field,
    set_tensor,
    shorten_val,
    valid_segment,
    zeros_bomb,
)

BASE_STATE = "sha256:" + "ab" * 32
M_GAPS = [3, 7, 40, 1, 49]


def specs() -> dict[str, Any]:
    base, _ = model()
    return {n: spec_of(t, n) for n, t in base.items()}


# --- the cases (mutations from aurora_tools.bench.hostile.forge) ---------------


@dataclass(frozen=True)
class Case:
    id: str
    target: EncodeOptions
    mutate: Mut
    match: str


CASES = [
    Case(
        "zstd-bomb-values",
        ZSTD_ONLY,
        set_tensor("1.val", zeros_bomb(64 << 20)),
        "past the bound of 10 bytes",
    ),
    Case(
        "zstd-bomb-indices",
        ZSTD_ONLY,
        set_tensor("1.idx", zeros_bomb(64 << 20)),
        "past the bound of 50 bytes",
    ),
    Case(
        "zstd-declares-too-much",
        ZSTD_ONLY,
        set_tensor("1.val", frame(bytes(1 << 20))),
        "declares 1048576 bytes",
    ),
    Case("zstd-corrupt", ZSTD_ONLY, flip_in("1.val", 6), "zstd frame is corrupt|truncated"),
    Case("zstd-garbage", ZSTD_ONLY, set_tensor("1.val", b"this is not zstd"), "zstd frame is corrupt"),
    Case(
        "zstd-wrong-size",
        ZSTD_ONLY,
        set_tensor("1.val", frame(bytes(8))),
        "decompresses to 8 bytes, expected 10",
    ),
    Case(
        "zstd-trailing",
        ZSTD_ONLY,
        set_tensor("1.val", frame(bytes(10)) + b"\x00"),
        "after its frame",
    ),
    Case("zstd-val-not-u8", ZSTD_ONLY, retype_val("I8"), "must be a 1-D U8 tensor"),
    Case("unknown-idx-codec", PAPER, set_field(idx_codec="lz4"), "unknown idx_codec 'lz4'"),
    Case("unknown-val-codec", PAPER, set_field(val_codec="brotli"), "unknown val_codec 'brotli'"),
    Case("unknown-values-mode", PAPER, set_field(values="add"), "unknown values mode 'add'"),
    Case("unknown-encoding", PAPER, set_field(encoding="rle"), "unknown encoding 'rle'"),
    Case("truncated-varint", PAPER, set_tensor("1.idx", leb(3, 7, 40, 1) + b"\xb1"), "truncated"),
    Case(
        "varint-over-10-bytes",
        PAPER,
        set_tensor("1.idx", b"\x83" + b"\x80" * 9 + b"\x00" + leb(7, 40, 1, 49)),
        "longer than 10 bytes",
    ),
    Case(
        "varint-above-2^63",
        PAPER,
        set_tensor("1.idx", b"\xff" * 9 + b"\x01" + leb(7, 40, 1, 49)),
        "above 2\\^63",
    ),
    Case("zero-gap", PAPER, set_tensor("1.idx", leb(3, 7, 40, 0, 50)), "gap of 0 at position 3"),
    Case(
        "index-out-of-range",
        PAPER,
        set_tensor("1.idx", leb(3, 7, 40, 1, 77)),
        r"index 128 at position 4 outside \[0, 128\)",
    ),
    Case("nnz-too-large", PAPER, set_field(nnz=6), "expected 6"),
    Case("nnz-too-small", PAPER, set_field(nnz=4), "expected 4"),
    Case("nnz-past-range", PAPER, set_field(nnz=129), "nnz 129 impossible"),
    Case("value-dtype", PAPER, retype_val("F16"), "has dtype F16, expected BF16"),
    Case("value-dtype-xor-bits", PAPER, retype_val("U16"), "has dtype U16, expected BF16"),
    Case("value-too-short", PAPER, shorten_val, r"has shape \[4\], expected \[5\]"),
    Case("value-too-long", PAPER, lengthen_val, r"has shape \[6\], expected \[5\]"),
    Case(
        "unknown-parameter",
        PAPER,
        set_field(param="model.nope.weight"),
        "no parameter 'model.nope.weight'",
    ),
    Case(
        "wrong-shape",
        PAPER,
        set_field(shape=[16, 8]),
        r"is \[16, 8\] bfloat16 in the delta, \[8, 16\] bfloat16 in the model",
    ),
    Case("wrong-dtype", PAPER, set_field(dtype="float16"), "float16 in the delta"),
    Case("unknown-dtype", PAPER, set_field(dtype="int8"), "unknown dtype 'int8'"),
    Case("range-past-numel", PAPER, set_field(stop=129), r"range \[0, 129\) is not inside"),
    Case("empty-range", PAPER, set_field(start=5, stop=5), r"range \[5, 5\)"),
    Case("negative-start", PAPER, set_field(start=-1), r"range \[-1, 128\)"),
    Case("missing-field", PAPER, set_field(nnz=DELETE), "missing field 'nnz'"),
    Case("field-type", PAPER, set_field(start="0"), "field 'start' has type str"),
    Case("bool-is-not-int", PAPER, set_field(stop=True), "field 'stop' has type bool"),
    Case(
        "missing-idx-tensor",
        PAPER,
        drop_tensor("1.idx"),
        "names tensor '1.idx', which the segment lacks",
    ),
    Case(
        "missing-val-tensor",
        PAPER,
        drop_tensor("1.val"),
        "names tensor '1.val', which the segment lacks",
    ),
    Case(
        "idx-not-u8",
        PAPER,
        lambda e, t: t.__setitem__("1.idx", ("I8",) + tuple(t["1.idx"][1:])),
        "must be a 1-D U8 tensor",
    ),
    Case(
        "idx-past-bound",
        PAPER,
        set_tensor("1.idx", leb(3, 7, 40, 1, 49) + b"\x00" * 50),
        "exceeds its bound 50",
    ),
    Case("bitmask-bit-past-range", BITMASK, bit_past_range, r"sets a bit past the range \[0, 124\)"),
    Case("bitmask-count", BITMASK, set_field(nnz=4), "bitmask marks 5 indices, nnz is 4"),
    Case(
        "u32-not-increasing",
        NAIVE_U32,
        set_tensor("1.idx", np.array([3, 10, 51, 50, 100], "<u4").tobytes()),
        "not strictly increasing at position 3",
    ),
    Case(
        "u32-out-of-range",
        NAIVE_U32,
        set_tensor("1.idx", np.array([3, 10, 50, 51, 128], "<u4").tobytes()),
        r"index 128 at position 4 outside",
    ),
    Case(
        "dense-xor-count",
        EncodeOptions(index_encodings=("dense",), value_modes=("xor",), codecs=("none",)),
        set_field(nnz=3),
        "dense xor stream changes 5 elements, nnz is 3",
    ),
    Case(
        "entry-not-object",
        PAPER,
        lambda e, t: e.__setitem__(1, ["m"]),  # type: ignore[call-overload]
        "entry is not a JSON object",
    ),
]


def _apply_case(case: Case) -> bytes:
    return mutated_segment(case.target, case.mutate)


@pytest.mark.parametrize("target", [PAPER, ZSTD_ONLY, EncodeOptions()], ids=["paper", "zstd", "auto"])
def test_unmodified_rewrite_is_accepted(target: EncodeOptions) -> None:
    """The rewriting helper is faithful: without a mutation the segment applies."""
    data = rewrite_segment(valid_segment(target))
    staged = stage_segments([("seg", data)], 1, specs())
    base, new = model()
    apply_delta(staged, FusedWeights(base))
    assert_bit_identical(base, new)
    assert [e.param for e in staged.entries] == ["f", "m"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_stage_rejects(case: Case) -> None:
    bad = _apply_case(case)
    with pytest.raises(EntryError, match=case.match) as ei:
        stage_segments([("seg-00007.safetensors", bad)], 1, specs())
    err = ei.value
    assert isinstance(err, FormatError) and isinstance(err, ValueError)
    assert err.where == "seg-00007.safetensors" and err.entry == 1
    msg = str(err)
    assert msg.startswith("segment seg-00007.safetensors, entry 1")
    param = json.loads(read_safetensors(bad)[0]["aurora.entries"])[1]
    if isinstance(param, dict) and isinstance(param.get("param"), str):
        assert f"entry 1 ({param['param']})" in msg


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fetch_rejects_before_apply(case: Case, memory_store) -> None:
    bad = _apply_case(case)
    params = {
        "f": {"shape": [40], "dtype": "float32", "nnz": 2},
        "m": {"shape": [8, 16], "dtype": "bfloat16", "nnz": 5},
    }
    m = publish_raw_delta(memory_store, 1, BASE_STATE, [bad], params)
    base, _ = model()
    sink = RecordingSink(FusedWeights(base))
    before = bits_digest(base)
    with pytest.raises(EntryError, match=case.match) as ei:
        _, staged = fetch_delta(memory_store, 1, sink.specs())
        apply_delta(staged, sink)
    assert sink.writes == 0
    assert bits_digest(base) == before
    key = f"{version_dir('delta', 1)}/{m.segments[0].key}"
    assert memory_store.where(key) in str(ei.value)
    assert "entry 1" in str(ei.value)


# --- version-level checks -------------------------------------------------------


def test_overlapping_entries_across_two_segments() -> None:
    a = valid_segment(PAPER)
    b = valid_segment(EncodeOptions())  # same params, same full ranges
    with pytest.raises(EntryError, match=r"overlaps \[0, 40\) of seg-a entry 0") as ei:
        stage_segments([("seg-a", a), ("seg-b", b)], 1, specs())
    assert ei.value.where == "seg-b" and ei.value.param == "f"


def test_partially_overlapping_ranges() -> None:
    def narrow(lo: int, hi: int) -> Callable[[list[dict[str, Any]]], None]:
        def f(ents: list[dict[str, Any]]) -> None:
            del ents[0]
            ents[0].update(start=lo, stop=hi)

        return f

    # entry "m" with indices 3..100 re-declared over [0, 101) and [100, 128)
    first = rewrite_segment(valid_segment(PAPER), entries=narrow(0, 101))
    seg2 = valid_segment(PAPER)
    # second segment: only index 100 of m, range [100, 128)
    second = rewrite_segment(
        seg2,
        entries=narrow(100, 128),
        tensors=lambda t: t.update({"1.idx": ("U8", [1], leb(0)), "1.val": ("BF16", [1], t["1.val"][2][-2:])}),
    )
    second = rewrite_segment(second, entries=lambda e: e[0].update(nnz=1))
    stage_segments([("s1", first)], 1, specs())  # each alone is fine
    stage_segments([("s2", second)], 1, specs())
    with pytest.raises(EntryError, match="overlaps"):
        stage_segments([("s1", first), ("s2", second)], 1, specs())
    with pytest.raises(EntryError, match="overlaps"):
        stage_segments([("s2", second), ("s1", first)], 1, specs())


def test_adjacent_ranges_do_not_overlap() -> None:
    def cut(lo: int, hi: int, keep: list[int]) -> bytes:
        seg = valid_segment(PAPER)
        meta, tens = read_safetensors(seg)
        vals = tens["1.val"][2]
        pos = [M_CHANGED.index(i) for i in keep]
        raw = b"".join(vals[2 * p : 2 * p + 2] for p in pos)
        gaps = np.diff(np.array(keep), prepend=lo)

        def e(ents: list[dict[str, Any]]) -> None:
            del ents[0]
            ents[0].update(start=lo, stop=hi, nnz=len(keep), idx="1.idx", val="1.val")

        return rewrite_segment(
            seg,
            entries=e,
            tensors=lambda t: t.update(
                {
                    "1.idx": ("U8", [len(leb(*gaps))], leb(*gaps)),
                    "1.val": ("BF16", [len(keep)], raw),
                }
            ),
        )

    s1, s2 = cut(0, 51, [3, 10, 50]), cut(51, 128, [51, 100])
    staged = stage_segments([("s1", s1), ("s2", s2)], 1, specs())
    base, new = model()
    apply_delta(staged, FusedWeights(base))
    assert torch.equal(base["m"].view(torch.int16), new["m"].view(torch.int16))


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"aurora.format": "3"}, "aurora.format is '3'"),
        ({"aurora.kind": "snapshot"}, "aurora.kind is 'snapshot'"),
        ({"aurora.version": "x1"}, "'aurora.version' is not a decimal integer"),
        ({"aurora.base_version": "-1"}, "'aurora.base_version' is not a decimal integer"),
        ({"aurora.entries": "{not json"}, "aurora.entries is not valid UTF-8 JSON"),
        ({"aurora.entries": '{"a": 1}'}, "aurora.entries is not a JSON list"),
        (
            {"aurora.version": "2", "aurora.base_version": "1"},
            "belongs to version 2 \\(base 1\\), expected 1",
        ),
        ({"aurora.base_version": "5"}, "belongs to version 1 \\(base 5\\)"),
    ],
)
def test_segment_metadata_rejected(meta: dict[str, str], match: str) -> None:
    bad = rewrite_segment(valid_segment(PAPER), metadata=lambda m: m.update(meta))
    with pytest.raises(SegmentError, match=match) as ei:
        stage_segments([("seg-3", bad)], 1, specs())
    assert str(ei.value).startswith("segment seg-3: ")


def drop_key(key: str, meta: dict[str, str]) -> None:
    del meta[key]


def test_missing_metadata_keys_rejected() -> None:
    for key in (
        "aurora.format",
        "aurora.kind",
        "aurora.version",
        "aurora.base_version",
        "aurora.entries",
    ):
        bad = rewrite_segment(valid_segment(PAPER), metadata=functools.partial(drop_key, key))
        with pytest.raises(SegmentError, match="seg-9"):
            decode_segment(bad, "seg-9", specs())


# --- the container: truncation, header lengths, tensor table ----------------------


def test_truncated_segment_rejected_at_every_length() -> None:
    data = valid_segment(EncodeOptions())
    for n in range(len(data)):
        with pytest.raises(SegmentError, match="seg-t"):
            decode_segment(data[:n], "seg-t", specs())
        with pytest.raises(SegmentError):
            parse_safetensors(data[:n], "seg-t")


def test_header_length_past_end() -> None:
    data = valid_segment(PAPER)
    (n,) = struct.unpack_from("<Q", data)
    bad = struct.pack("<Q", len(data)) + data[8:]
    with pytest.raises(
        SegmentError,
        match=f"header length {len(data)} points past the end of the {len(data)}-byte object",
    ):
        parse_safetensors(bad, "seg-h")
    assert n < len(data)


@pytest.mark.parametrize("n", [MAX_HEADER_BYTES + 1, 1 << 40, (1 << 64) - 1])
def test_absurd_header_length(n: int) -> None:
    data = valid_segment(PAPER)
    with pytest.raises(SegmentError, match="absurdly large"):
        parse_safetensors(struct.pack("<Q", n) + data[8:], "seg-a")


def header_mut(f: Callable[[dict[str, Any]], None], data: bytes | None = None) -> bytes:
    data = data if data is not None else valid_segment(PAPER)
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    f(header)
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + data[8 + n :]


@pytest.mark.parametrize(
    ("mut", "match"),
    [
        (lambda h: h["1.val"].update(data_offsets=[0, 1 << 40]), "outside the"),
        (lambda h: h["1.val"].update(dtype="Q7"), "unknown dtype 'Q7'"),
        (lambda h: h["1.val"].update(shape=[-1]), "bad shape"),
        (lambda h: h["1.val"].update(shape=[7]), "needs 14 bytes"),
        (lambda h: h["1.val"].update(data_offsets=[0]), "data_offsets"),
        (lambda h: h.update({"1.val": 5}), "description is not an object"),
        (lambda h: h.update({"__metadata__": {"a": 1}}), "must map strings to strings"),
        (
            lambda h: h.update({"extra": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}),
            "gap or overlap",
        ),
    ],
)
def test_tensor_table_rejected(mut: Callable[[dict[str, Any]], None], match: str) -> None:
    with pytest.raises(SegmentError, match=match):
        parse_safetensors(header_mut(mut), "seg-x")


def test_trailing_bytes_after_last_tensor_rejected() -> None:
    with pytest.raises(SegmentError, match="1 bytes after the last tensor"):
        parse_safetensors(valid_segment(PAPER) + b"\x00", "seg-x")


def test_header_not_json() -> None:
    bad = struct.pack("<Q", 8) + b"{nope!!}"
    with pytest.raises(SegmentError, match="not valid UTF-8 JSON"):
        parse_safetensors(bad, "seg-x")
    bad = struct.pack("<Q", 8) + b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8"
    with pytest.raises(SegmentError, match="not valid UTF-8 JSON"):
        parse_safetensors(bad, "seg-x")
    bad = struct.pack("<Q", 8) + b"[1,2,3] "
    with pytest.raises(SegmentError, match="not a JSON object"):
        parse_safetensors(bad, "seg-x")


@settings(max_examples=60)
@given(
    pos=st.integers(0, 10_000),
    xor=st.integers(1, 255),
    target=st.sampled_from(["paper", "auto", "zstd"]),
)
def test_fuzz_single_byte_flip_is_refused_or_harmless(pos: int, xor: int, target: str) -> None:
    """Any one corrupted byte: either a FormatError, or a segment that still
    validates (a flipped value byte); never another exception type."""
    opts = {"paper": PAPER, "auto": EncodeOptions(), "zstd": ZSTD_ONLY}[target]
    data = bytearray(valid_segment(opts))
    data[pos % len(data)] ^= xor
    try:
        decode_segment(bytes(data), "seg-f", specs())
    except FormatError as e:
        assert "seg-f" in str(e)


# --- store path: integrity -----------------------------------------------------


def test_flipped_byte_in_store_fails_sha256(local_store) -> None:
    data = valid_segment(EncodeOptions())
    params = {
        "f": {"shape": [40], "dtype": "float32", "nnz": 2},
        "m": {"shape": [8, 16], "dtype": "bfloat16", "nnz": 5},
    }
    m = publish_raw_delta(local_store, 1, BASE_STATE, [data], params)
    key = f"{version_dir('delta', 1)}/{m.segments[0].key}"
    # sanity: the untouched version fetches and applies
    base, new = model()
    _, staged = fetch_delta(local_store, 1, specs(), expect_base_state=BASE_STATE)
    apply_delta(staged, FusedWeights(base))
    assert_bit_identical(base, new)
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x01
    local_store.put(key, bytes(bad), mode="overwrite")
    base, _ = model()
    before = bits_digest(base)
    sink = RecordingSink(FusedWeights(base))
    with pytest.raises(IntegrityError, match="sha256 does not match") as ei:
        apply_delta(fetch_delta(local_store, 1, sink.specs())[1], sink)
    assert local_store.where(key) in str(ei.value)
    assert sink.writes == 0 and bits_digest(base) == before


def test_truncated_object_in_store_fails_size_check(memory_store) -> None:
    data = valid_segment(PAPER)
    m = publish_raw_delta(memory_store, 1, BASE_STATE, [data], {})
    key = f"{version_dir('delta', 1)}/{m.segments[0].key}"
    memory_store.put(key, data[:-3], mode="overwrite")
    with pytest.raises(IntegrityError, match=f"{len(data) - 3} bytes, manifest says {len(data)}"):
        fetch_delta(memory_store, 1, specs())


def test_truncated_segment_committed_as_such_is_a_segment_error(memory_store) -> None:
    data = valid_segment(PAPER)[:-3]
    m = publish_raw_delta(memory_store, 1, BASE_STATE, [data], {})
    key = f"{version_dir('delta', 1)}/{m.segments[0].key}"
    with pytest.raises(SegmentError, match="outside the") as ei:
        fetch_delta(memory_store, 1, specs())
    assert str(ei.value).startswith(f"segment {memory_store.where(key)}:")


def test_params_table_must_match_entries(memory_store) -> None:
    from aurora_store.errors import ManifestError

    data = valid_segment(PAPER)
    publish_raw_delta(
        memory_store,
        1,
        BASE_STATE,
        [data],
        {"m": {"shape": [8, 16], "dtype": "bfloat16", "nnz": 5}},
    )
    with pytest.raises(ManifestError, match="params\\['f'\\].nnz is 0, segments carry 2"):
        fetch_delta(memory_store, 1, specs())


# --- apply re-checks the sink ------------------------------------------------------


def test_apply_refuses_param_the_sink_lacks() -> None:
    staged = stage_segments([("s", valid_segment(PAPER))], 1, None)
    base, _ = model()
    del base["m"]
    before = bits_digest(base)
    sink = RecordingSink(FusedWeights(base))
    with pytest.raises(ModelMismatchError, match="no parameter 'm'"):
        apply_delta(staged, sink)
    assert sink.writes == 0 and bits_digest(base) == before


def test_apply_refuses_range_past_the_sink() -> None:
    staged = stage_segments([("s", valid_segment(PAPER))], 1, None)
    base, _ = model()
    base["m"] = torch.zeros(100, dtype=torch.bfloat16)
    before = bits_digest(base)
    sink = RecordingSink(FusedWeights(base))
    with pytest.raises(ModelMismatchError, match=r"\[8, 16\] bfloat16 in the delta, \[100\] bfloat16 in the model"):
        apply_delta(staged, sink)
    assert sink.writes == 0 and bits_digest(base) == before


def test_apply_refuses_dtype_mismatch_with_the_sink() -> None:
    staged = stage_segments(
        [
            (
                "s",
                valid_segment(EncodeOptions(index_encodings=("dense",), value_modes=("new",), codecs=("none",))),
            )
        ],
        1,
        None,
    )
    base, _ = model()
    base["m"] = torch.zeros(8, 16, dtype=torch.float32)  # same numel, another dtype
    before = bits_digest(base)
    with pytest.raises(ModelMismatchError):
        apply_delta(staged, FusedWeights(base))
    assert bits_digest(base) == before


# --- decode without a model: hostile shapes and deep JSON ------------------------


def raw_segment(entries: Any, tensors: list[tuple[str, str, list[int], bytes]]) -> bytes:
    meta = {
        "aurora.format": "1",
        "aurora.kind": "delta",
        "aurora.version": "1",
        "aurora.base_version": "0",
        "aurora.entries": entries if isinstance(entries, str) else json.dumps(entries),
    }
    return write_safetensors(tensors, meta)


@pytest.mark.parametrize("encoding", ["leb128", "u64"])
def test_huge_shape_without_model_is_an_entry_error(encoding: str) -> None:
    idx = leb(5) if encoding == "leb128" else np.array([5], "<u8").tobytes()
    e = [
        {
            "param": "p",
            "shape": [1 << 64],
            "dtype": "bfloat16",
            "start": 0,
            "stop": 1 << 64,
            "nnz": 1,
            "encoding": encoding,
            "idx": "i",
            "val": "v",
        }
    ]
    data = raw_segment(e, [("v", "BF16", [1], b"\x00\x00"), ("i", "U8", [len(idx)], idx)])
    with pytest.raises(EntryError):
        decode_segment(data, "s")


@pytest.mark.parametrize("where", ["header", "entries"])
def test_deeply_nested_json_is_a_segment_error(where: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    if where == "entries":
        data = raw_segment(deep, [])
    else:
        h = deep.encode()
        data = struct.pack("<Q", len(h)) + h
    with pytest.raises(SegmentError):
        decode_segment(data, "s")


def _header_only(header: dict[str, Any]) -> bytes:
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj


def _meta(**over: str) -> dict[str, str]:
    m = {"aurora.format": "1", "aurora.kind": "delta", "aurora.version": "1", "aurora.base_version": "0", "aurora.entries": "[]"}
    m.update(over)
    return m


@pytest.mark.parametrize(
    "data",
    [
        # an integer of more than 4300 digits: json's ValueError, not JSONDecodeError
        struct.pack("<Q", 5008) + b'{"a": 1' + b"1" * 5000 + b"}",
        _header_only({"__metadata__": _meta(**{"aurora.entries": "[" + "1" * 5000 + "]"})}),
        _header_only({"__metadata__": _meta(**{"aurora.version": "9" * 5000})}),
        # an unhashable dtype code
        _header_only({"x": {"dtype": ["U8"], "shape": [0], "data_offsets": [0, 0]}}),
    ],
    ids=["header-int-digits", "entries-int-digits", "version-digits", "dtype-list"],
)
def test_json_and_int_limits_are_segment_errors(data: bytes) -> None:
    with pytest.raises(SegmentError):
        decode_segment(data, "s")
