"""The directory ``aurora follow`` keeps: a symlink switched atomically between complete version directories.

``DIR`` is a symlink to ``.NAME.aurora/vNNNNNNNN`` (relative, in DIR's
parent, so the pair can be moved together). A version directory is written
under a temporary name, every file flushed to disk, its marker
``aurora-version.json`` last, then renamed into place; only then does a new
symlink replace ``DIR`` (``os.replace``, atomic on POSIX). A server that
resolves ``DIR`` sees the old complete version or the new complete one,
never a mixture, and never a directory still being written.

Retention: the current version and the one just switched away from. The
previous one is kept until the next switch, so a server that resolved
``DIR`` just before a switch and is still reading the files finds them all;
everything older is removed at each switch. A reader slower than a whole
version interval (a server loading v10 while v11 and v12 are both written)
can lose its files: reload on a signal, not on a timer much faster than the
run publishes. Disk: three versions at most (current, previous, the one
being written).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aurora_store.errors import ConfigError

__all__ = ["MARKER", "Marker", "OutDir"]

log = logging.getLogger("aurora.follow")

MARKER = "aurora-version.json"
"""File of a version directory naming what it holds (written last)."""

_PREFIX = "v"
_TMP = ".tmp-"


@dataclass(frozen=True, slots=True)
class Marker:
    """What ``aurora-version.json`` says: the version a directory holds and how to check it."""

    version: int
    state: str
    weights_digest: str
    run: str | None
    time: str

    def to_json(self) -> bytes:
        return (
            json.dumps(
                {"version": self.version, "state": self.state, "weights_digest": self.weights_digest, "run": self.run, "time": self.time},
                indent=1,
            )
            + "\n"
        ).encode()

    @classmethod
    def read(cls, path: str) -> Marker | None:
        """The marker in directory ``path``; None if it has none or one that does not parse."""
        try:
            with open(os.path.join(path, MARKER), encoding="utf-8") as f:
                d = json.load(f)
            return cls(int(d["version"]), str(d["state"]), str(d["weights_digest"]), d.get("run"), str(d.get("time", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None


class OutDir:
    """``DIR`` and its hidden sibling of version directories; see the module's docstring."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path.rstrip("/") or path)
        parent, name = os.path.split(self.path)
        if not name:
            raise ConfigError(f"--out {path}: not a directory name")
        self.parent = parent
        self.hidden_name = f".{name}.aurora"
        self.hidden = os.path.join(parent, self.hidden_name)
        self._check()

    def _check(self) -> None:
        """Refuse a ``DIR`` that is not ours: a real directory or file, or a symlink elsewhere."""
        if not os.path.isdir(self.parent):
            raise ConfigError(f"--out {self.path}: its parent {self.parent} is not a directory")
        if os.path.islink(self.path):
            target = os.readlink(self.path)
            if os.path.dirname(target) != self.hidden_name:
                raise ConfigError(
                    f"--out {self.path}: a symlink to {target}, not one aurora follow made (to {self.hidden_name}/...): remove it or choose another --out"
                )
            return
        if os.path.lexists(self.path):
            kind = "a directory" if os.path.isdir(self.path) else "a file"
            raise ConfigError(
                f"--out {self.path}: {kind} exists there; aurora follow keeps DIR as a symlink it switches: remove it or choose another --out"
            )

    def current(self) -> tuple[str, Marker] | None:
        """(the directory ``DIR`` points to, its marker); None when there is none yet (or it is unreadable)."""
        if not os.path.islink(self.path):
            return None
        target = os.path.join(self.parent, os.readlink(self.path))
        marker = Marker.read(target)
        return None if marker is None else (target, marker)

    def write(self, marker: Marker, save: Callable[[str], object], files: Mapping[str, bytes]) -> str:
        """A complete version directory for ``marker``: ``save(dir)`` writes the weights, then ``files``, then the marker.

        ``files`` (name -> bytes, the run's model description) are written
        after ``save`` so the run's own config and generation config win over
        whatever ``save_pretrained`` derived. Returns the directory, renamed
        into place (not yet switched to).
        """
        os.makedirs(self.hidden, exist_ok=True)
        final = os.path.join(self.hidden, f"{_PREFIX}{marker.version:08d}")
        tmp = os.path.join(self.hidden, f"{_TMP}{_PREFIX}{marker.version:08d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save(tmp)
        for name, data in files.items():
            _write(os.path.join(tmp, name), data)
        _write(os.path.join(tmp, MARKER), marker.to_json())
        mode = 0o666 & ~_umask()  # readable by the server's user as any file this process creates (save_pretrained's are 0600)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), mode)
            _fsync_path(os.path.join(tmp, name))
        _fsync_path(tmp)
        cur = self.current()
        if os.path.lexists(final):
            if cur is not None and os.path.samefile(cur[0], final):
                raise ConfigError(
                    f"{final}: DIR points there already (version {marker.version} written twice)"
                )  # pragma: no cover - the loop never asks
            shutil.rmtree(final)  # left by a process that stopped before switching to it
        os.rename(tmp, final)
        _fsync_path(self.hidden)
        return final

    def switch(self, version_dir: str) -> str | None:
        """Point ``DIR`` at ``version_dir`` atomically; remove every version directory but it and the previous one.

        Returns the previous directory (None at the first switch).
        """
        cur = self.current()
        rel = os.path.join(self.hidden_name, os.path.basename(version_dir))
        link = os.path.join(self.parent, f".{os.path.basename(self.path)}.aurora-link{_TMP}{os.getpid()}")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(rel, link)
        os.replace(link, self.path)
        _fsync_path(self.parent)
        keep = {os.path.basename(version_dir)} | ({os.path.basename(cur[0])} if cur is not None else set())
        self._remove_all_but(keep)
        return None if cur is None else cur[0]

    def clean_leftovers(self) -> None:
        """At start: remove what a stopped process left (temporary directories and links) and every version directory ``DIR`` does not point to."""
        if not os.path.isdir(self.hidden):
            return
        for name in os.listdir(self.hidden):
            if name.startswith(_TMP):
                shutil.rmtree(os.path.join(self.hidden, name), ignore_errors=True)
        prefix = f".{os.path.basename(self.path)}.aurora-link{_TMP}"
        for name in os.listdir(self.parent):
            if name.startswith(prefix):
                os.unlink(os.path.join(self.parent, name))
        cur = self.current()
        if cur is not None:
            self._remove_all_but({os.path.basename(cur[0])})

    def _remove_all_but(self, keep: set[str]) -> None:
        for name in sorted(os.listdir(self.hidden)):
            if name.startswith(_PREFIX) and name not in keep:
                shutil.rmtree(os.path.join(self.hidden, name), ignore_errors=True)
                log.debug("removed %s", os.path.join(self.hidden, name))


def utc_now() -> str:
    """The time a marker records (UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _fsync_path(path: str) -> None:
    """Flush a file or directory to disk: a switched-to directory survives a crash complete."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
