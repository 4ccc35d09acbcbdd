from __future__ import annotations

import pytest

from lmkv.backends import lm_wire as wire

KEY = b"meta-llama/Llama-3.1-8B-Instruct@2@1@-1a2b3c4d5e6f7081@bfloat16"


def test_sizes_match_the_spec():
    assert wire.REQUEST_SIZE == 186 and wire.RESPONSE_SIZE == 36


def test_request_round_trip_and_space_padding():
    raw = wire.pack_request(
        wire.Command.PUT, KEY, 1024, wire.Fmt.BINARY, wire.DType.UINT8, (1024, 0, 0, 0)
    )
    assert len(raw) == 186
    assert raw[36:].rstrip(b" ") == KEY and raw[-1:] == b" "  # spaces, never NUL
    assert wire.unpack_request(raw) == wire.RequestHeader(1, 1024, 4, 6, 0, (1024, 0, 0, 0), KEY)


def test_response_has_location_last():
    raw = wire.pack_response(wire.Code.SUCCESS, 8, 1, 3, (2, 32, 256, 1024))
    assert raw[-4:] == b"\0\0\0\0" and raw[16:20] == (2).to_bytes(4, "little")
    assert wire.unpack_response(raw) == wire.ResponseHeader(200, 8, 1, 3, (2, 32, 256, 1024), 0)
    assert wire.unpack_response(wire.FAIL_EMPTY) == wire.ResponseHeader(
        400, 0, 1, 2, (0, 0, 0, 0), 0
    )


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (b"", "empty"),
        (b"x" * 151, "limit is 150"),
        (b"a\x00b", "control byte"),
        (b"tab\there", "control byte"),
        (b"del\x7f", "control byte"),
        (b" lead", "space"),
        (b"trail ", "space"),
    ],
)
def test_bad_keys_are_rejected(key, why):
    with pytest.raises(wire.WireError, match=why):
        wire.check_key(key)
    with pytest.raises(wire.WireError):
        wire.pack_request(wire.Command.GET, key)


def test_keys_with_spaces_inside_and_utf8_are_taken_as_lmcaches_server_takes_them():
    """LMCache's client names a chunk by vLLM's model setting, a path with spaces or
    non-ASCII characters as often as not; its server strips only the padding."""
    for key in (b"/models/Llama 3.1 8B@1@0@-1a@bfloat16", "/models/通义千问-7B@1@0@1a@half".encode()):
        assert wire.check_key(key) == key
        assert wire.unpack_request(wire.pack_request(wire.Command.GET, key)).key == key


def test_encode_key():
    assert wire.encode_key("a@1") == b"a@1"
    assert wire.encode_key("x" * 150) == b"x" * 150
    assert wire.encode_key("modèle@1") == "modèle@1".encode()
    with pytest.raises(wire.WireError, match="not valid Unicode"):
        wire.encode_key("bad\ud800@1")


def test_nul_padded_key_survives_unpack_and_fails_check():
    raw = bytearray(wire.pack_request(wire.Command.GET, b"k"))
    raw[37:] = bytes(149)  # NUL padding, as a careless client would send
    key = wire.unpack_request(raw).key
    assert key == b"k" + bytes(149)
    with pytest.raises(wire.WireError):
        wire.check_key(key)


def test_length_bounds():
    with pytest.raises(wire.WireError):
        wire.pack_request(wire.Command.PUT, b"k", -1)
    with pytest.raises(wire.WireError):
        wire.pack_request(wire.Command.PUT, b"k", 2**31)
