"""``aurora``: one command line for the library and the workers.

- :mod:`.main`: the parser (every subcommand, flag and help text) and :func:`main`;
- :mod:`.codec_cmds`: ``snapshot create``, ``delta create``, ``delta apply``;
- :mod:`.store_cmds`: ``lineage``, ``verify``, ``gc``;
- :mod:`.run_cmds`: ``trainer``, ``actor``, ``relay``, ``status``, ``testbed``, ``demo``;
- :mod:`.bench_cmds`: ``bench codec|transfer|ledger|e2e|wan``.

Importing any of them is cheap: a subcommand imports what it needs (torch,
the workers, a benchmark) only when it runs, and the options of subcommands
declared by heavy modules are added only when that subcommand is parsed.
"""

from __future__ import annotations

from aurora_tools.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
