"""Real redis-server processes on loopback for tests (single node and a 3-node cluster)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000) is free and valid too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


def _wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"redis-server on port {port} did not start")


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False):
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        self.port = port or (cluster_port() if cluster else free_port())
        self.workdir = workdir
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.workdir / f"nodes-{self.port}.conf")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port)
        self._check_it_answers()
        return self

    def _check_it_answers(self, timeout: float = 10.0) -> None:
        """The port answers as this process (another listener on a port picked earlier, or
        left by a server killed before, would pass for it while this one exited)."""
        import redis

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with "
                                   f"{self.proc.returncode} (the port taken?)")
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    if client.info("server")["process_id"] == self.proc.pid:
                        return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"port {self.port} is answered by another process than "
                                   "this redis-server")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


def start_cluster(workdir: Path, nodes: int = 3) -> list[RedisServer]:
    servers = [RedisServer(workdir / f"n{i}", cluster=True).start() for i in range(nodes)]
    addrs = [f"127.0.0.1:{s.port}" for s in servers]
    subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    # every node must see the whole cluster: a node that has not yet heard of the others
    # answers "the cluster is down" (seen under load when only the first node was checked)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = [subprocess.run(["redis-cli", "-p", str(s.port), "cluster", "info"],
                                 capture_output=True, text=True).stdout for s in servers]
        if all("cluster_state:ok" in out for out in states):
            return servers
        time.sleep(0.2)
    raise TimeoutError("redis cluster did not become ready")
