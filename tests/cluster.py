"""A throwaway 3-master Redis Cluster made of real redis-server processes."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from proxy.redis_server import RedisServerProcess

# Node ports from here, bus ports (+ 10000) from 20000: both below the range the kernel hands
# out for port 0 (32768 and up), where the suite's other servers and clients take theirs.
_NODE_PORTS = range(10000, 16384)


def cluster_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too, from a share of
    ``_NODE_PORTS`` no other process of the suite (pytest-xdist's workers) picks from, and not
    one of ``taken`` (a cluster's ports are all picked before its first node binds one)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = len(_NODE_PORTS) // max(workers, 1)
    first = _NODE_PORTS.start + share * (int(worker) if worker.isdigit() else 0) % len(_NODE_PORTS)
    for _ in range(200):
        port = random.randint(first, first + share - 1)
        if port in taken:
            continue
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterProcesses:
    def __init__(self, base_dir: Path, masters: int = 3, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes: list[RedisServerProcess] = []
        for i in range(masters * (1 + replicas)):
            port = cluster_port({node.port for node in self.nodes if node.port is not None})
            self.nodes.append(
                RedisServerProcess(
                    base_dir / f"node{i}",
                    port=port,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        "2000",
                        # Replicas sync at once (no 5 s wait for more replicas) and may always
                        # take over: this cluster exists to be failed over.
                        "--repl-diskless-sync-delay",
                        "0",
                        "--cluster-replica-validity-factor",
                        "0",
                    ),
                )
            )

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcesses:
        try:
            for node in self.nodes:
                node.start()
            cli = shutil.which("redis-cli")
            assert cli, "redis-cli is needed to form the cluster"
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()  # the nodes it started: no fixture's teardown runs for a start that failed
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        cli = shutil.which("redis-cli")
        assert cli
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(node.port), "cluster", "info"], capture_output=True, text=True, timeout=10
                ).stdout
                for node in self.nodes
                if node.process is not None and node.process.poll() is None
            ]
            links = [
                subprocess.run(
                    [cli, "-p", str(node.port), "info", "replication"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                for node in self.nodes
                if node.process is not None and node.process.poll() is None
            ]
            replicas_synced = all("role:master" in r or "master_link_status:up" in r for r in links)
            if states and all("cluster_state:ok" in s for s in states) and replicas_synced:
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def wait_replicated(self, master: RedisServerProcess, timeout_s: float = 10.0) -> None:
        """Until every replica of ``master`` has all it wrote. Redis replicates asynchronously:
        a write acknowledged in the instant before a master dies can be lost in the failover."""
        cli = shutil.which("redis-cli")
        assert cli
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = subprocess.run(
                [cli, "-p", str(master.port), "info", "replication"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            offset = fields.get("master_repl_offset", "").strip()
            replicas = [v for k, v in fields.items() if k.startswith("slave") and k[5:].isdigit()]
            if replicas and all(f"offset={offset}," in r for r in replicas):
                return
            time.sleep(0.02)
        raise RuntimeError("the replicas did not catch up with their master")

    def master_of(self, hash_tag: str) -> RedisServerProcess:
        """The node that serves the slot of ``{hash_tag}`` now."""
        cli = shutil.which("redis-cli")
        assert cli
        alive = [n for n in self.nodes if n.process is not None and n.process.poll() is None]
        slot = int(
            subprocess.run(
                [cli, "-p", str(alive[0].port), "cluster", "keyslot", hash_tag],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
        for node in alive:
            role = subprocess.run(
                [cli, "-p", str(node.port), "role"], capture_output=True, text=True, timeout=10
            ).stdout.split()[0]
            if role != "master":
                continue
            slots = subprocess.run(
                [cli, "-p", str(node.port), "cluster", "nodes"], capture_output=True, text=True, timeout=10
            ).stdout
            for line in slots.splitlines():
                fields = line.split()
                if "myself" not in fields[2]:
                    continue
                for part in fields[8:]:
                    low, _, high = part.partition("-")
                    if low.isdigit() and int(low) <= slot <= int(high or low):
                        return node
        raise RuntimeError(f"no master serves slot {slot}")
