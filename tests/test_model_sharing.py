"""Issue 47, item 1: one loaded model shared by threads, and hooks that never outlive their call.

Two threads on one model must give each the answers it gets alone. The interleaving is forced, not left
to chance: the first thread is paused at its first forward through a chosen module (a vision block, or the
first decoder layer) while the second thread answers whole, then resumes. Interrupts are injected at every
line the Qwen adapter and its hook helper run (a trace function raising ``KeyboardInterrupt`` at the k-th
line, for every k), and after each no hook is left on any module.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit import load, pruned
from prune_audit.models import qwen
from prune_audit.models.families import adapter_for

DEADLOCK_GUARD_S = 300  # a broken interleaving fails instead of hanging the suite; never reached when it works
MODELS = Path(qwen.__file__).parent
TRACED = {str(MODELS / "qwen.py"), str(MODELS / "hooks.py")}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    """Tiny Qwen2.5-VL (HiPrune reads hooks on its vision blocks), Qwen3-VL (deepstack state per prefill) and LLaVA
    (no per-call state on the model)."""
    root = tmp_path_factory.mktemp("sharing")
    return {
        family: load(str(adapter_for(family, "test").build_tiny(root / family, words=WORDS, seed=1)), device="cpu")
        for family in ("qwen2_5_vl", "qwen3_vl", "llava")
    }


def images(seeds: range) -> list:
    return [random_image(seed, (112, 112)) for seed in seeds]


def answers(vlm, selector: str, budget: int | None, seeds: range) -> list[tuple[Any, float]]:
    """(kept stages, p_yes) of each image of ``seeds`` under ``selector``, in batches of 3."""
    with pruned(vlm, selector, budget) as model:
        results = model.answer(images(seeds), [QUESTIONS[0]] * len(seeds), batch_size=3)
    return [(result.kept_stages, result.p_yes) for result in results]


def interleaved(first: Callable[[], Any], second: Callable[[], Any], pause_at) -> tuple[Any, Any]:
    """``first`` in one thread, paused at its first forward through module ``pause_at`` while ``second`` runs
    whole in another thread; both results (a thread's exception is raised here)."""
    inside, done = threading.Event(), threading.Event()
    owner: list[int] = []

    def pause(module, args) -> None:
        if threading.get_ident() == owner[0] and not inside.is_set():
            inside.set()
            assert done.wait(DEADLOCK_GUARD_S), "the second thread never finished"

    def run_first() -> Any:
        owner.append(threading.get_ident())
        return first()

    def run_second() -> Any:
        assert inside.wait(DEADLOCK_GUARD_S), "the first thread never reached the pause"
        try:
            return second()
        finally:
            done.set()

    handle = pause_at.register_forward_pre_hook(pause)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(run_first), pool.submit(run_second)]
            return futures[0].result(), futures[1].result()
    finally:
        handle.remove()


def hooks_left(vlm) -> list[str]:
    """Names of the modules of ``vlm`` still holding a forward hook or pre-hook."""
    return [name for name, module in vlm.model.named_modules() if module._forward_pre_hooks or module._forward_hooks]


@pytest.mark.parametrize(
    ("family", "first", "second", "pause"),
    [
        ("qwen2_5_vl", ("hiprune", 4), ("none", None), "vision"),
        ("qwen2_5_vl", ("hiprune", 4), ("hiprune", 6), "vision"),
        ("qwen2_5_vl", ("divprune", 4), ("vscan", 4), "vision"),
        ("qwen2_5_vl", ("vscan", 4), ("divprune", 4), "vision"),
        ("qwen3_vl", ("none", None), ("none", None), "decoder"),
        ("qwen3_vl", ("divprune", 4), ("none", None), "decoder"),
        ("llava", ("fastv", 48), ("none", None), "decoder"),
    ],
)
def test_two_threads_on_one_model_answer_as_each_alone(models, family, first, second, pause):
    vlm = models[family]
    first_seeds, second_seeds = range(0, 5), range(10, 14)
    alone = answers(vlm, *first, first_seeds), answers(vlm, *second, second_seeds)
    module = vlm.model.model.visual.blocks[0] if pause == "vision" else vlm.model.model.language_model.layers[0]
    together = interleaved(
        lambda: answers(vlm, *first, first_seeds), lambda: answers(vlm, *second, second_seeds), module
    )
    assert together == alone
    assert hooks_left(vlm) == []


class InterruptAt:
    """A trace function raising ``KeyboardInterrupt`` at the ``k``-th line run in the ``TRACED`` files (``k`` None:
    only counts them in ``lines``)."""

    def __init__(self, k: int | None) -> None:
        self.k, self.lines = k, 0

    def __call__(self, frame, event, arg):
        if event == "call":
            return self.local if frame.f_code.co_filename in TRACED else None
        return None

    def local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.k:
                raise KeyboardInterrupt(f"injected at line {frame.f_lineno} of {frame.f_code.co_filename}")
        return self.local


def traced(trace: InterruptAt, call: Callable[[], Any]) -> Any:
    sys.settrace(trace)
    try:
        return call()
    finally:
        sys.settrace(None)


def cleanup_lines() -> range:
    """Lines of ``capture_inputs``'s own cleanup (its ``finally`` block and ``_remove``), in models/hooks.py."""
    source = (MODELS / "hooks.py").read_text().splitlines()
    start = next(number for number, line in enumerate(source, 1) if line.strip() == "finally:")
    return range(start, len(source) + 1)


def test_an_interrupt_at_any_line_leaves_no_hook_and_no_stale_capture(models):
    vlm = models["qwen2_5_vl"]
    ask = lambda: answers(vlm, "hiprune", 4, range(2))  # noqa: E731
    reference = ask()
    counting = InterruptAt(None)
    assert traced(counting, ask) == reference
    assert counting.lines > 20  # the trace sees the adapter's vision path
    cleanup = cleanup_lines()
    for k in range(1, counting.lines + 1):
        with pytest.raises(KeyboardInterrupt) as caught:
            traced(InterruptAt(k), ask)
        where = str(caught.value)
        del caught  # the traceback holds the interrupted frames
        if hooks_left(vlm):  # only an interrupt inside the removal itself; the hooks left remove themselves
            assert "hooks.py" in where and int(where.split()[3]) in cleanup, where
            assert ask() == reference
        assert hooks_left(vlm) == [], f"hooks left after {where}"
    assert ask() == reference  # nothing an interrupted call captured feeds a later one
