"""The engine's GGUF parser: metadata and tensors as the gguf package reads and writes them,
values as gguf.quants dequantizes them, and malformed files (truncated, lengths past the end,
misplaced tensors, unknown versions and value types) refused with a ValueError naming what was
wrong, never an IndexError, a crash or a huge allocation."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from lmkv_engines.minimal.gguf_file import GGUFFile, dequantize, plain

gguf = pytest.importorskip("gguf")


def _write(path, tensors=None, **fields):
    if tensors is None:
        tensors = (("w", np.arange(64, dtype=np.float32).reshape(2, 32), None),)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_string("general.name", "t\u00e9st")
    w.add_array("tokenizer.ggml.tokens", ["a", "\u0120b", "<s>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.0])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_uint64("big", 1 << 40)
    for key, value in fields.items():
        (w.add_bool if isinstance(value, bool) else w.add_int32)(key, value)
    for name, data, raw in tensors:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_as_the_gguf_package_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    tensors = [("f32", x, None), ("f16", x.astype(np.float16), None)]
    for kind in ("Q8_0", "Q4_0", "Q4_1", "BF16"):
        qt = gguf.GGMLQuantizationType[kind]
        tensors.append((kind.lower(), gguf.quants.quantize(x, qt), qt))
    path = _write(tmp_path / "m.gguf", tensors=tensors)
    f, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: plain(v) for k, v in f.fields.items()}
    assert {k: v.contents() for k, v in ref.fields.items() if not k.startswith("GGUF.")} == fields
    assert fields["general.name"] == "t\u00e9st" and fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["big"] == 1 << 40 and fields["tokenizer.ggml.scores"] == [0.5, -1.0, 0.0]
    assert isinstance(f.fields["tokenizer.ggml.scores"], np.ndarray)  # numbers stay compact
    assert [t.name for t in f.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(f.tensors, ref.tensors, strict=True):
        assert t.type_name == r.tensor_type.name and t.shape == (4, 64)
        want = gguf.quants.dequantize(r.data, r.tensor_type).astype(np.float32)
        got = f.dequantize(t)
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable and got.dtype == np.float32


def test_every_quantized_type_decodes_by_ggmls_rules():
    """Q4_0 / Q4_1 / Q8_0 blocks built by hand: low nibbles are a block's first 16 values."""
    d, m = np.float16(0.5), np.float16(-1.0)
    qs = bytes(range(16))  # low nibble j, high nibble 0
    q40 = d.tobytes() + qs
    np.testing.assert_array_equal(dequantize(q40, "Q4_0", (32,)),
                                  np.array([(j - 8) * 0.5 for j in range(16)] + [-4.0] * 16, np.float32))
    q41 = d.tobytes() + m.tobytes() + qs
    np.testing.assert_array_equal(dequantize(q41, "Q4_1", (32,)),
                                  np.array([j * 0.5 - 1 for j in range(16)] + [-1.0] * 16, np.float32))
    q80 = d.tobytes() + np.arange(-16, 16, dtype=np.int8).tobytes()
    np.testing.assert_array_equal(dequantize(q80, "Q8_0", (32,)), np.arange(-16, 16) * 0.5)
    bf16 = np.array([1.5, -2.25], np.float32).view(np.uint32) >> 16
    np.testing.assert_array_equal(dequantize(bf16.astype("<u2").tobytes(), "BF16", (2,)), [1.5, -2.25])


def _corrupt(path, offset: int, value: bytes):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(value)] = value
    path.write_bytes(bytes(raw))


def _find(path, text: str) -> int:
    """Offset of a string's length prefix in the file."""
    raw = path.read_bytes()
    at = raw.index(struct.pack("<Q", len(text.encode())) + text.encode())
    return at


@pytest.mark.parametrize("case", [
    "truncated_header", "truncated_metadata", "string_past_the_end", "array_count_huge",
    "tensor_past_the_end", "version_1", "big_endian", "value_type", "counts_too_big",
    "not_gguf", "alignment", "utf8", "dims", "duplicate_key", "duplicate_tensor", "huge_dim",
    "bool_alignment",
])  # fmt: skip
def test_malformed_files_are_refused_by_what_is_wrong(tmp_path, case):
    path = _write(tmp_path / "m.gguf")
    size = path.stat().st_size
    raw = path.read_bytes()
    want = {
        "truncated_header": "bytes", "truncated_metadata": "runs past the end",
        "string_past_the_end": "runs past the end", "array_count_huge": "claims",
        "tensor_past_the_end": "runs past the end of the file", "version_1": "version 1",
        "big_endian": "big-endian", "value_type": "value type 77", "counts_too_big": "more than",
        "not_gguf": "not a GGUF file", "alignment": "power of two", "utf8": "not UTF-8",
        "dims": "dimensions", "duplicate_key": "metadata key dup1 appears twice",
        "duplicate_tensor": "tensor w appears twice", "huge_dim": r"dimensions \[32, 9223",
        "bool_alignment": "power of two",
    }[case]
    if case == "truncated_header":
        path.write_bytes(raw[:20])
    elif case == "truncated_metadata":
        path.write_bytes(raw[: _find(path, "tokenizer.ggml.tokens") + 40])
    elif case == "string_past_the_end":
        _corrupt(path, _find(path, "t\u00e9st"), struct.pack("<Q", size))
    elif case == "array_count_huge":  # a string array: key, type 9, item type 8, count
        at = _find(path, "tokenizer.ggml.tokens") + 8 + len("tokenizer.ggml.tokens") + 8
        _corrupt(path, at, struct.pack("<Q", 1 << 60))
    elif case == "tensor_past_the_end":
        path.write_bytes(raw[:-64])
    elif case == "version_1":
        _corrupt(path, 4, struct.pack("<I", 1))
    elif case == "big_endian":
        _corrupt(path, 4, struct.pack(">I", 3))
    elif case == "value_type":  # general.name's value type
        _corrupt(path, _find(path, "general.name") + 8 + len("general.name"), struct.pack("<I", 77))
    elif case == "counts_too_big":
        _corrupt(path, 16, struct.pack("<Q", 1 << 40))
    elif case == "not_gguf":
        _corrupt(path, 0, b"GGML")
    elif case == "alignment":
        path = _write(tmp_path / "a.gguf", **{"general.alignment": 24})
    elif case == "utf8":
        _corrupt(path, _find(path, "t\u00e9st") + 8, b"\xff")
    elif case == "dims":  # the tensor's dimension count, after its name
        _corrupt(path, _find(path, "w") + 9, struct.pack("<I", 9))
    elif case == "duplicate_key":  # (gguf's writer keeps one value per key)
        path = _write(tmp_path / "d.gguf", dup1=1, dup2=2)
        _corrupt(path, _find(path, "dup2") + 8, b"dup1")
    elif case == "duplicate_tensor":
        v = np.zeros((2, 32), np.float32)
        path = _write(tmp_path / "d.gguf", tensors=(("w", v, None), ("v", v, None)))
        _corrupt(path, _find(path, "v") + 8, b"w")
    elif case == "huge_dim":  # the tensor's second dimension
        _corrupt(path, _find(path, "w") + 9 + 4 + 8, struct.pack("<Q", 1 << 63))
    elif case == "bool_alignment":
        path = _write(tmp_path / "a.gguf", **{"general.alignment": True})
    maps = _mappings(path)
    with pytest.raises(ValueError, match=want):
        GGUFFile(path)
    assert _mappings(path) == maps  # a refused file is unmapped at once


def _mappings(path) -> int:
    return Path("/proc/self/maps").read_text().count(str(path.resolve()))


def test_close_unmaps_the_file(tmp_path):
    path = _write(tmp_path / "m.gguf")
    with GGUFFile(path) as f:
        assert _mappings(path) == 1
        w = f.dequantize(f.tensors[0])
    assert _mappings(path) == 0 and w.shape == (2, 32)


def test_a_row_that_is_not_whole_blocks_is_refused(tmp_path):
    qt = gguf.GGMLQuantizationType.Q8_0
    data = gguf.quants.quantize(np.zeros((2, 64), np.float32), qt)
    path = _write(tmp_path / "m.gguf", tensors=(("w", data, qt),))
    _corrupt(path, _find(path, "w") + 9 + 4, struct.pack("<Q", 48))  # the row length, dims[0]
    with pytest.raises(ValueError, match="rows of 48 values, not a multiple of its block of 32"):
        GGUFFile(path)
