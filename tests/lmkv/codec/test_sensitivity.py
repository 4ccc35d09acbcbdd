"""cachegen's error targets weighed by each layer's measured effect on the model's output:
the allocation (CalibrationSettings.targets) and its measurement (measure_sensitivity)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmkv.codec.calibrate import MIN_TAIL, calibrate_kv, measure_sensitivity
from lmkv.codec.calibration import MAX_TARGET, CalibrationSettings, calibrate

LAYERS, HEADS, DIM, CHUNK, VOCAB = 4, 2, 8, 16, 11


def test_without_a_measurement_the_targets_are_the_ramp():
    s = CalibrationSettings(error=0.1, deep_ratio=0.5, value_ratio=0.5)
    ramp = s.targets(LAYERS)
    assert ramp[0, 0].item() == pytest.approx(0.1) and ramp[0, -1].item() == pytest.approx(0.05)
    assert ramp[1, 0].item() == pytest.approx(0.05)
    sens = torch.rand(2, LAYERS) + 0.1
    assert torch.equal(CalibrationSettings(error=0.1, deep_ratio=0.5, value_ratio=0.5,
                                           weigh_layers=False).targets(LAYERS, sens), ramp)
    assert torch.equal(s.targets(LAYERS, torch.zeros(2, LAYERS)), ramp)  # nothing moved: the ramp


def test_weighed_targets_spread_the_ramps_divergence_evenly():
    s = CalibrationSettings(error=0.1)
    sens = torch.tensor([[1.0, 4.0, 16.0, 100.0], [2.0, 0.5, 8.0, 25.0]])
    ramp, weighed = s.targets(LAYERS), s.targets(LAYERS, sens)
    share = sens * weighed.square()  # each layer's predicted divergence
    assert torch.allclose(share, share.mean().expand_as(share), rtol=1e-5)
    assert share.sum().item() == pytest.approx((sens * ramp.square()).sum().item(), rel=1e-5)
    # the more a layer moves the output, the finer its steps
    order = sens.flatten().argsort()
    assert bool((weighed.flatten()[order].diff() < 0).all())
    # fewer bits in all: the sum of log targets grows (equal divergence, coarser on the whole)
    assert weighed.log().sum() > ramp.log().sum()


def test_a_layer_that_does_not_move_the_output_gets_the_coarsest_target():
    sens = torch.ones(2, LAYERS)
    sens[1, 2] = 0.0
    weighed = CalibrationSettings(error=0.1).targets(LAYERS, sens)
    assert weighed[1, 2].item() == MAX_TARGET
    assert bool(weighed.flatten().topk(2).values[1] < MAX_TARGET)
    with pytest.raises(ValueError, match="does not fit"):
        CalibrationSettings().targets(LAYERS, torch.ones(2, LAYERS + 1))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or infinite"):
            CalibrationSettings().targets(LAYERS, torch.full((2, LAYERS), bad))


class OneLayerModel:
    """A KVComputer whose output reads only the V of one layer (and the tokens): the
    measured sensitivity must be that layer's alone."""

    rope_inv_freq = None

    def __init__(self, kv: int, layer: int):
        self.kv, self.layer = kv, layer
        self.readout = torch.randn(HEADS * DIM, VOCAB, generator=torch.Generator().manual_seed(3))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def compute_kv(self, token_lists: list[list[int]], pre_rope: bool = False) -> list[torch.Tensor]:
        out = []
        for ids in token_lists:
            g = torch.Generator().manual_seed(sum(ids))
            base = torch.randn(2, LAYERS, 1, HEADS, DIM, generator=g) * 3
            out.append(base + torch.randn(2, LAYERS, len(ids), HEADS, DIM, generator=g))
        return out

    def continuation_logits(self, tokens: list[int], prefix_kv: torch.Tensor) -> torch.Tensor:
        read = prefix_kv[self.kv, self.layer].reshape(prefix_kv.shape[2], -1).cumsum(0)[-1]
        n = len(tokens) - prefix_kv.shape[2]
        return (read @ self.readout).expand(n, VOCAB) * torch.arange(1, n + 1)[:, None] / n


def test_sensitivity_is_measured_where_the_output_reads():
    model = OneLayerModel(kv=1, layer=2)
    prompts = [list(range(i, i + 3 * CHUNK + MIN_TAIL)) for i in range(3)]
    table = calibrate([c for kv in model.compute_kv(prompts) for c in kv.split(CHUNK, dim=2)
                       if c.shape[2] == CHUNK], CalibrationSettings(error=0.2))
    sens = measure_sensitivity(model, table, prompts, CHUNK)
    assert sens.shape == (2, LAYERS)
    assert sens[1, 2].item() > 0
    others = torch.ones(2, LAYERS, dtype=torch.bool)
    others[1, 2] = False
    assert bool((sens[others] == 0).all())
    weighed = CalibrationSettings(error=0.2).targets(LAYERS, sens)
    assert weighed[1, 2] < 0.2 and bool((weighed[others] == MAX_TARGET).all())


def test_prompts_too_short_to_measure_on_are_refused():
    model = OneLayerModel(kv=0, layer=0)
    prompts = [list(range(CHUNK + MIN_TAIL - 1))]
    table = calibrate([model.compute_kv([list(range(CHUNK))])[0]], CalibrationSettings(error=0.2))
    with pytest.raises(ValueError, match="make them longer"):
        measure_sensitivity(model, table, prompts, CHUNK)


def test_calibrating_on_prompts_too_short_to_weigh_is_refused_before_any_kv():
    """Weighing needs MIN_TAIL tokens past a chunk: calibrate_kv refuses shorter prompts
    before it computes anything (the minutes of KV would be lost), naming the length needed."""

    class Counting(OneLayerModel):
        calls = 0

        def compute_kv(self, token_lists, pre_rope=False):
            Counting.calls += 1
            return super().compute_kv(token_lists, pre_rope)

    lmkv = SimpleNamespace(chunk_size=CHUNK)
    prompts = [list(range(CHUNK + MIN_TAIL - 1))] * 2
    with pytest.raises(ValueError, match=f"at least {CHUNK + MIN_TAIL} tokens"):
        calibrate_kv(Counting(0, 0), lmkv, CalibrationSettings(), prompts)
    assert Counting.calls == 0
