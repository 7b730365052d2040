"""What an engine that reads the store itself (vLLM) reports holding, against what the Actor checked.

Why: such an engine's workers fetch versions in processes of their own. A
second read of a manifest can get other bytes than the Actor's first (a
mirror that changes its answer between two reads, same ``base_state``):
the workers would then hold weights the Actor never checked, and it would
settle rollouts of them under the true state. So the Actor hands the
manifests it checked to the engine (which reads none of them again), and
compares every state the engine reports staging or reaching with them;
any difference is an :class:`~aurora_store.errors.IntegrityError`, which the
Actor treats like any version that fails validation: refused (from a
mirror: read from origin instead), quarantined at origin.
"""

from __future__ import annotations

from collections.abc import Sequence

from aurora_store.errors import ChainError, IntegrityError
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import Manifest
from workers.engine import RemoteStaged

__all__ = ["check_chain", "check_reached", "check_staged"]


def check_staged(version: int, checked: Manifest, reported: Manifest, staged: RemoteStaged | StagedDelta) -> None:
    """Refuse a delta the engine staged under another manifest or state than the one checked here."""
    state = staged.state if isinstance(staged, RemoteStaged) else None  # the workers' state; a StagedDelta carries none
    if reported.state != checked.state or (state is not None and state != checked.state) or staged.version != version:
        raise IntegrityError(
            f"delta {version}: the engine staged v{staged.version} with state {state or reported.state}, "
            f"the manifest checked by the Actor says {checked.state}; refused"
        )


def check_chain(chain: Sequence[Manifest]) -> int | None:
    """The version of the first manifest of ``chain`` (snapshot, deltas) that does not continue the one before; None if whole."""
    for prev, m in zip(chain, chain[1:], strict=False):
        if m.kind != "delta" or m.version != prev.version + 1 or m.base_state != prev.state:
            return m.version
    return None


def check_reached(version: int, state: str, reached: tuple[int, str]) -> None:
    """Refuse an engine that reached another (version, state) than the chain the Actor checked ends at."""
    if tuple(reached) != (version, state):
        raise IntegrityError(f"the engine reached v{reached[0]} ({reached[1]}), the Actor checked v{version} ({state}); refused")


def chain_error(version: int, chain: Sequence[Manifest]) -> ChainError:
    """The error of a chain whose manifest of ``version`` does not continue the one before."""
    states = {m.version: m.state for m in chain}
    return ChainError(f"delta {version}: base_state does not continue v{version - 1} ({states.get(version - 1)})")
