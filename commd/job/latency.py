"""A bounded window of latency samples with percentiles (for `commd status`)."""

from __future__ import annotations

import numpy as np

from commd_protocol.status import LatencySummary


class LatencyWindow:
    """The last ``capacity`` samples in seconds; percentiles in microseconds."""

    def __init__(self, capacity: int = 4096) -> None:
        self._samples = np.zeros(capacity, dtype=np.float64)
        self._count = 0

    def add(self, seconds: float) -> None:
        self._samples[self._count % self._samples.size] = seconds
        self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def summary(self) -> LatencySummary | None:
        """Percentiles over the window; None when empty."""
        if self._count == 0:
            return None
        window = self._samples[: min(self._count, self._samples.size)] * 1e6
        p50, p99 = np.percentile(window, [50, 99])
        return LatencySummary(p50_us=round(float(p50), 1), p99_us=round(float(p99), 1),
                              max_us=round(float(window.max()), 1), samples=float(window.size))
