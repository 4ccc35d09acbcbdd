"""The codecs: lossless round trips, cachegen's error bound, calibration tables, rANS,
rejection of corrupt, truncated and foreign payloads, and the quality gate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmkv.codec import ForeignFrame, FrameError, cachegen, decode_into, encode, rans
from lmkv.codec.calibration import CacheGenTable, CalibrationSettings, calibrate
from lmkv.codec.gate import QualityGate
from lmkv.config import ConfigError, load_config
from lmkv.layout import KVLayout
from lmkv.memory import MemoryPool
from lmkv.metrics import LMKVMetrics

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, chunk_size=40)


def kv_like(seed: int, smooth: bool = False, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """KV with per-channel offsets and scales (like keys); ``smooth``: a large component
    shared by the chunk's tokens plus small per-token noise (the token locality of a
    trained model's KV)."""
    g = torch.Generator().manual_seed(seed)
    shape = layout.chunk_shape
    scale = torch.linspace(0.2, 3.0, shape[-1])
    offset = torch.randn(shape[:2] + (1,) + shape[3:], generator=torch.Generator().manual_seed(7))
    x = torch.randn(shape, generator=g)
    if smooth:
        x = 3 * torch.randn(shape[:2] + (1,) + shape[3:], generator=g) + 0.3 * x
    return (x * scale + 4 * offset).to(layout.dtype)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per [kv, layer] relative error ||a - b|| / ||b||."""
    a, b = a.float(), b.float()
    return ((a - b).square().sum(dim=(2, 3, 4)) / b.square().sum(dim=(2, 3, 4))).sqrt()


@pytest.fixture(scope="module")
def table() -> CacheGenTable:
    return calibrate([kv_like(s) for s in range(4)])


def test_lossless_codecs_round_trip_exactly():
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(kv_like(0))
    for codec in ("raw", "zstd"):
        dst.kv.zero_()
        decode_into(bytes(encode(src, "k", codec)), dst, "k")
        assert torch.equal(src.kv, dst.kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cachegen_error_within_the_calibrated_bound(dtype):
    layout = KVLayout(4, 2, 16, dtype, 40)
    settings = CalibrationSettings(error=0.03, deep_ratio=3.0, value_ratio=1.5)
    table = calibrate([kv_like(s, layout=layout) for s in range(3)], settings)
    assert torch.allclose(table.target[0], torch.tensor([0.03, 0.05, 0.07, 0.09]))
    assert torch.allclose(table.target[1], table.target[0] * 1.5)
    pool = MemoryPool(layout, 2 * (64 + layout.chunk_bytes))
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(kv_like(10, layout=layout))
    frame = bytes(encode(src, "k", "cachegen", table))
    decode_into(frame, dst, "k", table)
    err = rel_error(dst.kv, src.kv)
    assert (err <= table.target * 1.1).all(), (err, table.target)
    assert (err >= table.target * 0.2).all()  # it is lossy, and uses the room it is given
    assert len(frame) < 0.3 * src.kv.numel() * 2  # > 3.3x smaller than fp16, tiny chunk


def test_shallow_layers_and_keys_get_more_bins():
    table = calibrate([kv_like(s) for s in range(2)], CalibrationSettings(deep_ratio=2.0, value_ratio=2.0))
    assert table.step.shape == (2, 4, 2, 16)
    t = table.target
    assert (t[:, 1:] > t[:, :-1]).all() and (t[1] == 2 * t[0]).all()
    data = torch.cat([kv_like(s) for s in range(2)], dim=2)
    rms = (data - data.mean(dim=2, keepdim=True)).square().mean(dim=(2, 3, 4)).sqrt()
    assert torch.allclose(table.step[:, :, 0, 0], t * math.sqrt(12) * rms, rtol=1e-4)


def test_delta_coding_is_chosen_for_smooth_kv_and_shrinks_it():
    big = KVLayout(2, 2, 64, torch.float32, 256)  # streams of 32k symbols, as in real chunks
    per_channel = CalibrationSettings(transform=False)
    table = calibrate([kv_like(s, smooth=True, layout=big) for s in range(3)], per_channel)
    assert table.delta.all()
    assert not calibrate([kv_like(s, layout=big) for s in range(3)], per_channel).delta.any()
    x = kv_like(9, smooth=True, layout=big)
    plain = CacheGenTable.from_bytes(_with_delta(table, False))
    assert len(cachegen.encode(x, table)) < 0.9 * len(cachegen.encode(x, plain))
    out = torch.empty_like(x)
    cachegen.decode_into(cachegen.encode(x, table), out, table)
    assert (rel_error(out, x) <= table.target * 1.1).all()


def _with_delta(table: CacheGenTable, on: bool) -> bytes:
    from lmkv.codec.calibration import build_table

    delta = torch.full_like(table.delta, on)
    return build_table(table.step, table.mean, delta, table.target, table.group_size).to_bytes()


def test_symbols_beyond_int8_and_partial_groups(table):
    x = kv_like(3)
    x[1, 2, 5, 1, 3] = 500.0  # an outlier: its stream goes as int16
    x[0, 0, 39] = -300.0  # the last token, alone in its group of 16 (40 = 16 + 16 + 8)
    out = torch.empty_like(x)
    cachegen.decode_into(cachegen.encode(x, table), out, table)
    assert abs(out[1, 2, 5, 1, 3].item() - 500) < table.step[1, 2, 1, 3].item()
    assert (out[0, 0, 39] + 300).abs().max() < table.step[0, 0].max()


def test_quantize_dequantize_twins_agree_with_plain_formula(table):
    x = kv_like(4)
    q = cachegen.quantize(x, table.step, table.mean, table.delta, table.group_size)
    want = torch.round((x - table.mean[:, :, None]) / table.step[:, :, None])
    assert q.dtype == torch.int16 and torch.equal(q.float(), want)  # no delta layers here
    out = torch.empty_like(x)
    cachegen.dequantize(q, table.step, table.mean, table.delta, table.group_size, out)
    assert torch.allclose(out, want * table.step[:, :, None] + table.mean[:, :, None], atol=1e-5)


def test_table_file_round_trip_and_id(tmp_path, table):
    path = tmp_path / "t.safetensors"
    table.save(path)
    again = CacheGenTable.load(path)
    assert again.table_id == table.table_id and torch.equal(again.step, table.step)
    with pytest.raises(ValueError):
        CacheGenTable.from_bytes(b"\x08" + bytes(40))
    with pytest.raises(ValueError, match="does not fit"):
        table.check_layout((2, 3, 40, 2, 16))


def test_corrupt_truncated_and_foreign_payloads_are_rejected(table):
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(kv_like(5))
    frame = bytes(encode(src, "k", "cachegen", table))
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0x40
    with pytest.raises(FrameError, match="checksum"):
        decode_into(bytes(flipped), dst, "k", table)
    with pytest.raises(FrameError, match="truncated"):
        decode_into(frame[:-10], dst, "k", table)
    for bad in (bytes(flipped), frame[:-10]):  # corrupt: not foreign
        with pytest.raises(FrameError) as e:
            decode_into(bad, dst, "k", table)
        assert not isinstance(e.value, ForeignFrame)
    with pytest.raises(ForeignFrame, match="no calibration table"):
        decode_into(frame, dst, "k", None)
    other = calibrate([kv_like(s) for s in range(4, 6)])
    with pytest.raises(ForeignFrame, match="calibration table"):
        decode_into(frame, dst, "k", other)
    # a payload that passes the checksum but is malformed: cachegen's own checks catch it
    payload = cachegen.encode(src.kv, table)
    for bad in (payload[:-3], payload + b"\0", payload[:20]):
        with pytest.raises(cachegen.PayloadError):
            cachegen.decode_into(bad, dst.kv, table)


def test_rans_round_trip_and_rejects_garbage():
    rng = np.random.default_rng(0)
    for n, spread in [(1, 1.0), (7, 0.1), (5000, 3.0), (70000, 20.0)]:
        s = np.clip(np.round(rng.normal(0, spread, n)), -128, 127).astype(np.int8)
        blob = rans.encode(s)
        assert np.array_equal(rans.decode(blob, n), s)
    h = -sum(p * math.log2(p) for p in np.unique(s, return_counts=True)[1] / n)
    assert len(blob) * 8 / n < h + 0.2  # near the entropy
    with pytest.raises(rans.RansError):
        rans.decode(blob[:-2], n)
    with pytest.raises(rans.RansError):
        rans.decode(blob[:3], n)
    payload_r = cachegen.encode(kv_like(1), calibrate([kv_like(2)], CalibrationSettings(
        transform=False)), coder="rans")
    assert payload_r[:4] == b"CGv1"


def kv_correlated(seed: int, layout: KVLayout, rank: int = 6) -> torch.Tensor:
    """KV whose token vectors (all heads' channels of a layer) lie near a few shared
    directions, as a trained model's do: what the decorrelating transform is for."""
    two, layers, t, h, d = layout.chunk_shape
    mix = torch.randn(two, layers, rank, h * d, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(two, layers, t, rank, generator=g) * torch.linspace(4, 1, rank)
    x = z @ mix + 0.05 * torch.randn(two, layers, t, h * d, generator=g) + 2.0
    return x.reshape(layout.chunk_shape).to(layout.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transform_is_chosen_for_correlated_kv_and_keeps_the_error_bound(dtype):
    big = KVLayout(3, 2, 32, dtype, 128)
    chunks = [kv_correlated(s, big) for s in range(4)]
    table = calibrate(chunks, CalibrationSettings(error=0.04))
    per_channel = calibrate(chunks, CalibrationSettings(error=0.04, transform=False))
    assert table.basis is not None and per_channel.basis is None
    iid = [torch.randn(big.chunk_shape, generator=torch.Generator().manual_seed(s)).to(dtype)
           for s in range(3)]
    assert calibrate(iid).basis is None  # nothing to decorrelate: not worth its streams
    basis = table.basis.reshape(6, 64, 64)
    eye = torch.eye(64).expand(6, 64, 64)
    assert torch.allclose(basis.transpose(1, 2) @ basis, eye, atol=1e-4)  # orthonormal
    assert (table.bands[..., -1] == 64).all()  # every coefficient is stored by default
    weak_dropped = calibrate(chunks, CalibrationSettings(error=0.04, store_weak=False))
    assert (weak_dropped.bands[..., -1] < 64).all()
    x = kv_correlated(9, big)
    payload = cachegen.encode(x, table)
    assert payload[:4] == b"CGv2"
    assert len(payload) < 0.7 * len(cachegen.encode(x, per_channel))
    out = torch.empty_like(x)
    cachegen.decode_into(payload, out, table)
    centred = x.float() - x.float().mean(dim=2, keepdim=True)
    err = ((out.float() - x.float()).square().sum(dim=(2, 3, 4))
           / centred.square().sum(dim=(2, 3, 4))).sqrt()
    assert (err <= table.target * 1.2).all(), (err, table.target)
    with pytest.raises(cachegen.PayloadError, match="table"):  # the other table's payload
        cachegen.decode_into(payload, out, per_channel)


def transform_reference(x: torch.Tensor, table: CacheGenTable) -> torch.Tensor:
    """The plain formula of a transform table's decode of chunk ``x`` (keys as given, no
    rotation), in float64: coefficients quantized and dequantized, those not stored at their
    mean, times the basis."""
    two, layers, t, h, d = x.shape
    basis = table.basis.reshape(two, layers, h * d, h * d)
    coef = (x.reshape(two, layers, t, h * d) @ basis).view(x.shape)
    sym = cachegen.quantize(coef, table.step, table.mean, table.delta, table.group_size)
    deq = torch.empty_like(coef)
    cachegen.dequantize(sym, table.step, table.mean, table.delta, table.group_size, deq)
    deq = deq.reshape(two, layers, t, h * d)
    mean = table.mean.reshape(two, layers, 1, h * d).expand_as(deq)
    kept = torch.arange(h * d) < table.bands[..., -1:]  # [2, L, C]
    deq = torch.where(kept[:, :, None], deq, mean)
    return (deq.double() @ basis.double().transpose(2, 3)).view(x.shape)


@pytest.mark.parametrize("store_weak", [True, False])
def test_transform_decode_is_the_dequantized_coefficients_times_the_basis(store_weak):
    """The batched bfloat16 decode equals the plain formula: coefficients quantized and
    dequantized, dropped ones at their mean, times the basis; with a wide (int16) band, into
    fp32 and fp16, and from threads decoding at once (shared scratch)."""
    import threading

    big = KVLayout(3, 2, 32, torch.float32, 128)
    table = calibrate([kv_correlated(s, big) for s in range(4)],
                      CalibrationSettings(error=0.04, store_weak=store_weak))
    x = kv_correlated(11, big)
    x[:, :, 7] *= 60  # an outlier token: its strongest coefficients need int16
    want = transform_reference(x, table)
    payload = cachegen.encode(x, table)
    count = cachegen._HEAD.unpack_from(payload)[5]
    widths = [cachegen._STREAM.unpack_from(payload, cachegen._HEAD.size + i * cachegen._STREAM.size)[0]
              for i in range(count)]
    assert 2 in widths  # the int16 path is exercised
    usual = torch.cat([want[:, :, :7], want[:, :, 8:]], dim=2)  # without the outlier
    spread = (usual - usual.mean(dim=2, keepdim=True)).square().mean().sqrt()
    # bfloat16 products (2^-8 of the magnitude), then the output dtype's rounding, twice
    tol = 0.01 * spread + 2**-8 * want.abs()
    for dtype in (torch.float32, torch.float16):
        out = torch.empty(x.shape, dtype=dtype)
        cachegen.decode_into(payload, out, table)
        assert ((out.double() - want).abs() <= tol + 2 * torch.finfo(dtype).eps * want.abs()).all()
    outs = [torch.empty_like(x) for _ in range(4)]
    threads = [threading.Thread(target=lambda o=o: [cachegen.decode_into(payload, o, table)
                                                    for _ in range(20)]) for o in outs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for o in outs:
        assert torch.equal(o, outs[0]) and ((o.double() - want).abs() <= tol).all()


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)


def rotated(kv: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """kv with its keys (pre-RoPE) rotated to positions [position, position + T)."""
    from lmkv.ops_torch import rerotate_keys

    out = kv.clone()
    rerotate_keys(out[0], torch.arange(position, position + kv.shape[2]), inv_freq)
    return out


def test_a_rope_table_codes_keys_unrotated_at_any_position(tmp_path):
    """A table calibrated on keys before RoPE codes a chunk rotated to any position within
    its error bound, smaller than a table calibrated on the rotated keys it would otherwise
    see; the position travels in the payload (and the frame's chunk position feeds it);
    keys stored before RoPE (NO_POSITION) are coded as they are."""
    from lmkv.memory import NO_POSITION

    big = KVLayout(3, 2, 32, torch.float32, 128)
    inv_freq = rope_frequencies(32)
    pre = [kv_correlated(s, big) for s in range(4)]
    table = calibrate(pre, CalibrationSettings(error=0.04), rope=inv_freq)
    assert table.rope is not None and table.basis is not None
    plain = calibrate([rotated(c, 128 * i, inv_freq) for i, c in enumerate(pre)],
                      CalibrationSettings(error=0.04))
    again = CacheGenTable.from_bytes(table.to_bytes())
    assert again.table_id == table.table_id and torch.equal(again.rope, inv_freq)
    x0 = kv_correlated(9, big)
    sizes = {"rope": 0, "plain": 0}
    for position in (0, 1000, 70_000):
        x = rotated(x0, position, inv_freq)
        payload = cachegen.encode(x, table, position=position)
        sizes["rope"] += len(payload)
        sizes["plain"] += len(cachegen.encode(x, plain))
        out = torch.empty_like(x)
        cachegen.decode_into(payload, out, table)
        centred = x - x.mean(dim=2, keepdim=True)
        err = ((out - x).square().sum(dim=(2, 3, 4)) / centred.square().sum(dim=(2, 3, 4))).sqrt()
        assert (err <= table.target * 1.2).all(), (position, err)
        # the position is what makes un-rotated keys cheap: one off costs size
        assert len(cachegen.encode(x, table, position=position + 1)) > 1.5 * len(payload)
    assert sizes["rope"] < 0.9 * sizes["plain"]
    out = torch.empty_like(x0)  # keys before RoPE: not rotated
    cachegen.decode_into(cachegen.encode(x0, table, position=NO_POSITION), out, table)
    assert (rel_error(out, x0) <= table.target * 1.3).all()
    with pytest.raises(cachegen.PayloadError, match="flags|table"):
        cachegen.decode_into(cachegen.encode(x0, plain), out, table)
    with pytest.raises(ValueError, match="position"):
        cachegen.encode(x0, table, position=-1)
    with pytest.raises(ValueError, match="position"):
        cachegen.encode(x0, table)  # a rope table needs it
    pool = MemoryPool(big, 2 * (64 + big.chunk_bytes))  # through the frame
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(rotated(x0, 512, inv_freq))
    src.position = 512
    frame = bytes(encode(src, "k", "cachegen", table))
    (carried,) = cachegen._POSITION.unpack_from(frame, 64 + cachegen._HEAD.size)
    assert carried == 512
    decode_into(frame, dst, "k", table)
    assert (rel_error(dst.kv, src.kv) <= table.target * 1.3).all()
    with pytest.raises(ValueError, match="position"):
        src.position = -1
    bad = table.to_bytes().replace(b"rope_inv_freq", b"rope_inv_frex")  # /3 without rope
    with pytest.raises(ValueError, match="without rotary"):
        CacheGenTable.from_bytes(bad)
    from lmkv.codec.calibration import build_table

    with pytest.raises(ValueError, match="rotary"):
        build_table(table.step, table.mean, table.delta, table.target, table.group_size,
                    table.basis, table.bands, inv_freq[:-1])


def test_transform_table_file_round_trip_and_older_tables_still_load(tmp_path):
    big = KVLayout(2, 2, 32, torch.float32, 64)
    table = calibrate([kv_correlated(s, big) for s in range(3)])
    table.save(tmp_path / "t.safetensors")
    again = CacheGenTable.load(tmp_path / "t.safetensors")
    assert again.table_id == table.table_id and torch.equal(again.basis, table.basis)
    assert torch.equal(again.bands, table.bands)
    x = kv_correlated(5, big)
    a, b = torch.empty_like(x), torch.empty_like(x)
    cachegen.decode_into(cachegen.encode(x, table), a, table)
    cachegen.decode_into(cachegen.encode(x, again), b, again)
    assert torch.equal(a, b)
    old = calibrate([kv_like(s) for s in range(2)], CalibrationSettings(transform=False))
    assert CacheGenTable.from_bytes(old.to_bytes()).basis is None  # format /1: no transform
    from lmkv.codec.calibration import build_table

    bad = table.bands.clone()
    bad[0, 0, -1] = 65  # more coefficients than channels
    with pytest.raises(ValueError, match="inconsistent transform"):
        build_table(table.step, table.mean, table.delta, table.target, table.group_size,
                    table.basis, bad)


def test_incompressible_streams_are_stored_as_they_are(table):
    """Symbols spread evenly over int8 do not compress: such a stream is stored as is
    (width 3), decodes exactly, and a stored stream of the wrong length is rejected."""
    from lmkv.codec.cachegen import _HEAD, _STREAM, STORED

    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, LAYOUT.chunk_shape, generator=g).float()
    x = q * table.step[:, :, None] + table.mean[:, :, None]
    payload = cachegen.encode(x, table)
    widths = [_STREAM.unpack_from(payload, _HEAD.size + i * _STREAM.size)[0]
              for i in range(_HEAD.unpack_from(payload)[-1])]
    assert STORED in widths
    out = torch.empty_like(x)
    cachegen.decode_into(payload, out, table)
    assert torch.allclose(out, x, atol=1e-4)
    bad = bytearray(payload)
    i = widths.index(STORED)
    width, length = _STREAM.unpack_from(bad, _HEAD.size + i * _STREAM.size)
    _STREAM.pack_into(bad, _HEAD.size + i * _STREAM.size, width, length - 1)
    with pytest.raises(cachegen.PayloadError):
        cachegen.decode_into(bytes(bad), out, table)


def test_rans_payload_decodes_like_zstd(table):
    x = kv_like(6)
    a, b = torch.empty_like(x), torch.empty_like(x)
    cachegen.decode_into(cachegen.encode(x, table, "zstd"), a, table)
    cachegen.decode_into(cachegen.encode(x, table, "rans"), b, table)
    assert torch.equal(a, b)


def test_quality_gate_samples_measures_and_falls_back_once():
    metrics = LMKVMetrics()
    assert metrics.registry.get_sample_value("lmkv_codec_agreement") == 1.0  # nothing checked:
    calls = []  # no alert on agreement < codec_min_agreement (it read 0 with no lossy codec)
    gate = QualityGate(every=3, min_agreement=0.9, metrics=metrics,
                       fallback=lambda: calls.append(1) or ["disk"], min_tokens=20)
    assert [gate.sample() for _ in range(7)] == [True, False, False, True, False, False, True]
    assert gate.record(list(range(10)), list(range(10))) == 1.0
    assert not calls  # 10 tokens < min_tokens
    assert gate.record(list(range(10)), list(range(5)) + [0] * 5) == 0.5
    assert calls == [1] and gate.tripped and not gate.sample()
    value = metrics.registry.get_sample_value
    assert value("lmkv_codec_agreement") == 0.75
    assert value("lmkv_codec_checked_tokens_total") == 20
    assert value("lmkv_codec_fallbacks_total") == 1
    gate.record([1, 2], [3, 4])
    assert calls == [1]  # trips once


def test_codec_config_keys():
    cfg = load_config(env={"LMKV_LOCAL_DISK_CODEC": "cachegen"}, remote_serde="cachegen",
                      codec_check_every=10)
    assert cfg.local_disk_codec == "cachegen" and cfg.codec_check_every == 10
    with pytest.raises(ConfigError, match="local_disk_codec"):
        load_config(env={}, local_disk_codec="lz4")
    with pytest.raises(ConfigError, match="codec_min_agreement"):
        load_config(env={}, codec_min_agreement=1.5)


def test_values_beyond_the_tables_range_are_refused_and_stored_lossless(table, tmp_path, caplog):
    """A value that would clamp (|x - mean| / step >= QMAX) is never coded silently outside
    the error bound: encode raises OutOfRange (transform, per-channel and delta tables, at a
    token that is not its group's anchor), and a lossy tier frames that chunk with zstd,
    exactly, counted in lmkv_codec_lossless_chunks and logged once."""
    import logging

    from lmkv.backends.disk import DiskBackend
    from lmkv.storage.tier import Tier

    big = KVLayout(2, 2, 64, torch.float32, 256)
    smooth = calibrate([kv_like(s, smooth=True, layout=big) for s in range(3)],
                       CalibrationSettings(transform=False))
    assert smooth.delta.all()
    correlated = calibrate([kv_correlated(s, KVLayout(3, 2, 32, torch.float32, 128)) for s in range(4)])
    assert correlated.basis is not None
    cases = [(table, kv_like(5)), (smooth, kv_like(9, smooth=True, layout=big)),
             (correlated, kv_correlated(9, KVLayout(3, 2, 32, torch.float32, 128)))]
    for t, x in cases:
        cachegen.encode(x, t)  # in range: coded
        far = x.clone()
        far[1, 1, 3, 0, 5] += 1e6 * t.step.max()  # token 3: not an anchor of a delta group
        with pytest.raises(cachegen.OutOfRange, match="steps from the table's mean"):
            cachegen.encode(far, t)
    metrics = LMKVMetrics()
    tier = Tier("disk", DiskBackend(tmp_path / "disk", 1 << 30), "cachegen", table, metrics)
    pool = MemoryPool(LAYOUT, 3 * (64 + LAYOUT.chunk_bytes))
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(kv_like(5))
    src.kv[1, 1, 3, 0, 5] += 20000 * table.step.max()
    with caplog.at_level(logging.WARNING, logger="lmkv.storage.tier"):
        for key in ("a", "b"):
            frame = tier.encode(key, src)
            assert decode_into(frame, dst, key, table).name == "zstd"
            assert torch.equal(dst.kv, src.kv)
    assert metrics.registry.get_sample_value("lmkv_codec_lossless_chunks_total", {"tier": "disk"}) == 2
    assert caplog.text.count("stores a chunk lossless") == 1
    src.kv.copy_(kv_like(5))
    assert decode_into(tier.encode("c", src), dst, "c", table).name == "cachegen"


@pytest.mark.parametrize("transform", [True, False])
def test_calibration_raises_a_target_finer_than_the_kvs_range_allows(transform, caplog):
    """A target whose step cannot span a layer's largest value (here a spike in V layer 2)
    is raised there, with a warning naming the layer; elsewhere it stays; the calibration
    chunks themselves then encode without OutOfRange."""
    import logging

    chunks = [kv_like(s) for s in range(4)]
    chunks[1][1, 2, 5, 1, 3] += 3000.0
    settings = CalibrationSettings(error=1e-3, deep_ratio=1.0, value_ratio=1.0, transform=transform)
    with caplog.at_level(logging.WARNING, logger="lmkv.codec.calibration"):
        table = calibrate(chunks, settings)
    assert "finer than the KV's range allows" in caplog.text and "V2" in caplog.text
    assert table.target[1, 2] > 2 * 1e-3
    assert torch.allclose(table.target[0], torch.tensor(1e-3)) and abs(table.target[1, 0] - 1e-3) < 1e-9
    for c in chunks:
        cachegen.encode(c, table)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmkv.codec.calibration"):
        calibrate(chunks, CalibrationSettings(transform=transform))  # the default target: in range
    assert "finer" not in caplog.text


def _zstd_rle(size: int, real: bool = True) -> bytes:
    """A zstd frame announcing ``size`` bytes, made of RLE blocks (a few bytes per 128 KiB;
    with ``real`` False it holds only 2 KiB of them)."""
    import struct

    head = b"\x28\xb5\x2f\xfd" + bytes([3 << 6, 10 << 3]) + struct.pack("<Q", size)
    blocks, left = [], size if real else 2048
    while left:
        n = min(left, 1 << 17)
        left -= n
        blocks.append((int(left == 0) | (1 << 1) | (n << 3)).to_bytes(3, "little") + b"\0")
    return head + b"".join(blocks)


def _framed(key: str, payload: bytes, codec_id: int = 1) -> bytes:
    import xxhash

    from lmkv.codec.frame import _DTYPES, _HEADER, MAGIC, VERSION
    from lmkv.memory import HEADER_BYTES

    return _HEADER.pack(MAGIC, VERSION, codec_id, _DTYPES[LAYOUT.dtype], 5, *LAYOUT.chunk_shape,
                        len(payload), xxhash.xxh3_64_intdigest(payload),
                        xxhash.xxh3_64_intdigest(key.encode())).ljust(HEADER_BYTES, b"\0") + payload


def test_zstd_payloads_announcing_another_size_are_refused_before_decoding(table):
    """A checksummed frame whose zstd payload announces more than the chunk (32 KiB can
    announce 1 GiB: zstandard would allocate and fill it) is refused without decoding: a
    FrameError (a miss), never gigabytes of memory or a MemoryError past the tier."""
    import resource

    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    buf = pool.allocate()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for size, real in ((1 << 30, True), (1 << 44, False)):
        with pytest.raises(FrameError, match="announces"):
            decode_into(_framed("k", _zstd_rle(size, real)), buf, "k")
    per_channel = calibrate([kv_like(s) for s in range(2)], CalibrationSettings(transform=False))
    payload = bytearray(cachegen.encode(kv_like(3), per_channel))
    head = cachegen._HEAD.size
    bomb = _zstd_rle(1 << 30)  # in place of stream 0
    width, length = cachegen._STREAM.unpack_from(payload, head)
    off = head + len(per_channel.delta.reshape(-1)) * cachegen._STREAM.size
    cachegen._STREAM.pack_into(payload, head, 1, len(bomb))
    payload[off : off + length] = bomb
    with pytest.raises(cachegen.PayloadError, match="announces"):
        cachegen.decode_into(bytes(payload), buf.kv, per_channel)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB


def test_rans_streams_must_have_the_lanes_encode_writes():
    """A stream claiming one lane would make the decoder loop once per symbol."""
    import struct

    n = 256 * 3 * 64
    one_lane = (struct.pack("<hH", 0, 1) + struct.pack("<H", 4096) + struct.pack("<II", 1, 0)
                + struct.pack("<I", 1 << 16))
    with pytest.raises(rans.RansError, match="lanes"):
        rans.decode(one_lane, n)


def test_calibration_files_are_checked_before_use(table):
    """A table file that lmkv did not write as it should is refused with a ValueError
    naming the problem (a missing tensor, bad metadata, a group size, an infinite step, a
    transform with anchor deltas): never an engine that starts and then fails every save
    or decodes NaN."""
    from safetensors.torch import load, save

    from lmkv.codec.calibration import _metadata

    data = table.to_bytes()
    tensors, meta = load(data), _metadata(data)

    def variant(drop=None, meta_json=None, **changed):
        t = {k: v for k, v in tensors.items() if k != drop} | changed
        return save(t, metadata={"lmkv": meta_json} if meta_json else meta)

    import json

    fmt = json.loads(meta["lmkv"])["format"]
    cases = [
        (variant(drop="step"), "not a cachegen calibration table"),
        (variant(meta_json="[1, 2]"), "not a JSON object"),
        (variant(meta_json=json.dumps({"format": fmt})), "group_size None"),
        (variant(meta_json=json.dumps({"format": fmt, "group_size": 0})), "group_size 0"),
        (variant(step=torch.full_like(tensors["step"], math.inf)), "inconsistent tensors"),
    ]
    for data_, message in cases:
        with pytest.raises(ValueError, match=message):
            CacheGenTable.from_bytes(data_)
    correlated = calibrate([kv_correlated(s, KVLayout(3, 2, 32, torch.float32, 128)) for s in range(4)])
    assert correlated.basis is not None
    from lmkv.codec.calibration import build_table

    with pytest.raises(ValueError, match="anchor deltas"):
        build_table(correlated.step, correlated.mean, torch.ones_like(correlated.delta),
                    correlated.target, 16, correlated.basis, correlated.bands)
    # every tensor finite, yet step x basis overflows float32: every chunk decoded to NaN
    with pytest.raises(ValueError, match="not orthonormal"):
        build_table(correlated.step, correlated.mean, correlated.delta, correlated.target, 16,
                    4 * correlated.basis, correlated.bands)
    with pytest.raises(ValueError, match="too large to decode"):
        build_table(torch.full_like(correlated.step, 3e38), correlated.mean, correlated.delta,
                    correlated.target, 16, correlated.basis, correlated.bands)


def test_a_chunk_with_nan_is_not_coded_lossy(table):
    x = kv_like(4)
    x[0, 1, 2, 0, 3] = math.nan
    with pytest.raises(cachegen.OutOfRange, match="NaN"):
        cachegen.encode(x, table)


def test_a_tail_chunk_in_a_lossy_tier_is_stored_lossless_at_its_size(table):
    """cachegen codes whole chunks: a chunk of fewer tokens (a RAG document's tail) is
    framed by zstd at its own size, and comes back with its token count."""
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(kv_like(6))
    src.kv[:, :, 5:].zero_()
    src.num_tokens = 5
    frame = encode(src, "k", "cachegen", table)
    assert decode_into(frame, dst, "k", table).name == "zstd"
    assert dst.num_tokens == 5 and torch.equal(dst.kv, src.kv)


def _lossy_disk_manager(table, tmp_path):
    """A storage manager over a cachegen disk tier holding chunk "k"."""
    from lmkv.backends.disk import DiskBackend
    from lmkv.storage.manager import StorageManager
    from lmkv.storage.tier import Tier

    metrics = LMKVMetrics()
    pool = MemoryPool(LAYOUT, 4 * (64 + LAYOUT.chunk_bytes))
    tier = Tier("disk", DiskBackend(tmp_path, 1 << 30), "cachegen", table, metrics)
    manager = StorageManager(pool, [tier], metrics)
    buf = pool.allocate()
    buf.kv.copy_(kv_like(7))
    tier.write("k", tier.encode("k", buf))
    buf.release()
    return pool, tier, manager


def test_a_gate_trip_during_a_lossy_read_keeps_that_chunk_out(table, tmp_path):
    """The quality gate trips while a lossy chunk is being decoded: the chunk read is not
    served nor kept in the hot cache (before, it re-entered the hot cache after the trip
    had emptied it of lossy chunks)."""
    pool, tier, manager = _lossy_disk_manager(table, tmp_path)
    try:
        real = tier.read

        def read_then_trip(keys, bufs, absent=None):
            out = real(keys, bufs, absent)
            manager.make_lossless()  # the gate trips while this read was in flight
            return out

        tier.read = read_then_trip
        assert manager.fetch(["k"]) == []
        assert not manager.hot.contains("k")
    finally:
        manager.close()


def test_a_gate_trip_just_before_a_lossy_chunk_enters_the_hot_cache_keeps_it_out(table, tmp_path):
    """The trip lands after the load checked the gate and before it put the chunk in the
    hot cache (the gate runs on its own thread): the hot cache refuses it, the load takes it
    as a miss."""
    pool, _, manager = _lossy_disk_manager(table, tmp_path)
    try:
        real = manager.hot.put

        def trip_then_put(key, buf, parent=None):
            manager.make_lossless()
            return real(key, buf, parent)

        manager.hot.put = trip_then_put
        assert manager.fetch(["k"]) == []
        assert not manager.hot.contains("k")
        assert not any(b.lossy for b in manager.hot.entries.values())
    finally:
        manager.close()
    assert pool.num_free == 4


def test_a_frame_coded_with_another_table_is_a_miss_left_for_its_engine(table, tmp_path):
    """Two engines share a store with different calibration tables: each reads the other's
    lossy frames as misses (counted as foreign) and never deletes them."""
    from lmkv.backends.disk import DiskBackend
    from lmkv.storage.tier import Tier

    metrics = LMKVMetrics()
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    mine = Tier("disk", DiskBackend(tmp_path, 1 << 30), "cachegen", table, metrics)
    buf = pool.allocate()
    buf.kv.copy_(kv_like(7))
    assert mine.write("k", mine.encode("k", buf))
    buf.release()
    other = calibrate([kv_like(s) for s in range(4, 6)])
    theirs = Tier("disk", DiskBackend(tmp_path, 1 << 30), "cachegen", other, metrics)
    for tier, served in ((theirs, False), (mine, True), (theirs, False), (mine, True)):
        buf = pool.allocate()
        assert tier.read(["k"], [buf]) == [served]
        buf.release()
    errors = {s.labels["kind"]: s.value for m in metrics.registry.collect()
              if m.name == "lmkv_errors" for s in m.samples if s.name.endswith("_total")}
    assert errors == {"foreign": 2}


def test_a_chunk_computed_over_lossy_kv_is_stored_only_where_it_reads_back_lossy(table, tmp_path):
    """KV computed over chunks decoded lossy is approximate too: a lossless tier never gets
    it (read back, it would pass for exact KV, unseen by the quality gate), a lossy tier
    gets it whole only, and after the gate's fallback nothing keeps it."""
    from lmkv.backends.disk import DiskBackend
    from lmkv.storage.manager import StorageManager
    from lmkv.storage.tier import Tier

    metrics = LMKVMetrics()
    pool = MemoryPool(LAYOUT, 8 * (64 + LAYOUT.chunk_bytes))
    raw = Tier("disk", DiskBackend(tmp_path / "raw", 1 << 30), "raw", None, metrics)
    lossy = Tier("remote", DiskBackend(tmp_path / "lossy", 1 << 30), "cachegen", table, metrics)
    manager = StorageManager(pool, [raw, lossy], metrics)
    try:
        def put(key, derived, tokens=LAYOUT.chunk_size):
            buf = pool.allocate()
            buf.kv.copy_(kv_like(8))
            buf.num_tokens, buf.lossy = tokens, derived
            manager.put(key, buf)
            buf.release()
            manager.io.drain()

        put("exact", False)
        put("derived", True)
        put("derived-tail", True, tokens=5)
        held = lambda tier: [k for k in ("exact", "derived", "derived-tail") if tier.contains([k])[0]]
        assert held(raw) == ["exact"]
        assert held(lossy) == ["exact", "derived"]
        assert manager.hot.entries["derived"].lossy
        manager.make_lossless()
        assert not manager.hot.contains("derived")
        put("derived-after", True)
        assert not manager.hot.contains("derived-after")
        assert not raw.contains(["derived-after"])[0] and not lossy.contains(["derived-after"])[0]
    finally:
        manager.close()


def test_a_chunk_whose_transform_overflows_is_not_coded_lossy():
    """Finite KV near float32's limit: the decorrelating transform's sums overflow (inf - inf
    is NaN, which quantizes to a finite symbol): refused like a NaN in the chunk."""
    chunks = [kv_correlated(s, LAYOUT) for s in range(4)]
    transformed = calibrate(chunks, CalibrationSettings(error=0.04))
    assert transformed.basis is not None
    x = kv_correlated(9, LAYOUT)
    x[0, 0, 0, 0] = 3e38
    x[0, 0, 0, 1] = -3e38
    assert bool(torch.isfinite(x).all())
    with pytest.raises(cachegen.OutOfRange, match="NaN"):
        cachegen.encode(x, transformed)


def test_calibration_text_shorter_than_a_prompt_is_an_error_not_random_ids():
    from lmkv.codec.calibrate import calibration_prompts

    tokenize = lambda text: list(range(len(text.split())))  # noqa: E731
    with pytest.raises(ValueError, match="50 tokens, shorter than one prompt of 100"):
        calibration_prompts(1000, 3, 100, text="w " * 50, tokenize=tokenize)
    assert len(calibration_prompts(1000, 3, 10, text="w " * 25, tokenize=tokenize)) == 2
    with pytest.raises(ValueError, match="--prompts, --length"):
        calibration_prompts(1000, 0, 100)
    with pytest.raises(ValueError, match="--prompts, --length"):
        calibration_prompts(1000, 2, -5)


def test_bytes_after_a_zstd_frame_are_refused_as_the_native_decoder_does():
    """A checksummed frame whose zstd payload carries bytes after its zstd frame: a
    FrameError (zstandard decoded the frame and ignored the rest)."""
    import zstandard

    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    buf = pool.allocate()
    kv = kv_like(4)
    payload = zstandard.ZstdCompressor(level=1).compress(kv.numpy().tobytes())
    decode_into(_framed("k", payload), buf, "k")
    assert torch.equal(buf.kv, kv)
    with pytest.raises(FrameError, match="4 stray bytes after its zstd frame"):
        decode_into(_framed("k", payload + b"junk"), buf, "k")
