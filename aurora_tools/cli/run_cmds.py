"""``aurora trainer|actor|relay|status|testbed|demo``: the processes of a run and the tools around them.

The options of ``trainer``, ``actor``, ``relay`` and ``demo`` are declared
by the workers themselves (``bench synthetic-trainer|synthetic-actor``: the
workers' and the synthetic workload's); the ``add_*``
functions here import them, so :mod:`aurora_tools.cli.main` calls them only
for the subcommand being run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from aurora_store.errors import ConfigError, CoordinationError
from aurora_store.options import resolve as resolve_options
from aurora_store.options import storage_options
from aurora_tools.cli.console import say

__all__ = [
    "add_trainer_arguments",
    "add_actor_arguments",
    "add_relay_arguments",
    "add_demo_arguments",
    "add_follow_arguments",
    "add_synthetic_trainer_arguments",
    "add_synthetic_actor_arguments",
    "cmd_trainer",
    "cmd_synthetic_trainer",
    "cmd_synthetic_actor",
    "cmd_actor",
    "cmd_relay",
    "cmd_follow",
    "cmd_status",
    "cmd_testbed",
    "cmd_demo",
]


# -- trainer and actor: the GRPO workers --
def add_trainer_arguments(p: argparse.ArgumentParser) -> None:
    from workers.trainer import add_arguments

    add_arguments(p)


def _announce(
    worker: str,
    args: argparse.Namespace,
    fill: Callable[[argparse.ArgumentParser], None],
    options: dict[str, Any],
    resolve: Callable[[argparse.Namespace], Any] | None = None,
) -> None:
    """Print the effective options and record them in the run root (:mod:`.config_file`).

    ``resolve``: the worker's ``config_from_args``, for the record's ``resolved`` part; a
    value it refuses is left for the worker itself to report.
    """
    from aurora_tools.cli.config_file import announce

    parser = argparse.ArgumentParser(add_help=False)
    fill(parser)  # the names of the worker's options; the values are the parsed ones
    config = None
    if resolve is not None:
        try:
            config = resolve(args)
        except (ConfigError, OSError, ValueError):
            config = None
    announce(worker, parser, args, options, background=True, config=config)


def cmd_trainer(args: argparse.Namespace) -> int:
    options = storage_options(args.storage_option)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        from workers.trainer import config_from_args

        _announce("trainer", args, add_trainer_arguments, options, config_from_args)
    from workers.trainer import main

    return main(args, options)


def add_actor_arguments(p: argparse.ArgumentParser) -> None:
    from workers.actor import add_arguments

    add_arguments(p)


def _choose_actor_id(args: argparse.Namespace) -> None:
    """A random Actor id chosen now, unless given, so the start's record names this Actor."""
    from workers.actor.config import ENV_PREFIX, ActorConfig

    if not args.actor_id:
        args.actor_id = resolve_options(ActorConfig, ENV_PREFIX).actor_id


def cmd_actor(args: argparse.Namespace) -> int:
    options = storage_options(args.storage_option)
    from workers.actor.cli import config_from_args

    _choose_actor_id(args)
    _announce("actor", args, add_actor_arguments, options, config_from_args)
    from workers.actor import main

    return main(args, options)


# -- the synthetic workload of ``aurora bench wan``: the real workers with simulated compute --
def add_synthetic_trainer_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.synthetic.args import add_trainer_arguments as add_synthetic

    add_trainer_arguments(p)
    add_synthetic(p)


def cmd_synthetic_trainer(args: argparse.Namespace) -> int:
    from aurora_tools.synthetic.args import synthetic_trainer_config
    from aurora_tools.synthetic.trainer import trainer_main

    options = storage_options(args.storage_option)
    _announce("trainer", args, add_synthetic_trainer_arguments, options, synthetic_trainer_config)
    return trainer_main(args, options)


def add_synthetic_actor_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.synthetic.args import add_actor_arguments as add_synthetic

    add_actor_arguments(p)
    add_synthetic(p)


def cmd_synthetic_actor(args: argparse.Namespace) -> int:
    from aurora_tools.synthetic.actor import actor_main

    options = storage_options(args.storage_option)
    _choose_actor_id(args)
    _announce("actor", args, add_synthetic_actor_arguments, options)
    return actor_main(args, options)


# -- relay --
def add_relay_arguments(p: argparse.ArgumentParser) -> None:
    from workers.relay import add_arguments

    add_arguments(p)


def cmd_relay(args: argparse.Namespace) -> int:
    from workers.relay import run_from_args
    from workers.relay.cli import config_from_args

    _announce("relay", args, add_relay_arguments, storage_options(args.storage_option), config_from_args)

    return run_from_args(args)


# -- follow --
def add_follow_arguments(p: argparse.ArgumentParser) -> None:
    from workers.follow import add_arguments

    add_arguments(p)


def cmd_follow(args: argparse.Namespace) -> int:
    """Print the effective options (never recorded in the run root: a follower may hold read-only credentials), then follow."""
    from aurora_tools.cli.config_file import effective_options, render
    from workers.follow import main

    options = storage_options(args.storage_option)
    parser = argparse.ArgumentParser(add_help=False)
    add_follow_arguments(parser)
    cfg = getattr(args, "config_file", None)
    say(render("follow", effective_options(parser, args), getattr(cfg, "path", None)))
    return main(args, options)


# -- status --
def cmd_status(args: argparse.Namespace) -> int:
    import json

    from aurora_store.coordination.redisconn import connect
    from aurora_store.coordination.status import collect_status, render
    from aurora_store.redact import redact_text

    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch {args.watch}: the refresh period must be positive")
    client = connect(args.redis)
    where = args.redis.rsplit("@", 1)[-1]
    tty = sys.stdout.isatty()
    first = True
    try:
        while True:
            try:
                st = collect_status(client, args.run)
                text = json.dumps(st, sort_keys=True) if args.json else render(st)
            except CoordinationError as e:
                reason = e.__cause__ or e  # redis-py's own words, as printed before the translation
                if args.watch is None:
                    raise ConfigError(f"Redis at {where}: {reason}") from None
                text = f"Redis at {where}: {reason} (retrying)"
            text = redact_text(text)  # a mirror URL read from Redis may carry credentials
            if args.watch is not None and tty and not args.json:
                text = "\x1b[H\x1b[2J" + text
            elif args.watch is not None and not first and not args.json:
                text = "\n" + text
            print(text, flush=True)
            first = False
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


# -- testbed --
def cmd_testbed(args: argparse.Namespace) -> int:
    from aurora_tools.testbed.background import start_background, stop_background
    from aurora_tools.testbed.serve import banner, serve
    from aurora_tools.testbed.state import STATE_FILE

    if args.action == "down":
        res = stop_background(args.dir)
        say(f"testbed in {os.path.abspath(args.dir)} stopped: {'; '.join(res['stopped'])}")
        return 0
    if args.background:
        state = start_background(args.dir, args.s3_port, args.redis_port, args.bucket, s3=getattr(args, "s3", "auto"))
        print(banner(state, background=True), flush=True)
        say(f"(state {os.path.join(state['dir'], STATE_FILE)}, log {state['log']})")
        return 0
    return serve(args.dir, args.s3_port, args.redis_port, args.bucket, s3=getattr(args, "s3", "auto"))


# -- demo --
def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.demo.system import add_arguments

    add_arguments(p)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    """``aurora tiny-model``: a model directory (and data) like a user's, made here, for trying ``--model``."""
    from aurora_tools.tinymodel import (
        make_model_dir,
        supervise,
        write_gsm8k_jsonl,
        write_math_jsonl,
    )

    if os.path.exists(args.out):
        raise SystemExit(f"aurora tiny-model: {args.out} exists; pick a new directory")
    if args.supervise_steps and not args.data_dir:
        raise SystemExit("aurora tiny-model: --supervise-steps needs --data-dir (the rows it fine-tunes on)")
    path = make_model_dir(args.out, args.family, seed=args.seed)
    print(f"{path}: a tiny {args.family} (random bf16 weights, safetensors) with a BPE tokenizer and a chat template")
    if args.data_dir:
        os.makedirs(args.data_dir, exist_ok=True)
        g = write_gsm8k_jsonl(os.path.join(args.data_dir, "gsm8k.jsonl"), 200, seed=args.seed)
        m = write_math_jsonl(os.path.join(args.data_dir, "math.jsonl"), 200, seed=args.seed)
        print(f"{g}, {m}: 200 GSM8K-format and 200 MATH-format rows")
        if args.supervise_steps:
            from workers.task import make_task

            pairs = [
                (p.prompt_text, p.solution)
                for name, data in (("gsm8k", g), ("math", m))
                for p in make_task(name, data).train_problems(0, 150, 0)
                if p.solution
            ]
            loss = supervise(path, pairs, steps=args.supervise_steps, seed=args.seed)
            print(f"fine-tuned {args.supervise_steps} steps on {len(pairs)} worked answers (last loss {loss:.3f})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from aurora_tools.demo.system import main

    return main(args)
