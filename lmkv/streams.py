"""Where lmkv's copies to and from paged memory run: their own stream on a CUDA device,
ordered against the engine's stream by events (GPU-side waits: the host goes on), so
loads and saves overlap the forward pass; on the CPU a copy has finished when issued and
every method is a no-op and every mark is done. The engine's stream is the one current on
the thread that calls ``bind_engine`` (the forward pass's thread)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class CopyStream:
    """The host (and the CPU emulator): copies are synchronous, marks are always done."""

    def bind_engine(self) -> None:
        """Take the calling thread's current stream as the engine's."""

    def active(self) -> contextlib.AbstractContextManager:
        """Make this stream current on the calling thread for the block."""
        return contextlib.nullcontext()

    def engine_mark(self) -> Any:
        """A mark after the engine's work issued so far (a layer's KV written)."""
        return None

    def mark(self) -> Any:
        """A mark after this stream's work issued so far."""
        return None

    def waits(self, mark: Any) -> None:
        """This stream waits for ``mark`` before its next work."""

    def engine_waits(self, mark: Any) -> None:
        """The engine's stream waits for ``mark`` before its next work."""

    def synchronize(self) -> None:
        """The host waits until this stream's work has finished (before its host buffers
        are reused)."""

    def done(self, mark: Any) -> bool:
        """Whether the work before ``mark`` has finished (the host does not wait)."""
        return True

    def wait(self, mark: Any) -> None:
        """The host waits for the work before ``mark``."""


class CudaCopyStream(CopyStream):
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.engine = torch.cuda.current_stream(device)

    def bind_engine(self) -> None:
        self.engine = torch.cuda.current_stream(self.device)

    def active(self):
        return torch.cuda.stream(self.stream)

    def engine_mark(self):
        return self.engine.record_event()

    def mark(self):
        return self.stream.record_event()

    def waits(self, mark) -> None:
        if mark is not None:
            self.stream.wait_event(mark)

    def engine_waits(self, mark) -> None:
        if mark is not None:
            self.engine.wait_event(mark)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def done(self, mark) -> bool:
        return mark is None or mark.query()

    def wait(self, mark) -> None:
        if mark is not None:
            mark.synchronize()


def copy_stream(device: torch.device) -> CopyStream:
    """A copy stream for paged memory on ``device``."""
    return CudaCopyStream(device) if device.type == "cuda" else CopyStream()
