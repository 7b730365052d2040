"""``aurora follow``: keep a local directory holding a run's newest version as a Hugging Face checkpoint (docs/WORKERS.md).

- :mod:`workers.follow.switch`: the symlinked directory, switched atomically between complete versions;
- :mod:`workers.follow.follow`: :class:`FollowConfig` and the loop (a :class:`~aurora_store.Follower` per process);
- :mod:`workers.follow.cli`: the options.
"""

from workers.follow.cli import add_arguments, config_from_args, main
from workers.follow.follow import FollowConfig, follow

__all__ = ["FollowConfig", "add_arguments", "config_from_args", "follow", "main"]
