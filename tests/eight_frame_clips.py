"""The tiny Qwen2.5-VL and the eight-frame clip the video selectors' model tests share (a 4 x 4 x 5 token grid of
130 x 100 frames), and a spy on what a selector is given."""

from __future__ import annotations

from typing import Any

from tiny_models import QUESTIONS, WORDS, random_image

SMALL = {"min_pixels": 4 * 28 * 28, "total_pixels": 8 * 168 * 168}  # 8 frames of 130 x 100: a 4 x 4 x 5 token grid


def tiny_video_vlm(tmp_path_factory, text_layers: int = 3, seed: int = 6) -> Any:
    """A tiny random Qwen2.5-VL (168-px images, ``text_layers`` decoder layers) loaded on the CPU."""
    from prune_audit.models import load_vlm
    from prune_audit.models.qwen import QwenModel

    path = QwenModel.build_tiny(
        tmp_path_factory.mktemp("qwen") / "qwen", words=WORDS, image_size=168, text_layers=text_layers, seed=seed
    )
    return load_vlm(path, device="cpu")


def eight_frame_item(vlm: Any, repeat: int = 1) -> Any:
    """The prepared question on an eight-frame clip at 2 fps (4 s); ``repeat``: each random frame shown that many
    times in a row (4: frames repeating in pairs of steps, so tokens are static across windows of two steps)."""
    from prune_audit.data.video import sample_clip

    images = [random_image(seed // repeat, (130, 100)) for seed in range(8)]
    return vlm.prepare_video(sample_clip(images, 2.0, **SMALL), QUESTIONS[0])


def spied(selector: Any) -> tuple[Any, list]:
    """``selector`` whose ``select`` records the signals it is given, and that record."""
    calls: list = []
    select = selector.select

    def recording(signals, budget, generator=None):
        calls.append(signals)
        return select(signals, budget, generator)

    object.__setattr__(selector, "select", recording)
    return selector, calls
