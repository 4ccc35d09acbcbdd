"""The vLLM connector's worker role against vLLM's own model-runner code, step by step
(tests/vllm/worker_role_checks.py in .venv-vllm): failed loads are reported in the step
they happen, whatever order vLLM asks in, and nothing computed over their pages is stored."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason="real vLLM is not installed: run scripts/setup_vllm_venv.sh (.venv-vllm)"),
]


@pytest.fixture(scope="module")
def seen() -> dict:
    out = subprocess.run([str(VENV_PY), "-m", "tests.vllm.worker_role_checks"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_failed_load_is_reported_in_its_own_step(seen):
    """With speculative decoding vLLM asks for load errors before wait_for_save."""
    assert seen["deferred"] == {"defer=False": [[3], []], "defer=True": [[3], []]}


def test_the_step_after_a_failed_load_stores_nothing(seen):
    """Only 1 chunk (the stored first one) is found after the step following the failure;
    2 (the new one too) after the step after that."""
    assert seen["saves"] == {"chunks found after the next two steps": [1, 2]}


def test_a_load_failed_on_another_tensor_parallel_rank_stores_nothing_here(seen):
    """Only the chunk stored before is found: this rank's new chunk, computed over the other
    rank's stale attention, is not stored; the failed blocks are that rank's to report."""
    assert seen["other_rank"] == {"blocks reported": [], "chunks found": 1}


def test_blocks_whose_load_failed_leave_vllms_prefix_cache_with_those_computed_over_them(seen):
    """With kv_load_failure_policy "recompute" vLLM keeps them cached while they are computed
    again: a request admitted meanwhile would attend over pages never written."""
    assert seen["evicted"] == [6, 7, 8]


def test_layerwise_mode_asks_vllm_for_piecewise_cuda_graphs(seen):
    """A full graph's replay skips the per-layer hooks that wait for each layer's load."""
    assert seen["piecewise"] == {"False": False, "True": True}


def test_lmkv_asks_vllm_for_no_reliable_kv_delivery(seen):
    """lmkv holds no block past the step that computes it, in any role (a producer's
    preempted requests need no recompute)."""
    assert seen["kv_delivery"] is False
