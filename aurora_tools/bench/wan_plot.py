"""PNG plots of ``aurora bench wan`` results (matplotlib, Agg backend), one per experiment."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["write_plots"]

_MODE_ORDER = ("ideal", "full", "full-async2", "full-async4", "full-multistream", "delta-1stream", "delta")


def _ok(results: Sequence[Mapping[str, Any]], exp: str) -> list[Mapping[str, Any]]:
    return [r for r in results if exp in r["experiments"] and not r.get("error") and r.get("tokens_per_s")]


def write_plots(out: Mapping[str, Any], folder: str) -> list[str]:
    """Write one PNG per experiment that has results; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    res: Sequence[Mapping[str, Any]] = out["configs"]
    size = f"{out['params'] / 1e9:.2g} B params"
    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        path = os.path.join(folder, name)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    rs = sorted(_ok(res, "modes"), key=lambda r: _MODE_ORDER.index(r["mode"]))
    if rs:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        vals = [r.get("throughput_vs_ideal") or 0 for r in rs]
        bars = ax.bar(
            [r["mode"] for r in rs],
            vals,
            color=["#777" if r["mode"] == "ideal" else "#c44" if r["transfer"] == "full" else "#36c" for r in rs],
        )
        for b, v in zip(bars, vals, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, v + 0.02, f"{v:.2f}", ha="center", fontsize=8)
        r0 = rs[0]
        ax.set_ylabel("throughput / ideal")
        ax.set_ylim(0, 1.15)
        ax.set_title(f"Throughput by mode ({size}, {_link(r0)}, {r0['actors']} Actors)", fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
        save(fig, "wan_modes.png")

    rs = [r for r in _ok(res, "bandwidth") if r["mode"] in ("full", "delta") and r.get("transfer_s")]
    if rs:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        top = max((r["link_gbps"] or 0) for r in rs) or 1.0
        for mode, color in (("full", "#c44"), ("delta", "#36c")):
            pts = sorted(((r["link_gbps"] or out.get("measured_max_gbps") or 2 * top), r["transfer_s"]) for r in rs if r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=mode)
        ideal = [r for r in _ok(res, "bandwidth") if r["mode"] == "ideal"]
        if ideal:
            ax.axhline(ideal[0]["gen_window_s"], color="#777", ls="--", lw=1, label="generation window")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate, Gbit/s (rightmost: unshaped)")
        ax.set_ylabel("publish to staged, s")
        ax.set_title(f"Transfer time per version vs bandwidth ({size}, 1 Actor)", fontsize=10)
        ax.legend(fontsize=8)
        save(fig, "wan_bandwidth.png")

    rs = [r for r in _ok(res, "streams") if r.get("transfer_s")]
    if rs:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        labels = [f"{r['transfer']}\nS={r['streams']}" for r in rs]
        bars = ax.bar(labels, [r["transfer_s"] for r in rs], color=["#c44" if r["transfer"] == "full" else "#36c" for r in rs])
        for b, r in zip(bars, rs, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, r["transfer_s"], f"{r['transfer_s']:.2f}s", ha="center", va="bottom", fontsize=8)
        ts = [r["transfer_s"] for r in rs]
        if max(ts) > 20 * min(ts):
            ax.set_yscale("log")
        ax.set_ylabel("publish to staged, s")
        ax.set_title(f"One vs several streams ({_link(rs[0])}, {size})", fontsize=8)
        save(fig, "wan_streams.png")

    rs = [r for r in _ok(res, "relay") if r["mode"] == "delta" and r.get("object_bytes_per_version")]
    if rs:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for relay, color, label in ((True, "#36c", "with Relay"), (False, "#c44", "without Relay")):
            pts = sorted((r["actors"], r["object_bytes_per_version"] / 1e6) for r in rs if r["relay"] == relay)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        d = [r["version_bytes"] / 1e6 for r in rs if r.get("version_bytes")]
        if d:
            ax.axhline(sum(d) / len(d), color="#777", ls="--", lw=1, label="one delta")
        ax.set_xlabel("Actors in the region")
        ax.set_ylabel("MB into the region per version")
        ax.set_xticks(sorted({r["actors"] for r in rs}))
        ax.set_title(f"Cross-region bytes per version ({size})", fontsize=10)
        ax.legend(fontsize=8)
        save(fig, "wan_relay.png")

    rs = _ok(res, "hetero")
    if rs:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        bars = ax.bar(
            [r["split"] for r in rs], [r["tokens_per_s"] for r in rs], color=["#c44" if r["split"] == "uniform" else "#36c" for r in rs]
        )
        for b, r in zip(bars, rs, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"Split with slowdowns {','.join(f'{s:g}' for s in rs[0]['slowdowns'])}", fontsize=10)
        save(fig, "wan_hetero.png")

    rs = _ok(res, "churn")
    if rs:
        r = rs[0]
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        tl = r["timeline"]
        ax.plot([t["step"] for t in tl], [t["tokens_per_s"] for t in tl], "o-", color="#36c")
        kill, join = _churn_steps(r)
        if kill is not None:
            ax.axvline(kill + 0.5, color="#c44", ls="--", lw=1, label=f"Actor killed after step {kill}")
        if join is not None:
            ax.axvline(join + 0.5, color="#3a3", ls="--", lw=1, label=f"Actor joins after step {join}")
        ax.set_xlabel("step")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("tokens/s")
        ax.set_title(f"Churn: {r['actors']} Actors, {_link(r)}", fontsize=10)
        ax.legend(fontsize=8)
        save(fig, "wan_churn.png")

    rs = _ok(res, "scaling")
    if rs:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for mode, color in (("ideal", "#777"), ("delta", "#36c"), ("full", "#c44")):
            pts = sorted((r["actors"], r["tokens_per_s"]) for r in rs if r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=mode)
        ax.set_xlabel("Actors")
        ax.set_ylabel("tokens/s")
        ax.set_xticks(sorted({r["actors"] for r in rs}))
        ax.set_title(f"Scaling with Actor count ({_link(rs[0])}, {size})", fontsize=10)
        ax.legend(fontsize=8)
        save(fig, "wan_scaling.png")

    rs = [r for r in _ok(res, "regions") if r["mode"] == "delta" and r.get("cross_over_version_by_region")]
    if rs:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        regions = sorted(rs[0]["cross_over_version_by_region"])
        width = 0.8 / len(rs)
        for k, r in enumerate(rs):
            xs = [i + (k - (len(rs) - 1) / 2) * width for i in range(len(regions))]
            ys = [r["cross_over_version_by_region"].get(g, 0.0) for g in regions]
            ax.bar(
                xs, ys, width, color="#36c" if r["relay"] else "#c44", label="with a Relay per region" if r["relay"] else "without Relays"
            )
        ax.axhline(1.0, color="#777", ls="--", lw=1, label="one delta")
        ax.set_xticks(range(len(regions)))
        ax.set_xticklabels([f"{g} ({link})" for g, link in zip(regions, rs[0].get("regions") or regions, strict=False)])
        ax.set_ylabel("deltas into the region per version")
        ax.set_title(f"Two Actor regions, {rs[0]['actors'] // len(regions)} Actors each ({size})", fontsize=10)
        ax.legend(fontsize=8)
        save(fig, "wan_regions.png")
    return written


def _link(r: Mapping[str, Any]) -> str:
    rate = "unshaped" if r["link_gbps"] is None else f"{r['link_gbps']:g} Gbit/s"
    stalls = f", stalls {r['stall_prob']:g}/MiB x {r['stall_ms']:g} ms" if r.get("stall_prob") else ""
    return f"{rate}, {r['rtt_ms']:g} ms RTT{stalls}"


def _churn_steps(r: Mapping[str, Any]) -> tuple[int | None, int | None]:
    return r.get("kill_at"), r.get("join_at")
