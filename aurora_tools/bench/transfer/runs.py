"""One run of each kind: the pipeline (publish, then fetch) of a delta or a snapshot, and the raw transfer of the same objects."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_tools.bench.transfer.server import drop, open_timed
from aurora_tools.bench.transfer.timing import Stopwatch, TimedStore

__all__ = ["Run", "pipeline_delta", "pipeline_full", "raw_transfer", "delta_cpu_costs", "full_cpu_costs"]


@dataclass
class Run:
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


def pipeline_delta(
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
    commits: Any = None,
) -> Run:
    """``commits``: a :class:`~.server.RedisCommits` (a server without conditional writes), or None."""
    from aurora_store.lineage.fetch import fetch_delta, read_manifest
    from aurora_store.lineage.publish import PublishConfig, publish_delta

    base_state = "sha256:" + hashlib.sha256(b"aurora bench transfer base").hexdigest()
    # Any: the pipeline takes a Store; a TimedStore is one by delegation.
    store: Any = open_timed(srv, bucket, f"delta-{uuid.uuid4().hex[:8]}", max_concurrency)
    commit, records = commits.prepare(store.inner) if commits is not None else (None, None)
    cfg = PublishConfig(streams=streams, segment_bytes=segment_bytes, options=options)
    run = Run(streams)
    clock = Stopwatch(pid)
    with clock.run():
        t0 = time.perf_counter()
        m = publish_delta(store, "bench", 1, deltas, base_state, cfg, commit=commit)
        t1 = time.perf_counter()
        got = read_manifest(store, "delta", 1, commits=records) if records is not None else None
        _, staged = fetch_delta(store, 1, specs, streams=streams, expect_base_state=base_state, manifest=got)
        t2 = time.perf_counter()
    run.publish_s, run.fetch_s = t1 - t0, t2 - t1
    _fill(run, store, clock)
    run.objects = [o for o in _put_payloads(store, m)]
    run.manifest = store.inner.get(_manifest_key("delta", 1))
    if check is not None:
        run.lossless = check(staged)
    drop(store)
    return run


def pipeline_full(
    srv: Any,
    pid: int | None,
    bucket: str,
    fused: Mapping[str, torch.Tensor],
    streams: int,
    shard_bytes: int,
    expect_digest: str,
    max_concurrency: int,
    commits: Any = None,
) -> Run:
    from aurora_store.apply.sink import weights_digest
    from aurora_store.lineage.fetch import fetch_snapshot, read_manifest
    from aurora_store.lineage.publish import PublishConfig, publish_snapshot

    store: Any = open_timed(srv, bucket, f"full-{uuid.uuid4().hex[:8]}", max_concurrency)
    commit, records = commits.prepare(store.inner) if commits is not None else (None, None)
    cfg = PublishConfig(streams=streams, shard_bytes=shard_bytes)
    run = Run(streams)
    clock = Stopwatch(pid)
    with clock.run():
        t0 = time.perf_counter()
        m = publish_snapshot(store, "bench", 0, fused, None, cfg, commit=commit)
        t1 = time.perf_counter()
        got = read_manifest(store, "snapshot", 0, commits=records) if records is not None else None
        _, tensors = fetch_snapshot(store, 0, streams=streams, manifest=got)
        t2 = time.perf_counter()
    run.publish_s, run.fetch_s = t1 - t0, t2 - t1
    _fill(run, store, clock)
    run.objects = [o for o in _put_payloads(store, m)]
    run.manifest = store.inner.get(_manifest_key("snapshot", 0))
    run.lossless = weights_digest(tensors) == expect_digest
    del tensors
    drop(store)
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


def _fill(run: Run, store: TimedStore, clock: Stopwatch) -> None:
    run.upload_s = store.busy("put")
    run.commit_s = store.busy("put", manifest=True)
    run.get_s = store.busy("get")
    run.manifest_get_s = store.busy("get", manifest=True)
    run.cpu_client_s = clock.cpu_client
    run.cpu_server_s = clock.cpu_server


def raw_transfer(
    srv: Any,
    pid: int | None,
    bucket: str,
    objects: Sequence[bytes],
    manifest: bytes,
    streams: int,
    client: str = "s3fs",
) -> Run:
    """The same objects with nothing around them: parallel puts, then the
    manifest; the manifest, then parallel gets; one request per object.

    ``s3fs`` is the pipeline's own client stack (with ``max_concurrency=1``,
    so that a get is one GET, not a HEAD then a GET; each put's body as the
    store sends it, :meth:`~aurora_store.storage.base.Store.upload_body`); ``boto3`` is the
    reference of what the server does for a thinner client.
    """
    store = open_timed(srv, bucket, f"raw-{uuid.uuid4().hex[:8]}", max_concurrency=1)
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

        def put(path: str, data: bytes) -> Any:  # the body the store sends (S3: no copy of it)
            return fs.pipe_file(path, store.upload_body(data))

        get = fs.cat_file
    paths = [f"{root}/obj-{i:05d}" for i in range(len(objects))]
    run = Run(streams)
    clock = Stopwatch(pid)
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
    drop(store)
    return run


# serial CPU costs (no server, one thread)


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def delta_cpu_costs(
    deltas: Sequence[Any],
    segments: Sequence[bytes],
    specs: Mapping[str, Any],
    options: Any,
    segment_bytes: int,
) -> dict[str, float]:
    from aurora_store.format.checkpoint import assemble_staged, encode_segments
    from aurora_store.format.segment import decode_segment

    encode_s, _ = _time(lambda: sum(len(s.data) for s in encode_segments(deltas, 1, options, segment_bytes)))
    verify_s, _ = _time(lambda: [hashlib.sha256(s).hexdigest() for s in segments])
    decode_s, _ = _time(lambda: assemble_staged([(f"seg-{i}", decode_segment(s, f"seg-{i}", specs)) for i, s in enumerate(segments)], 1))
    return {"encode": encode_s, "verify": verify_s, "decode": decode_s}


def full_cpu_costs(fused: Mapping[str, torch.Tensor], shards: Sequence[bytes]) -> dict[str, float]:
    from safetensors.torch import load, save

    encode_s, _ = _time(lambda: len(save(dict(fused))))
    verify_s, _ = _time(lambda: [hashlib.sha256(s).hexdigest() for s in shards])
    decode_s, _ = _time(lambda: [load(s) for s in shards])
    return {"encode": encode_s, "verify": verify_s, "decode": decode_s}
