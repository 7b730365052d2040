"""Aurora's half of the vLLM engine: code that runs inside vLLM's worker processes.

vLLM mixes :class:`AuroraWorkerExtension` into its ``Worker`` class
(``LLM(worker_extension_cls="workers.engine.vllm_worker.AuroraWorkerExtension")``);
``LLM.collective_rpc("aurora_…", args=…)`` then calls these methods on every
tensor-parallel rank, between two model steps (vLLM's worker runs RPCs and
forward passes on one thread, so a delta can never land inside a forward
pass). The parameters a delta is written into are the model's own
``nn.Parameter`` storage, under the fused names of FORMAT.md §2 (vLLM's
``qkv_proj``/``gate_up_proj``); nothing is reallocated and no second copy of
the weights is kept.

Each rank reads segments from the store itself (``aurora_stage``: fetch,
verify sha256, decode, validate, in a background thread of the worker), so a
delta crosses no process boundary after it leaves the store; only small
replies (states, digests, counts) come back. A rank keeps the elements of a
delta its shard holds (:mod:`aurora_store.apply.tp`). Every method returns
``{"ok": value}`` or ``{"error": wire}`` (:mod:`workers.engine.vllm_wire`):
an exception raised here would reach the caller as a bare string, and the
engine turns these replies back into Aurora's error classes, fields intact.

Importing this module in a CPU worker also keeps vLLM's CPU linear layers on
their own weight tensors (see
:func:`workers.engine.vllm_params.keep_cpu_linear_on_live_weights`); vLLM
imports it in the worker before it loads the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from aurora_store.apply.prepare import prepare_delta, prepare_part
from aurora_store.apply.prepared_delta import PreparedDelta, layout_of_shards, parts_of
from aurora_store.apply.sink import apply_delta, weights_digest
from aurora_store.codec.extract import bits_view, spec_of
from aurora_store.errors import ChainError, ConfigError, IntegrityError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import Manifest
from aurora_store.lineage.fetch import ManifestReader, bound_index, fetch_delta, fetch_snapshot
from aurora_store.lineage.plan import plan_chain, scan_versions
from workers.engine import vllm_digest, vllm_moe
from workers.engine.vllm_config import VLLM_PREPARE
from workers.engine.vllm_params import Held, keep_cpu_linear_on_live_weights
from workers.engine.vllm_wire import decode_entries, encode_entries, reply

__all__ = ["AuroraWorkerExtension", "decode_entries", "encode_entries", "reply"]

log = logging.getLogger("aurora.vllm_worker")

T = TypeVar("T")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# vLLM imports this module in each worker before it loads the model: from
# then on, the worker's CPU linear layers multiply by their live weights.
keep_cpu_linear_on_live_weights()


class AuroraWorkerExtension:
    """Methods ``LLM.collective_rpc`` calls on every rank; all named ``aurora_*``.

    vLLM refuses an extension whose attribute names collide with its
    Worker's, hence the prefix (and the single attribute ``_aurora``).
    """

    _aurora: Held | None = None

    def _aurora_held(self) -> Held:
        if self._aurora is None:
            raise ConfigError("aurora_attach was not called in this worker")
        return self._aurora

    def aurora_attach(self, driver_pid: int | None = None) -> dict[str, Any]:
        """Take the model's parameters over; reply with the whole-model specs (fused names).

        With ``driver_pid``, the worker exits when that process is gone: an
        Actor killed with SIGKILL (a spot preemption) cannot stop vLLM's
        processes itself, and they would hold their memory and cores forever.
        """

        def go() -> dict[str, Any]:
            from aurora_store.codec import kernels

            model = self.get_model()  # type: ignore[attr-defined]
            self._aurora = Held(model)
            kernels.warm_up()  # compile (or load) the apply kernels now, not inside the first activation
            if driver_pid is not None:
                threading.Thread(target=_exit_with, args=(driver_pid,), name="aurora-watchdog", daemon=True).start()
            h = self._aurora
            return {
                "rank": h.rank,
                "tp": h.tp,
                "pid": os.getpid(),
                "specs": {n: [list(s.shape), s.dtype] for n, s in h.sink.specs().items()},
            }

        return reply(go)

    def aurora_load(self, tensors: Mapping[str, Any], version: int | None) -> dict[str, Any]:
        """Overwrite every weight from whole tensors ``{name: [dtype, shape, bytes]}`` (fused names)."""

        def go() -> None:
            h = self._aurora_held()
            missing = sorted(set(h.sink.tensors) - set(tensors))
            extra = sorted(set(tensors) - set(h.sink.tensors))
            if missing or extra:
                raise ModelMismatchError(f"weights lack {missing[:3]} / carry unknown {extra[:3]} (fused names)")
            for name, (dtype, shape, data) in tensors.items():
                full = torch.frombuffer(bytearray(data), dtype=_DTYPES[dtype]).view(tuple(shape))
                if spec_of(full, name) != h.sink.specs()[name]:
                    raise ModelMismatchError(f"{name}: given {list(shape)} {dtype}, the model holds {h.sink.specs()[name]}")
            with _writing(h):
                for name, (dtype, shape, data) in tensors.items():
                    h.load_whole(name, torch.frombuffer(bytearray(data), dtype=_DTYPES[dtype]).view(tuple(shape)))
                h.version, h.state = version, None
                _sync()

        return reply(go)

    def aurora_bootstrap(
        self,
        url: str,
        options: Mapping[str, Any],
        version: int | None,
        streams: int,
        manifests: list[bytes] | None = None,
        digest: bool = False,
    ) -> dict[str, Any]:
        """Reach ``version`` (default: the newest) from the store: newest snapshot, then deltas in place.

        ``manifests``: the manifests the Actor checked (the snapshot's, then
        each delta's, in order): the worker follows exactly that chain and
        reads no manifest itself, and fetches every object of it before its
        first write (a refusal leaves the weights as they were). Replies
        ``{"version", "state"}`` (and ``"digest"`` when asked): what it applied.
        """

        def go() -> dict[str, Any]:
            h = self._aurora_held()
            store = h.store(url, options)
            if manifests is not None:
                _bootstrap_checked(h, store, [_handed(b, f"handed manifest {i}") for i, b in enumerate(manifests)], streams)
                return _held_reply(h, digest)
            index = scan_versions(store)
            target = index.latest if version is None else version
            if target is None:
                raise ChainError(f"{store.url}: no version to bootstrap from")
            # Only snapshots bound to the chain (FORMAT.md §4.1): a planted one is never the start.
            reader = ManifestReader(store)
            plan = plan_chain(bound_index(index, reader), target)
            if plan.snapshot is None:
                raise ChainError(f"version {target} is unreachable: no snapshot at or below it")
            sm, tensors = fetch_snapshot(store, plan.snapshot, streams, reader.get("snapshot", plan.snapshot))
            if set(tensors) != set(h.sink.tensors):
                raise ModelMismatchError(
                    f"snapshot {plan.snapshot} names {sorted(set(tensors) ^ set(h.sink.tensors))[:3]} that the model lacks or misses"
                )
            for name in sorted(tensors):
                if spec_of(tensors[name], name) != h.sink.specs()[name]:
                    raise ModelMismatchError(f"snapshot {plan.snapshot}: {name} does not fit the model")
            for name in sorted(tensors):
                h.load_whole(name, tensors.pop(name))
            h.version, h.state = plan.snapshot, sm.state
            for v in plan.deltas:
                m, staged = fetch_delta(store, v, h.sink.specs(), streams, expect_base_state=h.state)
                apply_delta(staged, h.sink)
                h.version, h.state = v, m.state
            _sync()
            return {"version": h.version, "state": h.state}

        return reply(lambda: _while_writing(self._aurora_held(), go))

    def aurora_stage(
        self,
        url: str,
        options: Mapping[str, Any],
        version: int,
        expect_base_state: str | None,
        streams: int,
        manifest: bytes | None = None,
    ) -> dict[str, Any]:
        """Start fetching, verifying and decoding delta ``version`` in the background; returns at once.

        ``manifest``: the manifest the Actor read and checked; the worker
        then never reads it from the store (a second read could get other
        bytes: a mirror that changes its answer), and checks every segment
        against that one.
        """

        def go() -> None:
            h = self._aurora_held()
            store = h.store(url, options)
            m = None
            if manifest is not None:
                m = _handed(manifest, f"handed manifest of delta {version}")
                if (m.kind, m.version) != ("delta", version):
                    raise IntegrityError(f"the manifest handed for delta {version} describes {m.kind} {m.version}")
            with h.lock:
                old = h.staging.get(version)
                if old is not None and not (old.done() and old.exception() is not None):
                    return  # already staged or on its way
                h.staging[version] = h.pool.submit(_fetch_prepared, h, store, version, streams, expect_base_state, m)

        return reply(go)

    def aurora_staged(self, version: int, wait_s: float) -> dict[str, Any]:
        """``{"state", "nnz"}`` once delta ``version`` is staged here; ``None`` while it is still on its way."""

        def go() -> dict[str, Any] | None:
            h = self._aurora_held()
            fut = h.staging.get(version)
            if fut is None:
                raise ChainError(f"delta {version} was never staged in this worker")
            try:
                m, staged = fut.result(timeout=wait_s)
            except TimeoutError:
                return None
            except BaseException:
                with h.lock:
                    h.staging.pop(version, None)  # a later aurora_stage may try again
                raise
            return {"state": m.state, "nnz": staged.nnz, "bytes": m.total_bytes}

        return reply(go)

    def aurora_activate(self, version: int, expect_state: str | None = None, digest: bool = False) -> dict[str, Any]:
        """Apply staged delta ``version`` in place; drop it and anything older.

        ``expect_state``: the state the Actor settles with; a staged delta of
        another state is refused before any write. Replies ``{"seconds",
        "version", "state"}`` (and ``"digest"`` when asked): what this rank applied.
        """

        def go() -> dict[str, Any]:
            h = self._aurora_held()
            fut = h.staging.get(version)
            if fut is None:
                raise ChainError(f"delta {version} was never staged in this worker")
            try:
                m, staged = fut.result()
            except BaseException:
                with h.lock:
                    h.staging.pop(version, None)
                raise
            if expect_state is not None and m.state != expect_state:
                raise IntegrityError(
                    f"delta {version}: the worker staged state {m.state}, the Actor checked {expect_state}; nothing applied"
                )
            t0 = time.perf_counter()
            _apply(h, staged, m.state)
            dt = time.perf_counter() - t0
            with h.lock:
                for v in [v for v in h.staging if v <= version]:
                    h.staging.pop(v)
            return {"seconds": dt, **_held_reply(h, digest)}

        return reply(go)

    def aurora_apply(self, wire: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a delta decoded elsewhere (shipped as :func:`encode_entries`). Returns seconds spent."""

        def go() -> float:
            h = self._aurora_held()
            staged = decode_entries(wire)
            t0 = time.perf_counter()
            _apply(h, staged, None)
            return time.perf_counter() - t0

        return reply(go)

    def aurora_held(self, digest: bool = False) -> dict[str, Any]:
        """``{"version", "state"}`` this rank holds (and ``"digest"`` when asked)."""
        return reply(lambda: _held_reply(self._aurora_held(), digest))

    def aurora_digest(self) -> dict[str, Any]:
        """``weights_digest`` of the whole model as the Trainer holds it (same bytes, same names)."""
        return reply(lambda: weights_digest(self._aurora_held().whole(), self._aurora_held().plan))

    def aurora_digest_start(self, expected: str) -> dict[str, Any]:
        """tp=1: start hashing the weights in ``expected``'s form (FORMAT.md §4.1) in the background; returns at once."""
        return reply(lambda: vllm_digest.start(self._aurora_held(), expected))

    def aurora_digest_result(self, wait_s: float) -> dict[str, Any]:
        """``{"digest"}`` of the hash ``aurora_digest_start`` began (None: a write raced it); None while it runs."""
        return reply(lambda: vllm_digest.result(self._aurora_held(), wait_s))

    def aurora_digest_gathered(self, expected: str) -> dict[str, Any]:
        """Tensor parallelism: each whole tensor gathered to rank 0 and hashed there; rank 0's digest, None elsewhere."""
        return reply(lambda: vllm_digest.gathered(self._aurora_held(), expected))

    def aurora_probe(self, raw: bool = False) -> dict[str, Any]:
        """Process id, resident memory and every parameter's storage address (tests, benchmarks).

        ``raw``: also the sha256 of each tensor's bytes as this rank holds them (padded and packed
        where vLLM pads and packs): what a test compares with vLLM's own load of the same version.
        """

        def go() -> dict[str, Any]:
            h = self._aurora_held()
            out = {
                "pid": os.getpid(),
                "rss": _rss_bytes(),
                "ptrs": {n: t.data_ptr() for n, t in h.sink.tensors.items()},
                "version": h.version,
                "staged": sorted(h.staging),
            }
            if raw:
                out["raw"] = {n: hashlib.sha256(bits_view(t).cpu().numpy().tobytes()).hexdigest() for n, t in h.sink.tensors.items()}
            return out

        return reply(go)

    def aurora_reload(self, url: str, options: Mapping[str, Any], version: int, streams: int) -> dict[str, Any]:
        """Benchmark baseline: vLLM's own ``model.load_weights`` with every weight of ``version``.

        This is how weights usually reach a running vLLM in RL: the whole
        model in Hugging Face names, through each layer's weight loader. The
        weights are read from the store and split into Hugging Face names
        before the clock starts; only ``load_weights`` is timed, with what a
        correct load of packed experts adds (vllm_moe.reload_packed: vLLM pads
        and prepacks them again, as at start). The held version is unchanged
        afterwards (it reloads the version held).
        """

        def go() -> float:
            h = self._aurora_held()
            if h.version != version:
                raise ChainError(f"reload of version {version}: the worker holds {h.version}")
            from aurora_store.lineage.materialize import materialize

            tensors, _ = materialize(h.store(url, options), version, streams)
            model = self.get_model()  # type: ignore[attr-defined]
            family = getattr(getattr(self, "vllm_config", None), "model_config", None)
            family = getattr(getattr(family, "hf_config", None), "model_type", None)
            hf = list(vllm_moe.hf_named(model, tensors, family))
            t0 = time.perf_counter()
            vllm_moe.reload_packed(model, hf)  # model.load_weights, experts padded and packed again
            _sync()
            return time.perf_counter() - t0

        return reply(lambda: _while_writing(self._aurora_held(), go))


def _while_writing(h: Held, fn: Callable[[], T]) -> T:
    with _writing(h):
        return fn()


def _handed(data: bytes, where: str) -> Manifest:
    """A manifest the Actor checked, handed over the RPC (parsed and validated again: cheap)."""
    if not isinstance(data, (bytes, bytearray)):
        raise IntegrityError(f"{where}: not bytes")
    return Manifest.from_bytes(bytes(data), where)


def _held_reply(h: Held, digest: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"version": h.version, "state": h.state}
    if digest:
        out["digest"] = weights_digest(h.whole(), h.plan)
    return out


def _bootstrap_checked(h: Held, store: Any, chain: list[Manifest], streams: int) -> None:
    """Reach the end of ``chain`` (a snapshot manifest, then delta manifests) exactly as the Actor planned it.

    Continuity is checked on the manifests themselves, every object is
    fetched and verified against them, and only then is anything written.
    """
    if not chain or chain[0].kind != "snapshot":
        raise ChainError("a bootstrap chain starts with a snapshot manifest")
    state = chain[0].state
    for prev, m in zip(chain, chain[1:], strict=False):
        if m.kind != "delta" or m.version != prev.version + 1 or m.base_state != state:
            raise ChainError(f"handed chain: {m.kind} {m.version} does not continue {prev.kind} {prev.version} ({state})")
        state = m.state
    sm = chain[0]
    _, tensors = fetch_snapshot(store, sm.version, streams, sm)
    if set(tensors) != set(h.sink.tensors):
        raise ModelMismatchError(
            f"snapshot {sm.version} names {sorted(set(tensors) ^ set(h.sink.tensors))[:3]} that the model lacks or misses"
        )
    for name in sorted(tensors):
        if spec_of(tensors[name], name) != h.sink.specs()[name]:
            raise ModelMismatchError(f"snapshot {sm.version}: {name} does not fit the model")
    deltas = [fetch_delta(store, m.version, h.sink.specs(), streams, m.base_state, m) for m in chain[1:]]
    for name in sorted(tensors):
        h.load_whole(name, tensors.pop(name))
    h.version, h.state = sm.version, sm.state
    for m, staged in deltas:
        apply_delta(staged, h.sink)
        h.version, h.state = m.version, m.state
    _sync()


def _fetch_prepared(h: Held, store: Any, version: int, streams: int, base_state: str | None, m: Manifest | None) -> tuple[Manifest, Any]:
    """Fetch, verify and decode delta ``version``, then prepare it for this rank's shards while the
    engine generates (aurora_store.apply.prepare), so activation only writes (the checks and block
    searches of ``apply_delta`` move off the safe point; the scatter itself stays, and dominates).
    ``AURORA_VLLM_PREPARE=0``: the decoded delta, applied as before (to measure both). Column-split
    shards (tensor parallelism) always keep the decoded delta."""
    layout = layout_of_shards(h.sink.layouts)
    if layout is None or not VLLM_PREPARE.get():
        return fetch_delta(store, version, h.sink.specs(), streams, base_state, m)
    specs = h.sink.specs()
    # Each segment prepared in its download thread as it is decoded; the join is what is left.
    got, staged = fetch_delta(
        store,
        version,
        specs,
        streams,
        base_state,
        m,
        prepare=lambda seg: prepare_part(seg.version, seg.entries, specs, layout, basis=h.sink),
    )
    return got, prepare_delta(staged, specs, layout, device=lambda n: h.sink.tensors[n].device, parts=parts_of(staged, h.sink))


def _apply(h: Held, staged: StagedDelta | PreparedDelta, state: str | None) -> None:
    if h.version is not None and staged.base_version != h.version:
        raise ChainError(f"delta {staged.version} is based on version {staged.base_version}, the worker holds version {h.version}")
    with _writing(h):
        if isinstance(staged, PreparedDelta):
            staged.write(h.sink.tensors)  # every target checked before the first write
        else:
            apply_delta(staged, h.sink)  # validates every entry against the whole model before writing
        _sync()
        h.version, h.state = staged.version, state


@contextlib.contextmanager
def _writing(h: Held) -> Iterator[None]:
    """Around every weight write: a digest hashed beside it (vllm_digest) is then void."""
    h.writes += 1
    try:
        yield
    finally:
        h.writes += 1


def _exit_with(pid: int, period_s: float = 1.0) -> None:
    """End this worker, and the engine process above it, once ``pid`` no longer exists."""
    import signal

    while True:
        time.sleep(period_s)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            continue  # exists, owned by someone else
    log.warning("the process driving this vLLM engine (pid %d) is gone: stopping", pid)
    parent = os.getppid()
    if parent not in (0, 1, pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent, signal.SIGTERM)  # the EngineCore, which nothing else would stop
    os._exit(0)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
