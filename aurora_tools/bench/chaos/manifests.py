"""Every manifest the run commits, read as it appears (:class:`ManifestLog`).

The store is the evidence for the chain (``steps_completed``), the epochs
and the states batches were generated on; but retention deletes old
versions during the run, so the harness keeps its own copy of each
manifest, read soon after the version is published. Reads use a client
that gives up fast (the S3 server is SIGSTOPped for a while during the
run); a version not read yet is simply read on a later pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.testing.servers import S3Server

__all__ = ["ManifestLog", "fast_client"]


def fast_client(s3: S3Server) -> Any:
    """A boto3 client of ``s3`` that fails within seconds instead of retrying for minutes."""
    import boto3
    from botocore.config import Config

    env = s3.env_vars
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        config=Config(connect_timeout=2, read_timeout=4, retries={"max_attempts": 1, "mode": "standard"}),
    )


class ManifestLog:
    """Delta and snapshot manifests of run root ``s3://bucket/prefix``, by version.

    :meth:`scan` reads every manifest not read yet, deltas from the lowest
    unread version up to the first missing one, snapshots at every version
    up to ``head()``; :meth:`start` runs it every ``period_s`` in a thread.
    """

    def __init__(self, s3: S3Server, bucket: str, prefix: str, head: Callable[[], int], period_s: float = 1.0) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.prefix = prefix
        self.head = head
        self.period_s = period_s
        self.deltas: dict[int, Manifest] = {}
        self.snapshots: dict[int, Manifest] = {}
        self._absent: set[tuple[str, int]] = set()
        """Snapshots looked for and not found at or below the head (none will appear there)."""
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._client: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="chaos-manifests", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.period_s):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - a manifest that does not parse is read again, and reported by the chain check
                continue

    def _get(self, kind: str, v: int) -> Manifest | None:
        """The manifest, or None when it is not there (or the store did not answer)."""
        if self._client is None:
            self._client = fast_client(self.s3)
        key = f"{self.prefix}/{manifest_key(kind, v)}"
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as e:  # noqa: BLE001 - missing, or the store is away: read again later
            response = getattr(e, "response", None) or {}
            if response.get("Error", {}).get("Code", "") not in ("NoSuchKey", "404"):
                raise _Away from None
            return None
        return Manifest.from_bytes(body, where=f"s3://{self.bucket}/{key}")

    def scan(self) -> None:
        """One pass; stops at the first error from the store (the next pass goes on)."""
        try:
            head = self.head()
            v = min((x for x in range(1, head + 2) if x not in self.deltas), default=head + 1)
            while True:
                m = self._get("delta", v)
                if m is None:
                    break
                with self.lock:
                    self.deltas[v] = m
                v += 1
            # A snapshot is written before the step's log line: at or below the head it is there, or never.
            for s in range(0, head + 1):
                if s in self.snapshots or ("snapshot", s) in self._absent:
                    continue
                m = self._get("snapshot", s)
                with self.lock:
                    if m is not None:
                        self.snapshots[s] = m
                    else:
                        self._absent.add(("snapshot", s))
        except _Away:
            return

    def states(self) -> dict[int, str]:
        """Version -> state digest, from every manifest read."""
        with self.lock:
            out = {v: m.state for v, m in self.snapshots.items()}
            out.update({v: m.state for v, m in self.deltas.items()})
            return out


class _Away(Exception):
    """The store did not answer (paused, or not up yet)."""
