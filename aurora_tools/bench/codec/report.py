"""The table of ``aurora bench codec``, and its entry point."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from aurora_store.codec import kernels
from aurora_tools.bench.codec.benchmark import DEFAULT_LR, DENSITY_BAND, ROWS, CodecReport, run
from aurora_tools.bench.codec.measure import Progress
from aurora_tools.synthetic.shapes import QWEN3_0_6B, shape_for_params

__all__ = ["format_table", "main"]

_LABELS = {
    "u64": "u64 (naive)",
    "u32": "u32 (naive)",
    "leb128": "leb128 (paper)",
    "xor_zstd": "xor_zstd",
    "auto": "auto (fmt 1)",
    "auto_v2": "auto_v2 (dflt)",
    "zstd_u32": "zstd_u32 (ref.)",
}


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _path_text(d: Mapping[str, Any]) -> str:
    if d["kernel_path"] == "jit":
        return f"jit (numba {d['numba_version']} compiled kernels; compile or cache load {d['jit_warmup_s']:.2f} s, not timed)"
    if d["numba_version"] is None:
        return "numpy (numba is not installed)"
    return f"numpy ({kernels.JIT_ENV}=1; numba {d['numba_version']} available)"


def _m(rate: float | None) -> float | None:
    return None if rate is None else rate / 1e6


def format_table(report: CodecReport) -> str:
    d = report.data
    nnz = d["changed"]
    lo, hi = DENSITY_BAND
    lines = [
        f"Aurora codec benchmark: {d['model']}, {d['params'] / 1e6:.1f} M parameters "
        f"({d['weight_bytes'] / 1e9:.2f} GB bf16), one RL-like step at lr {d['lr']:g}, seed {d['seed']}",
        f"  changed {nnz:,} of {d['total_elements']:,} elements: density {100 * d['density']:.3f}% "
        f"(target band {100 * lo:g}-{100 * hi:g}%: {'in' if d['density_in_band'] else 'OUT'})",
        f"  timings: one thread (torch.set_num_threads(1)), best of {d['reps']} runs",
        f"  kernels: {_path_text(d)}",
        "",
        f"  {'encoding':<17}{'bytes':>13}{'B/changed':>11}{'vs u64':>8}{'vs full':>9}{'encode':>13}{'decode+apply':>14}  lossless",
        f"  {'':<17}{'':>13}{'':>11}{'':>8}{'':>9}{'M elem/s':>13}{'M elem/s':>14}",
    ]
    u64 = d["payload_bytes"]["u64"]
    for k in ROWS:
        b = d["payload_bytes"][k]
        enc = d["encode_elems_per_s_by_encoding"].get(k)
        dec = d["decode_apply_elems_per_s_by_encoding"].get(k)
        ll = d["lossless_by_encoding"].get(k)
        lines.append(
            f"  {_LABELS[k]:<17}{_fmt(b, ',d', 'n/a'):>13}"
            f"{_fmt(d['bytes_per_changed'][k], '.3f', 'n/a'):>11}"
            f"{_fmt(b / u64 if b and u64 else None, '.3f'):>8}"
            f"{_fmt(d['compression_vs_full'].get(k), '.0f'):>8}x"
            f"{_fmt(None if enc is None else enc / 1e6, '.1f'):>13}"
            f"{_fmt(None if dec is None else dec / 1e6, '.1f'):>14}"
            f"  {'-' if ll is None else ('yes' if ll else 'NO')}"
        )
    gb = d["scan_bytes"] / 1e9
    lines += [
        "",
        f"  memcpy (torch copy_, same {gb:.2f} GB)   {d['memcpy_s']:7.3f} s {d['memcpy_gbps']:7.2f} GB/s",
        f"  extraction (scan base + new)          {d['extract_s']:7.3f} s {d['scan_gbps']:7.2f} GB/s"
        f"  = {d['scan_fraction_of_memcpy']:.2f} x memcpy",
        f"  extraction + auto encoding (fmt 1)    {d['extract_encode_s']:7.3f} s "
        f"{d['extract_encode_gbps']:7.2f} GB/s  = {d['extract_encode_fraction_of_memcpy']:.2f} x memcpy",
        f"  extraction + auto_v2 encoding (fmt 2) {d['extract_encode_s_v2']:7.3f} s "
        f"{d['extract_encode_gbps_v2']:7.2f} GB/s  = {d['extract_encode_fraction_of_memcpy_v2']:.2f} x memcpy",
        "  on CPU time (this process's, what the core did while others also ran):",
        f"    extraction + encoding = {d['extract_encode_fraction_of_memcpy_cpu']:.2f} (fmt 1), "
        f"{d['extract_encode_fraction_of_memcpy_cpu_v2']:.2f} (fmt 2) x memcpy; decode + apply "
        f"{_fmt(_m(d['decode_apply_elems_per_cpu_s']), '.1f')} (fmt 1), "
        f"{_fmt(_m(d['decode_apply_elems_per_cpu_s_v2']), '.1f')} (fmt 2) M elem/s",
        "",
        f"  {'by kernel path':<22}{'jit':>26}{'numpy':>26}",
    ]
    ex, frac = d["extract_s_by_path"], d["scan_fraction_of_memcpy_by_path"]
    da = d["decode_apply_auto_elems_per_s_by_path"]

    def cell(p: str, text: Callable[[str], str]) -> str:
        return f"{text(p) if p in ex else 'n/a':>26}"

    lines += [
        f"  {'extraction':<22}" + "".join(cell(p, lambda p: f"{ex[p]:.3f} s = {frac[p]:.2f} x memcpy") for p in ("jit", "numpy")),
        f"  {'decode + apply (auto)':<22}"
        + "".join(cell(p, lambda p: "-" if da.get(p) is None else f"{da[p] / 1e6:.1f} M elem/s") for p in ("jit", "numpy")),
        f"  both paths bit-identical: {'yes' if d['paths_agree'] else 'NO'}" + ("" if len(ex) > 1 else " (only one path available)"),
        "",
    ]
    for rd in (d.get("real_delta"), d.get("real_delta_band")):
        if not rd:
            continue
        b = rd["bytes_per_changed"]
        lines += [
            f"  real deltas: {rd['model']}, {rd['params'] / 1e6:.2f} M parameters, {rd['deltas']} deltas, "
            f"density {100 * rd['density']:.2f}% ({rd['optimizer']})",
            "    B/changed: "
            + ", ".join(f"{k} {v:.3f}" for k, v in b.items() if v is not None)
            + f"; lossless: {'yes' if rd['lossless'] else 'NO'}",
        ]
    if d.get("real_delta"):
        lines.append("")
    lines += ["  targets"]
    for t in d["targets"]:
        v = t["value"]
        if t["key"] == "lossless":
            shown = "yes" if t["met"] else "no"
        else:
            shown = "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"
        verdict = "met" if t["met"] else "MISSED"
        if "note" in t:
            verdict = f"not judged: {t['note']}"
        lines.append(f"    {t['target']:<56}{shown:>8}  {verdict}")
    load = d["load_avg_1m"]
    lines.append(
        f"  setup {d['setup_s']:.1f} s, total {d['total_s']:.1f} s, peak RSS {d['peak_rss_gb']:.2f} GB, "
        f"load average {load['start']:.1f} -> {load['end']:.1f} on {d['cpus']} CPUs"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``aurora bench codec``; returns the exit status."""
    params = getattr(args, "params", None)
    shape = QWEN3_0_6B if params is None else shape_for_params(float(params))
    lr = getattr(args, "lr", None)
    lr = DEFAULT_LR if lr is None else float(lr)
    if not lr > 0:
        raise ValueError(f"--lr must be positive, got {lr}")
    seed = int(getattr(args, "seed", 0) or 0)
    real = bool(getattr(args, "real", True))
    report = run(shape, lr=lr, seed=seed, progress=Progress(), real=real)
    if getattr(args, "json", False):
        print(report.to_json())
    else:
        print(format_table(report))
    return 0
