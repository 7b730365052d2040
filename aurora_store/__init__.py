"""Aurora: versioned sparse delta checkpoints for RL policy updates.

The public API is four names (docs/API.md): :class:`Publisher` publishes
the versions of a run from any trainer, :class:`Follower` brings any set of
tensors (a model, a state dict, an inference engine) to a version, and
:class:`Published` / :class:`Updated` say what each call did. Below them is
the library (codec, format, storage, lineage, coordination); ``workers``
builds the Trainer, Actor and Relay on it.

The names are imported on first use, so ``import aurora_store`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aurora_store.version import __version__

__all__ = ["Follower", "Published", "Publisher", "Updated", "__version__"]

if TYPE_CHECKING:
    from aurora_store.api import Follower, Published, Publisher, Updated


def __getattr__(name: str) -> Any:
    if name in ("Follower", "Published", "Publisher", "Updated"):
        from aurora_store import api

        return getattr(api, name)
    raise AttributeError(f"module 'aurora_store' has no attribute {name!r}")
