"""Wall time of the consecutive parts of an answer (vision, selection, prefill, decode): CUDA events on a
GPU, a monotonic clock on CPU (docs/compute.md, "Latency parts")."""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise

import torch


class PartClock:
    """Milliseconds spent in consecutive parts.

    :meth:`lap` closes the part running since the previous lap (or the clock's creation). On a GPU
    each lap records a ``torch.cuda.Event(enable_timing=True)`` on the device's current stream
    without waiting for it, so timing does not stall the host between parts; :meth:`read` waits for
    the last event once and charges each part the device time between its two events (the work
    queued in between, and any time the device waited for the host, such as a selection on the CPU).
    On CPU each lap reads ``time.perf_counter``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, torch.cuda.Event | float]] = [("", self._mark())]

    def _mark(self) -> torch.cuda.Event | float:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def lap(self, part: str) -> None:
        """Charge the time since the previous lap (or the start) to ``part``."""
        self._marks.append((part, self._mark()))

    def read(self) -> dict[str, float]:
        """Milliseconds of each part, summed over its laps (waits for the device on a GPU)."""
        if self._cuda:
            self._marks[-1][1].synchronize()
        parts: dict[str, float] = {}
        for (_, start), (part, end) in pairwise(self._marks):
            spent = start.elapsed_time(end) if self._cuda else (end - start) * 1000
            parts[part] = parts.get(part, 0.0) + spent
        return parts


def timed_ms(device: torch.device, work: Callable[[], object]) -> float:
    """Milliseconds of ``work()`` on ``device``'s :class:`PartClock`."""
    clock = PartClock(device)
    work()
    clock.lap("work")
    return clock.read()["work"]


__all__ = ["PartClock", "timed_ms"]
