"""The vLLM paged-memory layouts against plain-torch references: chunks written by slot
mapping land where each backend's kernels read them, and read back unchanged."""

from __future__ import annotations

import pytest
import torch

from lmkv_engines.vllm.paged import cpu_paged_memory, gpu_paged_memory

L, NB, BS, H, D, T = 3, 6, 16, 2, 8, 32


def _cpu_reference(raw: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Read tokens at (block, offset) out of CPU pages by the documented formula:
    page [Hkv][K^T: e * BS + s | V: BS * D + s * D + e]. raw: [L, NB, H, BS * 2 * D]."""
    out = torch.empty(2, L, len(blocks), H, D)
    for layer in range(L):
        for t, (b, s) in enumerate(zip(blocks.tolist(), offs.tolist(), strict=True)):
            for h in range(H):
                page = raw[layer, b, h]
                out[0, layer, t, h] = page[torch.arange(D) * BS + s]
                out[1, layer, t, h] = page[BS * D + s * D + torch.arange(D)]
    return out


def _gpu_reference(raw: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """raw: [L, NB, BS, H, 2 * D]; K = [..., :D], V = [..., D:]."""
    tok = raw[:, blocks, offs]  # [L, T, H, 2D]
    return torch.stack([tok[..., :D], tok[..., D:]])


def _memories(kind: str):
    if kind == "cpu":
        raw = torch.zeros(L, NB, H, BS * 2 * D)
        layers = [raw[i].view(NB, H, BS, 2 * D) for i in range(L)]  # vLLM's logical view
        return raw, cpu_paged_memory(layers), _cpu_reference
    raw = torch.zeros(L, NB, BS, H, 2 * D)
    logical = [raw[i].transpose(1, 2) for i in range(L)]  # [NB, H, BS, 2D] as vLLM registers it
    return raw, gpu_paged_memory([t.transpose(1, 2) for t in logical]), _gpu_reference


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("aligned", ["blocks", "consecutive", "tokens"])
@pytest.mark.parametrize("skip", [0, 16])
def test_load_then_save_round_trip(kind, aligned, skip):
    raw, paged, reference = _memories(kind)
    g = torch.Generator().manual_seed(1)
    chunk = torch.randn(2, L, T, H, D, generator=g)
    if aligned == "blocks":  # blocks 4 and 1, whole
        slots = torch.cat([torch.arange(4 * BS, 5 * BS), torch.arange(BS, 2 * BS)])
    elif aligned == "consecutive":  # blocks 2 and 3, whole: one slice
        slots = torch.arange(2 * BS, 2 * BS + T)
    else:  # scattered single tokens
        slots = torch.randperm(NB * BS, generator=g)[:T]
    paged.load(chunk, slots, skip)
    blocks, offs = slots // BS, slots % BS
    got = reference(raw, blocks, offs)
    assert torch.equal(got[:, :, skip:], chunk[:, :, skip:])
    if skip:  # tokens [0, skip) were left alone
        assert not got[:, :, :skip].any()
    back = torch.full_like(chunk, -1.0)
    paged.save(slots, back, skip)
    assert torch.equal(back[:, :, skip:], chunk[:, :, skip:])
    assert bool((back[:, :, :skip] == -1).all())


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("layer", [None, 2])
def test_a_load_ending_inside_the_chunk_writes_only_the_mapped_tokens(kind, layer):
    """The last chunk of a prompt of whole chunks is loaded but for its last token: the
    worker passes a view of the chunk's first tokens with their slots (here ending inside a
    block, after skipping a block)."""
    raw, paged, reference = _memories(kind)
    chunk = torch.randn(2, L, T, H, D)
    slots = torch.arange(2 * BS, 2 * BS + T - 1)
    paged.load(chunk[:, :, : T - 1], slots, BS, layer)
    got = reference(raw, torch.arange(2 * BS, 2 * BS + T) // BS, torch.arange(2 * BS, 2 * BS + T) % BS)
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    assert torch.equal(got[:, layers, BS : T - 1], chunk[:, layers, BS : T - 1])
    assert not got[:, :, : BS].any() and not got[:, :, T - 1].any()  # skipped, and not mapped
    if layer is not None:
        assert not got[:, :layer].any()


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_single_layer(kind):
    raw, paged, reference = _memories(kind)
    chunk = torch.randn(2, L, T, H, D)
    slots = torch.arange(2 * BS, 2 * BS + T)
    paged.load(chunk, slots, 0, layer=1)
    got = reference(raw, slots // BS, slots % BS)
    assert torch.equal(got[:, 1], chunk[:, 1])
    assert not got[:, 0].any() and not got[:, 2].any()
    back = torch.zeros_like(chunk)
    paged.save(slots, back, 0, layer=1)
    assert torch.equal(back[:, 1], chunk[:, 1]) and not back[:, 0].any()


def test_shapes_and_dtype():
    _, paged, _ = _memories("cpu")
    assert (paged.num_layers, paged.num_kv_heads, paged.head_dim, paged.block_size) == (L, H, D, BS)
    assert paged.dtype == torch.float32



@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("aligned", ["blocks", "consecutive", "tokens"])
def test_layers_in_separate_buffers_move_layer_by_layer_to_the_same_places(kind, aligned):
    """vLLM's layers share one buffer at one stride (one copy moves a chunk's K across all
    layers); layers allocated apart take the per-layer path, with the same result."""
    raw, shared, _ = _memories(kind)
    if kind == "cpu":  # the strided CPU layout moves all layers at once where it can
        assert shared.k_all is not None and shared.k_all.shape == (L, NB, BS, H, D)
    if kind == "cpu":
        apart = [raw[i].clone().view(NB, H, BS, 2 * D) for i in range(L)]
        separate = cpu_paged_memory(apart)
    else:
        apart = [raw[i].clone().transpose(1, 2) for i in range(L)]
        separate = gpu_paged_memory([t.transpose(1, 2) for t in apart])
    if kind == "cpu":
        assert separate.k_all is None and separate.v_all is None
    g = torch.Generator().manual_seed(3)
    chunk = torch.randn(2, L, T, H, D, generator=g)
    slots = {"blocks": torch.cat([torch.arange(4 * BS, 5 * BS), torch.arange(BS, 2 * BS)]),
             "consecutive": torch.arange(2 * BS, 2 * BS + T),
             "tokens": torch.randperm(NB * BS, generator=g)[:T]}[aligned]
    for skip in (0, 5):
        shared.load(chunk + skip, slots, skip)
        separate.load(chunk + skip, slots, skip)
        assert torch.equal(torch.stack(apart).flatten(), raw.flatten()) if kind == "cpu" else \
            torch.equal(torch.stack(apart).transpose(2, 3).flatten(), raw.flatten())
        a, b = torch.zeros_like(chunk), torch.zeros_like(chunk)
        shared.save(slots, a, skip)
        separate.save(slots, b, skip)
        assert torch.equal(a, b) and torch.equal(a[:, :, skip:], (chunk + skip)[:, :, skip:])


def test_all_layer_view_only_for_layers_at_one_stride_without_overlap():
    from lmkv_engines.vllm.paged import _all_layers

    buf = torch.zeros(4 * 100)
    assert torch.equal(_all_layers([buf[i * 100 : i * 100 + 80].view(8, 10) for i in range(4)])[2],
                       buf[200:280].view(8, 10))
    assert _all_layers([buf[i * 50 : i * 50 + 80].view(8, 10) for i in range(4)]) is None  # overlap
    assert _all_layers([buf[0:80].view(8, 10), buf[100:180].view(8, 10), buf[300:380].view(8, 10)]) is None
    assert _all_layers([buf[0:80].view(8, 10), torch.zeros(8, 10)]) is None  # another buffer


@pytest.mark.parametrize("layer", [None, 1])
def test_the_gpu_layout_never_mixes_host_indices_with_device_pages(layer):
    """Pages on a device of their own (the meta device stands in for CUDA: any operation that
    mixes it with a host tensor raises): host chunks and host slot mappings are staged on
    the pages' device, for loads and saves, all layers or one."""
    pages = [torch.empty(NB, BS, H, 2 * D, device="meta") for _ in range(L)]
    paged = gpu_paged_memory(pages)
    chunk = torch.randn(2, L, T, H, D)  # lmkv's host memory
    slots = torch.randperm(NB * BS)[:T]
    paged.load(chunk, slots, 3, layer)
    out = torch.zeros(2, L, T, H, D)
    with pytest.raises(NotImplementedError):  # a meta tensor has no data to copy back
        paged.save(slots, out, 3, layer)


def test_the_gpu_layout_moves_chunks_with_the_transfer_kernels(emu):
    """The same copies through lmkv's CUDA transfer kernels, run by the CPU emulator."""
    raw, paged, reference = _memories("gpu")
    paged.launcher = emu
    g = torch.Generator().manual_seed(5)
    chunk = torch.randn(2, L, T, H, D, generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    paged.load(chunk, slots, 4)
    got = reference(raw, slots // BS, slots % BS)
    assert torch.equal(got[:, :, 4:], chunk[:, :, 4:]) and not got[:, :, :4].any()
    back = torch.zeros_like(chunk)
    paged.save(slots, back, 0, layer=2)
    assert torch.equal(back[:, 2, 4:], chunk[:, 2, 4:]) and not back[:, :2].any()


def test_the_gpu_layouts_kernels_are_ready_when_vllm_registers_its_caches(emu, monkeypatch):
    """Registering vLLM's GPU layers prepares them for lmkv's kernels at once (a first start
    compiles the kernels there, not in the first request's step): no copy prepares again."""
    from lmkv_cuda import kv_copy

    made = []

    class Counted(kv_copy.VllmLayers):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kv_copy, "VllmLayers", Counted)
    raw = torch.zeros(L, NB, BS, H, 2 * D)
    paged = gpu_paged_memory([raw[i] for i in range(L)], launcher=emu)
    assert made == [1]
    chunk = torch.randn(2, L, T, H, D)
    slots = torch.randperm(NB * BS)[:T]
    paged.load(chunk, slots)
    paged.save(slots, torch.zeros_like(chunk), 0, layer=1)
    assert made == [1]


def test_the_gpu_layouts_layers_are_checked_once_not_per_copy(emu, monkeypatch):
    """The transfer kernels' wrapper checks vLLM's layers (and builds their address table)
    once per registered cache; each copy, all layers or one, checks only its chunk and
    slots, and layer-wise copies land where whole-chunk ones do."""
    from lmkv_cuda import kv_copy

    checked = []
    real = kv_copy.check_tensor
    monkeypatch.setattr(kv_copy, "check_tensor", lambda t, name, *a, **k: checked.append(name)
                        or real(t, name, *a, **k))
    raw, paged, reference = _memories("gpu")
    paged.launcher = emu
    g = torch.Generator().manual_seed(6)
    chunk = torch.randn(2, L, T, H, D, generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    paged.load(chunk, slots, 0, layer=0)
    assert sum(n.startswith("kv_caches") for n in checked) == L  # once, at the first copy
    checked.clear()
    for layer in range(1, L):
        paged.load(chunk, slots, 0, layer=layer)
    paged.load(chunk, slots, 0)
    assert not any(n.startswith("kv_caches") for n in checked)
    assert torch.equal(reference(raw, slots // BS, slots % BS), chunk)
    back = torch.zeros_like(chunk)
    for layer in range(L):
        paged.save(slots, back, 0, layer=layer)
    assert torch.equal(back, chunk)


def test_a_host_view_goes_to_a_device_in_few_contiguous_pieces():
    from lmkv.paged import MAX_PIECES, contiguous_pieces, on_device

    chunk = torch.randn(2, L, T, H, D)
    assert contiguous_pieces(chunk) == [()]
    layer = chunk[:, 1:2]  # K and V of one layer
    assert contiguous_pieces(layer) == [(0,), (1,)]
    assert all(layer[i].is_contiguous() for i in contiguous_pieces(layer))
    assert len(contiguous_pieces(chunk[:, :, 4:])) == 2 * L <= MAX_PIECES
    assert on_device(layer, torch.device("meta")).shape == layer.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layer", [None, 1])
def test_the_gpu_layout_on_cuda_moves_pinned_chunks(layer):
    """On a real GPU: pinned host chunks into CUDA pages and back through the prepared
    layers (all layers, or one layer's K and V pieces), asynchronous copies included (the
    stream is synchronized before the host reads, as lmkv's worker does)."""
    raw = torch.zeros(L, NB, BS, H, 2 * D, device="cuda")
    paged = gpu_paged_memory([raw[i] for i in range(L)])
    chunk = torch.randn(2, L, T, H, D).pin_memory()
    slots = torch.randperm(NB * BS)[:T]
    layers = range(L) if layer is None else [layer]
    paged.load(chunk, slots, 4, layer)
    back = torch.zeros_like(chunk).pin_memory()
    paged.save(slots, back, 4, layer)
    torch.cuda.current_stream().synchronize()
    got = _gpu_reference(raw.cpu(), slots // BS, slots % BS)
    for i in layers:
        assert torch.equal(got[:, i, 4:], chunk[:, i, 4:]) and not got[:, i, :4].any()
        assert torch.equal(back[:, i, 4:], chunk[:, i, 4:]) and not back[:, i, :4].any()
