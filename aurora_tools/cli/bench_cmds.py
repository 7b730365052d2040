"""``aurora bench codec|transfer|ledger|e2e|wan|chaos|hostile|activate|trainer|verl|fp8``: each benchmark prints a table, or one JSON object.

Each benchmark declares its own options (``add_*_arguments`` import it, so
:mod:`aurora_tools.cli.main` calls them only for the benchmark being run),
except ``bench codec``, whose few options are declared here.
"""

from __future__ import annotations

import argparse

__all__ = [
    "add_codec_arguments",
    "add_transfer_arguments",
    "add_ledger_arguments",
    "add_e2e_arguments",
    "add_wan_arguments",
    "add_chaos_arguments",
    "cmd_bench_codec",
    "cmd_bench_transfer",
    "cmd_bench_ledger",
    "cmd_bench_e2e",
    "cmd_bench_wan",
    "cmd_bench_chaos",
    "add_hostile_arguments",
    "cmd_bench_hostile",
    "add_activate_arguments",
    "cmd_bench_activate",
    "add_trainer_arguments",
    "cmd_bench_trainer",
    "add_verl_arguments",
    "cmd_bench_verl",
    "add_fp8_arguments",
    "cmd_bench_fp8",
]


def add_codec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        type=float,
        default=None,
        help="model size in parameters (e.g. 6e8); default: Qwen3-0.6B shape",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate of the measured step (default 2e-7: about 1%% density)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from aurora_tools.bench.codec import main

    return main(args)


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.transfer import add_arguments

    add_arguments(p)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from aurora_tools.bench.transfer import main

    return main(args)


def add_ledger_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.ledger import add_arguments

    add_arguments(p)


def cmd_bench_ledger(args: argparse.Namespace) -> int:
    from aurora_tools.bench.ledger import main

    return main(args)


def add_e2e_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.e2e import add_arguments

    add_arguments(p)


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from aurora_tools.bench.e2e import main

    return main(args)


def add_wan_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.wan import add_arguments

    add_arguments(p)


def cmd_bench_wan(args: argparse.Namespace) -> int:
    from aurora_tools.bench.wan import main

    return main(args)


def add_chaos_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.chaos import add_arguments

    add_arguments(p)


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    from aurora_tools.bench.chaos import main

    return main(args)


def add_hostile_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.hostile import add_arguments

    add_arguments(p)


def cmd_bench_hostile(args: argparse.Namespace) -> int:
    from aurora_tools.bench.hostile import main

    return main(args)


def add_activate_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.activate import add_arguments

    add_arguments(p)


def cmd_bench_activate(args: argparse.Namespace) -> int:
    from aurora_tools.bench.activate import main

    return main(args)


def add_trainer_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.trainer import add_arguments

    add_arguments(p)


def cmd_bench_trainer(args: argparse.Namespace) -> int:
    from aurora_tools.bench.trainer import main

    return main(args)


def add_verl_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.verl import add_arguments

    add_arguments(p)


def cmd_bench_verl(args: argparse.Namespace) -> int:
    from aurora_tools.bench.verl import main

    return main(args)


def add_fp8_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.bench.fp8 import add_arguments

    add_arguments(p)


def cmd_bench_fp8(args: argparse.Namespace) -> int:
    from aurora_tools.bench.fp8 import main

    return main(args)
