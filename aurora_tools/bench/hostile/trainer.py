"""Attacks on a Trainer's run root (issues 24, 25): a planted checkpoint, a tampered checkpoint part, a planted next version.

Each case clones the bench's one tiny Trainer run (:mod:`aurora_tools.bench.hostile.runs`),
plants what a writer without the signing key could, and runs the real
``aurora trainer --resume`` over it, an in-process settler standing in for
the Actors. The run was made with v0..v3, signed, and a checkpoint before
each step; what is planted is unsigned (the attacker has no key).
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import torch

from aurora_tools.bench.hostile.cases import Case, Context, Result, _short
from aurora_tools.bench.hostile.runs import STEPS, child_env, clone_run, settler, trainer_cmd

__all__ = ["TRAINER_CASES", "resume"]

PLANTED_STEP = 99_999_999
"""Where the planted checkpoint goes: past every real one."""

SHIFT = 1.0
"""What the planted checkpoint adds to every weight: far more than one step of training moves any."""

RESUME_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Resumed:
    rc: int
    log: str

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.log

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.log.splitlines() if ln.startswith("aurora: error")]


def resume(run: dict[str, Any], steps: int, log: Path) -> Resumed:
    """``aurora trainer --resume`` over a cloned run for ``steps`` steps in all, a settler answering its batches."""
    with settler(run["redis"], run["run"]), open(log, "wb") as out:
        try:
            p = subprocess.run(
                trainer_cmd(run["url"], run["redis"], run["run"], steps, "--resume", "--sign-key", run["sign_key"]),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
                timeout=RESUME_TIMEOUT_S,
                check=False,
            )
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return Resumed(rc, log.read_text(errors="replace"))


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Mean absolute change of every element from ``b`` to ``a``."""
    return sum(float((a[n].float() - b[n].float()).abs().sum()) for n in b) / sum(t.numel() for t in b.values())


def _planted_checkpoint(ctx: Context, res: Result) -> None:
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.materialize import materialize
    from aurora_store.storage import open_store
    from workers.trainer.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

    run = clone_run(ctx, "planted-checkpoint")
    store = open_store(run["url"])
    real = load_checkpoint(store, max(list_checkpoints(store)))
    tensors = {n: (t + SHIFT if n.startswith("model.") and t.is_floating_point() else t) for n, t in real.tensors.items()}
    # The same record (binding fields and all) over other tensors, hashes recomputed by the writer itself.
    save_checkpoint(store, dataclasses.replace(real, step=PLANTED_STEP, tensors=tensors))
    r = resume(run, STEPS + 1, run["dir"].parent / "trainer.log")
    res.traceback = r.traceback
    if r.traceback:
        res.outcome, res.how = "traceback", "the resumed Trainer wrote a traceback"
        return
    head = STEPS + 1
    try:
        m = read_manifest(store, "delta", head)
    except Exception:  # noqa: BLE001 - no next version: the Trainer published nothing
        m = None
    if m is None:
        if r.rc != 0 and len(r.error_lines) == 1:
            res.outcome, res.how = "refused", f"resume stopped, nothing published: {_short(r.error_lines[0])[:110]}"
        else:
            res.outcome, res.how = "failed", f"exit {r.rc}, no v{head}: {_short((r.error_lines or [r.log.strip()[-150:]])[-1])}"
        return
    before, _ = materialize(store, STEPS)
    after, _ = materialize(store, head)
    moved = _moved(after, before)
    if moved > SHIFT / 4:
        res.outcome, res.applied = "applied", True
        res.how = f"v{head} moved every weight by {moved:.2f} on average: trained from the planted checkpoint"
        return
    if m.base_version != STEPS or m.base_state != read_manifest(store, "delta", STEPS).state:
        res.outcome, res.how = "failed", f"v{head} is not built on the real head v{STEPS}"
        return
    res.outcome = "refused"
    res.how = f"v{head} follows the real checkpoint (mean change {moved:.4f}); exit {r.rc}"


def _tampered_part(ctx: Context, res: Result) -> None:
    """The newest real checkpoint's parts edited in place: SHIFT added to every model tensor's bytes, the record left as it
    was (its sizes and sha256 now wrong). Resume must not load it: it takes the older checkpoint, or stops in one line."""
    import json

    import numpy as np

    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.materialize import materialize
    from aurora_store.storage import open_store
    from workers.trainer.checkpoint import checkpoint_folder, checkpoint_key, list_checkpoints

    run = clone_run(ctx, "tampered-checkpoint-part")
    store = open_store(run["url"])
    step = max(list_checkpoints(store))
    rec = json.loads(store.get(checkpoint_key(step)))
    np_types = {"float32": np.float32, "float64": np.float64}
    edits: dict[str, bytearray] = {}
    for name, t in rec["tensors"].items():
        if not name.startswith("model.") or t["dtype"] not in np_types:
            continue
        size = np.dtype(np_types[t["dtype"]]).itemsize
        for c in t["chunks"]:
            path = run["dir"] / checkpoint_folder(step) / c["object"]
            buf = edits.setdefault(str(path), bytearray(path.read_bytes()))
            n = int(np.prod(c["sizes"]))
            view = np.frombuffer(buf, dtype=np_types[t["dtype"]], count=n, offset=c["at"])
            buf[c["at"] : c["at"] + n * size] = (view + SHIFT).astype(np_types[t["dtype"]]).tobytes()
    for path, buf in edits.items():
        Path(path).write_bytes(bytes(buf))
    if not edits:
        res.outcome, res.how = "failed", f"checkpoint {step} holds no float model tensor to tamper with"
        return
    r = resume(run, STEPS + 1, run["dir"].parent / "trainer.log")
    res.traceback = r.traceback
    head = STEPS + 1
    try:
        m = read_manifest(store, "delta", head)
    except Exception:  # noqa: BLE001 - no next version: the Trainer published nothing
        m = None
    named = f"step-{step:08d}" in r.log and "unusable" in r.log
    if r.traceback:
        res.outcome, res.how = "traceback", "the resumed Trainer wrote a traceback"
    elif m is None:
        if r.rc != 0 and len(r.error_lines) == 1:
            res.outcome, res.how = "refused", f"resume stopped, nothing published: {_short(r.error_lines[0])[:110]}"
        else:
            res.outcome, res.how = "failed", f"exit {r.rc}, no v{head}: {_short((r.error_lines or [r.log.strip()[-150:]])[-1])}"
    elif (moved := _moved(materialize(store, head)[0], materialize(store, STEPS)[0])) > SHIFT / 4:
        res.outcome, res.applied = "applied", True
        res.how = f"v{head} moved every weight by {moved:.2f} on average: trained from the tampered part"
    elif m.base_version != STEPS or m.base_state != read_manifest(store, "delta", STEPS).state:
        res.outcome, res.how = "failed", f"v{head} is not built on the real head v{STEPS}"
    elif not named:
        res.outcome, res.how = "failed", f"v{head} published, but the log never names checkpoint {step} unusable: was it read?"
    else:
        res.outcome = "refused"
        res.how = (
            f"checkpoint {step} refused by its parts' sha256, resumed from an older one; v{head} on v{STEPS} (mean change {moved:.4f})"
        )


def _planted_next_version(ctx: Context, res: Result) -> None:
    """A well-formed delta manifest at v{H+1} on the head's state, planted (no segments, no signature):
    in a signed run, the resumed Trainer must neither adopt it as its head nor report a fence."""
    from aurora_store.format.manifest import Manifest, chain_state, content_digest, manifest_key
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.storage import open_store

    run = clone_run(ctx, "planted-next-version")
    store = open_store(run["url"])
    head = read_manifest(store, "delta", STEPS)
    key = manifest_key("delta", STEPS + 1)
    planted = Manifest(
        kind="delta",
        run=run["run"],
        version=STEPS + 1,
        segments=(),
        params={},
        state=chain_state(head.state, content_digest(())),
        base_version=STEPS,
        base_state=head.state,
        producer={"name": "planted", "epoch": 1},
    )
    (run["dir"] / key).parent.mkdir(parents=True, exist_ok=True)
    (run["dir"] / key).write_bytes(planted.to_bytes())
    r = resume(run, STEPS + 2, run["dir"].parent / "trainer.log")
    res.traceback = r.traceback
    lines = r.error_lines
    fenced = "FencedOut" in r.log or "newer Trainer" in r.log
    if r.traceback:
        res.outcome, res.how = "traceback", "the Trainer wrote a traceback"
    elif r.rc == 0:
        res.outcome, res.applied = "applied", True
        res.how = f"the Trainer adopted the planted v{STEPS + 1} as its head and ran on"
    elif fenced:
        res.outcome, res.how = "failed", f"reported as a fence: {_short((lines or ['FencedOut in the log'])[-1])[:110]}"
    elif len(lines) != 1:
        res.outcome, res.how = "failed", f"exit {r.rc} with {len(lines)} error lines"
    elif key.split("/")[1] not in lines[0] and key not in lines[0]:
        res.outcome, res.how = "failed", f"the error does not name {key}: {_short(lines[0])[:110]}"
    else:
        res.outcome, res.how = "refused", _short(lines[0])[:140]


def _valid_resume(ctx: Context, res: Result) -> None:
    """Control: the cloned run resumes and publishes its next version on the real head."""
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.storage import open_store

    run = clone_run(ctx, "valid-resume")
    r = resume(run, STEPS + 1, run["dir"].parent / "trainer.log")
    res.traceback = r.traceback
    store = open_store(run["url"])
    try:
        m = read_manifest(store, "delta", STEPS + 1)
        ok = m.base_state == read_manifest(store, "delta", STEPS).state
    except Exception:  # noqa: BLE001 - judged below
        ok = False
    if r.rc == 0 and ok and not r.traceback:
        res.outcome, res.how = "accepted", f"resumed, v{STEPS + 1} on v{STEPS}"
    else:
        res.outcome = "traceback" if r.traceback else "failed"
        res.how = f"exit {r.rc}: {_short((r.error_lines or [r.log.strip()[-150:]])[-1])}"


def _gc_then_resume(ctx: Context, res: Result) -> None:
    """Control: what a Trainer killed mid-upload leaves (parts of an attempt beside a committed record, and a folder whose
    record never landed, as old as the grace) is removed by ``aurora gc``; every committed checkpoint's objects stay,
    and the run resumes and publishes its next version on the real head."""
    import json
    import shutil

    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.storage import open_store
    from aurora_tools.bench.hostile.cases import cli
    from workers.trainer.checkpoint import checkpoint_folder, checkpoint_key, list_checkpoints

    run = clone_run(ctx, "gc-then-resume")
    store = open_store(run["url"])
    steps = list_checkpoints(store)
    if len(steps) < 3:
        res.outcome, res.how = "failed", f"the shared run holds checkpoints {steps}, the case needs 3"
        return
    newest, killed = steps[-1], steps[0]
    root = run["dir"]
    # Beside the newest committed checkpoint: a second attempt's parts (the same bytes under another attempt).
    rec = json.loads(store.get(checkpoint_key(newest)))
    attempt = rec["objects"][0]["key"].split("/", 1)[0]
    shutil.copytree(root / checkpoint_folder(newest) / attempt, root / checkpoint_folder(newest) / "killed-attempt")
    # The oldest: its record never landed (the Trainer was killed before it); a later version is committed.
    (root / checkpoint_key(killed)).unlink()
    dead = {k for k in store.list(checkpoint_folder(killed))} | {
        k for k in store.list(checkpoint_folder(newest)) if "/killed-attempt/" in k
    }
    kept = {k for s in steps[1:] for k in store.list(checkpoint_folder(s)) if "/killed-attempt/" not in k}
    g = cli(
        [
            "gc",
            run["url"],
            "--keep-snapshots",
            "8",
            "--grace-s",
            "0",
            "--apply",
            "--redis",
            run["redis"],
            "--run",
            run["run"],
        ]
    )  # no --trust-key: the clone's versions are signed for the shared run's name, so none would count under this one
    left = set(store.list("checkpoints/"))
    if g.rc != 0 or g.traceback:
        res.traceback = g.traceback
        res.outcome, res.how = "failed", f"aurora gc exit {g.rc}: {_short((g.error_lines or [g.err.strip()[-150:]])[-1])}"
        return
    if left & dead or kept - left:
        res.outcome = "failed"
        res.how = f"gc left {len(left & dead)} dead part(s) and removed {len(kept - left)} committed object(s)"
        return
    r = resume(run, STEPS + 1, run["dir"].parent / "trainer.log")
    res.traceback = r.traceback
    try:
        ok = read_manifest(store, "delta", STEPS + 1).base_state == read_manifest(store, "delta", STEPS).state
    except Exception:  # noqa: BLE001 - judged below
        ok = False
    if r.rc == 0 and ok and not r.traceback:
        res.outcome = "accepted"
        res.how = f"gc removed {len(dead)} uncommitted part(s), kept {len(kept)} committed object(s); resumed, v{STEPS + 1} on v{STEPS}"
    else:
        res.outcome = "traceback" if r.traceback else "failed"
        res.how = f"resume after gc: exit {r.rc}: {_short((r.error_lines or [r.log.strip()[-150:]])[-1])}"


TRAINER_CASES = [
    Case("trainer:planted-checkpoint", "trainer", "refuse", _planted_checkpoint),
    Case("trainer:tampered-checkpoint-part", "trainer", "refuse", _tampered_part),
    Case("trainer:planted-next-version", "trainer", "refuse", _planted_next_version),
    Case("valid:trainer-resumes", "control", "accept", _valid_resume),
    Case("valid:gc-removes-killed-checkpoint-parts-and-resume-works", "control", "accept", _gc_then_resume),
]
