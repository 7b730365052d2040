"""The Actor: bootstrap, stage, activate, generate, settle (docs/WORKERS.md).

- :mod:`workers.actor.config`: :class:`ActorConfig` (``AURORA_ACTOR_*``) and :class:`ActorStats`;
- :mod:`workers.actor.actor`: the :class:`Actor` process (stager thread, safe-point activation, claims);
- :mod:`workers.actor.cli`: ``aurora actor`` options and :func:`run_until_stopped`.
"""

from workers.actor.actor import Actor
from workers.actor.cli import add_arguments, config_from_args, main, run_until_stopped
from workers.actor.config import ActorConfig, ActorStats

__all__ = ["Actor", "ActorConfig", "ActorStats", "add_arguments", "config_from_args", "main", "run_until_stopped"]
