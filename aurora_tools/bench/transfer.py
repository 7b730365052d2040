"""``aurora bench transfer``: publish-to-staged time over 1 and S connections, against raw S3.

What is timed, against an S3-protocol server (moto) started by this program
on 127.0.0.1 and stopped when it ends:

- *delta* (the realistic payload): a Qwen3-shaped bf16 model takes one
  Adam-sized step (:class:`~aurora_tools.synthetic.shapes.MasterWeights`); the
  changed elements are extracted once, then ``publish_delta`` (encode, upload
  segments while encoding, commit the manifest) followed by ``fetch_delta``
  (fetch, verify sha256, decode and validate) is the *publish-to-staged* time;
- *full*: the same model's full weights, ``publish_snapshot`` followed by
  ``fetch_snapshot``;
- *raw*: the same bytes (same number of objects, same sizes: segments or
  shards first, then the manifest; the manifest first on the way back) put and
  got with the same client stack (s3fs) from a thread pool, with nothing else
  around it. ``pipeline_over_raw`` is pipeline time over raw time at the same
  number of connections.

Each is measured over 1 connection and over ``--streams`` connections. The
staged delta is applied to a copy of the base and must give the new weights
bit for bit (``lossless``); the fetched snapshot must equal them too.

On loopback nothing waits on the network: client and server burn CPU, and on a
small machine the cores are the limit, which is why client and server CPU
seconds are reported next to the wall times.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["add_arguments", "main", "shape_for_params", "TimedStore", "run_benchmark"]

#: Default model size: Qwen3-0.6B's geometry cut to 6 of its 28 layers (about
#: 250 M parameters, 0.5 GB of bf16). Making the synthetic update costs about
#: 0.17 s per million parameters on two cores (an fp32 master copy, one
#: step), and every full-weights transfer is repeated four times, so the
#: whole 0.6 B model would not fit a run of a few minutes; 250 M keeps the
#: tied 151936 x 1024 embedding (the largest single tensor) and real layers.
DEFAULT_PARAMS = 2.5e8
#: Targets reported (not asserted).
TARGET_SPEEDUP = 1.4
TARGET_OVER_RAW = 1.3
_MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=float,
        default=None,
        help=f"model size in parameters (default {DEFAULT_PARAMS:.3g}: Qwen3-0.6B geometry, 6 layers)",
    )
    parser.add_argument(
        "--streams", type=int, default=8, help="connections of the parallel runs (S)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=2.5e-7,
        help="step size of the synthetic update (2.5e-7: about 1.3%% density in steady state)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="steps taken before the measured one (the first step off a fresh master "
        "changes about 0.2%% more elements than a steady-state step)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="delta runs per connection count (best reported)"
    )
    parser.add_argument(
        "--full-repeats",
        type=int,
        default=1,
        help="full-weights runs per connection count (best reported)",
    )
    parser.add_argument(
        "--segment-mib",
        type=float,
        default=0.0,
        help="delta segment size; 0 (default) cuts the delta into about 2 x streams segments (<= 16 MiB)",
    )
    parser.add_argument(
        "--shard-mib",
        type=float,
        default=0.0,
        help="snapshot shard size; 0 (default) aims at about 2 x streams shards (<= 1 GiB)",
    )
    parser.add_argument(
        "--server",
        choices=("process", "thread"),
        default="process",
        help="run moto in a child process (default: it then has its own interpreter lock) or in a thread of this one",
    )
    parser.add_argument("--no-full", action="store_true", help="skip the full-weights runs")
    parser.add_argument(
        "--value-modes",
        default="",
        help="comma list the encoder may choose from (new,xor); default: the library's EncodeOptions",
    )
    parser.add_argument(
        "--index-encodings",
        default="",
        help="comma list (leb128,bitmask,dense,u32,u64); default: the library's EncodeOptions",
    )
    parser.add_argument(
        "--s3fs-max-concurrency",
        type=int,
        default=0,
        help="s3fs max_concurrency of the pipeline's store (0: s3fs's default, 10 requests per large object)",
    )
    parser.add_argument("--no-boto3", action="store_true", help="skip the raw boto3 reference runs")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="put Aurora's WAN proxy (a child process) between client and server with this round-trip time; "
        "0 (default): talk to the loopback server directly",
    )
    parser.add_argument(
        "--rate-mbit", type=float, default=0.0, help="with the proxy: rate limit of the link in Mbit/s (0: none)"
    )


@contextmanager
def _proxied(endpoint: str, rtt_ms: float, rate_mbit: float) -> Iterator[str]:
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    argv = [sys.executable, "-m", "aurora_tools.wan.proxy", "--upstream", f"{host}:{port}", "--delay-ms", f"{rtt_ms / 2:g}"]
    if rate_mbit > 0:
        argv += ["--rate-mbit", f"{rate_mbit:g}"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout is not None
        addr = child.stdout.readline().strip()
        if ":" not in addr:
            raise RuntimeError(f"the WAN proxy did not start (said {addr!r})")
        yield f"http://{addr}"
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# ---------------------------------------------------------------------------
# model


def shape_for_params(params: float | None) -> Any:
    """A Qwen3-shaped model of about ``params`` parameters.

    From about 171 M up: Qwen3-0.6B's geometry (hidden 1024, vocab 151936)
    with as many layers as fit. Below: a narrower Qwen3-style model (vocab 32 x
    hidden) with the widest hidden size that leaves room for a layer.
    """
    from aurora_tools.synthetic.shapes import QWEN3_0_6B, Qwen3Shape

    target = DEFAULT_PARAMS if params is None else float(params)
    if target <= 0:
        raise ValueError(f"--params must be positive, got {params}")

    def fit(base: Qwen3Shape) -> Qwen3Shape | None:
        fixed = dataclasses.replace(base, layers=0).params
        per_layer = dataclasses.replace(base, layers=1).params - fixed
        if target < fixed + per_layer:
            return None
        return dataclasses.replace(base, layers=max(1, round((target - fixed) / per_layer)))

    big = fit(QWEN3_0_6B)
    if big is not None:
        return big
    for hidden in (768, 512, 384, 256, 192, 128, 96, 64):
        small = Qwen3Shape(
            vocab=32 * hidden,
            hidden=hidden,
            layers=1,
            intermediate=3 * hidden,
            heads=max(2, hidden // 64),
            kv_heads=max(1, hidden // 128),
            head_dim=64 if hidden >= 128 else 32,
        )
        got = fit(small)
        if got is not None:
            return got
    return dataclasses.replace(small, layers=1)  # the smallest model there is


def _fuse(plan: Any, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused (engine-named) contiguous tensors of Hugging Face-named weights."""
    return {
        p.name: torch.cat([weights[b.source].reshape(-1) for b in p.blocks]).view(p.spec.shape)
        if p.is_fused
        else weights[p.blocks[0].source].contiguous().clone()
        for p in plan
    }


# ---------------------------------------------------------------------------
# timing


@dataclass(frozen=True, slots=True)
class _Op:
    kind: str
    key: str
    nbytes: int
    t0: float
    t1: float


class TimedStore:
    """A :class:`~aurora_store.storage.store.Store` that records when each put and get ran.

    Everything else is delegated; the pipeline under test does not know it is
    being watched.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: list[_Op] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _record(self, kind: str, key: str, nbytes: int, t0: float) -> None:
        op = _Op(kind, key, nbytes, t0, time.perf_counter())
        with self._lock:
            self.ops.append(op)

    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        t0 = time.perf_counter()
        self.inner.put(key, data, mode=mode)
        self._record("put", key, len(data), t0)

    def get(self, key: str) -> bytes:
        t0 = time.perf_counter()
        data: bytes = self.inner.get(key)
        self._record("get", key, len(data), t0)
        return data

    def busy(self, kind: str, manifest: bool = False) -> float:
        """Wall seconds with at least one ``kind`` op (on segments, or on the manifest) in flight."""
        spans = sorted(
            (o.t0, o.t1)
            for o in self.ops
            if o.kind == kind and o.key.endswith("manifest.json") == manifest
        )
        total, end = 0.0, -math.inf
        for a, b in spans:
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


def _cpu_of(pid: int | None) -> float:
    """CPU seconds (user + system) of a process; this one when ``pid`` is None."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class _Clock:
    """Wall and CPU seconds of client and server across a block."""

    server_pid: int | None
    wall: float = 0.0
    cpu_client: float = 0.0
    cpu_server: float | None = None

    @contextmanager
    def run(self) -> Iterator[_Clock]:
        w, c = time.perf_counter(), _cpu_of(None)
        s = _cpu_of(self.server_pid) if self.server_pid else None
        try:
            yield self
        finally:
            self.wall = time.perf_counter() - w
            self.cpu_client = _cpu_of(None) - c
            if s is not None and self.server_pid:
                self.cpu_server = _cpu_of(self.server_pid) - s


# ---------------------------------------------------------------------------
# server


_CHILD = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from aurora_store.testing.servers import S3Server
s = S3Server().start()
print(s.endpoint, flush=True)
sys.stdin.read()
s.stop()
"""


@contextmanager
def _s3_server(mode: str, rtt_ms: float = 0.0, rate_mbit: float = 0.0) -> Iterator[tuple[Any, int | None]]:
    """(S3Server, server pid or None) on 127.0.0.1, in a child process or a thread.

    With ``rtt_ms`` or ``rate_mbit``, the endpoint handed out is that of a
    WAN proxy (``aurora_tools.wan.proxy``, a child process of its own, so
    its work does not share the client's interpreter lock) in front of it.
    """
    if rtt_ms > 0 or rate_mbit > 0:
        from aurora_store.testing.servers import S3Server

        with _s3_server(mode) as (srv, pid), _proxied(srv.endpoint, rtt_ms, rate_mbit) as endpoint:
            yield S3Server(endpoint=endpoint), pid
        return
    from aurora_store.testing.servers import S3Server

    if mode == "thread":
        wz = logging.getLogger("werkzeug")
        level = wz.level
        wz.setLevel(logging.ERROR)  # one access-log line per request otherwise
        srv = S3Server().start()
        try:
            yield srv, None
        finally:
            srv.stop()
            wz.setLevel(level)
        return
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        if not endpoint.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the S3 server process did not start (said {endpoint!r})")
        yield S3Server(endpoint=endpoint), child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()  # the child stops its server on EOF
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _open(srv: Any, bucket: str, prefix: str, max_concurrency: int = 0) -> TimedStore:
    """A warmed store: the s3fs client exists and one request went through."""
    from aurora_store.storage.store import open_store

    opts = srv.storage_options()
    if max_concurrency:
        opts["max_concurrency"] = max_concurrency
    store = open_store(f"s3://{bucket}/{prefix}", opts)
    store.exists("warm-up")
    return TimedStore(store)


def _drop(store: TimedStore) -> None:
    """Delete everything under the store's root (moto keeps objects in memory and /tmp)."""
    with suppress(FileNotFoundError):
        store.fs.rm(store.root, recursive=True)


# ---------------------------------------------------------------------------
# one run of each kind


@dataclass
class _Run:
    """One publish-to-staged run, or one raw transfer of the same objects."""

    streams: int
    publish_s: float = 0.0
    fetch_s: float = 0.0
    upload_s: float = 0.0
    commit_s: float = 0.0
    manifest_get_s: float = 0.0
    get_s: float = 0.0
    cpu_client_s: float = 0.0
    cpu_server_s: float | None = None
    lossless: bool | None = None
    objects: list[bytes] = field(default_factory=list, repr=False)
    manifest: bytes = field(default=b"", repr=False)

    @property
    def total_s(self) -> float:
        return self.publish_s + self.fetch_s

    @property
    def cpu_s(self) -> float:
        """Client plus server CPU seconds (the server's are the client's in thread mode)."""
        return self.cpu_client_s + (self.cpu_server_s or 0.0)

    def summary(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "seconds": round(self.total_s, 4),
            "publish_s": round(self.publish_s, 4),
            "fetch_s": round(self.fetch_s, 4),
            "upload_busy_s": round(self.upload_s, 4),
            "commit_s": round(self.commit_s, 4),
            "manifest_get_s": round(self.manifest_get_s, 4),
            "get_busy_s": round(self.get_s, 4),
            "cpu_client_s": round(self.cpu_client_s, 3),
            "cpu_server_s": None if self.cpu_server_s is None else round(self.cpu_server_s, 3),
            "lossless": self.lossless,
        }


def _pipeline_delta(
    srv: Any,
    pid: int | None,
    bucket: str,
    deltas: Sequence[Any],
    specs: Mapping[str, Any],
    streams: int,
    segment_bytes: int,
    options: Any,
    max_concurrency: int,
    check: Callable[[Any], bool] | None,
) -> _Run:
    from aurora_store.lineage.fetch import fetch_delta
    from aurora_store.lineage.publish import PublishConfig, publish_delta

    base_state = "sha256:" + hashlib.sha256(b"aurora bench transfer base").hexdigest()
    # Any: the pipeline takes a Store; a TimedStore is one by delegation.
    store: Any = _open(srv, bucket, f"delta-{uuid.uuid4().hex[:8]}", max_concurrency)
    cfg = PublishConfig(streams=streams, segment_bytes=segment_bytes, options=options)
    run = _Run(streams)
    clock = _Clock(pid)
    with clock.run():
        t0 = time.perf_counter()
        m = publish_delta(store, "bench", 1, deltas, base_state, cfg)
        t1 = time.perf_counter()
        _, staged = fetch_delta(store, 1, specs, streams=streams, expect_base_state=base_state)
        t2 = time.perf_counter()
    run.publish_s, run.fetch_s = t1 - t0, t2 - t1
    _fill(run, store, clock)
    run.objects = [o for o in _put_payloads(store, m)]
    run.manifest = store.inner.get(_manifest_key("delta", 1))
    if check is not None:
        run.lossless = check(staged)
    _drop(store)
    return run


def _pipeline_full(
    srv: Any,
    pid: int | None,
    bucket: str,
    fused: Mapping[str, torch.Tensor],
    streams: int,
    shard_bytes: int,
    expect_digest: str,
    max_concurrency: int,
) -> _Run:
    from aurora_store.apply.sink import weights_digest
    from aurora_store.lineage.fetch import fetch_snapshot
    from aurora_store.lineage.publish import PublishConfig, publish_snapshot

    store: Any = _open(srv, bucket, f"full-{uuid.uuid4().hex[:8]}", max_concurrency)
    cfg = PublishConfig(streams=streams, shard_bytes=shard_bytes)
    run = _Run(streams)
    clock = _Clock(pid)
    with clock.run():
        t0 = time.perf_counter()
        m = publish_snapshot(store, "bench", 0, fused, None, cfg)
        t1 = time.perf_counter()
        _, tensors = fetch_snapshot(store, 0, streams=streams)
        t2 = time.perf_counter()
    run.publish_s, run.fetch_s = t1 - t0, t2 - t1
    _fill(run, store, clock)
    run.objects = [o for o in _put_payloads(store, m)]
    run.manifest = store.inner.get(_manifest_key("snapshot", 0))
    run.lossless = weights_digest(tensors) == expect_digest
    del tensors
    _drop(store)
    return run


def _manifest_key(kind: str, version: int) -> str:
    from aurora_store.format.manifest import manifest_key

    return manifest_key(kind, version)


def _put_payloads(store: TimedStore, m: Any) -> Iterator[bytes]:
    """The segment/shard objects of a version, in manifest order (read back after timing)."""
    from aurora_store.format.manifest import version_dir

    vdir = version_dir(m.kind, m.version)
    for ref in m.segments:
        yield store.inner.get(f"{vdir}/{ref.key}")


def _fill(run: _Run, store: TimedStore, clock: _Clock) -> None:
    run.upload_s = store.busy("put")
    run.commit_s = store.busy("put", manifest=True)
    run.get_s = store.busy("get")
    run.manifest_get_s = store.busy("get", manifest=True)
    run.cpu_client_s = clock.cpu_client
    run.cpu_server_s = clock.cpu_server


def _raw(
    srv: Any,
    pid: int | None,
    bucket: str,
    objects: Sequence[bytes],
    manifest: bytes,
    streams: int,
    client: str = "s3fs",
) -> _Run:
    """The same objects with nothing around them: parallel puts, then the
    manifest; the manifest, then parallel gets; one request per object.

    ``s3fs`` is the pipeline's own client stack (with ``max_concurrency=1``,
    so that a get is one GET, not a HEAD then a GET); ``boto3`` is the
    reference of what the server does for a thinner client.
    """
    store = _open(srv, bucket, f"raw-{uuid.uuid4().hex[:8]}", max_concurrency=1)
    root = store.root
    put: Callable[[str, bytes], Any]
    get: Callable[[str], bytes]
    if client == "boto3":
        import boto3
        from botocore.config import Config

        opts = srv.storage_options()
        s3 = boto3.session.Session().client(
            "s3",
            endpoint_url=opts["client_kwargs"]["endpoint_url"],
            region_name=opts["client_kwargs"]["region_name"],
            aws_access_key_id=opts["key"],
            aws_secret_access_key=opts["secret"],
            config=Config(max_pool_connections=max(10, streams)),
        )
        s3.head_bucket(Bucket=bucket)  # warm: client made, one request through

        def put(path: str, data: bytes) -> Any:
            return s3.put_object(Bucket=bucket, Key=path.split("/", 1)[1], Body=data)

        def get(path: str) -> bytes:
            body = s3.get_object(Bucket=bucket, Key=path.split("/", 1)[1])["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

    else:
        fs = store.fs
        put, get = fs.pipe_file, fs.cat_file
    paths = [f"{root}/obj-{i:05d}" for i in range(len(objects))]
    run = _Run(streams)
    clock = _Clock(pid)
    with clock.run():
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=streams) as pool:
            list(pool.map(put, paths, objects))
        put(f"{root}/manifest.json", manifest)
        t1 = time.perf_counter()
        got_manifest = get(f"{root}/manifest.json")
        with ThreadPoolExecutor(max_workers=streams) as pool:
            got = list(pool.map(get, paths))
        t2 = time.perf_counter()
    run.publish_s, run.fetch_s = t1 - t0, t2 - t1
    run.upload_s, run.get_s = run.publish_s, run.fetch_s
    run.cpu_client_s, run.cpu_server_s = clock.cpu_client, clock.cpu_server
    if len(got_manifest) != len(manifest) or [len(g) for g in got] != [len(o) for o in objects]:
        raise RuntimeError("raw transfer returned other sizes than it sent")
    del got
    _drop(store)
    return run


# ---------------------------------------------------------------------------
# serial CPU costs (no server, one thread)


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _delta_cpu_costs(
    deltas: Sequence[Any],
    segments: Sequence[bytes],
    specs: Mapping[str, Any],
    options: Any,
    segment_bytes: int,
) -> dict[str, float]:
    from aurora_store.format.checkpoint import assemble_staged, encode_segments
    from aurora_store.format.segment import decode_segment

    encode_s, _ = _time(
        lambda: sum(len(s.data) for s in encode_segments(deltas, 1, options, segment_bytes))
    )
    verify_s, _ = _time(lambda: [hashlib.sha256(s).hexdigest() for s in segments])
    decode_s, _ = _time(
        lambda: assemble_staged(
            [(f"seg-{i}", decode_segment(s, f"seg-{i}", specs)) for i, s in enumerate(segments)], 1
        )
    )
    return {"encode": encode_s, "verify": verify_s, "decode": decode_s}


def _full_cpu_costs(fused: Mapping[str, torch.Tensor], shards: Sequence[bytes]) -> dict[str, float]:
    from safetensors.torch import load, save

    encode_s, _ = _time(lambda: len(save(dict(fused))))
    verify_s, _ = _time(lambda: [hashlib.sha256(s).hexdigest() for s in shards])
    decode_s, _ = _time(lambda: [load(s) for s in shards])
    return {"encode": encode_s, "verify": verify_s, "decode": decode_s}


# ---------------------------------------------------------------------------
# the benchmark


def _best_run(runs: Sequence[_Run]) -> _Run:
    """The fastest run: on a shared machine, slower runs measure the neighbours.

    A whole run (not the best of each part) so that its parts add up.
    """
    return min(runs, key=lambda r: r.total_s)


def _lossless(runs: Sequence[_Run]) -> bool:
    checked = [r.lossless for r in runs if r.lossless is not None]
    return bool(checked) and all(checked)


def _section(
    runs: Mapping[tuple[str, int], Sequence[_Run]],
    streams: int,
    nbytes: int,
    cpu: Mapping[str, float],
) -> dict[str, Any]:
    """Summary of one payload: the best run of each variant, ratios, phases."""
    med = {k: _best_run(v) for k, v in runs.items()}
    pipe1, pipes = med[("pipeline", 1)], med[("pipeline", streams)]
    raw1, raws = med[("raw", 1)], med[("raw", streams)]
    mb = nbytes / 1e6
    out: dict[str, Any] = {
        "seconds_1_stream": round(pipe1.total_s, 4),
        "seconds_s_streams": round(pipes.total_s, 4),
        "speedup_streams": round(pipe1.total_s / pipes.total_s, 3),
        "pipeline_over_raw": round(pipes.total_s / raws.total_s, 3),
        "pipeline_over_raw_1_stream": round(pipe1.total_s / raw1.total_s, 3),
        # The same ratio in CPU seconds (client + server): what the pipeline
        # costs beyond moving the bytes, and far less sensitive than wall time
        # to other programs sharing the machine.
        "cpu_over_raw": round(pipes.cpu_s / max(1e-9, raws.cpu_s), 3),
        "cpu_s_pipeline_s": round(pipes.cpu_s, 3),
        "cpu_s_raw_s": round(raws.cpu_s, 3),
        "raw_seconds_1": round(raw1.total_s, 4),
        "raw_seconds_s": round(raws.total_s, 4),
        "raw_speedup_streams": round(raw1.total_s / raws.total_s, 3),
        "raw_mb_s_put_1": round(mb / raw1.publish_s, 1),
        "raw_mb_s_get_1": round(mb / raw1.fetch_s, 1),
        "raw_mb_s_put_s": round(mb / raws.publish_s, 1),
        "raw_mb_s_get_s": round(mb / raws.fetch_s, 1),
        "pipeline_mb_s_1": round(mb / pipe1.total_s, 1),
        "pipeline_mb_s_s": round(mb / pipes.total_s, 1),
        # Where the S-connection pipeline's time goes. encode/verify/decode are
        # serial CPU costs measured alone; upload/fetch are wall seconds with at
        # least one segment transfer in flight during the run; publish/stage are
        # the two halves of the run's wall time.
        "phases": {
            "encode": round(cpu["encode"], 4),
            "upload": round(pipes.upload_s, 4),
            "commit": round(pipes.commit_s, 4),
            "publish": round(pipes.publish_s, 4),
            "fetch": round(pipes.get_s, 4),
            "manifest_get": round(pipes.manifest_get_s, 4),
            "verify": round(cpu["verify"], 4),
            "decode": round(cpu["decode"], 4),
            "stage": round(pipes.fetch_s, 4),
        },
        # Checked on the first run of each connection count (a check costs a
        # copy of the model, an apply and a digest of every weight).
        "lossless_1": _lossless(runs[("pipeline", 1)]),
        "lossless_s": _lossless(runs[("pipeline", streams)]),
        "runs": {f"{k}_{'1' if s == 1 else 's'}": r.summary() for (k, s), r in med.items()},
        "samples": {
            f"{k}_{'1' if s == 1 else 's'}": [round(r.total_s, 4) for r in rs]
            for (k, s), rs in runs.items()
        },
    }
    out["lossless"] = out["lossless_1"] and out["lossless_s"]
    if ("boto3", 1) in med:
        b1, bs = med[("boto3", 1)], med[("boto3", streams)]
        out.update(
            {
                "boto3_seconds_1": round(b1.total_s, 4),
                "boto3_seconds_s": round(bs.total_s, 4),
                "boto3_mb_s_put_1": round(mb / b1.publish_s, 1),
                "boto3_mb_s_get_1": round(mb / b1.fetch_s, 1),
                "boto3_mb_s_put_s": round(mb / bs.publish_s, 1),
                "boto3_mb_s_get_s": round(mb / bs.fetch_s, 1),
                "pipeline_over_boto3": round(pipes.total_s / bs.total_s, 3),
            }
        )
    return out


def _auto_size(total: int, streams: int, floor: int, ceiling: int) -> int:
    """Object size that cuts ``total`` bytes into about 2 x ``streams`` objects."""
    return int(min(ceiling, max(floor, math.ceil(total / (2 * streams)))))


def _encode_options(args: argparse.Namespace) -> Any:
    from aurora_store.codec.entries import EncodeOptions

    kw: dict[str, Any] = {}
    for flag, name in (("value_modes", "value_modes"), ("index_encodings", "index_encodings")):
        raw = str(getattr(args, flag, "") or "")
        if raw:
            kw[name] = tuple(x.strip() for x in raw.split(",") if x.strip())
    return EncodeOptions(**kw)


def run_benchmark(
    args: argparse.Namespace, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """Run every measurement; returns the JSON-ready result."""
    from aurora_store.apply.sink import FusedWeights, apply_delta, weights_digest
    from aurora_store.codec.extract import extract, spec_of
    from aurora_store.codec.fusion import FusionPlan
    from aurora_store.format.checkpoint import DEFAULT_SEGMENT_BYTES, encode_segments
    from aurora_store.lineage.publish import DEFAULT_SHARD_BYTES
    from aurora_tools.synthetic.shapes import MasterWeights, make_weights

    streams = int(getattr(args, "streams", 8) or 8)
    if not 2 <= streams <= 256:
        raise ValueError(f"--streams must be 2..256 (it is compared with 1), got {streams}")
    seed = int(getattr(args, "seed", 0) or 0)
    lr = float(getattr(args, "lr", 2.5e-7))
    warmup = max(0, int(getattr(args, "warmup_steps", 1)))
    repeats = max(1, int(getattr(args, "repeats", 5)))
    full_repeats = max(1, int(getattr(args, "full_repeats", 1)))
    server_mode = str(getattr(args, "server", "process"))
    rtt_ms = float(getattr(args, "rtt_ms", 0.0) or 0.0)
    rate_mbit = float(getattr(args, "rate_mbit", 0.0) or 0.0)
    do_full = not getattr(args, "no_full", False)
    do_boto3 = not getattr(args, "no_boto3", False)
    max_conc = int(getattr(args, "s3fs_max_concurrency", 0) or 0)
    options = _encode_options(args)
    started = time.perf_counter()
    load_before = os.getloadavg()

    shape = shape_for_params(getattr(args, "params", None))
    log(f"model: {shape.params / 1e6:.1f} M parameters ({shape}); making weights and one step")
    t0 = time.perf_counter()
    weights = make_weights(shape, seed=seed)
    master = MasterWeights(weights, seed=seed)
    for _ in range(warmup):
        weights = master.step(lr=lr)  # the base: the version before the measured step
    new = master.step(lr=lr)
    del master
    gen_s = time.perf_counter() - t0
    plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in weights.items()})
    specs = plan.specs()
    numel = sum(p.spec.numel for p in plan)
    t0 = time.perf_counter()
    deltas = list(extract(plan, weights, new))
    extract_s = time.perf_counter() - t0
    nnz = sum(d.nnz for d in deltas)
    base_fused = _fuse(plan, weights)
    new_fused = _fuse(plan, new)
    del weights
    expect = weights_digest(new, plan)
    del new
    full_bytes = sum(t.numel() * t.element_size() for t in new_fused.values())

    def lossless(staged: Any) -> bool:
        sink = FusedWeights({n: t.clone() for n, t in base_fused.items()})
        apply_delta(staged, sink)
        return weights_digest(sink.tensors) == expect

    seg_mib = float(getattr(args, "segment_mib", 0.0) or 0.0)
    if seg_mib > 0:
        segment_bytes = int(seg_mib * _MIB)
    else:
        dry = sum(len(s.data) for s in encode_segments(deltas, 1, options))
        segment_bytes = _auto_size(dry, streams, 64 << 10, DEFAULT_SEGMENT_BYTES)
    shard_mib = float(getattr(args, "shard_mib", 0.0) or 0.0)
    shard_bytes = (
        int(shard_mib * _MIB)
        if shard_mib > 0
        else _auto_size(full_bytes, streams, _MIB, DEFAULT_SHARD_BYTES)
    )
    log(
        f"delta: {nnz} changed ({100 * nnz / numel:.2f} %), segments of {segment_bytes / _MIB:.2f} MiB"
    )
    raws = ("raw", "boto3") if do_boto3 else ("raw",)

    with _s3_server(server_mode, rtt_ms, rate_mbit) as (srv, pid):
        bucket = srv.new_bucket("bench")
        druns: dict[tuple[str, int], list[_Run]] = {}
        for rep in range(repeats):
            # Interleaved, so that a noisy neighbour hurts every variant alike.
            for s in (1, streams):
                p = _pipeline_delta(
                    srv,
                    pid,
                    bucket,
                    deltas,
                    specs,
                    s,
                    segment_bytes,
                    options,
                    max_conc,
                    lossless if rep == 0 else None,
                )
                druns.setdefault(("pipeline", s), []).append(p)
                line = f"delta  rep {rep} x{s:<3} pipeline {p.total_s:.3f}s"
                for kind in raws:
                    r = _raw(
                        srv,
                        pid,
                        bucket,
                        p.objects,
                        p.manifest,
                        s,
                        "boto3" if kind == "boto3" else "s3fs",
                    )
                    druns.setdefault((kind, s), []).append(r)
                    line += f" {kind} {r.total_s:.3f}s"
                log(line)
        first = druns[("pipeline", 1)][0]
        segs = first.objects
        delta_bytes = sum(len(o) for o in segs)
        delta = _section(
            druns,
            streams,
            delta_bytes,
            _delta_cpu_costs(deltas, segs, specs, options, segment_bytes),
        )
        delta["phases"]["extract"] = round(extract_s, 4)
        delta.update(
            {
                "bytes": delta_bytes,
                "objects": len(segs),
                "object_bytes_max": max(len(o) for o in segs),
                "segment_bytes": segment_bytes,
                "manifest_bytes": len(first.manifest),
            }
        )
        for rs in druns.values():
            for r in rs:
                r.objects = []
        full: dict[str, Any] | None = None
        if do_full:
            fruns: dict[tuple[str, int], list[_Run]] = {}
            shards: list[bytes] = []
            manifest = b""
            for rep in range(full_repeats):
                for s in (1, streams):
                    p = _pipeline_full(
                        srv, pid, bucket, new_fused, s, shard_bytes, expect, max_conc
                    )
                    fruns.setdefault(("pipeline", s), []).append(p)
                    # Keep one copy of the shards only.
                    shards, manifest, p.objects = p.objects, p.manifest, []
                    line = f"full   rep {rep} x{s:<3} pipeline {p.total_s:.3f}s"
                    for kind in raws:
                        r = _raw(
                            srv,
                            pid,
                            bucket,
                            shards,
                            manifest,
                            s,
                            "boto3" if kind == "boto3" else "s3fs",
                        )
                        fruns.setdefault((kind, s), []).append(r)
                        line += f" {kind} {r.total_s:.3f}s"
                    log(line)
            full = _section(fruns, streams, full_bytes, _full_cpu_costs(new_fused, shards))
            full.update(
                {
                    "bytes": sum(len(o) for o in shards),
                    "objects": len(shards),
                    "object_bytes_max": max(len(o) for o in shards),
                    "shard_bytes": shard_bytes,
                    "manifest_bytes": len(manifest),
                }
            )
            del shards
        endpoint = srv.endpoint

    t: dict[str, Any] = {
        "speedup_streams_min": TARGET_SPEEDUP,
        "pipeline_over_raw_max": TARGET_OVER_RAW,
    }
    for name, sec in (("delta", delta), ("full", full)):
        t[f"{name}_speedup_met"] = None if sec is None else sec["speedup_streams"] >= TARGET_SPEEDUP
        t[f"{name}_pipeline_over_raw_met"] = (
            None if sec is None else sec["pipeline_over_raw"] <= TARGET_OVER_RAW
        )
    return {
        "benchmark": "transfer",
        "params": shape.params,
        "model": dataclasses.asdict(shape),
        "streams": streams,
        "seed": seed,
        "lr": lr,
        "warmup_steps": warmup,
        "repeats": repeats,
        "full_repeats": full_repeats,
        "server": f"moto S3 ({'child process' if server_mode == 'process' else 'thread of the client'}) at {endpoint}"
        + (f" through the WAN proxy ({rtt_ms:g} ms RTT{f', {rate_mbit:g} Mbit/s' if rate_mbit else ''})" if rtt_ms or rate_mbit else ""),
        "rtt_ms": rtt_ms,
        "rate_mbit": rate_mbit or None,
        "client": "s3fs (aiobotocore)"
        + (f", max_concurrency={max_conc}" if max_conc else ", s3fs defaults"),
        "encode_options": dataclasses.asdict(options),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "density": round(nnz / numel, 6),
        "nnz": nnz,
        "generate_s": round(gen_s, 2),
        # Headline numbers: the delta, the payload Aurora ships every step.
        "seconds_1_stream": delta["seconds_1_stream"],
        "seconds_s_streams": delta["seconds_s_streams"],
        "speedup_streams": delta["speedup_streams"],
        "pipeline_over_raw": delta["pipeline_over_raw"],
        "bytes_delta": delta["bytes"],
        "bytes_full": full["bytes"] if full else full_bytes,
        "phases": delta["phases"],
        "raw_mb_s_put_1": delta["raw_mb_s_put_1"],
        "raw_mb_s_get_1": delta["raw_mb_s_get_1"],
        "raw_mb_s_put_s": delta["raw_mb_s_put_s"],
        "raw_mb_s_get_s": delta["raw_mb_s_get_s"],
        "lossless": bool(delta["lossless"] and (full is None or full["lossless"])),
        "delta": delta,
        "full": full,
        "targets": t,
        "wall_s": round(time.perf_counter() - started, 1),
    }


# ---------------------------------------------------------------------------
# output


def _fmt_table(r: Mapping[str, Any]) -> str:
    s = r["streams"]
    m = r["model"]
    d, f = r["delta"], r["full"]
    out = [
        f"Aurora transfer benchmark: publish-to-staged vs raw S3, 1 vs {s} connections",
        f"  model   Qwen3-shaped, {r['params'] / 1e6:.1f} M params (hidden {m['hidden']}, {m['layers']} layers, "
        f"vocab {m['vocab']}), bf16 {r['bytes_full'] / 1e6:.1f} MB; step {r['warmup_steps'] + 1} at lr {r['lr']:g}: "
        f"density {100 * r['density']:.2f} % ({r['nnz']} changed)",
        f"  server  {r['server']}; client {r['client']}; {r['cpus']} CPUs, load average "
        f"{r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after",
        f"  delta   {d['bytes'] / 1e6:.2f} MB in {d['objects']} segments (<= {d['segment_bytes'] / _MIB:.2f} MiB) + "
        f"{d['manifest_bytes']} B manifest, {r['bytes_full'] / max(1, d['bytes']):.0f}x smaller than full; "
        f"best of {r['repeats']} runs",
    ]
    if f:
        out.append(
            f"  full    {f['bytes'] / 1e6:.1f} MB in {f['objects']} shards (target {f['shard_bytes'] / _MIB:.0f} MiB, "
            f"largest {f['object_bytes_max'] / 1e6:.1f} MB: a shard holds whole tensors); "
            f"best of {r['full_repeats']} run(s)"
        )
    out.append("")
    hdr = (
        f"  {'payload':<7} {'conns':>5} {'publish':>8} {'stage':>7} {'total':>7} │ {'raw put':>8} {'raw get':>8} "
        f"{'raw':>7} {'pipe/raw':>8} │ {'MB/s pipe':>9} {'raw put/get':>11} {'boto3 put/get':>13} │ {'cpu c+s':>8} {'lossless':>8}"
    )
    out.append(hdr)
    out.append("  " + "-" * (len(hdr) - 2))
    for name, sec in (("delta", d), ("full", f)):
        if not sec:
            continue
        for key, conns in (("1", 1), ("s", s)):
            p = sec["runs"][f"pipeline_{key}"]
            w = sec["runs"][f"raw_{key}"]
            cpu = p["cpu_client_s"] + (p["cpu_server_s"] or 0.0)
            boto = (
                f"{sec[f'boto3_mb_s_put_{key}']:>6.0f}/{sec[f'boto3_mb_s_get_{key}']:<6.0f}"
                if f"boto3_mb_s_put_{key}" in sec
                else f"{'-':>13}"
            )
            ok = "yes" if sec[f"lossless_{key}"] else "NO"
            out.append(
                f"  {name:<7} {conns:>5} {p['publish_s']:>7.3f}s {p['fetch_s']:>6.3f}s {p['seconds']:>6.3f}s │ "
                f"{w['publish_s']:>7.3f}s {w['fetch_s']:>7.3f}s {w['seconds']:>6.3f}s {p['seconds'] / w['seconds']:>7.2f}x │ "
                f"{sec[f'pipeline_mb_s_{key}']:>9.1f} {sec[f'raw_mb_s_put_{key}']:>5.0f}/{sec[f'raw_mb_s_get_{key}']:<5.0f} "
                f"{boto} │ {cpu:>7.2f}s {ok:>8}"
            )
    out.append("")
    out.append(
        f"  phases at {s} connections, seconds (encode, verify, decode: serial CPU measured alone; "
        "upload, fetch: wall time with a transfer in flight)"
    )
    for name, sec in (("delta", d), ("full", f)):
        if not sec:
            continue
        ph = sec["phases"]
        extra = f"extract {ph['extract']:.3f} (not timed above)  " if "extract" in ph else ""
        out.append(
            f"    {name:<6} {extra}encode {ph['encode']:.3f}  upload {ph['upload']:.3f}  commit {ph['commit']:.3f}"
            f"  | fetch {ph['fetch']:.3f}  verify {ph['verify']:.3f}  decode {ph['decode']:.3f}"
        )
    out.append("")
    t = r["targets"]
    for name, sec in (("delta", d), ("full", f)):
        if not sec:
            continue
        sp_ok, ov_ok = t[f"{name}_speedup_met"], t[f"{name}_pipeline_over_raw_met"]
        out.append(
            f"  {name:<6} {s} vs 1 connection {sec['speedup_streams']:.2f}x (target >= {TARGET_SPEEDUP}x: "
            f"{'met' if sp_ok else 'missed'}; raw transfer itself {sec['raw_speedup_streams']:.2f}x); "
            f"pipeline/raw at {s}: {sec['pipeline_over_raw']:.2f}x (target <= {TARGET_OVER_RAW}x: "
            f"{'met' if ov_ok else 'missed'}; in CPU seconds {sec['cpu_over_raw']:.2f}x)"
        )
    out.append(
        f"  lossless: {'yes' if r['lossless'] else 'NO'} (staged delta applied to the base == new weights, "
        "bit for bit; fetched snapshot == the weights)"
    )
    out.append(
        f"  wall {r['wall_s']:.0f}s, of which {r['generate_s']:.0f}s making the synthetic model and its update"
    )
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """``aurora bench transfer``: exit status 0 when everything staged was lossless."""
    from aurora_tools.bench import run_and_report

    return run_and_report(args, run_benchmark, _fmt_table, lambda result: bool(result["lossless"]))


if __name__ == "__main__":  # pragma: no cover - `aurora bench transfer` is the entry point
    ap = argparse.ArgumentParser(prog="aurora bench transfer")
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
