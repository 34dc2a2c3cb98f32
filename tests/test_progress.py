"""Plain progress lines for logs: every ~10 s or 5 %, with done/total, questions/s and ETA."""

import io

from prune_audit.cli.progress import PlainLines, clock_text, progress_reporter


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_every_five_percent_or_ten_seconds_with_rate_and_eta():
    stream, clock = io.StringIO(), FakeClock()
    progress = PlainLines(stream, clock=clock)
    progress.start(100, 1100)  # a resumed run: 100 done before, 1000 to go
    for _ in range(10):  # 1 question a second: the 10 s interval prints the 10th
        clock.now += 1.0
        progress.advance(1)
    clock.now += 0.5
    progress.advance(1)
    clock.now += 1.0
    progress.advance(49)  # 50 since the last line: below 5 % of 1100 (55)
    clock.now += 1.0
    progress.advance(10)  # 60: prints
    for _ in range(93):  # to exactly 1100
        clock.now += 0.1
        progress.advance(10)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "questions: 100/1100 (9%) | - q/s | ETA ?"
    assert lines[1] == "questions: 110/1100 (10%) | 1.00 q/s | ETA 0:16:30"  # 10 q in 10 s, 990 left
    assert lines[2] == "questions: 170/1100 (15%) | 5.60 q/s | ETA 0:02:46"  # 70 q in 12.5 s
    assert lines[-1].startswith("questions: 1100/1100 (100%)") and lines[-1].endswith("ETA 0:00:00")
    assert len(lines) < 25


def test_quiet_and_terminal_choices():
    stream = io.StringIO()
    with progress_reporter(quiet=True, stream=stream) as progress:
        progress.start(0, 10)
        progress.update(10)
    assert stream.getvalue() == ""
    with progress_reporter(stream=stream) as progress:  # StringIO is not a terminal: plain lines
        progress.update(5, 10)
        progress.update(10, 10)
    assert stream.getvalue().splitlines()[-1].startswith("questions: 10/10 (100%)")
    assert clock_text(3725) == "1:02:05" and clock_text(None) == "?"
