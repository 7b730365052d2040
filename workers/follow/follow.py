"""``aurora follow``'s loop: keep a directory holding the run's newest version as a loadable Hugging Face checkpoint.

One :class:`~aurora_store.Follower` brings a bf16 skeleton, built from the
run's own ``model/`` description, to each new version (deltas after the one
held; a snapshot when that is cheaper, or at the first version); each
version is checked (chain, sha256, state, weights digest) before it is
written. Each version then becomes a complete directory beside ``DIR`` and
``DIR`` is switched to it (:mod:`workers.follow.switch`):
``AutoModelForCausalLM.from_pretrained(DIR)`` always loads a complete,
checked version.

A restarted follower continues from the version ``DIR`` holds: its weights
are read back and compared with its marker's digest (a mismatch, or a file
that does not load, means starting from the store again).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_store.api.follower import Follower
from aurora_store.api.weights import family_of, named_tensors, tied_head
from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import fuse_weights, plan_of, unfuse_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.config import option
from aurora_store.errors import ConfigError, IntegrityError
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.plan import scan_versions
from aurora_store.outage import (
    DEFAULT_OUTAGE_BUDGET_S,
    OUTAGE_BUDGET_ENV,
    Dependency,
    is_transient,
    outage_budget_s,
)
from aurora_store.quant import FORMATS
from aurora_store.storage import Store, open_store
from workers.common import MAX_MODEL_FILE_BYTES, MODEL_PREFIX, read_model_description
from workers.follow.fp8 import Fp8Directory
from workers.follow.switch import Marker, OutDir, utc_now
from workers.pretrained import DESCRIPTION_FILES

__all__ = ["ENV_PREFIX", "FollowConfig", "follow"]

log = logging.getLogger("aurora.follow")


ENV_PREFIX = "AURORA_FOLLOW_"
"""Prefix of the follower's environment variables (``AURORA_FOLLOW_POLL_S`` …);
``outage_budget_s`` is ``AURORA_OUTAGE_BUDGET_S``, shared with every worker."""


@dataclass(frozen=True, slots=True)
class FollowConfig:
    """What ``aurora follow`` was asked to do (:func:`workers.follow.cli.config_from_args`)."""

    store: str = field(metadata={"env": False})
    """Run root to follow."""
    out: str = field(metadata={"env": False})
    """The symlink kept pointing at the newest complete version's directory."""
    redis: str | None = field(default=None, metadata={"env": False})
    """The run's Redis, to wake on its announcements; None: poll the store."""
    run: str | None = field(default=None, metadata={"env": False})
    """Default: the run the manifests name (needed only to follow Redis announcements)."""
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, metadata={"env": False})
    mirror: str | None = option(
        None,
        metavar="URL",
        help="run root of a mirror to read segments from, checked against origin's manifests",
        default_text="none: origin only",
    )
    """Run root of a mirror to read segments from; every version is checked against origin's manifests."""
    mirror_options: Mapping[str, Any] = field(default_factory=dict, repr=False, metadata={"env": False})
    trust: TrustKeys | None = field(default=None, metadata={"env": False})
    until: int | None = option(
        None,
        env=False,
        metavar="V",
        help="exit 0 once version V (or a newer one) is in place",
        default_text="none: follow until SIGTERM/SIGINT",
    )
    """Exit 0 once a version >= this is in place; None: follow until stopped."""
    poll_s: float = option(1.0, metavar="S", help="how often to look for a new version without Redis, or between announcements")
    """How often to look for a new version without Redis, or between announcements."""
    outage_budget_s: float = option(
        DEFAULT_OUTAGE_BUDGET_S,
        env=OUTAGE_BUDGET_ENV,
        metavar="S",
        help="give up (exit 1, one line) once Redis or the store has been unreachable this long",
    )
    """How long Redis or the store may stay unreachable before the follower gives up."""
    quantize: str | None = option(
        None,
        env=False,
        choices=FORMATS,
        help="write each version's weights quantized: fp8-block128 (FP8 with 128x128 block scales; docs/FP8.md)",
        default_text="none: bf16 as the run holds them",
    )
    """Write each version in this quantization format (``fp8-block128``); None: bf16."""

    def __post_init__(self) -> None:
        if self.poll_s <= 0:
            raise ConfigError(f"--poll-s must be > 0, got {self.poll_s}")
        if self.until is not None and self.until < 0:
            raise ConfigError(f"--until must be >= 0, got {self.until}")


def follow(cfg: FollowConfig, stop: threading.Event) -> int:
    """Follow the run until ``stop`` is set or ``cfg.until`` is reached; 0 either way.

    Permanent errors (a bad ``--out``, a run without a model description, a
    version that fails its checks, an outage past the budget) raise:
    ``aurora``'s entry point prints them on one line and exits 1.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per version written says nothing in a log
    out = OutDir(cfg.out)
    out.clean_leftovers()
    raw = open_store(cfg.store, dict(cfg.storage_options))
    try:
        if not _wait_for_first_version(raw, cfg, stop):
            return 0
    except Exception as e:
        if stop.is_set() and is_transient(e):  # stopped while the store was away
            return 0
        raise
    f = Follower(
        raw,
        redis=cfg.redis,
        run=cfg.run,
        mirror=cfg.mirror,
        mirror_options=cfg.mirror_options,
        trust_keys=cfg.trust,
        outage_budget=cfg.outage_budget_s,
        poll_s=cfg.poll_s,
    )
    relay = threading.Thread(target=_relay_stop, args=(stop, f.stop), name="aurora-follow-stop", daemon=True)
    relay.start()
    try:
        model, files = _skeleton(f.origin)  # the Follower's view of the store: it rides outages
        fp8 = Fp8Directory(cfg.quantize) if cfg.quantize else None
        if fp8 is None:
            _resume(out, f, model)
        else:  # DIR holds FP8, not the bf16 truth the next delta applies to: start from the store
            files = fp8.files(files)
        while not f.stop.is_set():
            if cfg.until is not None and f.version is not None and f.version >= cfg.until:
                return 0
            v = f.latest()
            if v is None or v == f.version:
                v = f.wait(after=f.version)
                if v is None:  # stopped
                    return 0
            _one_version(out, f, model, files, v, fp8)
        return 0
    except Exception as e:
        if f.stop.is_set() and is_transient(e):  # stopped while riding an outage: Dependency re-raises its last error
            log.info("stopped during an outage (%s)", type(e).__name__)
            return 0
        raise
    finally:
        f.close()


def _relay_stop(stop: threading.Event, target: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``; the Follower's own event ends its waits and outage rides (this thread ends with either)."""
    while not target.is_set():
        if stop.wait(0.2):
            target.set()


def _wait_for_first_version(raw: Store, cfg: FollowConfig, stop: threading.Event) -> bool:
    """Until the store holds a version (saying so once); False when stopped first.

    A follower may start before the run: the run name (needed for Redis)
    comes from the first manifest, so nothing else can be done before one exists.
    """
    dep = Dependency("the store", log, outage_budget_s(cfg.outage_budget_s))
    said = False
    while not stop.is_set():
        index = dep.call(lambda: scan_versions(raw), "list versions", stop)
        if index.deltas or index.snapshots:
            return True
        if not said:
            log.info("%s holds no version yet: waiting for the run (looking every %.1f s)", raw.url, cfg.poll_s)
            said = True
        stop.wait(cfg.poll_s)
    return False


def _skeleton(store: Store) -> tuple[Any, dict[str, bytes]]:
    """(the run's model in bf16 with placeholder weights, its description files by name), each file checked against version 0's list."""
    used: dict[str, str] = {}
    try:
        model, _tokenizer = read_model_description(store, used)
    except ConfigError as e:
        raise ConfigError(
            f"{e}; aurora follow builds DIR from the run's model/ description (a Publisher writes it with model_files=)"
        ) from None
    files: dict[str, bytes] = {}
    for key, sha in sorted(used.items()):
        name = key[len(MODEL_PREFIX) :]
        if name not in DESCRIPTION_FILES:
            continue  # only the files a model directory holds, never a path of the store's choosing
        data = store.get_capped(key, MAX_MODEL_FILE_BYTES, "the limit on a model file")
        if hashlib.sha256(data).hexdigest() != sha:
            raise IntegrityError(f"{store.where(key)}: changed while it was read")
        files[name] = data
    return model, files


def _plan(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], FusionPlan]:
    named = dict(named_tensors(model))
    return named, plan_of(named, tied=tied_head(model, named), family=family_of(model))


def _digest(model: torch.nn.Module) -> str:
    return weights_digest(*_plan(model))


def _as_held(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A saved directory's tensors under the names ``model`` holds them by.

    ``save_pretrained`` writes a mixture-of-experts model's experts one by
    one (``…experts.{e}.gate_proj.weight``) while transformers holds them
    packed (``…experts.gate_up_proj``): both sides go through the format's
    names (FORMAT.md §2), so ``load_state_dict`` sees every tensor.
    """
    named, plan = _plan(model)
    if set(state) <= set(named):
        return state
    saved = plan_of(state, tied=False, family=plan.family)
    return unfuse_weights(fuse_weights(state, saved), plan)


def _resume(out: OutDir, f: Follower, model: Any) -> None:
    """Take over the version ``DIR`` holds, if its weights load and match its marker (and the run's state)."""
    cur = out.current()
    if cur is None:
        return
    path, marker = cur
    if marker.run is not None and f.run is not None and marker.run != f.run:
        raise ConfigError(f"--out {out.path}: holds run {marker.run!r}, the store is run {f.run!r}: choose another --out")
    try:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(path, name)))
        model.load_state_dict(_as_held(state, model), strict=False)
        model.tie_weights()  # a tied head is saved once, under the embedding's name
        ok = _digest(model) == marker.weights_digest
    except (OSError, RuntimeError, ValueError) as e:
        log.info("%s: cannot be read back (%s): starting from the store", path, e)
        return
    if not ok:
        log.info("%s: its weights do not match its marker: starting from the store", path)
        return
    f.version, f.state = marker.version, marker.state
    log.info("continuing from v%d (%s)", marker.version, path)


def _one_version(out: OutDir, f: Follower, model: Any, files: Mapping[str, bytes], v: int, fp8: Fp8Directory | None = None) -> None:
    """Bring the skeleton to ``v``, write its directory (in FP8 with ``fp8``), switch ``DIR`` to it; one log line."""
    t0 = time.perf_counter()
    u = f.update(model, version=v)
    digest = _digest(model)  # the marker names the bf16 version, quantized or not
    marker = Marker(u.version, u.state, digest, f.run, utc_now())

    def save(d: str) -> None:
        model.save_pretrained(d)
        if fp8 is not None:
            fp8.convert(d)

    final = out.write(marker, save, files)
    out.switch(final)
    how = f"{u.deltas} delta{'s' if u.deltas != 1 else ''}" if u.path == "deltas" else f"snapshot + {u.deltas} deltas"
    if fp8 is not None:
        how += f", FP8 work {fp8.last.work:,} elements ({fp8.last.changed:,} changed, {fp8.last.whole_blocks:,} blocks redone)"
    log.info(
        "v%d in place: %s, %d bytes fetched, %.2f s (update %.2f s); %s -> %s",
        u.version,
        how,
        u.bytes,
        time.perf_counter() - t0,
        u.seconds,
        out.path,
        os.path.relpath(final, out.parent),
    )
