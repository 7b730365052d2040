"""Aurora's public API: :class:`Publisher` for any trainer, :class:`Follower` for any inference process.

See docs/API.md. Everything else under ``aurora_store`` is the library
these two are built from, and may change between releases.
"""

from aurora_store.api.follower import Follower, Updated
from aurora_store.api.publisher import Published, Publisher

__all__ = ["Follower", "Published", "Publisher", "Updated"]
