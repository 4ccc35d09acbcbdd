"""The C sink of benchmarks/server_throughput.py: it compiles and speaks lm:// frames."""

from __future__ import annotations

import shutil
import socket

import pytest

from benchmarks.server_throughput import build_c_sink, free_port, start_c_sink
from lmkv.backends import lm_wire as wire

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

VALUE = 100_000


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        assert got, "the sink closed the connection"
        out += got
    return bytes(out)


def test_c_sink_takes_puts_and_answers_get_exist_health(tmp_path):
    port = free_port()
    proc = start_c_sink(build_c_sink(tmp_path), port, buffers=2, value=VALUE)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            key = b"bench@1@0@1f@bfloat16"
            payload = bytes(range(256)) * 1000  # larger than its buffer: it must grow
            sock.sendall(wire.pack_request(wire.Command.PUT, key, len(payload)) + payload)
            expected = [bytes((i + b) & 0xFF for i in range(VALUE)) for b in (0, 1)]
            for turn in range(3):  # the GET values rotate through the two buffers
                sock.sendall(wire.pack_request(wire.Command.GET, key))
                head = wire.unpack_response(_recv(sock, wire.RESPONSE_SIZE))
                assert (head.code, head.length) == (wire.Code.SUCCESS, VALUE)
                assert (head.fmt, head.dtype, head.shape) == (
                    wire.Fmt.BINARY, wire.DType.UINT8, wire.binary_shape(VALUE))
                assert _recv(sock, VALUE) == expected[turn % 2]
            for command in (wire.Command.EXIST, wire.Command.HEALTH):
                sock.sendall(wire.pack_request(command, key))
                assert _recv(sock, wire.RESPONSE_SIZE) == wire.SUCCESS_EMPTY
    finally:
        proc.kill()
        proc.wait()
