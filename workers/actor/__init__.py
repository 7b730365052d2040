"""The Actor: bootstrap, stage, activate, generate, settle (docs/WORKERS.md).

- :mod:`workers.actor.config`: :class:`ActorConfig` (``AURORA_ACTOR_*``) and :class:`ActorStats`;
- :mod:`workers.actor.actor`: the :class:`Actor`, wired from its parts and owning their threads:
  :mod:`~workers.actor.context` (dependencies), :mod:`~workers.actor.holding` (what its threads
  share), :mod:`~workers.actor.boot`, :mod:`~workers.actor.stager` with :mod:`~workers.actor.staging`,
  :mod:`~workers.actor.sources` and :mod:`~workers.actor.fetch`, :mod:`~workers.actor.safepoint`,
  :mod:`~workers.actor.work` and :mod:`~workers.actor.membership`;
- :mod:`workers.actor.cli`: ``aurora actor`` options and :func:`run_until_stopped`.
"""

from workers.actor.actor import Actor
from workers.actor.cli import add_arguments, config_from_args, main, run_until_stopped
from workers.actor.config import ActorConfig, ActorStats

__all__ = ["Actor", "ActorConfig", "ActorStats", "add_arguments", "config_from_args", "main", "run_until_stopped"]
