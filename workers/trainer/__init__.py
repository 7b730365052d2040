"""The Trainer: GRPO with one-step asynchrony, every step published as a delta (see :mod:`workers.trainer.trainer`).

Importing this package loads neither torch nor the model: :class:`Trainer`
and :func:`follow` are imported from :mod:`workers.trainer.trainer` by
whoever runs one.
"""

from workers.trainer.cli import add_arguments, config_from_args, main
from workers.trainer.config import TrainerConfig
from workers.trainer.publishing import unshipped_state

__all__ = ["TrainerConfig", "add_arguments", "config_from_args", "main", "unshipped_state"]
