"""Install the bundled wheels a machine lacks into a folder for ``PYTHONPATH`` (stdlib only).

``make gpu-check`` runs this file with the GPU machine's own ``python3``
before anything of the project is importable::

    python3 aurora_tools/gpucheck/install.py --wheels build/gpu-wheels --target /tmp/aurora-gpu-site

A wheel is skipped when its distribution is already installed at the same
or a newer version (the machine's torch, numpy, maybe transformers: a newer
release keeps the API the check uses, and shadowing a package another
installed one was built against is worse than not). The others are
installed with ``pip install --no-index --no-deps --target`` (the bundle is
the complete list, ``requirements.txt``; ``tests/test_gpucheck.py`` and the
no-venv check in docs/BENCHMARKS.md show it is), or unpacked directly when
this Python has no pip. Prints one line per wheel: installed or present.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def _key(version: str) -> tuple[int, ...]:
    """A release's leading numeric parts (``2026.10.19.post1`` -> (2026, 10, 19)), for ordering."""
    out: list[int] = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this Python already has, or None."""
    for candidate in {name, name.replace("_", "-")}:
        try:
            return importlib.metadata.version(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def needed(wheels_dir: str) -> tuple[list[str], list[str]]:
    """(wheel files to install, lines about the ones already present)."""
    todo: list[str] = []
    present: list[str] = []
    for path in sorted(glob.glob(os.path.join(wheels_dir, "*.whl"))):
        m = _WHEEL.match(os.path.basename(path))
        if m is None:
            raise SystemExit(f"install.py: {path}: not a wheel file name")
        have = installed_version(m["name"])
        if have is not None and _key(have) >= _key(m["version"]):
            present.append(f"present {m['name']} {have} (bundled {m['version']})")
        else:
            todo.append(path)
    return todo, present


def _unpack(wheel: str, target: str) -> None:
    """A wheel's files into ``target``, its ``.data/purelib`` and ``platlib`` merged in (no pip)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    for data in glob.glob(os.path.join(target, "*.data")):
        for lib in ("purelib", "platlib"):
            src = os.path.join(data, lib)
            if os.path.isdir(src):
                shutil.copytree(src, target, dirs_exist_ok=True)
        shutil.rmtree(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", required=True, help="folder of .whl files (make gpu-wheels)")
    p.add_argument("--target", required=True, help="folder to install into; put it first on PYTHONPATH")
    args = p.parse_args(argv)
    if not os.path.isdir(args.wheels) or not glob.glob(os.path.join(args.wheels, "*.whl")):
        print(
            f"install.py: {args.wheels}: no wheels there; run `make gpu-wheels` on a machine with network and carry the folder",
            file=sys.stderr,
        )
        return 2
    todo, present = needed(args.wheels)
    for line in present:
        print(line)
    os.makedirs(args.target, exist_ok=True)
    if not todo:
        return 0
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--upgrade",
            "--disable-pip-version-check",
            "--target",
            args.target,
            *todo,
        ]
        rc = subprocess.run(cmd).returncode
        if rc:
            print(f"install.py: pip install --target {args.target} failed (exit {rc})", file=sys.stderr)
            return rc
    else:
        for w in todo:
            _unpack(w, args.target)
    for w in todo:
        print(f"installed {os.path.basename(w)}" + ("" if has_pip else " (unpacked, no pip)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
