"""A real Mooncake Store on loopback for tests: master (with its HTTP metadata server) and
a separate storage process, so data crosses the TCP transport and outlives engines."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from .redis_server import _port_is_free, _wait_port


def _ports(n: int) -> list[int]:
    import random

    out: list[int] = []
    while len(out) < n:
        p = random.randint(20000, 60000)
        if p not in out and _port_is_free(p):
            out.append(p)
    return out


class MooncakeStore:
    def __init__(self, workdir: Path, segment: str = "512 MB"):
        if shutil.which("mooncake_master") is None:
            raise RuntimeError("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self.workdir = workdir
        self.segment = segment
        self.rpc, self.http, self.metrics, self.client = _ports(4)
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    @property
    def url(self) -> str:
        return f"mooncakestore://127.0.0.1:{self.rpc}/?metadata_server=http://127.0.0.1:{self.http}/metadata"

    def start(self) -> MooncakeStore:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "mooncake.log", "ab")  # noqa: SIM115 - outlives this call
        self.procs.append(subprocess.Popen(
            ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}", "--default_kv_lease_ttl=5000",
             "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.1"],
            stdout=log, stderr=log, env=self.env))
        _wait_port(self.rpc)
        _wait_port(self.http)
        self.procs.append(subprocess.Popen(
            ["mooncake_client", "--host=127.0.0.1", f"--port={self.client}",
             f"--global_segment_size={self.segment}", "--local_buffer_size=0",
             f"--metadata_server=http://127.0.0.1:{self.http}/metadata",
             f"--master_server_address=127.0.0.1:{self.rpc}", "--protocol=tcp"],
            stdout=log, stderr=log, env=self.env))
        time.sleep(2.0)  # the storage process mounts its segment with the master
        return self

    def kill(self) -> None:
        for p in reversed(self.procs):
            p.kill()
            p.wait(timeout=30)
        self.procs = []
