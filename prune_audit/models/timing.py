"""Wall time of the consecutive parts of a prefill (vision, selection, language model)."""

from __future__ import annotations

import time

import torch


class PartClock:
    """Milliseconds spent in consecutive parts, read on a monotonic clock.

    On a GPU the device is synchronised before every reading, so a part's time is the
    work it queued (the same interval CUDA events around it would bound, at the cost of
    one synchronisation per part).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.parts: dict[str, float] = {}
        self._last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, part: str) -> None:
        """Charge the time since the previous lap (or the start) to ``part``."""
        now = self._now()
        self.parts[part] = self.parts.get(part, 0.0) + (now - self._last) * 1000
        self._last = now


__all__ = ["PartClock"]
