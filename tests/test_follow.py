"""``aurora follow``: a directory that always holds the run's newest complete version, loadable by ``from_pretrained``.

A run of a tiny Qwen3 with its model description is published with
``aurora_store.Publisher``; ``aurora follow`` runs in its own process, as a
user would start it beside an inference server. At every version the
directory loads with ``AutoModelForCausalLM.from_pretrained`` and holds the
publisher's weights bit for bit (FORMAT.md §4.1 digest); while versions
arrive, every load of it succeeds and is one of the published versions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from api_helpers import digest_of

from aurora_store import Publisher
from aurora_store.lineage.binding import ModelFile
from aurora_store.storage import open_store
from aurora_store.testing.wait import wait_until
from aurora_tools.tinymodel import make_model_dir
from workers.common import write_model_description
from workers.follow import FollowConfig, follow
from workers.follow.switch import MARKER
from workers.pretrained import load_pretrained, read_model_dir

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vllm_follow.py"
WAIT_S = 120.0
"""Longest a test waits for the follower to reach a version (a bound against hanging, not an assertion on speed)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")


def _describe(store_url: str, model_dir: str) -> list[ModelFile]:
    md = read_model_dir(model_dir)
    return write_model_description(open_store(store_url), md.files["config.json"], md.files.get("tokenizer.json"), md.files)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 200, (2, 10), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _follow(*args: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    env = {**os.environ, "AURORA_TORCH_THREADS": "1"}
    env.pop("AURORA_REDIS_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "aurora_tools.cli", "follow", *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )


def _marker(out: Path) -> dict[str, Any] | None:
    try:
        got: dict[str, Any] = json.loads((out / MARKER).read_text())
        return got
    except (OSError, ValueError):
        return None


def _marker_digest(model: torch.nn.Module) -> str:
    """The digest ``aurora follow`` writes in its marker (and vLLM's workers report): the streamed form of FORMAT.md §4.1."""
    from aurora_store.api.weights import named_tensors, tied_head
    from aurora_store.apply.sink import weights_digest
    from aurora_store.codec.extract import plan_of

    named = {n: t.detach().to(torch.bfloat16) for n, t in named_tensors(model)}
    return weights_digest(named, plan_of(named, tied=tied_head(model, named)))


def _loaded_digest(out: Path) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, local_files_only=True)
    return digest_of(model)


@pytest.mark.slow
def test_follow_waits_for_the_run_then_holds_every_version_bit_for_bit(tmp_path: Path, model_dir: str) -> None:
    store = f"file://{tmp_path}/run"
    out = tmp_path / "served"
    log = tmp_path / "follow.log"
    with open(log, "w") as err:
        proc = _follow("--store", store, "--out", str(out), "--until", "3", "--poll-s", "0.1", stderr=err)
    try:
        # Started before the run exists: it waits, saying so.
        wait_until(
            lambda: "holds no version yet" in log.read_text(),
            "word that it waits",
            timeout=WAIT_S,
            interval=0.05,
            processes={"aurora follow": proc},
        )
        model = load_pretrained(model_dir)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        dirs = []
        with Publisher(store, model_files=_describe(store, model_dir), digest_every=1) as pub:
            for v in range(4):
                if v:
                    _step(model, opt, v)
                p = pub.publish(model)
                assert p is not None and p.version == v
                wait_until(
                    lambda v=v: (_marker(out) or {}).get("version") == v,
                    f"v{v} in place",
                    timeout=WAIT_S,
                    interval=0.05,
                    processes={"aurora follow": proc},
                )
                m = _marker(out)
                assert m is not None and m["state"] == p.state and m["weights_digest"] == _marker_digest(model) and m["run"] == "run"
                assert _loaded_digest(out) == p.weights_digest == digest_of(model)
                dirs.append(os.path.realpath(out))
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text
    assert [f"v{v} in place" in text for v in range(4)] == [True] * 4
    # DIR is a relative symlink into the hidden sibling; the version before the current is kept, older ones are gone.
    assert os.readlink(out) == ".served.aurora/v00000003"
    assert sorted(os.listdir(tmp_path / ".served.aurora")) == ["v00000002", "v00000003"]
    assert len(set(dirs)) == 4
    # Restarted at the version DIR holds: it continues from it (read back, checked) and writes nothing.
    before = os.stat(tmp_path / ".served.aurora" / "v00000003" / MARKER).st_mtime_ns
    again = _follow("--store", store, "--out", str(out), "--until", "3")
    _, err2 = again.communicate(timeout=WAIT_S)
    assert again.returncode == 0, err2[-2000:]
    assert "continuing from v3" in err2 and "in place" not in err2
    assert os.stat(tmp_path / ".served.aurora" / "v00000003" / MARKER).st_mtime_ns == before


@pytest.mark.server
@pytest.mark.slow
def test_with_redis_every_load_during_the_run_is_a_complete_published_version(
    tmp_path: Path, model_dir: str, redis_server: Any, run_name: str
) -> None:
    store = f"file://{tmp_path}/{run_name}"
    out = tmp_path / "served"
    model = load_pretrained(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    published: dict[str, int] = {}
    versions = 6
    with Publisher(store, redis=redis_server.url, run=run_name, model_files=_describe(store, model_dir), digest_every=1) as pub:
        p = pub.publish(model)
        assert p is not None
        published[p.weights_digest] = 0
        # Polling once a minute: only the run's announcements can make it this quick.
        proc = _follow("--store", store, "--redis", redis_server.url, "--out", str(out), "--poll-s", "60")
        try:
            wait_until(lambda: _marker(out) is not None, "v0 in place", timeout=WAIT_S, interval=0.05, processes={"aurora follow": proc})
            loads: list[str] = []
            failures: list[BaseException] = []
            done = threading.Event()

            def load_all_the_time() -> None:
                while not done.is_set():
                    try:
                        loads.append(_loaded_digest(out))
                    except BaseException as e:  # noqa: BLE001 - the test reports it
                        failures.append(e)

            loader = threading.Thread(target=load_all_the_time)
            loader.start()
            try:
                for v in range(1, versions + 1):
                    _step(model, opt, v)
                    p = pub.publish(model)
                    assert p is not None and p.version == v
                    published[p.weights_digest] = v
                    if v % 2 == 0:  # let some versions land one by one, others two at a time
                        wait_until(
                            lambda v=v: (_marker(out) or {}).get("version") == v,
                            f"v{v} in place",
                            timeout=WAIT_S,
                            interval=0.05,
                            processes={"aurora follow": proc},
                        )
            finally:
                done.set()
                loader.join()
            assert not failures, failures[0]
            assert loads and set(loads) <= set(published)
            m = _marker(out)
            assert m is not None and m["version"] == versions and m["weights_digest"] == _marker_digest(model)
            assert _loaded_digest(out) == p.weights_digest
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and f"v{versions} in place" in err


@pytest.mark.server
@pytest.mark.slow
def test_redis_going_away_and_coming_back_is_ridden_out(tmp_path: Path, model_dir: str, own_redis_server: Any, run_name: str) -> None:
    store = f"file://{tmp_path}/{run_name}"
    out = tmp_path / "served"
    model = load_pretrained(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    files = _describe(store, model_dir)
    with Publisher(store, redis=own_redis_server.url, run=run_name, model_files=files) as pub:
        pub.publish(model)
    log = tmp_path / "follow.log"
    with open(log, "w") as sink:
        proc = _follow(
            "--store", store, "--redis", own_redis_server.url, "--out", str(out), "--poll-s", "0.2", "--outage-budget-s", "300", stderr=sink
        )
    try:
        wait_until(
            lambda: (_marker(out) or {}).get("version") == 0,
            "v0 in place",
            timeout=WAIT_S,
            interval=0.05,
            processes={"aurora follow": proc},
            logs=[log],
        )
        own_redis_server.stop()
        _step(model, opt, 1)
        with Publisher(store, run=run_name) as quiet:  # the Trainer's Redis is away; the store takes the version
            p1 = quiet.publish(model)
        assert p1 is not None and p1.version == 1
        wait_until(
            lambda: "unreachable" in log.read_text(),
            "word of the outage",
            timeout=WAIT_S,
            interval=0.05,
            processes={"aurora follow": proc},
            logs=[log],
        )  # met, and ridden (it still runs)
        own_redis_server.start()  # back, empty
        _step(model, opt, 2)
        with Publisher(store, redis=own_redis_server.url, run=run_name, digest_every=1) as pub:
            p2 = pub.publish(model)
        assert p2 is not None and p2.version == 2
        wait_until(
            lambda: (_marker(out) or {}).get("version") == 2,
            "v2 in place",
            timeout=WAIT_S,
            interval=0.05,
            processes={"aurora follow": proc},
            logs=[log],
        )
        assert _loaded_digest(out) == p2.weights_digest
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and "v2 in place" in text, text[-2000:]


def _one_line_error(proc: subprocess.Popen[str]) -> str:
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1, err[-2000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("aurora: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "foreign symlink"])
def test_an_out_that_is_not_ours_is_refused_untouched(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "served"
    if kind == "directory":
        out.mkdir()
        (out / "config.json").write_text("{}")
    else:
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to("elsewhere")
    line = _one_line_error(_follow("--store", f"file://{tmp_path}/run", "--out", str(out), "--until", "0"))
    assert str(out) in line and ("a directory exists there" in line if kind == "directory" else "not one aurora follow made" in line)
    assert (out / "config.json").exists() if kind == "directory" else os.readlink(out) == "elsewhere"


@pytest.mark.slow
def test_a_run_without_a_model_description_is_one_line(tmp_path: Path) -> None:
    from api_helpers import tiny_lm

    store = f"file://{tmp_path}/run"
    with Publisher(store) as pub:
        pub.publish(tiny_lm())
    line = _one_line_error(_follow("--store", store, "--out", str(tmp_path / "served"), "--until", "0"))
    assert "no model description" in line and "model_files=" in line
    assert not os.path.lexists(tmp_path / "served")


@pytest.mark.slow
@pytest.mark.long  # 30 s; Follower.update on a vLLM engine is also test_vllm_engine's (make test)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed: pip install 'aurora-store[vllm]'")
def test_the_vllm_example_starts_from_the_followed_dir_and_applies_two_versions_in_place(tmp_path: Path, model_dir: str) -> None:
    store = f"file://{tmp_path}/run"
    out = tmp_path / "served"
    model = load_pretrained(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    log = tmp_path / "vllm.log"
    with Publisher(store, model_files=_describe(store, model_dir)) as pub:
        p0 = pub.publish(model)
        assert p0 is not None
        assert follow(FollowConfig(store=store, out=str(out), until=0), threading.Event()) == 0  # in this process: aurora follow's loop
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "AURORA_TORCH_THREADS": "1"}
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--store", store, "--model", str(out), "--until", "2"],
                stdout=sink,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        try:
            wait_until(
                lambda: "loaded by vLLM" in log.read_text(),
                "vLLM started",
                timeout=WAIT_S,
                interval=0.05,
                processes={"aurora follow": proc},
            )
            assert f"v0: loaded by vLLM from {out}, digest {_marker_digest(model)[:19]}... checked" in log.read_text()
            digests = []
            for v in (1, 2):
                _step(model, opt, v)
                p = pub.publish(model)
                assert p is not None and p.version == v
                digests.append(_marker_digest(model))  # what vLLM reports; no digest in these deltas to check it with
            assert proc.wait(timeout=WAIT_S) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    for v, d in zip((1, 2), digests, strict=True):
        assert f"v{v}: staged in" in text and f"digest {d[:19]}... checked" in text
    assert "bootstrapped" not in text  # it started from the directory, not from the store


def test_a_config_file_gives_follow_its_options_and_flags_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aurora_tools.cli import config_file, run_cmds
    from aurora_tools.cli.main import build_parser
    from workers.follow import config_from_args

    monkeypatch.delenv("AURORA_REDIS_URL", raising=False)  # --redis defaults to it
    f = tmp_path / "run.toml"
    f.write_text(
        'store = "file:///tmp/run"\nregion = "eu"\n'  # top level: the Actor's region is skipped here
        '[follow]\nout = "/srv/served"\nuntil = 3\npoll-s = 0.5\nstorage-option = ["anon=true"]\n'
        "[trainer]\nlr = 0.1\n"
    )
    fills = {
        "trainer": run_cmds.add_trainer_arguments,
        "actor": run_cmds.add_actor_arguments,
        "relay": run_cmds.add_relay_arguments,
        "follow": run_cmds.add_follow_arguments,
    }
    argv = ["follow", "--config", str(f), "--until", "5"]
    args = config_file.parse_worker_args(build_parser(argv), argv, fills)
    cfg = config_from_args(args)
    assert (cfg.store, cfg.out, cfg.until, cfg.poll_s, dict(cfg.storage_options)) == (
        "file:///tmp/run",
        "/srv/served",
        5,
        0.5,
        {"anon": True},
    )
    assert cfg.redis is None and cfg.run is None
    f.write_text('[follow]\nout = "/srv/served"\nuntill = 3\n')
    with pytest.raises(SystemExit) as e:
        config_file.parse_worker_args(build_parser(argv), argv, fills)
    assert e.value.code == 2


def test_the_switch_keeps_the_current_and_the_previous_version_and_cleans_leftovers(tmp_path: Path) -> None:
    from workers.follow.switch import Marker, OutDir

    out = OutDir(str(tmp_path / "served"))
    assert out.current() is None

    def save(v: int) -> Callable[[str], object]:
        return lambda d: Path(d, "model.safetensors").write_bytes(b"v%d" % v)

    for v in range(4):
        final = out.write(Marker(v, f"s{v}", f"d{v}", "r", "t"), save(v), {"config.json": b"{}"})
        before = out.current()
        assert before is None or before[1].version == v - 1  # written, not yet switched to
        out.switch(final)
        now = out.current()
        assert now is not None
        marker = now[1]
        assert (marker.version, marker.state, Path(tmp_path / "served" / "model.safetensors").read_bytes()) == (v, f"s{v}", b"v%d" % v)
        assert sorted(os.listdir(tmp_path / ".served.aurora")) == [f"v{x:08d}" for x in range(max(0, v - 1), v + 1)]
    # A process stopped mid-write leaves a temporary directory and link: the next start removes them, and the previous version.
    (tmp_path / ".served.aurora" / ".tmp-v00000004-1").mkdir()
    os.symlink(".served.aurora/v00000003", tmp_path / ".served.aurora-link.tmp-1")
    OutDir(str(tmp_path / "served")).clean_leftovers()
    assert sorted(os.listdir(tmp_path / ".served.aurora")) == ["v00000003"]
    assert not os.path.lexists(tmp_path / ".served.aurora-link.tmp-1") and os.readlink(tmp_path / "served") == ".served.aurora/v00000003"
