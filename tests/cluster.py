"""A throwaway 3-master Redis Cluster made of real redis-server processes."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from proxy.redis_server import RedisServerProcess, free_port


class RedisClusterProcesses:
    def __init__(self, base_dir: Path, masters: int = 3) -> None:
        self.nodes: list[RedisServerProcess] = []
        for i in range(masters):
            port = free_port()
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
                    ),
                )
            )

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        assert cli, "redis-cli is needed to form the cluster"
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(node.port), "cluster", "info"], capture_output=True, text=True, timeout=10
                ).stdout
                for node in self.nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
