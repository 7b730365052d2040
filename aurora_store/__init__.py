"""Aurora: versioned sparse delta checkpoints for RL policy updates.

The library a user imports: codec, format, store, lineage. It knows nothing
about training loops; ``workers`` builds the Trainer, Actor and Relay on it.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
