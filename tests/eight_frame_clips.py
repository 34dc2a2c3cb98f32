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


def assert_keep_all_is_dense(vlm: Any, item: Any, selector: Any) -> None:
    """``selector`` keeping every token of ``item`` gives the stock forward's last logits (1e-5)."""
    import torch
    from tiny_models import stock_inputs

    full, _ = vlm.prefill([item], selector, item.num_visual)
    with torch.no_grad():
        stock = vlm.model(**stock_inputs(vlm, item)).logits[:, -1]
    assert (full.logits - stock).abs().max() <= 1e-5


def assert_merging_and_still_images_refused(vlm: Any, item: Any, name: str) -> None:
    """Video selector ``name`` merging on a Qwen clip (merged tokens have no 3-D position) and, with
    ``merge=false``, on a still image is refused in one line."""
    import pytest

    from prune_audit.errors import PruneAuditError
    from prune_audit.pruners import get_selector

    with pytest.raises(PruneAuditError, match="original position") as refusal:
        vlm.prefill([item], get_selector(name), 16)
    assert "\n" not in str(refusal.value)
    image = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    with pytest.raises(PruneAuditError, match="still image"):
        vlm.prefill([image], get_selector(name, merge=False), 10)
