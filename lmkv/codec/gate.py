"""QualityGate: watches the greedy-token agreement of lossy KV and falls back to lossless.

The engine re-runs 1 in ``every`` requests that were served lossy (cachegen) KV without
any cached KV, and hands both token lists to ``record``. Agreement = matching positions /
compared positions, summed over all checks since start (so a gauge reads it directly).
Once ``min_tokens`` tokens have been compared and the agreement is below
``min_agreement``, the gate trips once: ``fallback`` (StorageManager.make_lossless) turns
the lossy tiers to zstd, and chunks they stored lossy are no longer served.

Metrics (on the engine's registry): lmkv_codec_checks_total, lmkv_codec_checked_tokens_total,
lmkv_codec_agreed_tokens_total, lmkv_codec_agreement (gauge), lmkv_codec_fallbacks_total.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..metrics import LMKVMetrics

log = logging.getLogger(__name__)


class QualityGate:
    def __init__(self, every: int, min_agreement: float, metrics: LMKVMetrics,
                 fallback: Callable[[], list[str]], min_tokens: int = 32):
        self.every = every
        self.min_agreement = min_agreement
        self.metrics = metrics
        self.fallback = fallback
        self.min_tokens = min_tokens
        self.tripped = False
        self._seen = 0
        self._checked = 0
        self._agreed = 0
        self._lock = threading.Lock()

    def sample(self) -> bool:
        """Called for each request served lossy KV: True for 1 in ``every``."""
        if self.every <= 0 or self.tripped:
            return False
        with self._lock:
            self._seen += 1
            return self._seen % self.every == 1 % self.every

    @property
    def agreement(self) -> float:
        return self._agreed / self._checked if self._checked else 1.0

    def record(self, reference: list[int], served: list[int]) -> float:
        """Compare the tokens made without cached KV (``reference``) with those made with
        lossy KV (``served``); returns this check's agreement."""
        n = min(len(reference), len(served))
        same = sum(a == b for a, b in zip(reference[:n], served[:n], strict=True))
        with self._lock:
            self._checked += n
            self._agreed += same
            trip = (not self.tripped and self._checked >= self.min_tokens
                    and self.agreement < self.min_agreement)
            self.tripped |= trip
        m = self.metrics
        m.codec_checks.inc()
        m.codec_checked_tokens.inc(n)
        m.codec_agreed_tokens.inc(same)
        m.codec_agreement.set(self.agreement)
        if trip:
            tiers = self.fallback()
            m.codec_fallbacks.inc()
            log.warning("lmkv: lossy KV agreement %.4f < %.4f over %d tokens; tiers %s now "
                        "store lossless (zstd)", self.agreement, self.min_agreement,
                        self._checked, ", ".join(tiers) or "-")
        return same / n if n else 1.0
