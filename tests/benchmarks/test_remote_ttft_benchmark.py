"""benchmarks/remote_ttft.py at a small size: a second instance loads the prompt from a real
lmkv_server, directly and through a slow link (benchmarks/slow_link.py), and the relay
itself delays and paces as asked."""

from __future__ import annotations

import socket
import sys
import threading
import time

from . import ROOT, run_benchmark


def test_a_second_instance_loads_over_loopback_and_over_a_slow_link():
    out = run_benchmark("remote_ttft.py", "--backends", "lm", "--model", "realistic",
                        "--prompt-tokens", "512", "--repeats", "1", "--link", "10:50")
    assert "lm: TTFT recompute" in out and "(511 of 512 tokens loaded)" in out, out
    assert "lm over a link of 10 ms RTT, 50 MB/s: TTFT recompute" in out, out
    assert out.count("(511 of 512 tokens loaded)") == 2, out


def test_the_slow_link_delays_each_direction_and_caps_its_bandwidth():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from slow_link import SlowLink

    size = 5_000_000
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def serve():
            conn, _ = server.accept()
            with conn:
                while request := conn.recv(16):
                    conn.sendall(b"x" * size if request == b"big" else request)

        threading.Thread(target=serve, daemon=True).start()
        link = SlowLink(server.getsockname(), rtt_ms=40, mbytes_per_s=50).start()
        try:
            with socket.create_connection(("127.0.0.1", link.port)) as c:
                start = time.perf_counter()
                c.sendall(b"ping")
                assert c.recv(16) == b"ping"
                assert 0.04 <= time.perf_counter() - start < 0.5
                start = time.perf_counter()
                c.sendall(b"big")
                got = 0
                while got < size:
                    got += len(c.recv(1 << 20))
                assert 0.04 + size / 50e6 <= time.perf_counter() - start < 2.0
        finally:
            link.stop()
