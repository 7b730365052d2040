"""Objects planted beside a store the command line made (issue 24), read by the real command-line readers.

The store is what ``aurora snapshot create`` and ``aurora delta create``
write (unsigned, no Redis): v0, v1, v2. Each case copies it, plants what
someone with write access to the bucket could, and runs ``aurora lineage``,
``aurora gc`` or ``aurora delta apply`` in a fresh process under an 8 GiB
address-space limit, reading its own peak resident size from ``wait4``. A
reader "survives" when it exits without a traceback and its peak stays
within :data:`RSS_SLACK_MB` of a normal ``delta apply`` of the same store.
Oversized objects are sparse files: hundreds of MB to a reader, no disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from aurora_tools.bench.hostile.cases import Case, Context, Result, _load, _same_bits, _short
from aurora_tools.bench.hostile.rss import Measured, cli_measured

__all__ = ["PLANTED_CASES", "cli_store", "RSS_SLACK_MB", "OVERSIZED_BYTES", "sparse"]

REAL = (0, 1, 2)
"""The versions the command line wrote."""

FAR = (9_999_999_998, 9_999_999_999)
"""Where the planted snapshots go."""

OVERSIZED_BYTES = 600 << 20
"""Size of a planted oversized object: far past every limit, and of what a reader may hold."""

RSS_SLACK_MB = 100.0
"""How far above a normal ``delta apply`` a reader's peak may go."""


def sparse(path: Path, size: int = OVERSIZED_BYTES) -> None:
    """Make ``path`` a sparse file of ``size`` zero bytes (no disk used), replacing what was there."""
    if path.exists():
        path.chmod(0o644)
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def cli_store(ctx: Context) -> dict[str, Any]:
    """v0 (snapshot) and deltas v1, v2 written by the CLI, and a normal ``delta apply`` of each.

    Returns ``dir``, ``outs`` (version -> the applied file), ``peak_mb``
    (the largest peak of those applies) and ``weights`` (version -> input file).
    """
    if "cli-store" in ctx.resources:
        return ctx.resources["cli-store"]
    from safetensors.torch import save_file

    from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

    base = ctx.dir("cli-store")
    root = base / "run"
    url = f"file://{root}"
    w = make_weights(QWEN3_TINY, seed=0)
    master = MasterWeights(w, seed=3)
    files = []
    for v in REAL:
        p = base / f"w{v}.safetensors"
        save_file(w if v == 0 else master.step(lr=1e-6), str(p))
        files.append(str(p))
    steps = [["snapshot", "create", files[0], "--version", "0", "--store", url]]
    steps += [["delta", "create", files[v - 1], files[v], "--version", str(v), "--store", url] for v in REAL[1:]]
    for argv in steps:
        r = cli_measured(argv, limit=None)
        if r.rc != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {r.err.strip()[-300:]}")
    outs, peak = {}, 0.0
    for v in REAL:
        out = base / f"out{v}.safetensors"
        r = cli_measured(["delta", "apply", "--version", str(v), "--store", url, "--out", str(out)])
        if r.rc != 0:
            raise RuntimeError(f"delta apply v{v} of the clean store failed: {r.err.strip()[-300:]}")
        outs[v] = out
        peak = max(peak, r.peak_mb)
    res = {"dir": root, "outs": outs, "peak_mb": peak}
    ctx.resources["cli-store"] = res
    return res


def _copy(ctx: Context, name: str) -> tuple[Path, str, dict[str, Any]]:
    src = cli_store(ctx)
    dst = ctx.dir(name) / "run"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src["dir"], dst)
    for p in dst.rglob("*"):
        if p.is_file():
            p.chmod(0o644)
    return dst, f"file://{dst}", src


def _files(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256): what a clean-up must leave."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _plant_far_snapshots(root: Path) -> None:
    """Two empty, well-formed snapshot manifests far in the future."""
    from aurora_store.format.manifest import Manifest, content_digest, manifest_key

    for v in FAR:
        m = Manifest(kind="snapshot", run="planted", version=v, segments=(), params={}, state=content_digest(()))
        p = root / manifest_key("snapshot", v)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(m.to_bytes())


def _bounded(res: Result, r: Measured, baseline_mb: float) -> bool:
    """False (and the case failed) when the reader's peak went past the normal apply's plus the slack."""
    if r.peak_mb > baseline_mb + RSS_SLACK_MB:
        res.outcome = "failed"
        res.how = f"peak RSS {r.peak_mb:.0f} MB, a normal delta apply {baseline_mb:.0f} MB: memory grew with what was planted"
        return False
    return True


def _died(res: Result, r: Measured, what: str) -> bool:
    """True (and the outcome set) when the reader crashed, was killed or wrote a traceback."""
    res.traceback = r.traceback
    if r.traceback:
        res.outcome, res.how = "traceback", f"{what}: traceback"
    elif r.rc < 0 or r.rc in (124, 137):
        res.outcome, res.how = "failed", f"{what}: killed (exit {r.rc}, peak RSS {r.peak_mb:.0f} MB)"
    else:
        return False
    return True


def _lineage_far_snapshots(ctx: Context, res: Result) -> None:
    root, url, src = _copy(ctx, "far-snap-lineage")
    _plant_far_snapshots(root)
    r = cli_measured(["lineage", url])
    if _died(res, r, "aurora lineage"):
        return
    if r.rc != 0:
        res.outcome, res.how = "failed", f"aurora lineage exit {r.rc}: {_short((r.error_lines or [r.err.strip()[-150:]])[-1])}"
        return
    if not _bounded(res, r, src["peak_mb"]):
        return
    named = [ln.strip() for ln in r.out.splitlines() if any(str(v) in ln for v in FAR) or "not committed" in ln]
    if not named:
        res.outcome, res.how = "failed", "exit 0, but the planted snapshots are not named"
        return
    res.outcome, res.how = "refused", f"exit 0, peak {r.peak_mb:.0f} MB; says: {named[0][:100]}"


def _gc_far_snapshots(ctx: Context, res: Result) -> None:
    root, url, src = _copy(ctx, "far-snap-gc")
    before = _files(root)
    _plant_far_snapshots(root)
    r = cli_measured(["gc", url, "--keep-snapshots", "1", "--apply", "--grace-s", "0"])
    if _died(res, r, "aurora gc"):
        return
    after = _files(root)
    gone = sorted(k for k in before if after.get(k) != before[k])
    if gone:
        res.outcome, res.applied = "applied", True
        res.how = f"gc deleted or changed {len(gone)} real object(s), e.g. {gone[0]}"
        return
    if not _bounded(res, r, src["peak_mb"]):
        return
    if r.rc != 0 and len(r.error_lines) != 1:
        res.outcome, res.how = "failed", f"aurora gc exit {r.rc} without one error line"
        return
    res.outcome = "refused"
    res.how = f"every real object kept (exit {r.rc}, peak {r.peak_mb:.0f} MB)"


def _apply_far_snapshots(ctx: Context, res: Result) -> None:
    root, url, src = _copy(ctx, "far-snap-apply")
    _plant_far_snapshots(root)
    peaks = []
    for v in REAL:
        out = root.parent / f"out{v}.safetensors"
        r = cli_measured(["delta", "apply", "--version", str(v), "--store", url, "--out", str(out)])
        if _died(res, r, f"delta apply v{v}"):
            return
        if r.rc != 0:
            res.outcome, res.how = "failed", f"delta apply v{v} exit {r.rc}: {_short((r.error_lines or ['no message'])[-1])}"
            return
        if not _same_bits(_load(out), _load(src["outs"][v])):
            res.outcome, res.applied, res.how = "applied", True, f"v{v} materialized to other weights"
            return
        if not _bounded(res, r, src["peak_mb"]):
            return
        peaks.append(r.peak_mb)
    res.outcome, res.how = "refused", f"v0..v2 materialized bit-exact beside the plants (peak {max(peaks):.0f} MB)"


def _oversized(target: str) -> Any:
    """A real object of the store replaced by a sparse file of :data:`OVERSIZED_BYTES`; ``delta apply`` must refuse it."""

    def run(ctx: Context, res: Result) -> None:
        from aurora_store.format.manifest import manifest_key, version_dir

        root, url, src = _copy(ctx, f"oversized-{target}-origin")
        version = 0 if target == "shard" else 2
        if target == "manifest":
            victim = root / manifest_key("delta", 2)
        else:
            kind = "snapshot" if target == "shard" else "delta"
            m = json.loads((root / manifest_key(kind, version)).read_bytes())
            victim = root / version_dir(kind, version) / m["segments"][0]["key"]
        sparse(victim)
        out = root.parent / "out.safetensors"
        r = cli_measured(["delta", "apply", "--version", str(version), "--store", url, "--out", str(out)])
        if _died(res, r, "delta apply"):
            return
        if r.rc == 0 or out.exists():
            res.outcome, res.applied, res.how = (
                "applied",
                out.exists(),
                f"delta apply of a {OVERSIZED_BYTES >> 20} MB {target} exited {r.rc}",
            )
            return
        if len(r.error_lines) != 1:
            res.outcome, res.how = "failed", f"{len(r.error_lines)} error lines, exit {r.rc}"
            return
        if not _bounded(res, r, src["peak_mb"]):
            return
        res.outcome = "refused"
        res.how = f"peak {r.peak_mb:.0f} MB (normal {src['peak_mb']:.0f}): {_short(r.error_lines[0])[:110]}"

    return run


# --- another run's signed chain ---------------------------------------------------------


def _two_runs(ctx: Context) -> dict[str, Any]:
    """Run A (v0, v1) and run B, forked from it (A's v0 and v1 copied, then B's own v2), one key signing both.

    B's v2 links onto A's v1 state: it differs from what A could hold only in its signed ``run``.
    """
    if "two-runs" in ctx.resources:
        return ctx.resources["two-runs"]
    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_store.format.signing import PUBLIC_KEY_FILE, generate_keypair
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

    keys = ctx.dir("shared-key")
    signer = generate_keypair(keys, overwrite=True)
    cfg = PublishConfig(streams=2, segment_bytes=16 << 10)
    w0 = make_weights(QWEN3_TINY, seed=0)
    plan = plan_of(w0, tied=False)
    master = MasterWeights(w0, seed=0)
    ws = [w0, master.step(lr=2.5e-7), master.step(lr=2.5e-7)]
    roots = {run: ctx.dir("two-runs") / run for run in ("run-a", "run-b")}
    a = open_store(f"file://{roots['run-a']}")
    s0 = publish_snapshot(a, "run-a", 0, fuse_weights(w0, plan), None, cfg, signer=signer)
    s1 = publish_delta(a, "run-a", 1, extract(plan, ws[0], ws[1]), s0.state, cfg, signer=signer)
    shutil.rmtree(roots["run-b"], ignore_errors=True)
    shutil.copytree(roots["run-a"], roots["run-b"])
    b = open_store(f"file://{roots['run-b']}")
    publish_delta(b, "run-b", 2, extract(plan, ws[1], ws[2]), s1.state, cfg, signer=signer)
    res = {"roots": roots, "pub": str(keys / PUBLIC_KEY_FILE)}
    ctx.resources["two-runs"] = res
    return res


def _another_runs_chain(ctx: Context, res: Result) -> None:
    from aurora_store.format.manifest import version_dir

    runs = _two_runs(ctx)
    dst = ctx.dir("another-run") / "run-a"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(runs["roots"]["run-a"], dst)
    v2 = version_dir("delta", 2)
    shutil.copytree(runs["roots"]["run-b"] / v2, dst / v2)  # run B's v2, under run A's names
    out = dst.parent / "out.safetensors"
    r = cli_measured(["delta", "apply", "--version", "2", "--store", f"file://{dst}", "--out", str(out), "--trust-key", runs["pub"]])
    if _died(res, r, "delta apply"):
        return
    if r.rc == 0 or out.exists():
        res.outcome, res.applied, res.how = "applied", True, "run B's signed v2 was applied in run A"
    elif len(r.error_lines) != 1:
        res.outcome, res.how = "failed", f"{len(r.error_lines)} error lines, exit {r.rc}"
    else:
        res.outcome, res.how = "refused", _short(r.error_lines[0])


def _valid_beside_plants(ctx: Context, res: Result) -> None:
    """Control: run A's own chain, signed, applies with the shared key."""
    runs = _two_runs(ctx)
    out = ctx.dir("another-run") / "valid.safetensors"
    r = cli_measured(
        ["delta", "apply", "--version", "1", "--store", f"file://{runs['roots']['run-a']}", "--out", str(out)]
        + [
            "--trust-key",
            runs["pub"],
        ]
    )
    res.traceback = r.traceback
    if r.rc == 0 and not r.traceback and out.exists():
        res.outcome, res.how = "accepted", "run A's own signed v1 applies"
    else:
        res.outcome, res.how = ("traceback" if r.traceback else "failed"), _short((r.error_lines or [f"exit {r.rc}"])[-1])


def _case(name: str, fn: Any, quick: bool = False, expected: str = "refuse", group: str = "planted") -> Case:
    return Case(name, group, expected, fn, quick=quick)


PLANTED_CASES = [
    _case("planted:far-future-snapshots:lineage", _lineage_far_snapshots, quick=True),
    _case("planted:far-future-snapshots:gc-keeps-real", _gc_far_snapshots),
    _case("planted:far-future-snapshots:apply-bit-exact", _apply_far_snapshots),
    _case("oversized:manifest-from-origin", _oversized("manifest"), group="oversized"),
    _case("oversized:segment-from-origin", _oversized("segment"), quick=True, group="oversized"),
    _case("oversized:shard-from-origin", _oversized("shard"), group="oversized"),
    _case("signed:another-runs-chain", _another_runs_chain, group="signature"),
    _case("valid:shared-key-own-run-applies", _valid_beside_plants, expected="accept", group="control"),
]
