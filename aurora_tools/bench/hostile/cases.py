"""The cases of ``aurora bench hostile``: each builds a store (or a run) and attacks the real code.

A case returns a :class:`Result`. Attack cases are expected to be *refused*
(an error, or the hostile object ignored while the true weights are reached);
valid controls are expected to be *accepted*. "Applied" means a forged weight
got through: an output file written from a refused version, weights that are
not the true ones, or a worker activating what it should have refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aurora_tools.bench.hostile import forge

__all__ = ["Result", "Case", "Context", "CASES", "cli"]

CLI_TIMEOUT_S = 180.0


@dataclass
class Result:
    """What one case did. ``outcome``: refused | accepted | applied | traceback | failed."""

    name: str
    group: str
    expected: str  # "refuse" | "accept"
    outcome: str = "failed"
    how: str = ""
    applied: bool = False
    traceback: bool = False
    segment_reads: int | None = None  # reads of the refused version's segments (signature cases)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        want = "refused" if self.expected == "refuse" else "accepted"
        return self.outcome == want and not self.applied and not self.traceback

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("name", "group", "expected", "outcome", "how", "applied", "traceback", "seconds")}
        if self.segment_reads is not None:
            d["segment_reads"] = self.segment_reads
        d["ok"] = self.ok
        return d


@dataclass
class Context:
    """Where cases put their files, and the servers they share (started lazily)."""

    root: Path
    resources: dict[str, Any] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def dir(self, name: str) -> Path:
        p = self.root / name
        p.mkdir(parents=True, exist_ok=True)
        return p

    def close(self) -> None:
        for c in reversed(self.closers):
            with contextlib.suppress(Exception):  # best effort at teardown
                c()


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    expected: str
    run: Callable[[Context, Result], None]
    quick: bool = False


@dataclass(frozen=True)
class CliRun:
    rc: int
    out: str
    err: str

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.out or "Traceback" in self.err

    @property
    def error_lines(self) -> list[str]:
        """The ``aurora: error: ...`` lines (progress notes also go to stderr)."""
        return [ln for ln in self.err.splitlines() if ln.startswith("aurora: error")]


def cli(argv: Sequence[str], env: dict[str, str] | None = None) -> CliRun:
    """``python -m aurora_tools.cli ARGV`` in a fresh process, with no AURORA_* settings inherited."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    e.update(env or {})
    try:
        p = subprocess.run(
            [sys.executable, "-m", "aurora_tools.cli", *argv],
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            env=e,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return CliRun(124, "", f"timed out after {CLI_TIMEOUT_S:.0f} s")
    return CliRun(p.returncode, p.stdout, p.stderr)


def _expect_cli_refusal(res: Result, run: CliRun, out: Path | None, match: str | None) -> None:
    """A refusal: exit != 0, one error line (saying ``match``), no traceback, no output file."""
    res.traceback = run.traceback
    res.applied = out is not None and out.exists()
    lines = run.error_lines
    res.how = _short(lines[-1]) if lines else f"exit {run.rc}, no message"
    if res.traceback:
        res.outcome = "traceback"
    elif res.applied:
        res.outcome = "applied"
    elif run.rc == 0:
        res.outcome = "accepted"
    elif match is not None and not re.search(match, run.err):
        res.outcome = "failed"
        res.how = f"refused, but not saying /{match}/: {res.how}"
    elif len(lines) != 1:
        res.outcome = "failed"
        res.how = f"{len(lines)} error lines: {res.how}"
    else:
        res.outcome = "refused"


def _short(line: str) -> str:
    """An error line without its long temporary paths."""
    line = line.removeprefix("aurora: error: ")
    line = re.sub(r"file://\S*?/run/", "", line)
    return re.sub(r"deltas/v\d+/[0-9a-f]{16}/(seg-\d+)\.safetensors", r"\1", line)[:160]


def _expect_cli_success(res: Result, run: CliRun, what: str) -> None:
    res.traceback = run.traceback
    if run.rc == 0 and not run.traceback:
        res.outcome, res.how = "accepted", what
    else:
        res.outcome = "traceback" if run.traceback else "failed"
        lines = run.error_lines
        res.how = _short(lines[-1]) if lines else f"exit {run.rc}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 1: torch.int8, 8: torch.int64}[t.element_size()])


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        got[n].shape == want[n].shape and got[n].dtype == want[n].dtype and torch.equal(_bits(got[n]), _bits(want[n])) for n in want
    )


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# --- per-entry hostile segments through ``aurora delta apply`` ----------------------------


def _raw_run(ctx: Context, name: str, segments: list[bytes], params: dict[str, dict[str, Any]]) -> str:
    """Snapshot 0 of :func:`forge.model` and delta 1 made of ``segments``: the store's URL."""
    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage import open_store

    url = f"file://{ctx.dir(name)}/run"
    store = open_store(url)
    base, _ = forge.model()
    snap = publish_snapshot(store, "t", 0, base, None)
    forge.publish_raw_delta(store, 1, snap.state, segments, params)
    return url


def _segment_case(mut: str) -> Callable[[Context, Result], None]:
    def run(ctx: Context, res: Result) -> None:
        url = _raw_run(ctx, f"seg-{mut}", [forge.hostile_segment(mut)], forge.raw_params())
        out = ctx.dir(f"seg-{mut}") / "out.safetensors"
        _expect_cli_refusal(
            res, cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)]), out, forge.SEGMENT_MUTATIONS[mut][2]
        )

    return run


def _valid_raw_delta(ctx: Context, res: Result) -> None:
    from aurora_store.codec.entries import PAPER

    url = _raw_run(ctx, "valid-raw", [forge.valid_segment(PAPER)], forge.raw_params())
    out = ctx.dir("valid-raw") / "out.safetensors"
    run = cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)])
    _expect_cli_success(res, run, "applied; bit-exact")
    if res.outcome == "accepted" and not _same_bits(_load(out), forge.model()[1]):
        res.outcome, res.how = "failed", "applied, but the weights are not the new ones"


# --- reader limits -----------------------------------------------------------------------


def _header_90mb(ctx: Context, res: Result) -> None:
    n = 90_000_000
    url = _raw_run(ctx, "header-90mb", [struct.pack("<Q", n) + b" " * n], {})
    out = ctx.dir("header-90mb") / "out.safetensors"
    _expect_cli_refusal(res, cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)]), out, "absurdly large")


def _decode_bomb(ctx: Context, res: Result) -> None:
    """24 parameters of 2 MiB each, each a ~100-byte frame; the manifest vouches for one."""
    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage import open_store

    n = 24
    url = f"file://{ctx.dir('decode-bomb')}/run"
    store = open_store(url)
    snap = publish_snapshot(store, "t", 0, {f"p{i}": torch.zeros(forge.BIG, dtype=torch.bfloat16) for i in range(n)}, None)
    params = {"p0": {"shape": [forge.BIG], "dtype": "bfloat16", "nnz": forge.BIG}}
    forge.publish_raw_delta(store, 1, snap.state, [forge.bomb_many_params(n)], params)
    out = ctx.dir("decode-bomb") / "out.safetensors"
    _expect_cli_refusal(res, cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)]), out, "past its budget")


def _manifest_edit(ctx: Context, name: str, edit: Callable[[bytes], bytes]) -> tuple[str, Path]:
    from aurora_store.codec.entries import PAPER
    from aurora_store.format.manifest import manifest_key
    from aurora_store.storage import open_store

    url = _raw_run(ctx, name, [forge.valid_segment(PAPER)], forge.raw_params())
    store = open_store(url)
    key = manifest_key("delta", 1)
    store.put(key, edit(store.get(key)), mode="overwrite")
    return url, ctx.dir(name) / "out.safetensors"


def _json_digits(ctx: Context, res: Result) -> None:
    def edit(b: bytes) -> bytes:
        d = b.decode()
        bad = d.replace('"version": 1,', '"version": ' + "7" * 5000 + ",", 1)
        assert bad != d, "manifest layout changed"
        return bad.encode()

    url, out = _manifest_edit(ctx, "json-5000-digits", edit)
    _expect_cli_refusal(res, cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)]), out, "5000 digits")


def _manifest_too_big(ctx: Context, res: Result) -> None:
    from aurora_store.format.limits import MAX_MANIFEST_BYTES

    def edit(b: bytes) -> bytes:
        return b.rstrip().rstrip(b"}") + b', "pad": "' + b"x" * MAX_MANIFEST_BYTES + b'"}'

    url, out = _manifest_edit(ctx, "manifest-too-big", edit)
    _expect_cli_refusal(res, cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)]), out, "limit")


def _overlap(ctx: Context, res: Result) -> None:
    """Two segments each carry a valid entry for all of ``w``: verify --deep and apply refuse."""
    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage import open_store

    url = f"file://{ctx.dir('overlap')}/run"
    store = open_store(url)
    snap = publish_snapshot(store, "t", 0, {"w": torch.zeros(64, dtype=torch.bfloat16)}, None)
    seg = forge.segment([forge.dense_entry(0, "w", 0, 64, numel=64)], [forge.zeros_frame(128)])
    forge.publish_raw_delta(store, 1, snap.state, [seg, seg], {"w": {"shape": [64], "dtype": "bfloat16", "nnz": 128}})
    v = cli(["verify", url, "--deep"])
    out = ctx.dir("overlap") / "out.safetensors"
    a = cli(["delta", "apply", "--version", "1", "--store", url, "--out", str(out)])
    _expect_cli_refusal(res, a, out, "overlaps")
    res.traceback = res.traceback or v.traceback
    if res.outcome == "refused" and (v.rc == 0 or "overlaps" not in v.out + v.err):
        res.outcome, res.how = "failed", f"apply refused, verify --deep exit {v.rc}"
    elif res.outcome == "refused":
        res.how = "verify --deep and apply: " + res.how


# --- signatures -----------------------------------------------------------------------------


def _signed_run(ctx: Context) -> dict[str, Any]:
    """Snapshot 0 and delta 1 signed; 2 unsigned; 3 signed then tampered; 4 signed by an untrusted key.

    Each forged version stands on a signed chain of its own (v1 for all), so
    each is refused for its own reason: built as branches in three stores.
    """
    if "signed" in ctx.resources:
        return ctx.resources["signed"]
    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_store.format.manifest import manifest_key
    from aurora_store.format.signing import PUBLIC_KEY_FILE, Signer, generate_keypair
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

    keys = ctx.dir("signed-keys")
    signer = generate_keypair(keys, overwrite=True)
    forger = Signer.generate()
    cfg = PublishConfig(streams=2, segment_bytes=16 << 10)
    w0 = make_weights(QWEN3_TINY, seed=0)
    plan = plan_of(w0, tied=False)
    master = MasterWeights(w0, seed=0)
    ws = [w0, master.step(lr=2.5e-7), master.step(lr=2.5e-7)]
    urls = {}
    for name in ("valid", "unsigned", "tampered", "untrusted"):
        url = f"file://{ctx.dir('signed-' + name)}/run"
        store = open_store(url)
        s0 = publish_snapshot(store, "t", 0, fuse_weights(w0, plan), None, cfg, signer=signer)
        m1 = publish_delta(store, "t", 1, extract(plan, ws[0], ws[1]), s0.state, cfg, signer=signer)
        second = {"valid": signer, "unsigned": None, "tampered": signer, "untrusted": forger}[name]
        publish_delta(store, "t", 2, extract(plan, ws[1], ws[2]), m1.state, cfg, signer=second)
        if name == "tampered":
            key = manifest_key("delta", 2)
            d = json.loads(store.get(key))
            d["run"] = "someone-else"  # a signed field changed after signing
            store.put(key, json.dumps(d, indent=1).encode(), mode="overwrite")
        urls[name] = url
    res = {"urls": urls, "pub": str(keys / PUBLIC_KEY_FILE), "trust": signer.trust(), "want": fuse_weights(ws[2], plan)}
    ctx.resources["signed"] = res
    return res


def _signed_valid(ctx: Context, res: Result) -> None:
    run = _signed_run(ctx)
    out = ctx.dir("signed-valid") / "out.safetensors"
    r = cli(["delta", "apply", "--version", "2", "--store", run["urls"]["valid"], "--out", str(out), "--trust-key", run["pub"]])
    _expect_cli_success(res, r, "applied with --trust-key; bit-exact")
    if res.outcome == "accepted" and not _same_bits(_load(out), run["want"]):
        res.outcome, res.how = "failed", "applied, but not the true weights"


def _signature_case(kind: str, match: str) -> Callable[[Context, Result], None]:
    def run(ctx: Context, res: Result) -> None:
        from aurora_store.errors import AuroraError
        from aurora_store.format.manifest import version_dir
        from aurora_store.lineage.materialize import materialize

        sr = _signed_run(ctx)
        url = sr["urls"][kind]
        out = ctx.dir(f"signed-{kind}") / "out.safetensors"
        _expect_cli_refusal(
            res, cli(["delta", "apply", "--version", "2", "--store", url, "--out", str(out), "--trust-key", sr["pub"]]), out, match
        )
        # The same read in-process, through a store that counts its segment reads.
        forge.CountingStore.reset()
        store = forge.CountingStore(url)
        try:
            materialize(store, 2, trust=sr["trust"])
            refused = False
        except AuroraError:
            refused = True
        prefix = version_dir("delta", 2) + "/"
        res.segment_reads = sum(1 for k in forge.CountingStore.read if k.startswith(prefix))
        if not refused and res.outcome == "refused":
            res.outcome, res.how = "applied", "materialize accepted it in-process"
            res.applied = True
        elif res.segment_reads:
            res.outcome, res.how = "failed", f"{res.segment_reads} segment(s) of delta 2 read before the refusal"

    return run


# --- a planted snapshot -------------------------------------------------------------------


def _bound_run(ctx: Context) -> dict[str, Any]:
    """v0..v4 with weights digests, and a snapshot planted at 3 (true state, forged weights)."""
    if "bound" in ctx.resources:
        return ctx.resources["bound"]
    from aurora_store.apply.sink import weights_digest
    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

    cfg = PublishConfig(streams=2, segment_bytes=16 << 10)
    url = f"file://{ctx.dir('bound')}/run"
    store = open_store(url)
    w = make_weights(QWEN3_TINY, seed=0)
    plan = plan_of(w, tied=False)
    master = MasterWeights(w, seed=0)
    weights, states = [w], [publish_snapshot(store, "t", 0, fuse_weights(w, plan), None, cfg).state]
    for v in range(1, 5):
        new = master.step(lr=2.5e-7)
        m = publish_delta(store, "t", v, extract(plan, weights[v - 1], new), states[v - 1], cfg, weights_digest=weights_digest(new, plan))
        weights.append(new)
        states.append(m.state)
    forged = {n: t + 0.25 for n, t in fuse_weights(weights[3], plan).items()}
    publish_snapshot(store, "t", 3, forged, states[3], cfg)
    res = {"url": url, "want": {v: fuse_weights(weights[v], plan) for v in (2, 4)}}
    ctx.resources["bound"] = res
    return res


def _planted_snapshot(ctx: Context, res: Result) -> None:
    run = _bound_run(ctx)
    out = ctx.dir("bound") / "out4.safetensors"
    r = cli(["delta", "apply", "--version", "4", "--store", run["url"], "--out", str(out)])
    res.traceback = r.traceback
    if r.rc != 0 or r.traceback:
        res.outcome, res.how = ("traceback" if r.traceback else "failed"), _short((r.error_lines or [f"exit {r.rc}"])[-1])
    elif not _same_bits(_load(out), run["want"][4]):
        res.outcome, res.applied, res.how = "applied", True, "the planted snapshot's weights were materialized"
    else:
        said = [ln for ln in (r.out + r.err).splitlines() if "snapshot 3" in ln]
        res.outcome, res.how = "refused", "ignored, true weights reached" + (f" ({said[0].strip()[:100]})" if said else "")


def _valid_chain(ctx: Context, res: Result) -> None:
    run = _bound_run(ctx)
    out = ctx.dir("bound") / "out2.safetensors"
    r = cli(["delta", "apply", "--version", "2", "--store", run["url"], "--out", str(out)])
    _expect_cli_success(res, r, "materialized bit-exact")
    if res.outcome == "accepted" and not _same_bits(_load(out), run["want"][2]):
        res.outcome, res.how = "failed", "materialized, but not bit-exact"


# --- the registry -------------------------------------------------------------------------

_QUICK_SEGMENTS = {"zstd-bomb-values", "varint-above-2^63", "entry-not-object"}

CASES: list[Case] = [
    *(Case(f"segment:{m}", "segment", "refuse", _segment_case(m), quick=m in _QUICK_SEGMENTS) for m in forge.SEGMENT_MUTATIONS),
    Case("header-90mb", "limits", "refuse", _header_90mb),
    Case("json-int-5000-digits", "limits", "refuse", _json_digits, quick=True),
    Case("manifest-over-size-limit", "limits", "refuse", _manifest_too_big),
    Case("aggregate-decode-bomb", "limits", "refuse", _decode_bomb),
    Case("overlapping-entries", "limits", "refuse", _overlap),
    Case("unsigned-with-trust-key", "signature", "refuse", _signature_case("unsigned", "unsigned"), quick=True),
    Case("wrongly-signed", "signature", "refuse", _signature_case("tampered", "signature")),
    Case("untrusted-key", "signature", "refuse", _signature_case("untrusted", "key")),
    Case("planted-snapshot", "snapshot", "refuse", _planted_snapshot),
    Case("valid:raw-delta-applies", "control", "accept", _valid_raw_delta, quick=True),
    Case("valid:signed-delta-applies", "control", "accept", _signed_valid, quick=True),
    Case("valid:chain-bit-exact", "control", "accept", _valid_chain),
]


def run_case(case: Case, ctx: Context) -> Result:
    res = Result(case.name, case.group, case.expected)
    t0 = time.monotonic()
    try:
        case.run(ctx, res)
    except Exception as e:  # noqa: BLE001 - a broken case is reported, not raised
        res.outcome, res.how = "failed", f"the case itself failed: {type(e).__name__}: {str(e)[:200]}"
    res.seconds = round(time.monotonic() - t0, 2)
    return res
