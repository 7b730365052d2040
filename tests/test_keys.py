"""The key registry: every Redis key Aurora writes, byte for byte as docs/PROTOCOL.md and docs/WORKERS.md give them."""

from __future__ import annotations

import dataclasses

import pytest

from aurora_store.coordination.decode import as_int, as_str
from aurora_store.coordination.keys import RunKeys, glob_escape, key_prefix, validate_run_name
from aurora_store.errors import ConfigError


def test_every_key_of_a_run() -> None:
    k = RunKeys("r-1.x")
    p = "aurora:{r-1.x}:"
    assert k.prefix == key_prefix("r-1.x") == p
    expected = {
        # ledger
        k.actors: "actors",
        k.actor("a1"): "actor:a1",
        k.fence: "fence",
        k.steps: "steps",
        k.step(7): "step:7",
        k.step(7, "lease"): "step:7:lease",
        k.step(7, "results:payload"): "step:7:results:payload",
        k.assigned(7, "a1"): "step:7:assigned:a1",
        # bus
        k.events(): "events",
        k.events("eu"): "region:eu:events",
        # workers
        k.trainer: "trainer",
        k.trainer_digests: "digest:trainer",
        k.actor_digests: "digest:actors",
        k.activations: "activations",
        k.relay("eu"): "relay:eu",
        k.relay_held("eu"): "relay-held:eu",
        # benchmarks
        k.wan("steps"): "wan:steps",
    }
    for got, tail in expected.items():
        assert got == p + tail
    assert k.relay_pattern == "aurora:\\{r-1.x\\}:relay:*"
    assert k.relay_held_pattern == "aurora:\\{r-1.x\\}:relay-held:*"  # not matched by relay_pattern
    assert k.pattern == "aurora:\\{r-1.x\\}:*"
    assert k.relay_region(k.relay("us-east")) == "us-east"


def test_run_keys_are_a_frozen_value() -> None:
    k = RunKeys("a")
    assert k == RunKeys("a") and k != RunKeys("b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.run = "b"  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["", "a b", "a{b}", "x" * 129, "a:b", "a*"])
def test_bad_run_names_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        validate_run_name(bad)
    with pytest.raises(ConfigError):
        RunKeys(bad)


def test_glob_escape() -> None:
    assert glob_escape("a*b?[c]\\{d}") == "a\\*b\\?\\[c\\]\\\\\\{d\\}"


def test_decode_helpers() -> None:
    assert as_str(b"abc") == as_str("abc") == "abc"
    assert as_str(7) == "7"
    assert as_str(b"\xff", "replace") == "\ufffd"
    with pytest.raises(UnicodeDecodeError):
        as_str(b"\xff")
    assert as_int(b"12") == as_int("12") == 12
    assert as_int(None) is None and as_int(b"", 0) == 0 and as_int("", 3) == 3
    with pytest.raises(ValueError):
        as_int(b"x")
    assert as_int(b"x", lenient=True) is None
