"""``aurora bench trainer``'s baseline is taken after the codec's kernels are loaded, and their bytes are reported apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aurora_store.codec.kernels import jit_available
from aurora_tools.bench.trainer.run import _baseline


@pytest.mark.slow
@pytest.mark.skipif(not jit_available(), reason="numba is not installed: the kernels are numpy, nothing to load")
def test_the_child_takes_its_baseline_after_loading_the_codec_kernels_and_says_what_they_cost(tmp_path: Path) -> None:
    out = tmp_path / "baseline"
    env = {k: v for k, v in os.environ.items() if k != "AURORA_NO_JIT"}
    p = subprocess.run(
        [sys.executable, "-m", "aurora_tools.bench.trainer.child", str(out), "--", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    baseline, kernels = _baseline(out)
    # numba and llvmlite alone are tens of MB resident; the baseline holds them and torch besides.
    assert 10 << 20 < kernels < baseline


def test_a_baseline_file_of_one_line_reads_as_no_kernel_bytes(tmp_path: Path) -> None:
    f = tmp_path / "b"
    f.write_text("123456", encoding="ascii")
    assert _baseline(f) == (123456, 0)
    f.write_text("123456\n789\n", encoding="ascii")
    assert _baseline(f) == (123456, 789)


@pytest.mark.skipif(not jit_available(), reason="numba is not installed")
def test_a_process_is_told_apart_by_whether_it_loaded_the_kernels() -> None:
    from aurora_tools.bench.trainer.memory import maps_kernels

    code = "import sys, time\nif sys.argv[1] == '1':\n    import llvmlite.binding\nprint('ready', flush=True)\ntime.sleep(60)\n"
    procs = [subprocess.Popen([sys.executable, "-c", code, arg], stdout=subprocess.PIPE, text=True) for arg in ("0", "1")]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert [maps_kernels(p.pid) for p in procs] == [False, True]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not maps_kernels(procs[0].pid)  # gone: False, not an error
