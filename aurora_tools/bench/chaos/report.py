"""The table ``aurora bench chaos`` prints: each fault, the phase it hit, what the run did; then the verdict."""

from __future__ import annotations

import textwrap
from typing import Any

__all__ = ["table", "METRICS"]

METRICS = (
    "steps_requested",
    "steps_completed",
    "faults_injected",
    "trainer_resumes",
    "prompts_lost",
    "prompts_unreturned",
    "accepted_twice",
    "accepted_wrong_state",
    "accepted_wrong_version",
    "bit_identical",
    "activations_compared",
    "max_stall_s",
    "redis_keys_before_after",
)
"""The keys issue 12 asks of ``--json``, in the order the table prints them."""

_W = {"n": 2, "fault": 34, "at": 4, "phase": 36, "did": 64}


def _cell(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def table(res: dict[str, Any]) -> str:
    lines = [
        f"{'#':>{_W['n']}}  {'fault':<{_W['fault']}}  {'at':<{_W['at']}}  {'phase':<{_W['phase']}}  what the run did",
        "-" * (sum(_W.values()) + 8),
    ]
    for i, f in enumerate(res.get("faults", []), 1):
        at = f"v{f['at_version']}" if f.get("at_version") is not None else "-"
        did = f.get("outcome") or ""
        if f.get("notes") and f.get("injected"):
            did = "; ".join(f["notes"]) + "; " + did
        cols = [_cell(f["title"], _W["fault"]), _cell(f.get("phase") or "-", _W["phase"]), _cell(did, _W["did"])]
        for row in range(max(len(c) for c in cols)):
            title, phase, what = (c[row] if row < len(c) else "" for c in cols)
            lines.append(
                f"{(str(i) if row == 0 else ''):>{_W['n']}}  {title:<{_W['fault']}}  {(at if row == 0 else ''):<{_W['at']}}  {phase:<{_W['phase']}}  {what}"
            )
    lines.append("")
    for k in METRICS:
        v = res.get(k)
        if k == "redis_keys_before_after" and isinstance(v, dict):
            v = f"{v.get('before')} -> {v.get('after')}"
        elif k == "faults_injected":
            v = f"{v}/{res.get('faults_planned')}"
        elif k == "max_stall_s" and res.get("max_stall_between"):
            a, b = res["max_stall_between"]
            v = f"{v} (v{a} -> {'end' if b < 0 else f'v{b}'})"
        lines.append(f"{k:<24} {'n/a (no evidence)' if v is None else v}")
    for label, key in (
        ("unexpected exits", "unexpected_exits"),
        ("chain problems", "chain_problems"),
        ("digest mismatches", "digest_mismatches"),
        ("activations with no Trainer digest", "digests_uncompared"),
        ("evidence missing", "evidence_missing"),
    ):
        items = res.get(key) or []
        if items:
            lines.append(f"{label}: " + "; ".join(_short(x) for x in items[:6]) + (" …" if len(items) > 6 else ""))
    t = res.get("targets", {})
    verdict = "met" if t.get("met") else f"NOT met ({', '.join(t.get('failed', []))})"
    extra = " (global timeout)" if res.get("timed_out") else (f" ({res['aborted']})" if res.get("aborted") else "")
    logs = f"logs in {res['workdir']}/logs" if res.get("workdir") else "logs removed (--dir keeps them)"
    lines.append(f"targets {verdict}{extra}; {res.get('wall_s')}s; {logs}")
    return "\n".join(lines)


def _short(x: Any) -> str:
    if isinstance(x, dict):
        return f"{x.get('worker')} rc {x.get('rc')}: {x.get('last')}"
    if isinstance(x, list):
        return "/".join(str(i) for i in x)
    return str(x)
