"""What a chaos run proves, computed from what it left behind (:func:`summarize`).

Nothing here is taken on a worker's word alone, and nothing is read from
Redis that the faults could have erased, except what is still leasable at
the end:

- the chain and the epochs: the manifests the harness read from the store
  as they were committed (:class:`~aurora_tools.bench.chaos.manifests.ManifestLog`);
- weights: the digest files every process appended to (``AURORA_DIGEST_LOG``,
  one JSON line ``{"who", "version", "digest"}`` per version a Trainer
  published or an Actor activated), outside Redis;
- prompts: the Trainer's per-step JSON lines (:data:`~aurora_tools.bench.chaos.fleet.STEP_JSON_MARKER`)
  checked against the store's states and against each other;
- timing and exits: the harness's own clock and process table.

A metric whose evidence is missing is ``None`` (and named in
``evidence_missing``), never a default that would look like a pass.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from aurora_tools.bench.chaos.faults import FaultRecord
from aurora_tools.bench.chaos.fleet import (
    BOOT_RE,
    STEP_JSON_MARKER,
    STEP_RE,
    Incarnation,
)
from aurora_tools.bench.chaos.manifests import ManifestLog

if TYPE_CHECKING:
    from aurora_tools.bench.chaos.harness import ChaosRun

__all__ = ["summarize", "clean_line"]

_LINE_RE = re.compile(r"^\d\d:\d\d:\d\d\s+\S+\s+([A-Z]+)\s+(.*)$")
OUTAGE_START = re.compile(r"\bunreachable\b")
OUTAGE_END = re.compile(r"\breachable again\b")
RESUMED_RE = re.compile(r"\bresumed epoch (\d+)\b.*")
_STOPPED_SEEN = re.compile(r"refused|reject|regist|expired|stale|closed|gone", re.IGNORECASE)
_CORRUPT_SEEN = re.compile(r"sha256|integrity|corrupt|quarantin|mismatch|does not match", re.IGNORECASE)
_ORIGIN_SEEN = re.compile(r"\borigin\b")
_PROBLEM = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback|error:|fenc", re.IGNORECASE)


def clean_line(line: str, width: int = 180) -> str:
    """A log line without its time and process name, cut to ``width``."""
    m = _LINE_RE.match(line)
    text = m.group(2) if m else line.strip()
    return text if len(text) <= width else text[: width - 3] + "..."


# -- the chain ------------------------------------------------------------------------------
def _manifests(run: ChaosRun) -> ManifestLog:
    if run.manifests is None:
        raise RuntimeError("the run never started its servers: no manifest was read")
    return run.manifests


def _chain(run: ChaosRun) -> dict[str, Any]:
    """How far the committed chain reaches from v0, unbroken, and which epochs wrote it."""
    mlog = _manifests(run)
    with mlog.lock:
        deltas, snaps = dict(mlog.deltas), dict(mlog.snapshots)
    problems: list[str] = []
    completed = 0
    prev = snaps[0].state if 0 in snaps else None
    if prev is None:
        problems.append("v0's snapshot manifest was never read")
    for v in range(1, run.cfg.steps + 1):
        m = deltas.get(v)
        if m is None:
            if any(x > v for x in deltas):
                problems.append(f"v{v}: no delta manifest read, though later versions exist")
            break
        if m.base_version != v - 1 or (prev is not None and m.base_state != prev):
            problems.append(f"v{v}: its base (v{m.base_version}, {str(m.base_state)[:19]}) does not continue v{v - 1}")
            break
        if v in snaps and snaps[v].state != m.state:
            problems.append(f"v{v}: snapshot and delta name different states")
        prev = m.state
        completed = v
    epochs: dict[int, int] = {}
    for v, m in sorted({**snaps, **deltas}.items()):
        e = m.producer.get("epoch") if isinstance(m.producer, dict) else None
        if isinstance(e, int):
            epochs[v] = e
    regressions = 0
    top = 0
    for v in sorted(epochs):
        if epochs[v] < top:
            regressions += 1
            problems.append(f"v{v}: published by epoch {epochs[v]} after epoch {top} had published")
        top = max(top, epochs[v])
    return {"completed": completed, "problems": problems, "epochs": epochs, "epoch_regressions": regressions}


# -- weights -----------------------------------------------------------------------------------
def _digest_lines(inc: Incarnation) -> tuple[list[tuple[str, int, str]], int]:
    """(who, version, digest) of an incarnation's digest file, and how many lines did not parse."""
    out: list[tuple[str, int, str]] = []
    bad = 0
    try:
        with open(inc.digest_path, encoding="utf-8", errors="replace") as f:
            raw = f.read().splitlines()
    except OSError:
        return out, 0
    for ln in raw:
        if not ln.strip():
            continue
        try:
            d = json.loads(ln)
            out.append((str(d["who"]), int(d["version"]), str(d["digest"])))
        except (ValueError, KeyError, TypeError):
            bad += 1  # a process SIGKILLed mid-write leaves half a line
    return out, bad


def _digests(run: ChaosRun) -> dict[str, Any]:
    trainer: dict[int, set[str]] = {}
    acts: list[tuple[str, int, str]] = []
    bad = 0
    for inc in run.fleet.all:
        lines, b = _digest_lines(inc)
        bad += b
        for who, v, d in lines:
            if inc.role == "trainer" or who == "trainer":
                trainer.setdefault(v, set()).add(d)
            else:
                acts.append((inc.label, v, d))
    conflicts = sorted(v for v, ds in trainer.items() if len(ds) > 1)
    mismatches = [(who, v) for who, v, d in acts if v in trainer and d not in trainer[v]]
    uncompared = [(who, v) for who, v, _ in acts if v not in trainer]
    compared = sum(1 for _, v, _ in acts if v in trainer)
    identical: bool | None
    if not trainer and not acts:
        identical = None
    else:
        identical = compared > 0 and not mismatches and not uncompared and not conflicts
    return {
        "bit_identical": identical,
        "activations_compared": compared,
        "mismatches": mismatches[:20],
        "uncompared": uncompared[:20],
        "trainer_digest_conflicts": conflicts,
        "unreadable_lines": bad,
    }


# -- prompts -----------------------------------------------------------------------------------
def _entry(e: Any) -> tuple[str, str, int | None, int | None, str | None]:
    """(prompt, actor, token, version, state) of one ``used`` entry (a list or an object)."""
    if isinstance(e, dict):
        tok, ver, st = e.get("token"), e.get("version"), e.get("state")
        return (
            str(e.get("prompt")),
            str(e.get("actor")),
            (int(tok) if tok is not None else None),
            (int(ver) if ver is not None else None),
            (str(st) if st else None),
        )
    if isinstance(e, (list, tuple)) and e:
        p = list(e) + [None] * 5
        return (
            str(p[0]),
            str(p[1]),
            (int(p[2]) if p[2] is not None else None),
            (int(p[3]) if p[3] is not None else None),
            (str(p[4]) if p[4] else None),
        )
    return str(e), "", None, None, None


def _ids(x: Any) -> set[str]:
    return {str(i) for i in x} if isinstance(x, Iterable) and not isinstance(x, (str, bytes)) else set()


def _prompts(run: ChaosRun, completed: int) -> dict[str, Any]:
    states = _manifests(run).states()
    by_version: dict[int, list[dict[str, Any]]] = {}
    for _inc, rec in run.fleet.step_records():
        v = rec.get("version")
        if isinstance(v, int):
            by_version.setdefault(v, []).append(rec)
    out: dict[str, Any] = {
        "prompts_lost": None,
        "prompts_unreturned": None,
        "accepted_twice": None,
        "accepted_wrong_state": None,
        "accepted_wrong_version": None,
        "steps_unaccounted": None,
        "prompts_open_at_end": sum(len(p) for p in run.open_prompts.values()),
        "published_ms": {},
    }
    if not by_version:
        return out
    chosen: dict[int, dict[str, Any]] = {}
    for v in range(1, completed + 1):
        cands = by_version.get(v, [])
        # The record of the Trainer whose publication is the committed version (a Trainer
        # killed after publishing a record and before the manifest would leave another).
        good = [r for r in cands if r.get("state") is None or r.get("state") == states.get(v)]
        if good:
            chosen[v] = good[-1]
    unaccounted = [v for v in range(1, completed + 1) if v not in chosen]
    twice = wrong_version = wrong_state = unreturned = lost = 0
    lost_known = state_known = True
    seen: Counter[str] = Counter()
    for v, rec in sorted(chosen.items()):
        g = rec.get("gen_version")
        gen_state = states.get(g) if isinstance(g, int) else None
        used = [_entry(e) for e in rec.get("used", [])]
        twice += int(rec.get("accepted_twice", 0) or 0)
        wrong_version += int(rec.get("accepted_wrong_version", 0) or 0)
        for pid, _actor, _tok, ver, st in used:
            seen[pid] += 1
            if ver is not None and ver != g:
                wrong_version += 1
            if st is None or gen_state is None:
                state_known = False
            elif st != gen_state:
                wrong_state += 1
        back = rec.get("unreturned", [])
        back_ids = _ids(back)
        unreturned += len(back_ids) if back_ids or not isinstance(back, int) else int(back)
        if "prompts" in rec:
            lost += len(_ids(rec["prompts"]) - {u[0] for u in used} - back_ids)
        else:
            lost_known = False
        if isinstance(rec.get("published_ms"), (int, float)):
            out["published_ms"][v] = float(rec["published_ms"])
    twice += sum(n - 1 for n in seen.values() if n > 1)
    out.update(
        prompts_lost=lost if lost_known else None,
        prompts_unreturned=unreturned,
        accepted_twice=twice,
        accepted_wrong_state=wrong_state if state_known else None,
        accepted_wrong_version=wrong_version,
        steps_unaccounted=len(unaccounted),
    )
    return out


# -- time ----------------------------------------------------------------------------------------
def _stall(run: ChaosRun, completed: int, published_ms: dict[int, float], end_wall: float) -> tuple[float | None, list[int]]:
    """Longest time with no version published, from v0 on (and up to the end if the run stopped short)."""
    times: dict[int, float] = {}
    for v, (_, wall, _inc) in run.fleet.versions.items():
        if v <= completed:
            times[v] = wall
    for v, ms in published_ms.items():
        times[v] = ms / 1000
    if not times:
        return None, []
    seq = sorted(times.items())
    best, at = 0.0, [seq[0][0], seq[0][0]]
    for (a, ta), (b, tb) in zip(seq, seq[1:], strict=False):
        if tb - ta > best:
            best, at = tb - ta, [a, b]
    if completed < run.cfg.steps and end_wall - seq[-1][1] > best:
        best, at = end_wall - seq[-1][1], [seq[-1][0], -1]
    return round(best, 2), at


# -- faults --------------------------------------------------------------------------------------
def _first(lines: list[tuple[float, str]]) -> str | None:
    return clean_line(lines[0][1]) if lines else None


def _successor_note(inc: Incarnation) -> str:
    if inc.role == "actor":
        boots = inc.lines_since(inc.started, BOOT_RE)
        if boots:
            m = BOOT_RE.search(boots[0][1])
            return f"{inc.label} bootstrapped at v{m.group(1) if m else '?'} {boots[0][0] - inc.started:.1f}s after its start"
        return f"{inc.label} never bootstrapped" + (
            f" (exited rc {inc.rc}: {clean_line(inc.last_line())})" if inc.ended is not None and inc.ended_by is None else ""
        )
    if inc.role == "trainer":
        parts = []
        res = inc.lines_since(inc.started, RESUMED_RE)
        if res:
            parts.append(clean_line(res[0][1], 110))
        steps = inc.lines_since(inc.started, STEP_RE)
        if steps:
            m = STEP_RE.search(steps[0][1])
            parts.append(f"{inc.label} published v{m.group(2) if m else '?'} {steps[0][0] - inc.started:.1f}s after its start")
        elif inc.ended is not None and inc.ended_by is None:
            parts.append(f"{inc.label} exited rc {inc.rc} publishing nothing: {_problem_line(inc)}")
        else:
            parts.append(f"{inc.label} published nothing")
        return "; ".join(parts)
    return f"{inc.label} " + (
        "running at the end" if inc.ended is None or inc.ended_by is not None else f"exited rc {inc.rc}: {_problem_line(inc)}"
    )


def _problem_line(inc: Incarnation) -> str:
    for _, ln in reversed(inc.lines):
        if _PROBLEM.search(ln):
            return clean_line(ln)
    return clean_line(inc.last_line())


def _fault_json(run: ChaosRun, rec: FaultRecord, now: float) -> dict[str, Any]:
    f = run.fleet
    out: dict[str, Any] = {
        "fault": rec.name,
        "title": rec.title,
        "trigger_version": rec.trigger,
        "injected": rec.injected and rec.error is None,
        "at_version": rec.at_version if rec.injected else None,
        "phase": rec.phase or None,
        "notes": list(rec.notes),
        "error": rec.error,
        "duration_s": round(rec.t_lifted - rec.t_start, 2) if rec.injected and rec.t_lifted else None,
        "next_version": None,
        "recovery_s": None,
    }
    if not rec.injected or rec.error:
        out["outcome"] = rec.error or "not injected"
        return out
    if rec.t_lifted < rec.t_start:
        # The bench ended (its timeout, an abort) inside the fault: nothing was lifted, so nothing happened
        # "after" it; judged from an unset lift time, every line the victim ever wrote would read as late
        # (an old Trainer that was never woken reported as publishing after waking).
        successors = "; ".join(_successor_note(inc) for inc in rec.successors)
        out["outcome"] = "not lifted: the bench ended during the fault" + (f"; {successors}" if successors else "")
        return out
    after = sorted((v, t) for v, (t, _, _) in f.versions.items() if v > rec.head_lifted)
    said: list[str] = []
    if after:
        out["next_version"], t = after[0][0], after[0][1]
        out["recovery_s"] = round(max(0.0, t - rec.t_lifted), 2)
        said.append(f"v{after[0][0]} {out['recovery_s']:.1f}s after")
        window_end = t + 5.0
    elif rec.head_lifted >= run.cfg.steps:
        said.append(f"the run finished (v{rec.head_lifted}) during the fault")
        window_end = rec.t_lifted + 5.0
    else:
        said.append("no version after it")
        window_end = now
    starts = sorted({i.label for i in f.all for ts, _ in i.lines_since(rec.t_start, OUTAGE_START) if ts <= window_end})
    ends = sorted({i.label for i in f.all for ts, _ in i.lines_since(rec.t_start, OUTAGE_END) if ts <= window_end})
    if starts:
        said.append(f"outage logged by {', '.join(starts)}" + (f" (over: {', '.join(ends)})" if ends else ""))
    for inc in rec.successors:
        said.append(_successor_note(inc))
    if rec.name == "actor-stop" and rec.victims:
        seen = rec.victims[0].lines_since(rec.t_lifted, _STOPPED_SEEN)[:2]
        said.extend(f"{rec.victims[0].label} after SIGCONT: {clean_line(ln, 100)}" for _, ln in seen)
    if rec.name == "old-trainer" and rec.victims:
        old = rec.victims[0]
        late = [int(m.group(2)) for _, ln in old.lines_since(rec.t_lifted, STEP_RE) if (m := STEP_RE.search(ln))]
        out["old_trainer_published"] = late
        if late:
            said.append(f"WOKEN TRAINER PUBLISHED {', '.join(f'v{v}' for v in late)}")
        if old.ended is not None and old.ended_by is None:
            said.append(f"woken Trainer exited rc {old.rc} {old.ended - rec.t_lifted:.1f}s after waking: {_problem_line(old)}")
        elif old.ended_by:
            said.append(f"woken Trainer did not exit by itself ({old.ended_by} by the harness)")
    if rec.name == "corrupt" and rec.victims:
        v = rec.victims[0]
        hit = _first(v.lines_since(rec.t_start, _CORRUPT_SEEN))
        said.append(f"{v.label} saw: {hit}" if hit else f"{v.label} logged nothing about the corrupted object")
    if rec.name == "relay-kill":
        for name in run.relay_actors:
            actor = f.current.get(name)
            if actor is not None:
                hit = _first([x for x in actor.lines_since(rec.t_start, _ORIGIN_SEEN) if x[0] <= window_end])
                if hit:
                    said.append(f"{actor.label}: {hit}")
    victims = {id(v) for v in rec.victims} | {id(v) for v in run.fenced}
    for inc in f.all:
        if id(inc) in victims or inc.ended is None or inc.ended_by is not None or inc in rec.successors:
            continue
        if rec.t_start <= inc.ended <= window_end and not (inc.role == "trainer" and inc.rc == 0):
            said.append(f"{inc.label} EXITED rc {inc.rc}: {_problem_line(inc)}")
    out["outcome"] = "; ".join(said)
    return out


def _unexpected_exits(run: ChaosRun, finished: bool) -> list[dict[str, Any]]:
    """Workers that exited by themselves, but for the last Trainer finishing and woken old-epoch ones."""
    fenced = {id(i) for i in run.fenced}
    out = []
    for inc in run.fleet.all:
        if inc.ended is None or inc.ended_by is not None or id(inc) in fenced:
            continue
        if inc.role == "trainer" and inc.rc == 0 and finished and inc is run.fleet.trainer():
            continue
        out.append({"worker": inc.label, "rc": inc.rc, "after_s": round(inc.ended - run.t0, 1), "last": _problem_line(inc)})
    return out


# -- all of it -------------------------------------------------------------------------------------
def summarize(run: ChaosRun) -> dict[str, Any]:
    """The JSON object of ``aurora bench chaos --json`` (docs/BENCHMARKS.md defines each key)."""
    cfg = run.cfg
    now = time.monotonic()
    chain = _chain(run)
    completed = chain["completed"]
    digests = _digests(run)
    prompts = _prompts(run, completed)
    published_ms = prompts.pop("published_ms")
    stall, stall_at = _stall(run, completed, published_ms, time.time())
    resumes = sum(1 for i in run.fleet.incarnations("trainer") if i.resumed and i.lines_since(i.started, STEP_RE))
    faults = [_fault_json(run, r, now) for r in run.records]
    old_published = [v for fj in faults for v in fj.get("old_trainer_published", [])]
    exits = _unexpected_exits(run, completed >= cfg.steps)
    kb, ka = run.keys_before or (-1, -1), run.keys_after or (-1, -1)
    missing = []
    if digests["bit_identical"] is None:
        missing.append("digest files (AURORA_DIGEST_LOG): no line written")
    if prompts["steps_unaccounted"] is None:
        missing.append(f"the Trainer's per-step JSON lines ('{STEP_JSON_MARKER}{{...}}'): none found")
    elif prompts["accepted_wrong_state"] is None:
        missing.append("the state each used result carried (field 5 of the step lines' 'used' entries)")
    out: dict[str, Any] = {
        "steps_requested": cfg.steps,
        "steps_completed": completed,
        "faults_planned": len(cfg.schedule),
        "faults_injected": sum(1 for fj in faults if fj["injected"]),
        "trainer_resumes": resumes,
        "prompts_lost": prompts["prompts_lost"],
        "prompts_unreturned": prompts["prompts_unreturned"],
        "accepted_twice": prompts["accepted_twice"],
        "accepted_wrong_state": prompts["accepted_wrong_state"],
        "accepted_wrong_version": prompts["accepted_wrong_version"],
        "bit_identical": digests["bit_identical"],
        "activations_compared": digests["activations_compared"],
        "max_stall_s": stall,
        "max_stall_between": stall_at,
        "redis_keys_before_after": {"before": kb[0], "after": ka[0]},
        "redis_memory_before_after": {"before": kb[1], "after": ka[1]},
        "steps_unaccounted": prompts["steps_unaccounted"],
        "prompts_open_at_end": prompts["prompts_open_at_end"],
        "epochs": sorted(set(chain["epochs"].values())),
        "epoch_regressions": chain["epoch_regressions"],
        "old_trainer_published": old_published,
        "chain_problems": chain["problems"],
        "digest_mismatches": [list(x) for x in digests["mismatches"]],
        "digests_uncompared": [list(x) for x in digests["uncompared"]],
        "trainer_digest_conflicts": digests["trainer_digest_conflicts"],
        "unexpected_exits": exits,
        "faults": faults,
        "timed_out": run.timed_out,
        "aborted": run.aborted,
        "evidence_missing": missing,
        "wall_s": round(run.wall_s, 1),
        "workdir": run.workdir,
    }
    out["targets"] = _targets(out, cfg.actors_relay + cfg.actors_origin)
    return out


def _targets(out: dict[str, Any], actors: int) -> dict[str, Any]:
    need = actors * out["steps_requested"] // 2
    checks = {
        "steps_completed": out["steps_completed"] == out["steps_requested"],
        "faults_injected": out["faults_injected"] == out["faults_planned"],
        "prompts_lost": out["prompts_lost"] == 0,
        "accepted_twice": out["accepted_twice"] == 0,
        "accepted_wrong_state": out["accepted_wrong_state"] == 0,
        "accepted_wrong_version": out["accepted_wrong_version"] == 0,
        "steps_unaccounted": out["steps_unaccounted"] == 0,
        "bit_identical": out["bit_identical"] is True,
        "activations_compared": out["activations_compared"] >= need,
        "fenced": not out["old_trainer_published"] and out["epoch_regressions"] == 0,
        "unexpected_exits": not out["unexpected_exits"],
        "timed_out": not out["timed_out"],
    }
    return {"met": all(checks.values()), "failed": [k for k, ok in checks.items() if not ok], "activations_compared_min": need}
