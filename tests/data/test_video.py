"""Video clips as Qwen2.5-VL reads them (``data.video``): frame counts by hand for several clip rates and durations,
the sampled frames, the frame pixel limit, reading a folder of frames, and the token geometry's round trips."""

from __future__ import annotations

import pytest
from PIL import Image

from prune_audit.data.video import (
    VIDEO_MAX_PIXELS,
    VIDEO_TOTAL_PIXELS,
    ClipGeometry,
    frame_pixel_limit,
    read_frames,
    sample_clip,
    sampled_frame_count,
    sampled_frame_indices,
)
from prune_audit.errors import PruneAuditError


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "expected"),
    [
        (30, 30.0, 2.0, 4),  # 1 s: 2 frames at 2 fps, raised to the 4-frame minimum
        (300, 30.0, 2.0, 20),  # 10 s: 20 frames
        (25, 10.0, 2.0, 4),  # 2.5 s: 5 frames, floored to a multiple of 2
        (7, 1.0, 2.0, 6),  # 7 s: 14 frames, capped by max_frames = floor(min(768, 7) / 2) * 2 = 6
        (3, 30.0, 2.0, 2),  # 3 frames: the minimum 4 exceeds them; max_frames 2
        (60, 30.0, 1.0, 4),  # 2 s at 1 fps: 2, raised to 4
        (2000, 1.0, 2.0, 768),  # 2000 s: 4000 frames, capped at 768
        (301, 29.97, 2.0, 20),  # 10.04 s: 20.09 frames, floored to 20
    ],
)
def test_sampled_frame_count_by_hand(total, video_fps, fps, expected):
    assert sampled_frame_count(total, video_fps, fps=fps) == expected


def test_too_few_frames_are_refused_in_one_line():
    with pytest.raises(PruneAuditError, match="at least 2"):
        sampled_frame_count(1, 30.0)
    with pytest.raises(PruneAuditError, match="positive"):
        sampled_frame_count(10, 0.0)


def test_sampled_frames_are_the_rounded_linspace():
    assert sampled_frame_indices(30, 4) == [0, 10, 19, 29]  # 0, 9.67, 19.33, 29
    assert sampled_frame_indices(7, 6) == [0, 1, 2, 4, 5, 6]  # 0, 1.2, 2.4, 3.6, 4.8, 6
    assert sampled_frame_indices(5, 2) == [0, 4]
    assert sampled_frame_indices(4, 4) == [0, 1, 2, 3]


def test_frame_pixel_limit_shares_the_clip_budget():
    assert frame_pixel_limit(4) == VIDEO_MAX_PIXELS  # the per-frame cap binds for short clips
    assert frame_pixel_limit(768) == int(VIDEO_TOTAL_PIXELS / 768 * 2)  # 235,200: the clip budget shared out
    assert frame_pixel_limit(768, total_pixels=1000) == int(128 * 28 * 28 * 1.05)  # never under 1.05 x the minimum


def frames_of(count: int, size=(130, 100)) -> list[Image.Image]:
    return [Image.new("RGB", size, (10 * i % 256, 50, 200)) for i in range(count)]


def test_sample_clip_resizes_every_frame_by_the_video_limits():
    clip = sample_clip(frames_of(30), 30.0)  # 1 s -> 4 frames; 130x100 is below VIDEO_MIN_PIXELS: scaled up
    assert clip.geometry.frames == (0, 10, 19, 29)
    assert clip.geometry.sample_fps == pytest.approx(4.0)
    assert clip.seconds_per_step == pytest.approx(0.5)
    frame = clip.geometry.frame
    assert (frame.processed_width, frame.processed_height) == (364, 280)  # ceil to 28 px at >= 100,352 px
    assert frame.processed_width * frame.processed_height >= 128 * 28 * 28
    assert {image.size for image in clip.frames} == {(364, 280)}
    assert clip.geometry.video_grid == (2, 10, 13)
    assert clip.geometry.num_tokens == 260


def test_frames_of_different_sizes_are_refused():
    with pytest.raises(PruneAuditError, match="one size"):
        sample_clip(frames_of(3) + frames_of(1, (64, 64)), 2.0)


def test_a_folder_of_frames_is_read_in_name_order(tmp_path):
    for name, colour in [("b.png", 2), ("a.jpg", 1), ("c.PNG", 3)]:
        Image.new("RGB", (40, 30), (colour * 60, 0, 0)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a frame")
    frames = read_frames(tmp_path)
    assert [frame.getpixel((5, 5))[0] // 60 for frame in frames] == [1, 2, 3]
    clip = sample_clip(tmp_path, 1.0)  # 3 s at 1 fps: 6 frames wanted, capped at 2 of 3
    assert clip.geometry.frames == (0, 2)


def test_a_folder_without_frames_is_refused(tmp_path):
    with pytest.raises(PruneAuditError, match="no PNG or JPEG"):
        read_frames(tmp_path)
    with pytest.raises(PruneAuditError, match="not a folder"):
        read_frames(tmp_path / "missing")


def test_token_geometry_round_trips():
    geometry = sample_clip(frames_of(12, (300, 200)), 2.0).geometry  # 6 s at 2 fps: 12 frames, 6 steps
    steps, rows, cols = geometry.video_grid
    assert steps == 6
    for index in range(geometry.num_tokens):
        step, row, col = geometry.token_position(index)
        assert geometry.token_index(step, row, col) == index
        assert geometry.token_frames(index) == (2 * step, 2 * step + 1)
    # one step's boxes tile the original frame exactly
    area = 0.0
    for index in range(rows * cols):
        x0, y0, x1, y1 = geometry.token_box(index)
        area += (x1 - x0) * (y1 - y0)
    assert area == pytest.approx(300 * 200)
    assert geometry.token_box(rows * cols - 1)[2:] == pytest.approx((300, 200))
    assert geometry.token_box(rows * cols) == geometry.token_box(0)  # the next step: the same cell
    with pytest.raises(ValueError, match="outside"):
        geometry.token_position(geometry.num_tokens)
    with pytest.raises(ValueError, match="outside"):
        geometry.token_index(steps, 0, 0)


def test_a_family_reading_each_frame_as_an_image_has_one_frame_a_step():
    two_a_step = sample_clip(frames_of(12, (300, 200)), 2.0).geometry
    one_a_step = ClipGeometry(two_a_step.frame, two_a_step.frames, two_a_step.sample_fps, frames_per_step=1)
    cells = two_a_step.frame.num_tokens
    assert one_a_step.video_grid == (12, *two_a_step.frame.grid)
    assert one_a_step.token_frames(5 * cells + 3) == (5,)
    assert one_a_step.frame_cells(5, [5 * cells + 3, 4 * cells + 1]) == [3]
    assert ClipGeometry.from_dict(one_a_step.to_dict()) == one_a_step
    written_before = {key: value for key, value in two_a_step.to_dict().items() if key != "frames_per_step"}
    assert ClipGeometry.from_dict(written_before) == two_a_step  # records before the field: two frames a step
