"""``--json`` keeps standard output for the JSON: what a run prints, a library writes to descriptor 1
or a child process inherits goes to standard error (:mod:`aurora_tools.bench.json_stdout`)."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, os, subprocess, sys
from aurora_tools.bench.json_stdout import json_only
with json_only(sys.argv[1] == "on"):
    print("python noise")
    os.write(1, b"descriptor noise\\n")
    subprocess.run([sys.executable, "-c", "print('child noise')"], check=True)
print(json.dumps({"ok": 1}))
"""


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60, check=True)


def test_with_json_only_the_object_reaches_stdout_and_the_rest_goes_to_stderr() -> None:
    got = _run("on")
    assert got.stdout.splitlines() == ['{"ok": 1}']
    assert json.loads(got.stdout) == {"ok": 1}
    for noise in ("python noise", "descriptor noise", "child noise"):
        assert noise in got.stderr


def test_without_it_nothing_is_moved() -> None:
    got = _run("off")
    assert got.stdout.splitlines() == ["python noise", "descriptor noise", "child noise", '{"ok": 1}']
    assert got.stderr == ""
