"""Where the engine runs: a torch device, and the launcher of lmkv's CUDA kernels there.

``auto`` is CUDA when torch sees a GPU, else the CPU. ``emulate`` runs on CPU tensors with
every kernel (attention, cache writes, KV transfers, RoPE re-rotation) executed by the CUDA
emulator in lmkv_cuda.emu: the GPU code path without a GPU, for tests (slow)."""

from __future__ import annotations

import shutil
from typing import Any, NamedTuple

import torch

DEVICES = ("auto", "cpu", "cuda", "emulate")  # and cuda:N


class Device(NamedTuple):
    torch: torch.device
    launcher: Any  # lmkv_cuda.launcher.Launcher given explicitly (the emulator's), or None


def check_device(name: str) -> bool:
    return name in DEVICES or (name.startswith("cuda:") and name[5:].isdigit())


def resolve_device(name: str) -> Device:
    """The device ``name`` means here, made the process's current CUDA device where it is
    one (so that lmkv's pinned pool, streams and kernels, which use the current device, make
    no context on device 0 when the engine runs on another). Raises ValueError when it
    cannot be had."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "emulate":
        if shutil.which("g++") is None:
            raise ValueError("device emulate runs lmkv's CUDA kernels under the CPU emulator, "
                             "which needs g++")
        from lmkv_cuda.emu import EmuLauncher

        return Device(torch.device("cpu"), EmuLauncher())
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name}: no CUDA device is available to torch "
                         "(torch.cuda.is_available() is False); use --device cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        if device.index >= (count := torch.cuda.device_count()):
            raise ValueError(f"device {name}: torch sees {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
        torch.cuda.set_device(device)
    return Device(device, None)


def default_dtype(device: Device) -> str:
    """The engine's dtype when none is named: bfloat16 on a GPU (float16 before Ampere, whose
    bfloat16 is emulated), float32 on the CPU and under the emulator."""
    if device.torch.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.get_device_capability(device.torch) >= (8, 0) else "float16"
