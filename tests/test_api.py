"""The public API: a plain PyTorch loop publishes through ``Publisher``; ``Follower``s in other processes follow it.

One follower is woken by the run's Redis announcements, one polls the store
without Redis; both must hold bit-identical weights at every version. The
same ``publish`` call serves a ``torch.nn.Module``, a state dict of CPU
tensors, and a model sharded by FSDP2 over two gloo ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from api_helpers import digest_of, tiny_lm, train_step

import aurora_store
from aurora_store import Follower, Publisher
from aurora_store.errors import ConfigError, VersionNotFound

HELPER = str(Path(__file__).with_name("api_helpers.py"))
VERSIONS = 10


def _follower(store: str, redis: str | None, run: str, until: int) -> subprocess.Popen[str]:
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(HELPER).parent), *sys.path])}
    return subprocess.Popen(
        [sys.executable, HELPER, "follow", store, redis or "", run, str(until)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_the_public_names_are_exported() -> None:
    assert {"Publisher", "Follower", "Published", "Updated"} <= set(aurora_store.__all__)
    assert aurora_store.Publisher is Publisher


@pytest.mark.server
@pytest.mark.slow
def test_a_plain_loop_publishes_ten_versions_and_two_followers_stay_bit_identical(tmp_path: Path, redis_server: Any, run_name: str) -> None:
    store = f"file://{tmp_path}/run"
    followers = {"redis": _follower(store, redis_server.url, run_name, VERSIONS), "polling": _follower(store, None, run_name, VERSIONS)}
    model = tiny_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    published = {}
    with Publisher(store, redis=redis_server.url, run=run_name, snapshot_every=4, digest_every=1) as pub:
        for v in range(VERSIONS + 1):
            if v:
                train_step(model, opt, v)
            p = pub.publish(model if v % 2 else model.state_dict(), step=v)  # a module or a state dict: the same run
            assert p is not None and p.version == v
            assert p.weights_digest == digest_of(model)
            published[v] = p
    assert published[0].kind == "snapshot" and all(published[v].kind == "delta" for v in range(1, VERSIONS + 1))
    assert published[4].snapshot and published[8].snapshot and not published[5].snapshot
    assert 0 < published[5].density < 1 and published[5].bytes > 0
    for name, proc in followers.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-3000:])
        seen = [json.loads(line) for line in out.splitlines()]
        assert [s["version"] for s in seen] == list(range(VERSIONS + 1)), name
        for s in seen:
            assert s["digest"] == published[s["version"]].weights_digest, (name, s)
        assert seen[0]["path"] == "snapshot" and {s["path"] for s in seen[1:]} == {"deltas"}


def test_a_second_publisher_continues_the_chain_and_a_follower_jumps_to_the_newest(tmp_path: Path) -> None:
    store = f"file://{tmp_path}/run"
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Publisher(store) as pub:
        pub.publish(model)
        train_step(model, opt, 1)
        pub.publish(model)
    # A new process (a restarted trainer): the chain continues from v1, checked against its state.
    train_step(model, opt, 2)
    with Publisher(store, digest_every=1) as again:
        p = again.publish({n: t.clone() for n, t in model.state_dict().items()})
    assert p is not None and p.version == 2 and p.kind == "delta"
    target = tiny_lm(seed=5).to(torch.bfloat16)
    f = Follower(store)
    assert f.latest() == 2 and f.run == "run"
    u = f.update(target)
    assert u.version == 2 and digest_of(target) == p.weights_digest
    assert f.update(target).path == "none"
    with pytest.raises(VersionNotFound):
        Follower(f"file://{tmp_path}/empty").update(target)
    with pytest.raises(ConfigError, match="bfloat16 bit for bit"):
        Follower(store).update(tiny_lm())
    with pytest.raises(ConfigError, match="the model of a run is fixed"), Publisher(store) as bad:
        bad.publish({"x": torch.zeros(3)})


def test_a_failed_publish_is_retried_with_the_same_bytes(tmp_path: Path) -> None:
    from aurora_store.errors import OutageTooLong
    from aurora_store.storage import open_store

    store = open_store(f"file://{tmp_path}/run")
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pub = Publisher(store, outage_budget=0.2, digest_every=1)
    pub.publish(model)
    real_put = store.put
    lost = {"on": True, "manifests": 0}

    def lossy(key: str, data: bytes, mode: str = "create") -> None:
        real_put(key, data, mode)  # written, but the answer never arrives
        if key.endswith("manifest.json") and lost["on"]:
            lost["manifests"] += 1
            raise ConnectionResetError("the answer was lost")

    store.put = lossy  # type: ignore[method-assign]
    train_step(model, opt, 1)
    with pytest.raises(OutageTooLong):
        pub.publish(model)  # the store "away" past the budget: the caller hears of it
    assert lost["manifests"] >= 2  # retried whole (create-only: the same bytes again) before giving up
    lost["on"] = False
    p = pub.publish(model)  # same weights: same attempt and bytes, found committed
    assert p is not None and p.version == 1 and p.weights_digest == digest_of(model)
    # The next version follows on, and a reader sees one chain.
    train_step(model, opt, 2)
    p2 = pub.publish(model)
    assert p2 is not None and p2.version == 2
    target = tiny_lm(seed=3).to(torch.bfloat16)
    Follower(store).update(target)
    assert digest_of(target) == p2.weights_digest


def test_after_the_first_delta_the_adaptive_size_comes_from_the_last_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adaptive segment size has to see a whole delta before cutting it: the first delta is gathered,
    then extracted. From the second on the size comes from the delta before, so the extraction runs
    ahead of encoding on its own thread; the chain stays bit-exact."""
    import threading

    import aurora_store.api.publisher as publisher_mod
    from aurora_store.lineage.publish import PublishConfig

    threads: list[set[str]] = []
    sizes: list[int | None] = []
    real_extract, real_publish = publisher_mod.extract, publisher_mod.publish_delta

    def extract(*a: Any, **k: Any) -> Any:
        seen: set[str] = set()
        threads.append(seen)
        for d in real_extract(*a, **k):
            seen.add(threading.current_thread().name)
            yield d

    def publish_delta(*a: Any, **k: Any) -> Any:
        sizes.append(a[5].segment_bytes)
        return real_publish(*a, **k)

    monkeypatch.setattr(publisher_mod, "extract", extract)
    monkeypatch.setattr(publisher_mod, "publish_delta", publish_delta)
    store = f"file://{tmp_path}/run"
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = PublishConfig(streams=2)
    assert cfg.segment_bytes is None
    with Publisher(store, config=cfg, digest_every=1) as pub:
        pub.publish(model)
        published = []
        for step in range(1, 4):
            train_step(model, opt, step)
            p = pub.publish(model)
            assert p is not None
            published.append(p)
    assert threads[0] == {threading.current_thread().name}  # gathered in the caller
    assert threads[1] == threads[2] == {"aurora-extract"}
    assert sizes[0] is None
    f = Follower(store)
    assert sizes[1:] == [cfg.segment_bytes_for(p.bytes) for p in published[:2]]
    target = tiny_lm(seed=5).to(torch.bfloat16)
    assert f.update(target).version == 3 and digest_of(target) == published[-1].weights_digest
