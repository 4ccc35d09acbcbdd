"""cachegen's native decode (lmkv/codec/native.c): the same chunks as the torch decode,
corrupt payloads rejected without a crash, built once per source and CPU, and a clean
fallback to torch where it cannot be built."""

from __future__ import annotations

import ctypes.util
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch

from lmkv.codec import cachegen, native
from lmkv.codec.calibration import CalibrationSettings, calibrate
from lmkv.layout import KVLayout
from lmkv.memory import NO_POSITION

from .test_codec import kv_correlated, rope_frequencies, rotated, transform_reference

BIG = KVLayout(3, 2, 32, torch.float32, 128)
CAN_BUILD = bool((shutil.which("cc") or shutil.which("gcc")) and ctypes.util.find_library("zstd"))


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """native.library() built into an empty cache dir; the process's one restored after."""
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path
    native.library.cache_clear()


def torch_decode(payload: bytes, out: torch.Tensor, table, monkeypatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        cachegen.decode_into(payload, out, table)


@pytest.fixture(scope="module")
def rope_table():
    inv_freq = rope_frequencies(BIG.head_dim)
    return calibrate([kv_correlated(s, BIG) for s in range(4)],
                     CalibrationSettings(error=0.04, store_weak=False), rope=inv_freq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("amx", "product"), [(True, torch.bfloat16), (False, torch.bfloat16),
                                              (False, torch.float32)])
def test_native_decode_equals_the_torch_decode(monkeypatch, rope_table, amx, product, dtype):
    """Keys rotated to their positions (0, 1000, none), a wide (int16) band, dropped
    coefficients, plain tables too, into float32, float16 and bfloat16 chunks: the native
    decode gives the torch decode's chunk (checked against the plain formula in test_codec):
    to float32 rounding where the matmul is torch's too (in bfloat16 or float32, the same
    for both), to the bfloat16 rounding of torch's products with AMX (which keeps them in
    float32), plus the dtype's rounding (torch rounds to it up to three times, native once)."""
    monkeypatch.setattr(cachegen, "product_dtype", lambda c: product)
    lib = native.library()
    if CAN_BUILD:
        assert lib is not None  # where it can be built, it is what runs
    if amx and (lib is None or not lib.lmkv_amx()):
        pytest.skip("no AMX on this CPU")
    if lib is not None and not amx:
        monkeypatch.setattr(lib, "lmkv_amx", lambda: 0)
    inv_freq = rope_frequencies(BIG.head_dim)
    plain = calibrate([kv_correlated(s, BIG) for s in range(4)], CalibrationSettings(error=0.04))
    assert (rope_table.bands[..., -1] < BIG.num_kv_heads * BIG.head_dim).all()  # gaps exercised
    cases = []
    for position in (0, 1000, NO_POSITION):
        x = kv_correlated(11 + position % 7, BIG)
        x[:, :, 7] *= 60  # an outlier token: its strongest coefficients need int16
        if position != NO_POSITION:
            x = rotated(x, position, inv_freq)
        cases.append((rope_table, position, x))
    cases.append((plain, 0, kv_correlated(12, BIG)))
    for table, position, x in cases:
        payload = cachegen.encode(x, table, position=position)
        widths = [cachegen._STREAM.unpack_from(payload, cachegen._HEAD.size + 4 * (table.rope is not None)
                                               + i * cachegen._STREAM.size)[0]
                  for i in range(cachegen._HEAD.unpack_from(payload)[5])]
        assert table is plain or 2 in widths
        fast, ref = torch.full(x.shape, float("nan"), dtype=dtype), torch.empty(x.shape, dtype=dtype)
        cachegen.decode_into(payload, fast, table)
        torch_decode(payload, ref, table, monkeypatch)
        fast, ref = fast.float(), ref.float()
        scale = ref.abs().amax(dim=(2, 3, 4), keepdim=True)
        tol = 2**-8 * scale if amx else 1e-5 * scale + 1e-5 * ref.abs()
        if dtype != torch.float32:  # torch rounds to the dtype up to three times (on values
            tol = tol + 4 * torch.finfo(dtype).eps * scale  # up to the layer's largest), native once
        assert ((fast - ref).abs() <= tol).all(), position
        if amx:  # not merely within tolerance: the products differ by bfloat16 rounding alone
            assert (fast - ref).abs().mean() < 2**-10 * scale.mean()


def test_native_decode_rejects_corrupt_payloads_without_crashing(monkeypatch, rope_table):
    """Truncated, extended, mutated descriptors and flipped bytes: a PayloadError or a
    chunk, never a crash or a write outside the chunk (the guard band stays untouched)."""
    x = rotated(kv_correlated(3, BIG), 256, rope_frequencies(BIG.head_dim))
    payload = cachegen.encode(x, rope_table, position=256)
    head = cachegen._HEAD.size + cachegen._POSITION.size
    count = cachegen._HEAD.unpack_from(payload)[5]
    n = x.numel()
    guard = torch.full((3 * n,), 7.0)
    out = guard[n : 2 * n].view(x.shape)
    bad = [payload[:-1], payload[: head + 5 * count], payload[:head + 3], payload + b"\0"]
    rng = random.Random(0)
    for _ in range(150):
        b = bytearray(payload)
        i = rng.randrange(count)
        width, length = cachegen._STREAM.unpack_from(b, head + 5 * i)
        choice = rng.randrange(4)
        if choice == 0:
            cachegen._STREAM.pack_into(b, head + 5 * i, rng.choice([0, 2, 3, 4, 255]), length)
        elif choice == 1:
            length = rng.choice([0, max(0, length - 1), length + 1, 2**32 - 1])
            cachegen._STREAM.pack_into(b, head + 5 * i, width, length)
        else:
            for _ in range(rng.randrange(1, 8)):
                b[rng.randrange(head, len(b))] ^= 1 << rng.randrange(8)
        bad.append(bytes(b))
    rejected = 0
    for b in bad:
        try:
            cachegen.decode_into(b, out, rope_table)
        except cachegen.PayloadError:
            rejected += 1
        assert (guard[:n] == 7).all() and (guard[2 * n :] == 7).all()
    assert rejected >= 0.5 * len(bad)  # corrupt bytes are caught by the frame's checksum first
    for b in bad[:4]:
        with pytest.raises(cachegen.PayloadError):
            cachegen.decode_into(b, out, rope_table)


@pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or libzstd")
def test_native_library_is_built_once_and_reused(fresh_library):
    lib = native.library()
    assert lib is not None
    built = list((fresh_library / "native").glob("*.so"))
    assert len(built) == 1 and not list((fresh_library / "native").glob("tmp*"))
    stamp = built[0].stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library() is not None
    assert [p.stat().st_mtime_ns for p in (fresh_library / "native").glob("*.so")] == [stamp]


def test_without_a_compiler_or_when_off_decoding_stays_on_torch(fresh_library, monkeypatch, caplog,
                                                               rope_table):
    x = kv_correlated(5, BIG)
    payload = cachegen.encode(x, rope_table, position=NO_POSITION)
    ref = torch.empty_like(x)
    torch_decode(payload, ref, rope_table, monkeypatch)
    monkeypatch.setenv("CC", str(fresh_library / "no-such-cc"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="lmkv.codec.native"):
        assert native.library() is None
    assert "no native decoder" in caplog.text and "torch" in caplog.text
    out = torch.empty_like(x)
    cachegen.decode_into(payload, out, rope_table)
    assert torch.equal(out, ref)
    native.library.cache_clear()
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.library() is None


@pytest.mark.sanitize
@pytest.mark.skipif(not CAN_BUILD or shutil.which("g++") is None, reason="no C compiler or libzstd")
def test_native_decode_is_clean_under_address_sanitizer(tmp_path):
    """An ASan build of native.c decodes valid and corrupted payloads (truncated, extended,
    random bytes) on both of its paths without one out-of-bounds access."""
    import subprocess
    import sys

    from lmkv_cuda.emu import sanitizer_env

    script = Path(__file__).with_name("native_fuzz.py")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=sanitizer_env("address"),
                       capture_output=True, text=True, timeout=500, cwd=Path(__file__).parents[3])
    assert r.returncode == 0 and "ERROR: AddressSanitizer" not in r.stderr, r.stdout + r.stderr[-6000:]
    assert "native decode clean" in r.stdout


def test_first_decodes_of_a_table_on_several_threads_at_once(monkeypatch):
    """Fresh tables (wide enough that deriving their decode data takes a while) decoded by 4
    threads released together: every chunk equal to the one-thread decode, no crash (the
    derived data was once made by each thread and freed under the others)."""
    import threading

    from lmkv.codec.calibration import build_table

    h, d, layers, t = 8, 128, 4, 256
    c = h * d
    basis = torch.linalg.qr(torch.randn(c, c, generator=torch.Generator().manual_seed(0)))[0]
    args = (torch.full((2, layers, h, d), 0.01), torch.zeros(2, layers, h, d),
            torch.zeros(2, layers, dtype=torch.bool), torch.full((2, layers), 0.03), 16,
            basis.expand(2, layers, c, c).contiguous(),
            torch.tensor([0, 16, c], dtype=torch.int32).expand(2, layers, 3).contiguous())
    x = 0.3 * torch.randn(2, layers, t, h, d, generator=torch.Generator().manual_seed(1))
    table = build_table(*args)
    payload = cachegen.encode(x, table)
    ref = torch.empty_like(x)
    cachegen.decode_into(payload, ref, table)
    for _ in range(4):
        table = build_table(*args)  # nothing derived yet
        outs = [torch.empty_like(x) for _ in range(4)]
        start = threading.Barrier(4)

        def run(out: torch.Tensor, table=table, start=start) -> None:
            start.wait()
            cachegen.decode_into(payload, out, table)

        threads = [threading.Thread(target=run, args=(o,)) for o in outs]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for o in outs:
            assert torch.equal(o, ref)


@pytest.mark.parametrize(("layers", "tokens"), [(1, 64), (2, 16), (2, 48), (3, 40)])
def test_small_chunks_and_models_decode_natively(monkeypatch, layers, tokens):
    """One or two layers, partial chunks of 16 / 40 / 48 tokens: decoded (AMX where it takes
    them) as torch decodes them, never refused."""
    layout = KVLayout(layers, 2, 32, torch.float32, 128)
    table = calibrate([kv_correlated(s, layout) for s in range(4)], CalibrationSettings(error=0.04))
    x = kv_correlated(8, layout)[:, :, :tokens].contiguous()
    payload = cachegen.encode(x, table)
    fast, ref = torch.empty_like(x), torch.empty_like(x)
    cachegen.decode_into(payload, fast, table)
    torch_decode(payload, ref, table, monkeypatch)
    assert ((fast - ref).abs() <= 2**-8 * ref.abs().max()).all()


def test_chunks_the_native_path_does_not_take_decode_with_torch(monkeypatch, rope_table):
    """More channels than native.c holds, or fp16 out: native.decode declines (False, out
    untouched) and decode_into gives the torch decode's chunk."""
    x = rotated(kv_correlated(4, BIG), 64, rope_frequencies(BIG.head_dim))
    payload = cachegen.encode(x, rope_table, position=64)
    ref = torch.empty_like(x)
    torch_decode(payload, ref, rope_table, monkeypatch)
    monkeypatch.setattr(native, "MAX_CHANNELS", 32)
    out = torch.full_like(x, 7.0)
    start = cachegen._HEAD.size + cachegen._POSITION.size
    assert not native.decode(memoryview(payload), start, rope_table, out, 64)
    assert (out == 7).all()
    cachegen.decode_into(payload, out, rope_table)
    assert torch.equal(out, ref)


def test_a_payload_inside_the_output_buffer_is_read_before_it_is_overwritten(monkeypatch, rope_table):
    """A frame read into the slot it decodes to (the raw tiers' way): the decode must read
    every stream before it writes (AMX, which writes as it goes, is not used then)."""
    x = rotated(kv_correlated(6, BIG), 0, rope_frequencies(BIG.head_dim))
    payload = cachegen.encode(x, rope_table, position=0)
    ref = torch.empty_like(x)
    torch_decode(payload, ref, rope_table, monkeypatch)
    slot = torch.zeros(x.numel(), dtype=torch.float32)
    raw = slot.view(torch.uint8)
    assert len(payload) < raw.numel()
    raw[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    view = memoryview(raw.numpy())[: len(payload)]
    cachegen.decode_into(view, slot.view(x.shape), rope_table)
    assert ((slot.view(x.shape) - ref).abs() <= 2**-8 * ref.abs().max()).all()


def test_the_product_dtype_is_timed_once_or_set_by_the_operator(monkeypatch, caplog):
    """Without LMKV_CODEC_PRODUCT, float32 only where it runs more than 1.25x faster than
    bfloat16, timed once per channel count; the variable sets it; on the decode path another
    value (or a failed timing) gives bfloat16 and an error line, never an exception."""
    timed = []

    def seconds(f32: float):
        def product_seconds(dtype, c):
            timed.append(c)
            return {torch.bfloat16: 1.0, torch.float32: f32}[dtype]
        return product_seconds

    monkeypatch.delenv(cachegen.PRODUCT_ENV, raising=False)
    for f32, picked in ((0.7, torch.float32), (0.85, torch.bfloat16), (1.3, torch.bfloat16)):
        monkeypatch.setattr(cachegen, "_products", {})
        monkeypatch.setattr(cachegen, "_product_seconds", seconds(f32))
        assert cachegen.product_dtype(64) is picked and cachegen.product_dtype(64) is picked
    assert timed == [64] * 6  # two dtypes timed, once per case
    monkeypatch.setattr(cachegen, "_product_seconds", lambda dtype, c: 1 / 0)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("fp8", torch.bfloat16),
                        ("", torch.bfloat16)):
        monkeypatch.setattr(cachegen, "_products", {})
        monkeypatch.setenv(cachegen.PRODUCT_ENV, name)
        with caplog.at_level(logging.ERROR, logger="lmkv.codec.cachegen"):
            assert cachegen.product_dtype(64) is dtype
        assert ("LMKV_CODEC_PRODUCT='fp8'" in caplog.text) == (name == "fp8")
        assert ("division by zero" in caplog.text) == (name == "")
        caplog.clear()
    monkeypatch.setenv(cachegen.PRODUCT_ENV, "fp8")
    with pytest.raises(ValueError, match="LMKV_CODEC_PRODUCT='fp8'"):
        cachegen.forced_product()
    monkeypatch.undo()
    layout = KVLayout(2, 2, 32, torch.float32, 64)
    table = calibrate([kv_correlated(s, layout) for s in range(4)], CalibrationSettings(error=0.04))
    x = kv_correlated(5, layout)
    payload = cachegen.encode(x, table)
    exact = transform_reference(x, table)  # the products in float64
    error = {}
    for product in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(cachegen, "product_dtype", lambda c, product=product: product)
        out = torch.empty_like(x)
        lib = native.library()
        if lib is not None:
            monkeypatch.setattr(lib, "lmkv_amx", lambda: 0)
        cachegen.decode_into(payload, out, table)
        error[product] = float((out - exact).abs().max() / exact.abs().max())
    assert error[torch.float32] < 1e-5 < error[torch.bfloat16], error


def test_a_bad_product_setting_is_refused_when_lmkv_starts(tmp_path, monkeypatch, rope_table):
    """A cachegen tier with a transform table: LMKV_CODEC_PRODUCT=fp8 stops lmkv at start
    with the variable named (on any CPU), not at every load; unset, the product dtype is
    timed at start (without AMX), not beside the first loads."""
    from lmkv.cache import LMKVCache
    from lmkv.config import load_config

    path = tmp_path / "table.safetensors"
    rope_table.save(path)
    cfg = load_config(env={}, chunk_size=BIG.chunk_size, max_local_cpu_size=0.01, local_disk=f"file://{tmp_path}/disk/",
                      max_local_disk_size=0.1, local_disk_codec="cachegen", cachegen_calibration=str(path))
    monkeypatch.setenv(cachegen.PRODUCT_ENV, "fp8")
    with pytest.raises(ValueError, match="LMKV_CODEC_PRODUCT='fp8'"):
        LMKVCache(cfg, BIG, "model")
    monkeypatch.setenv(cachegen.PRODUCT_ENV, "float32")
    LMKVCache(cfg, BIG, "model").close()
    monkeypatch.delenv(cachegen.PRODUCT_ENV)  # unset: timed at start where AMX does not decode
    timed = []
    monkeypatch.setattr(cachegen, "_products", {})
    monkeypatch.setattr(cachegen, "_product_seconds", lambda dtype, c: timed.append(c) or 1.0)
    LMKVCache(cfg, BIG, "model").close()
    lib = native.library()
    assert timed == ([] if lib is not None and lib.lmkv_amx() else [BIG.num_kv_heads * BIG.head_dim] * 2)


@pytest.mark.parametrize("variant", ["two zstd frames", "a frame and a skippable frame"])
def test_the_native_and_torch_decoders_refuse_the_same_streams(monkeypatch, variant):
    """A stream of more than one zstd frame (a foreign writer's) was decoded by libzstd in
    the native path and refused by the torch one, which then removed it from a store the
    native engines shared: both refuse it now."""
    import struct

    import zstandard

    if native.library() is None:
        pytest.skip("no native decoder")
    layout = KVLayout(2, 2, 32, torch.float32, 64)
    table = calibrate([kv_correlated(s, layout) for s in range(4)], CalibrationSettings(error=0.04))
    assert table.basis is not None
    zc = zstandard.ZstdCompressor(level=1, write_content_size=False)
    if variant == "two zstd frames":
        make = lambda raw: zc.compress(raw[: len(raw) // 2]) + zc.compress(raw[len(raw) // 2 :])  # noqa: E731
    else:
        make = lambda raw: zc.compress(raw) + struct.pack("<II", 0x184D2A50, 3) + b"abc"  # noqa: E731
    x = kv_correlated(9, layout)
    payload = bytearray(cachegen.encode(x, table))
    head = cachegen._HEAD.size  # the first int8 stream that holds symbols, made over
    count = cachegen._HEAD.unpack_from(payload)[5]
    descs = [list(cachegen._STREAM.unpack_from(payload, head + 5 * i)) for i in range(count)]
    blobs, at = [], head + 5 * count
    for _, n in descs:
        blobs.append(bytes(payload[at : at + n]))
        at += n
    i = next(k for k, (w, n) in enumerate(descs) if w == 1 and n > 0)
    blobs[i] = make(zstandard.ZstdDecompressor().decompress(blobs[i], max_output_size=1 << 24))
    descs[i][1] = len(blobs[i])
    payload = bytes(payload[:head]) + b"".join(cachegen._STREAM.pack(*d) for d in descs) + b"".join(blobs)
    for decoder in ("native", "torch"):
        with monkeypatch.context() as m:
            if decoder == "torch":
                m.setattr(native, "library", lambda: None)
            with pytest.raises(cachegen.PayloadError):
                cachegen.decode_into(payload, torch.empty_like(x), table)
