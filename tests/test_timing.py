"""Issue 26: the latency parts on a GPU come from CUDA events, checked on CPU with a fake event and device.

A fake ``torch.cuda.Event`` reads a fake device timeline that the test advances by a known
amount inside each part of ``answer()`` (vision tower, selection, language-model prefill,
decoding); the recorded parts must be exactly those amounts divided by the batch size, so
every lap sits at its part's boundary and the event arithmetic is right.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_image

from prune_audit.answer_modes import Greedy
from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.models import answering, base
from prune_audit.models.timing import PartClock, timed_ms
from prune_audit.pruners.registry import get_selector


class FakeTimeline:
    """Milliseconds on a fake device; each part of the answer advances it by its own amount."""

    def __init__(self):
        self.now = 0.0
        self.synchronised = 0


@pytest.fixture
def timeline(monkeypatch):
    clock = FakeTimeline()

    class FakeEvent:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            self.at = clock.now

        def synchronize(self):
            clock.synchronised += 1

        def elapsed_time(self, end: FakeEvent) -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return clock


def test_cuda_clock_charges_each_part_the_time_between_its_events(timeline):
    clock = PartClock(torch.device("cuda"))
    for part, spent in (("vision", 2.5), ("selection", 1.0), ("vision", 0.5), ("prefill", 4.0)):
        timeline.now += spent
        clock.lap(part)
    assert timeline.synchronised == 0  # laps do not wait for the device
    assert clock.read() == {"vision": 3.0, "selection": 1.0, "prefill": 4.0}
    assert timeline.synchronised == 1
    assert timed_ms(torch.device("cuda"), lambda: setattr(timeline, "now", timeline.now + 6.0)) == 6.0


@pytest.fixture(scope="module")
def demo():
    return load_demo(DEMO_MODELS["demo"])


PART_MS = {"vision": 7.0, "selection": 3.0, "prefill": 11.0, "decode": 5.0}


@pytest.mark.parametrize(("selector", "greedy"), [("cls_attn", True), ("fastv", False), (None, False)])
def test_answer_latency_parts_are_bounded_by_cuda_events(demo, timeline, monkeypatch, selector, greedy):
    cuda = torch.device("cuda")
    monkeypatch.setattr(base, "PartClock", lambda device: PartClock(cuda))
    monkeypatch.setattr(answering, "PartClock", lambda device: PartClock(cuda))

    def advancing(method, part):
        def wrapper(*args, **kwargs):
            result = method(*args, **kwargs)
            timeline.now += PART_MS[part]
            return result

        return wrapper

    # the last step of each part: the tower, the selection (input-level) or the stage plan (in-LLM),
    # the decoder loop, and the reduction (greedy decoding under Greedy)
    monkeypatch.setattr(demo, "_vision", advancing(demo._vision, "vision"), raising=False)
    monkeypatch.setattr(base, "layer_plan", advancing(base.layer_plan, "selection"))
    monkeypatch.setattr(base, "select_input", advancing(base.select_input, "selection"))
    monkeypatch.setattr(demo.loop, "prefill", advancing(demo.loop.prefill, "prefill"), raising=False)
    monkeypatch.setattr(demo, "_reduce", advancing(demo._reduce, "decode"), raising=False)
    items = [demo.prepare(random_image(seed, (96, 96)), "is there a dog in the image?") for seed in (1, 2)]
    mode = {"mode": Greedy(2)} if greedy else {}
    answers = demo.answer(items, None if selector is None else get_selector(selector), None if selector is None else 40,
                          **mode)  # fmt: skip
    selections = 2 if selector == "cls_attn" else 1 if selector == "fastv" else 0  # select_input runs once per row
    expected = {"vision": 7.0, "selection": 3.0 * selections, "prefill": 11.0} | ({"decode": 5.0} if greedy else {})
    for answer in answers:
        assert answer.latency_parts == pytest.approx({part: ms / 2 for part, ms in expected.items()})
        assert answer.latency_ms == pytest.approx(sum(expected.values()) / 2)
