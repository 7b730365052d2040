"""The options of ``aurora bench transfer``, its defaults and targets, and the object sizes it derives."""

from __future__ import annotations

import argparse
import math
from typing import Any

from aurora_store.config import DEFAULT_STREAMS

__all__ = ["DEFAULT_PARAMS", "TARGET_SPEEDUP", "TARGET_OVER_RAW", "MIB", "add_arguments", "auto_size", "encode_options"]

#: Default model size: Qwen3-0.6B's geometry cut to 6 of its 28 layers (about
#: 250 M parameters, 0.5 GB of bf16). Making the synthetic update costs about
#: 0.17 s per million parameters on two cores (an fp32 master copy, one
#: step), and every full-weights transfer is repeated four times, so the
#: whole 0.6 B model would not fit a run of a few minutes; 250 M keeps the
#: tied 151936 x 1024 embedding (the largest single tensor) and real layers.
DEFAULT_PARAMS = 2.5e8
#: Targets reported (not asserted).
TARGET_SPEEDUP = 1.4
TARGET_OVER_RAW = 1.3
MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=float,
        default=None,
        help=f"model size in parameters (default {DEFAULT_PARAMS:.3g}: Qwen3-0.6B geometry, 6 layers)",
    )
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS, help="connections of the parallel runs (S)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--lr",
        type=float,
        default=2.5e-7,
        help="step size of the synthetic update (2.5e-7: about 1.3%% density in steady state)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="steps taken before the measured one (the first step off a fresh master "
        "changes about 0.2%% more elements than a steady-state step)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="delta runs per connection count (best reported)")
    parser.add_argument(
        "--full-repeats",
        type=int,
        default=1,
        help="full-weights runs per connection count (best reported)",
    )
    parser.add_argument(
        "--segment-mib",
        type=float,
        default=0.0,
        help="delta segment size; 0 (default) cuts the delta into about 2 x streams segments (<= 16 MiB)",
    )
    parser.add_argument(
        "--shard-mib",
        type=float,
        default=0.0,
        help="snapshot shard size; 0 (default) aims at about 2 x streams shards (<= 1 GiB)",
    )
    parser.add_argument(
        "--server",
        choices=("process", "thread"),
        default="process",
        help="run moto in a child process (default: it then has its own interpreter lock) or in a thread of this one",
    )
    parser.add_argument(
        "--s3",
        choices=("moto", "rclone"),
        default="moto",
        help="S3 server: moto (objects in memory) or rclone (`rclone serve s3`, objects in files; it ignores "
        "conditional writes, so every version commits through a persistent Redis)",
    )
    parser.add_argument("--no-full", action="store_true", help="skip the full-weights runs")
    parser.add_argument(
        "--value-modes",
        default="",
        help="comma list the encoder may choose from (new,xor); default: the library's EncodeOptions",
    )
    parser.add_argument(
        "--index-encodings",
        default="",
        help="comma list (leb128,bitmask,dense,u32,u64); default: the library's EncodeOptions",
    )
    parser.add_argument(
        "--s3fs-max-concurrency",
        type=int,
        default=0,
        help="s3fs max_concurrency of the pipeline's store (0: s3fs's default, 10 requests per large object)",
    )
    parser.add_argument("--no-boto3", action="store_true", help="skip the raw boto3 reference runs")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="put Aurora's WAN proxy (a child process) between client and server with this round-trip time; "
        "0 (default): talk to the loopback server directly",
    )
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="with the proxy: rate limit of the link in Mbit/s (0: none)")


def auto_size(total: int, streams: int, floor: int, ceiling: int) -> int:
    """Object size that cuts ``total`` bytes into about 2 x ``streams`` objects."""
    return int(min(ceiling, max(floor, math.ceil(total / (2 * streams)))))


def encode_options(args: argparse.Namespace) -> Any:
    from aurora_store.codec.entries import EncodeOptions

    kw: dict[str, Any] = {}
    for flag, name in (("value_modes", "value_modes"), ("index_encodings", "index_encodings")):
        raw = str(getattr(args, flag, "") or "")
        if raw:
            kw[name] = tuple(x.strip() for x in raw.split(",") if x.strip())
    return EncodeOptions(**kw)
