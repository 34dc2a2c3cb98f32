"""Progress of long commands: a live bar on a terminal, plain lines in logs, nothing with --quiet.

When stderr is not a terminal (CI, nohup, SLURM, ``| tee``) a live bar would print nothing
useful until the end, so plain lines go there instead: done/total, questions per second
and the time left, every ``interval`` seconds or ``fraction`` of the work, and at the end.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO


def clock_text(seconds: float | None) -> str:
    """h:mm:ss of a duration; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Silent:
    """Progress that shows nothing (--quiet); the base of the displays below."""

    done = 0

    def start(self, done: int, total: int) -> None:
        """Work begins with ``done`` of ``total`` already finished (a resumed run)."""
        self.done = done

    def update(self, done: int, total: int | None = None) -> None:
        """``done`` items finished so far (of ``total`` when given)."""
        self.done = done

    def advance(self, count: int) -> None:
        """``count`` more items finished."""
        self.update(self.done + count)


class PlainLines(Silent):
    """Progress as plain lines: ``questions: 450/900 (50%) | 12.3 q/s | ETA 0:00:37``."""

    def __init__(
        self,
        stream: TextIO,
        label: str = "questions",
        interval: float = 10.0,
        fraction: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.label, self.interval, self.fraction, self.clock = stream, label, interval, fraction, clock
        self.done, self.total = 0, None
        self.first_done, self.started = 0, clock()
        self.printed_done, self.printed_at = -1, self.started

    def start(self, done: int, total: int) -> None:
        self.done = self.first_done = done
        self.total = total
        self.started = self.printed_at = self.clock()
        self._emit(self.started)

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None and self.total is None:
            self.total, self.started = total, self.clock()
        self.done = done
        now = self.clock()
        step = max(1, math.ceil(self.fraction * self.total)) if self.total else math.inf
        finished = self.total is not None and done >= self.total
        if now - self.printed_at >= self.interval or done - self.printed_done >= step or finished:
            self._emit(now)

    def _emit(self, now: float) -> None:
        if self.done == self.printed_done:
            return
        elapsed = now - self.started
        rate = (self.done - self.first_done) / elapsed if elapsed > 0 else math.nan
        left = max(0, self.total - self.done) / rate if self.total is not None and rate > 0 else None
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        speed = f"{rate:.2f} q/s" if math.isfinite(rate) else "- q/s"
        print(
            f"{self.label}: {self.done}/{self.total if self.total is not None else '?'}{share} | {speed} | "
            f"ETA {clock_text(left)}",
            file=self.stream,
            flush=True,
        )
        self.printed_done, self.printed_at = self.done, now


class LiveBar(Silent):
    """A rich progress bar (terminals only)."""

    def __init__(self, progress: Any, label: str) -> None:
        self.progress, self.done = progress, 0
        self.task = progress.add_task(label, total=None, rate="")

    def start(self, done: int, total: int) -> None:
        self.done = done
        self.progress.update(self.task, completed=done, total=total)

    def update(self, done: int, total: int | None = None) -> None:
        self.progress.update(self.task, advance=done - self.done, total=total)
        self.done = done
        speed = self.progress.tasks[self.task].speed
        self.progress.update(self.task, rate=f"{speed:.2f} q/s" if speed else "")


@contextmanager
def progress_reporter(label: str = "questions", quiet: bool = False, stream: TextIO | None = None) -> Iterator[Silent]:
    """The progress display for this process's stderr: live bar, plain lines or (``quiet``) nothing."""
    stream = stream or sys.stderr
    if quiet:
        yield Silent()
        return
    if not stream.isatty():
        yield PlainLines(stream, label)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(file=stream), transient=False) as progress:
        yield LiveBar(progress, label)
