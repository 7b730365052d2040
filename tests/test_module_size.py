"""No module of the library or of the workers is over 500 lines, as ``wc -l`` counts them.

A module that grows past that is split into cohesive parts (see the modules
table in docs/ARCHITECTURE.md), so that each can be read whole.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("aurora_store", "workers")
MAX_LINES = 500


def _lines(path: Path) -> int:
    """Newline characters in the file: what ``wc -l`` prints."""
    return path.read_bytes().count(b"\n")


def test_no_module_is_over_500_lines() -> None:
    modules = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(modules) > 50  # the packages were found
    over = [(p.relative_to(ROOT).as_posix(), n) for p in modules if (n := _lines(p)) > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines (wc -l), split them:\n" + "\n".join(
        f"  {path}: {n}" for path, n in sorted(over, key=lambda o: -o[1])
    )
