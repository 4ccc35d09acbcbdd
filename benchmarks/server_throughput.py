"""lm:// server throughput: lmkv_server vs two sink servers vs LMCache's lmcache_server.

    python benchmarks/server_throughput.py [--clients 1 8 32] [--total 1GiB]

Each client is its own process with one connection (so the clients are not limited by
one GIL) and reuses one payload buffer and one receive buffer, which is the cheapest
correct client possible: what remains is the server's cost. Every configuration moves
``--total`` bytes; the servers run side by side and are measured one after the other
for each configuration, ``--repeat`` times, best run kept. Clients and servers share the
machine's CPUs, so each line also gives the CPU time each server spent per GB moved (all
its threads, lowest run): a measure of its efficiency that noise from other processes
affects much less than throughput.

Three workloads: ``put`` overwrites 256 keys in turn (1 GiB: lmcache_server's memory
stays bounded and malloc reuses it); ``fill`` writes fresh keys only, as a cache being
filled with new chunks does (lmkv_server evicts; lmcache_server, which never frees, is
restarted before each run so that it does not exhaust the machine; the sink does not
care); ``get`` reads the last 64 keys written (256 MiB).

The sinks accept the same frames, store nothing (read PUT payloads into one reused
buffer) and answer every GET from one preallocated buffer (``--sink-buffers``):
``py-sink`` is this file's Python thread-per-connection loop; ``c-sink`` is
benchmarks/sink.c, compiled at run time with the system C compiler (thread per connection,
one MSG_WAITALL recv per payload, one sendmsg per reply): the ceiling for a server that
has to keep the bytes. lmcache_server is started from .venv-lmcache if present
(scripts/setup_lmcache_venv.sh).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lmkv.backends import lm_wire as wire  # noqa: E402

MiB = 1 << 20
VALUE = 4 * MiB
KEY_SPACE = 256  # PUT keys cycle through 256 x 4 MiB = 1 GiB
GET_KEYS = 64  # GET reads the last 64 keys written
LMCACHE_SERVER = REPO / ".venv-lmcache" / "bin" / "lmcache_server"
C_SINK = Path(__file__).with_name("sink.c")


class Result(NamedTuple):
    op: str
    clients: int
    gbps: dict[str, float]  # best run per server
    cpu_per_gb: dict[str, float]  # server CPU seconds (all threads) per GB, lowest run


# ---------------------------------------------------------------- sink server


def run_sink(port: int, buffers: int) -> None:
    """Thread per connection, blocking sockets, no storage at all. GETs are answered from
    ``buffers`` preallocated values in turn (1: one buffer that stays in the CPU cache)."""
    listener = socket.create_server(("127.0.0.1", port), backlog=256)
    reply = wire.pack_response(
        wire.Code.SUCCESS, VALUE, wire.Fmt.BINARY, wire.DType.UINT8, wire.binary_shape(VALUE)
    )
    payloads = [os.urandom(VALUE) for _ in range(buffers)]
    turn = itertools.count()

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(wire.REQUEST_SIZE)
        scratch = memoryview(bytearray(VALUE))
        with conn:
            while _recv_exactly(conn, memoryview(header)):
                request = wire.unpack_request(header)
                if request.command == wire.Command.PUT:
                    _recv_exactly(conn, scratch[: request.length])
                elif request.command == wire.Command.GET:
                    conn.sendmsg([reply, payloads[next(turn) % buffers]])
                elif request.command in (wire.Command.EXIST, wire.Command.HEALTH):
                    conn.sendall(wire.SUCCESS_EMPTY)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def build_c_sink(out_dir: Path) -> Path:
    """Compile benchmarks/sink.c with the system C compiler; returns the executable."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH for the C sink")
    exe = out_dir / "lm-sink"
    subprocess.run([cc, "-O2", "-pthread", "-o", str(exe), str(C_SINK)], check=True)
    return exe


def start_c_sink(exe: Path, port: int, buffers: int, value: int = VALUE) -> subprocess.Popen:
    proc = subprocess.Popen([str(exe), str(port), str(value), str(buffers)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the C sink did not start (exit {proc.wait()})")
    return proc


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


# ---------------------------------------------------------------- clients


def _key(i: int) -> bytes:
    return f"bench@1@0@{i:x}@bfloat16".encode()


def client(port: int, op: str, ops: int, first: int, barrier, results) -> None:
    """``op``: "put" (keys cycle through KEY_SPACE: overwrites), "fill" (fresh keys from
    ``first`` on), or "get" (the last GET_KEYS keys)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(VALUE)
    buf = memoryview(bytearray(VALUE))
    reply = bytearray(wire.RESPONSE_SIZE)
    put_shape = wire.binary_shape(VALUE)
    barrier.wait()
    t0 = time.perf_counter()
    for i in range(ops):
        if op in ("put", "fill"):
            key = _key((first + i) % KEY_SPACE if op == "put" else KEY_SPACE + first + i)
            sock.sendall(
                wire.pack_request(
                    wire.Command.PUT, key, VALUE, wire.Fmt.BINARY, wire.DType.UINT8, put_shape
                )
            )
            sock.sendall(payload)
        else:
            key = _key(KEY_SPACE - GET_KEYS + (first + i) % GET_KEYS)
            sock.sendall(wire.pack_request(wire.Command.GET, key))
            _recv_exactly(sock, memoryview(reply))
            header = wire.unpack_response(reply)
            if header.code != wire.Code.SUCCESS or header.length != VALUE:
                raise RuntimeError(f"GET {key!r} failed: {header}")
            _recv_exactly(sock, buf)
    if op != "get":  # PUT has no reply: a round trip proves the server consumed it all
        sock.sendall(wire.pack_request(wire.Command.EXIST, _key(0)))
        _recv_exactly(sock, memoryview(reply))
    results.put(time.perf_counter() - t0)
    sock.close()


def measure(port: int, op: str, clients: int, total: int, first: int = 0) -> float:
    """GB/s moved by ``clients`` processes, ``total`` bytes in all."""
    ops = max(1, total // VALUE // clients)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(clients + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=client, args=(port, op, ops, first + c * ops, barrier, results))
        for c in range(clients)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=60)
    t0 = time.perf_counter()
    for _ in procs:
        while True:
            try:
                results.get(timeout=1)
                break
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    raise RuntimeError(f"a client failed on port {port}") from None
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"client failed on port {port}")
    return ops * clients * VALUE / elapsed / 1e9


def seed_get_keys(port: int) -> None:
    """Write the GET_KEYS keys that the GET runs read (one client, key by key)."""
    measure_keys = [_key(KEY_SPACE - GET_KEYS + i) for i in range(GET_KEYS)]
    payload = os.urandom(VALUE)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for key in measure_keys:
            sock.sendall(
                wire.pack_request(
                    wire.Command.PUT,
                    key,
                    VALUE,
                    wire.Fmt.BINARY,
                    wire.DType.UINT8,
                    wire.binary_shape(VALUE),
                )
            )
            sock.sendall(payload)


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server on {port} did not start")


def lmkv_env(tmp: Path) -> dict[str, str]:
    """Environment in which ``lmkv_server`` imports even when not pip-installed (then a
    symlink lmkv_server -> server/ in ``tmp`` goes on the path, here and in children)."""
    env = dict(os.environ)
    paths = [str(REPO)]
    try:
        import lmkv_server  # noqa: F401
    except ImportError:
        (tmp / "lmkv_server").symlink_to(REPO / "server")
        paths.insert(0, str(tmp))
        sys.path.insert(0, str(tmp))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


def start_servers(
    env: dict[str, str], max_memory: str, sink_buffers: int, c_sink: Path
) -> tuple[dict[str, int], dict[str, subprocess.Popen]]:
    ports = {"lmkv": free_port(), "py-sink": free_port(), "c-sink": free_port()}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    lmkv = [sys.executable, "-m", "lmkv_server", "127.0.0.1", str(ports["lmkv"])]
    procs = {
        "lmkv": subprocess.Popen(
            [*lmkv, "--max-memory", max_memory, "--log-level", "WARNING"], env=env, **quiet
        ),
        "py-sink": subprocess.Popen(
            [sys.executable, __file__, "--serve-sink", str(ports["py-sink"])]
            + ["--sink-buffers", str(sink_buffers)],
            env=env,
            **quiet,
        ),
        "c-sink": start_c_sink(c_sink, ports["c-sink"], sink_buffers),
    }
    if LMCACHE_SERVER.exists():
        ports["lmcache"], procs["lmcache"] = start_lmcache()
    else:
        print(f"# {LMCACHE_SERVER} not found: run scripts/setup_lmcache_venv.sh to compare")
    for name, port in ports.items():
        wait_port(port, procs[name])
    return ports, procs


def start_lmcache() -> tuple[int, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen(
        [str(LMCACHE_SERVER), "127.0.0.1", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return port, proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def format_line(r: Result) -> str:
    parts = [f"{r.op} clients={r.clients}"]
    parts += [f"{name} {gbps:.2f} GB/s" for name, gbps in r.gbps.items()]
    parts.append(" [server cpu-s/GB")
    parts += [f"{name} {cpu:.3f}" for name, cpu in r.cpu_per_gb.items()]
    parts[-1] += "]"
    ratios = []
    if "lmcache" in r.gbps:
        ratios.append(f"lmkv/lmcache={r.gbps['lmkv'] / r.gbps['lmcache']:.2f}x")
    ratios.append(f"lmkv/py-sink={r.gbps['lmkv'] / r.gbps['py-sink']:.2f}x")
    ratios.append(f"lmkv/c-sink={r.gbps['lmkv'] / r.gbps['c-sink']:.2f}x")
    return " ".join(parts) + "  " + " ".join(ratios)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--total", default="1GiB", help="bytes moved per measurement")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; best kept")
    p.add_argument("--max-memory", default="512MiB", help="lmkv_server's bound (evicts)")
    p.add_argument(
        "--sink-buffers",
        type=int,
        default=GET_KEYS,
        help=f"values the sinks answer GETs from (default {GET_KEYS}: the servers' working "
        "set; with 1, answering every GET from one buffer was slower at 1 client)",
    )
    p.add_argument("--serve-sink", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_sink:
        run_sink(args.serve_sink, args.sink_buffers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = lmkv_env(Path(tmp))
        from lmkv.sizes import parse_size

        total = parse_size(args.total)
        c_sink = build_c_sink(Path(tmp))
        ports, procs = start_servers(env, args.max_memory, args.sink_buffers, c_sink)
        try:
            print(
                f"# {VALUE // MiB} MiB values, {total / 2**30:.2f} GiB per measurement, "
                f"best of {args.repeat}, lmkv --max-memory {args.max_memory}, "
                f"sink GETs from {args.sink_buffers} buffer(s), "
                f"{os.cpu_count()} CPUs shared by clients and server"
            )
            fresh_keys = 0
            for op in ("put", "fill", "get"):
                if op == "get":
                    for name, port in ports.items():
                        if not name.endswith("sink"):
                            seed_get_keys(port)
                for clients in args.clients:
                    best = {name: 0.0 for name in ports}
                    cpu = {name: float("inf") for name in ports}
                    for _ in range(args.repeat):
                        for name in ports:
                            if op == "fill" and name == "lmcache":
                                # it never frees: a fresh process per run bounds its memory
                                procs[name].kill()
                                procs[name].wait()
                                ports[name], procs[name] = start_lmcache()
                                wait_port(ports[name], procs[name])
                            cpu0 = cpu_seconds(procs[name].pid)
                            gbps = measure(ports[name], op, clients, total, fresh_keys)
                            fresh_keys += total // VALUE
                            moved = total // VALUE // clients * clients * VALUE / 1e9
                            used = cpu_seconds(procs[name].pid) - cpu0
                            cpu[name] = min(cpu[name], used / moved)
                            best[name] = max(best[name], gbps)
                    print(format_line(Result(op, clients, best, cpu)), flush=True)
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
