"""End to end: Trainer, Relay and Actors as separate processes, real Redis and S3 server.

One run covers what issue 5 asks of the system together: bit-identical
weights at every activation (by digests both sides compute), no rollout
accepted on a wrong version or digest, every prompt settled exactly once,
an Actor SIGKILLed mid-run losing only its leases, a late joiner catching up
by chain replay and getting work, a Relay killed mid-run leaving its Actors
working from origin, and SIGTERM leaving with no lease hanging.
"""

from __future__ import annotations

import json

import pytest

from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.testing.servers import RedisServer
from aurora_tools.demo.system import DemoConfig, DemoResult, run_system_demo, summary_table
from workers.tokenizer import CharTokenizer
from workers.trainer.trainer import StepLog


def _log_tail(workdir, name: str, lines: int = 40) -> str:  # type: ignore[no-untyped-def]
    """The end of a worker's log, for a failure message (timing-dependent failures are diagnosed from it)."""
    path = workdir / "logs" / f"{name}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else f"(no {path})"


@pytest.mark.slow
@pytest.mark.server
def test_system_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with RedisServer() as rs:
        cfg = DemoConfig(
            steps=20,
            batch=16,
            group=4,
            actors_relay=2,
            actors_origin=1,
            kill_at=2,
            stop_relay_at=2,
            join_at=4,
            snapshot_every=3,
            redis=rs.url,
            run="e2e",
            workdir=str(tmp_path),
            display=False,
            # A run this small can finish a few seconds after the Relay dies: a short
            # grace lets its Actor turn to origin well within that.
            mirror_grace_s=0.5,
            tiny_hidden=64,
            tiny_intermediate=192,  # the system, not learning: the small model is enough
        )
        res = run_system_demo(cfg, say=lambda *a, **k: None)

        assert len(res.logs) == 20
        # Bit-identical at every activation, and activations were really compared.
        assert res.bit_identical, res.mismatches
        actors_seen = {a for a, _ in res.activations}
        assert {"eu-1", "us-0", "us-late"} <= actors_seen
        assert res.activations_compared >= 3 * 4
        # The settlement predicate and the ledger: nothing twice, nothing on a wrong version, nothing lost.
        assert res.accepted_twice == 0 and res.accepted_wrong_version == 0
        assert res.prompts_lost == 0
        assert all(sum(lg.by_actor.values()) == cfg.batch for lg in res.logs)
        # The killed Actor stops contributing; the others finish its share.
        assert res.actors_killed == 1
        assert all("eu-0" not in lg.by_actor for lg in res.logs[3:])
        # The late joiner caught up (activations after its join) and got work.
        late_versions = sorted(v for a, v in res.activations if a == "us-late")
        assert late_versions and late_versions[0] >= 4
        assert any("us-late" in lg.by_actor for lg in res.logs[4:]), ([lg.by_actor for lg in res.logs], _log_tail(tmp_path, "us-late"))
        # After the Relay died, its remaining Actor kept staging and activating
        # new versions (from origin, once the Relay's key expired) and kept working.
        eu1_versions = sorted(v for a, v in res.activations if a == "eu-1")
        assert eu1_versions[-1] >= 5, (eu1_versions, _log_tail(tmp_path, "eu-1"))  # the Relay died after step 1 (v2)
        # Work on a version only origin had (batch b is generated on v(b-1); v3 and later
        # came after the Relay died). The early steps are the slow ones (first
        # generations), so the Relay dies early: late steps can take a quarter of a
        # second each, less than an Actor needs to notice the dead mirror and catch up.
        assert any("eu-1" in lg.by_actor for lg in res.logs[4:]), ([lg.by_actor for lg in res.logs], _log_tail(tmp_path, "eu-1"))
        # SIGTERM: every Actor left gracefully and holds no lease.
        ledger = Ledger(connect(rs.url), "e2e")
        states = {a.actor: a.status for a in ledger.actors()}
        stuck = {a: states.get(a) for a in ("eu-1", "us-0", "us-late") if states.get(a) != "left"}
        assert not stuck, (stuck, res.stopped_hard, {a: _log_tail(tmp_path, a, 25) for a in stuck})
        assert sum(ledger.lease_counts().values()) == 0
        # Deltas are a fraction of the full weights.
        assert all(lg.delta_bytes < lg.full_bytes for lg in res.logs)
        # The JSON of `aurora demo --json`: the new keys, with the run's own values.
        j = res.to_json()
        for key in (
            "steps",
            "bit_identical",
            "reward_first",
            "reward_last",
            "prompts_lost",
            "accepted_twice",
            "accepted_wrong_version",
            "actors_killed",
            "actors_joined",
        ):
            assert key in j, key
        assert 0 < j["density_mean"] <= 1 and 0 < j["delta_over_full"] < 1, (j["density_mean"], j["delta_over_full"])
        assert all(lg.elements == res.logs[0].elements > 0 and 0 <= lg.changed <= lg.elements for lg in res.logs)
        # Mean over the deltas shipped: a step whose groups all scored alike changes nothing and ships none.
        shipped = [lg.changed / lg.elements for lg in res.logs if lg.delta_bytes]
        assert shipped and all(lg.changed == 0 for lg in res.logs if not lg.delta_bytes)
        assert j["density_mean"] == pytest.approx(sum(shipped) / len(shipped))
        assert j["model_family"] == "qwen3" and j["tokenizer_vocab_size"] == CharTokenizer().vocab_size
        acc = j["eval_accuracy_by_version"]
        assert 0 in acc and all(0.0 <= a <= 1.0 for a in acc.values()), acc
        assert json.loads(json.dumps(j))["density_mean"] == j["density_mean"]


def _log(step: int, delta_bytes: int, changed: int, elements: int, full_bytes: int = 1000) -> StepLog:
    return StepLog(
        step=step,
        version=step + 1,
        gen_version=max(0, step - 1),
        reward=0.5,
        wait_s=0.0,
        train_s=0.0,
        extract_publish_s=0.0,
        step_s=1.0,
        delta_bytes=delta_bytes,
        full_bytes=full_bytes,
        changed=changed,
        tokens=0,
        tokens_per_s=0.0,
        eligible=[],
        excluded=[],
        by_actor={},
        elements=elements,
    )


def test_demo_json_density_and_delta_over_full() -> None:
    """``density_mean`` is the mean of changed/elements over the deltas; ``delta_over_full`` the mean delta over the full bytes."""
    res = DemoResult(
        logs=[_log(0, 100, 10, 500), _log(1, 300, 30, 500)],
        bit_identical=True,
        activations_compared=2,
        mismatches=[],
        actors_killed=0,
        actors_joined=0,
        prompts_lost=0,
        accepted_twice=0,
        accepted_wrong_version=0,
        model_family="qwen3",
        tokenizer_vocab_size=30,
        eval_accuracy={5: 0.5, 0: 0.25},
    )
    j = res.to_json()
    assert j["density_mean"] == pytest.approx(0.04) and j["delta_over_full"] == pytest.approx(0.2)
    assert [s["density"] for s in j["per_step"]] == [pytest.approx(0.02), pytest.approx(0.06)]
    assert list(j["eval_accuracy_by_version"]) == [0, 5]
    assert "density" in summary_table(res) and "6.00%" in summary_table(res)
    # Nothing shipped (the ideal baseline): no density, not a division by zero.
    assert DemoResult([_log(0, 0, 0, 0)], False, 0, [], 0, 0, 0, 0, 0).to_json()["density_mean"] == 0.0
