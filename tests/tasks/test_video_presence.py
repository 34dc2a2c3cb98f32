"""video_presence: the question reader, POPE's scoring computed by hand, object tracks in the YouTube-VIS layout
(compressed and uncompressed RLE, polygons, null frames), and per-frame retention, clip-wide retention / lost and
lost_in_window counted by hand on a tiny clip geometry (2 temporal steps of a 1 x 2 token grid)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from prune_audit.answer_modes import YES_NO, YesNo
from prune_audit.data.clip_retention import clip_area
from prune_audit.data.coco import decode_rle
from prune_audit.data.geometry import qwen_geometry
from prune_audit.data.retention import retention_by_stage
from prune_audit.data.video import ClipGeometry
from prune_audit.data.youtube_vis import VideoTracks
from prune_audit.errors import PruneAuditError
from prune_audit.tasks import get_task

W, H, STORED = 56, 28, 8  # a frame is two 28-px cells side by side
FRAME = qwen_geometry((W, H), min_pixels=28 * 28, max_pixels=W * H)
GEOMETRY = ClipGeometry(FRAME, (0, 2, 4, 6), 1.0)  # every other stored frame sampled: 2 steps of frames (0, 2), (4, 6)

QUESTIONS = [
    {"question_id": 4, "video": "walk.mp4", "question": "Is there a cat at the beginning of the video?",
     "answer": "yes", "category": "cat", "window": [0, 3]},
    {"question_id": 5, "video": "walk", "question": "Is there a cat in the video?", "answer": "yes",
     "category": "cat", "window": None, "fps": 4},
]  # fmt: skip


def box(rows: slice, cols: slice) -> np.ndarray:
    mask = np.zeros((H, W), dtype=bool)
    mask[rows, cols] = True
    return mask


# stored frames 0..7; the sampled ones: 0 (100 px, left cell), 2 (50 left + 50 right), 4 (none), 6 (20 px, right)
MASKS = {0: box(slice(0, 10), slice(0, 10)), 2: box(slice(0, 10), slice(23, 33)), 6: box(slice(0, 2), slice(40, 50))}


def rle(mask: np.ndarray, compressed: bool = True) -> dict:
    encoded = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    if compressed:
        return {"size": encoded["size"], "counts": encoded["counts"].decode()}
    flat = mask.flatten(order="F").astype(int)
    runs, value, count = [], 0, 0
    for pixel in flat:
        if pixel != value:
            runs.append(count)
            value, count = pixel, 0
        count += 1
    return {"size": [H, W], "counts": [*runs, count]}


POLYGON = [[44.0, 14.0, 54.0, 14.0, 54.0, 24.0, 44.0, 24.0]]


def tracks(**change) -> dict:
    cat = [None] * STORED
    cat[0], cat[2], cat[6] = rle(MASKS[0]), rle(MASKS[2]), rle(MASKS[6], compressed=False)
    dog = [None] * STORED
    dog[1] = POLYGON
    data = {
        "videos": [{"id": 11, "file_names": [f"walk/{i:05d}.jpg" for i in range(STORED)], "width": W, "height": H,
                    "length": STORED}],
        "annotations": [{"id": 1, "video_id": 11, "category_id": 1, "segmentations": cat},
                        {"id": 2, "video_id": 11, "category_id": 2, "segmentations": dog}],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
    }  # fmt: skip
    return {**data, **change}


def test_reader_keeps_window_fps_and_the_folder_name(tmp_path):
    path = tmp_path / "presence.json"
    path.write_text(json.dumps(QUESTIONS))
    task = get_task("video_presence")
    first, second = task.read_questions([path])
    assert (first.split, first.question_id, first.image, first.window, first.label) == (
        "video_presence", 4, "walk", (0, 3), "yes",
    )  # fmt: skip
    assert task.clip_window(second) is None and task.clip_fps(second) == 4.0 and task.clip_fps(first) == 2.0
    assert task.prompt_text(first) == (
        "Is there a cat at the beginning of the video?\nAnswer the question using a single word or phrase."
    )
    assert task.answer_mode(first) is YES_NO


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"answer": "maybe"}, "'answer' must be yes or no"),
        ({"window": [3, 1]}, "'window' must be"),
        ({"window": [0]}, "'window' must be"),
        ({"question_id": "4"}, "'question_id' must be a non-negative integer"),
        ({"category": ""}, "'category' must be a non-empty string"),
    ],
)
def test_malformed_questions_are_refused_in_one_line(tmp_path, change, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{**QUESTIONS[0], **change}]))
    with pytest.raises(PruneAuditError, match=needle) as refusal:
        get_task("video_presence").read_questions([path])
    assert "\n" not in str(refusal.value)


def test_scoring_is_popes(tmp_path):
    path = tmp_path / "presence.json"
    path.write_text(json.dumps(QUESTIONS))
    task = get_task("video_presence")
    question = task.read_questions([path])[0]
    reduced = YesNo.from_probabilities(0.3, 0.1)
    scored = task.score(question, reduced)
    assert scored.answer_text == "yes" and scored.correct and scored.confidence == pytest.approx(0.75)
    assert scored.columns["object"] == "cat" and scored.columns["logit_diff"] == pytest.approx(math.log(3))
    assert not task.score(question, YesNo.from_probabilities(0.1, 0.3)).correct


def test_tracks_decode_each_frame_as_coco_does():
    loaded = VideoTracks(tracks(), "tracks.json")
    assert loaded.video_id("walk.mp4") == loaded.video_id("walk") == 11
    cat = loaded.category_masks("walk", "cat", range(STORED))
    for frame in range(STORED):
        assert np.array_equal(cat[frame], MASKS.get(frame, np.zeros((H, W), dtype=bool)))
    official = decode_rle(mask_utils.merge(mask_utils.frPyObjects(POLYGON, H, W)))
    assert np.array_equal(loaded.category_masks("walk", "dog", [1])[0], official) and official.any()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"annotations": [{"id": 1, "video_id": 12, "category_id": 1, "segmentations": [None] * STORED}]},
         "unknown video 12"),
        ({"annotations": [{"id": 1, "video_id": 11, "category_id": 1, "segmentations": [None] * 3}]},
         "3 segmentations for a video of 8 frames"),
        ({"annotations": [{"id": 1, "video_id": 11, "category_id": 1,
                           "segmentations": [{"size": [H, W + 1], "counts": [H * (W + 1)]}] * STORED}]}, "RLE size"),
        ({"videos": [{"id": 11, "file_names": ["a.jpg"], "width": W, "height": H}]}, "one folder named after"),
    ],
)  # fmt: skip
def test_malformed_tracks_are_refused_in_one_line(change, needle):
    with pytest.raises(PruneAuditError, match=needle) as refusal:
        VideoTracks(tracks(**change), "tracks.json")
    assert "\n" not in str(refusal.value)


def test_clip_check_refuses_another_frame_count_or_size(tmp_path):
    loaded = VideoTracks(tracks(), "tracks.json")
    loaded.check_clip("walk", STORED, (W, H), tmp_path)
    with pytest.raises(PruneAuditError, match="holds 7 frames but tracks.json annotates 8"):
        loaded.check_clip("walk", 7, (W, H), tmp_path)
    with pytest.raises(PruneAuditError, match="masks would not line up"):
        loaded.check_clip("walk", STORED, (W + 2, H), tmp_path)
    with pytest.raises(PruneAuditError, match="is not in tracks.json"):
        loaded.video_id("run")


def test_per_frame_retention_and_window_losses_counted_by_hand():
    masks = VideoTracks(tracks(), "tracks.json").category_masks("walk", "cat", GEOMETRY.frames)
    area = clip_area(masks, GEOMETRY)
    # per sampled frame (0, 2, 4, 6) and cell (left, right): object pixels
    assert area.frame_area.tolist() == [[100, 0], [50, 50], [0, 0], [0, 20]]
    assert area.frame_total.tolist() == [100, 100, 0, 20]
    whole = area.object_area()  # token t * 2 + cell holds its cell's pixels in frames 2t and 2t + 1
    assert whole.area_per_token.tolist() == [150, 50, 0, 20] and whole.total_area == 220
    kept = [0, 3]  # step 0's left cell, step 1's right cell
    retained = area.frame_retention(kept)
    assert retained[:2] == [1.0, 0.5] and math.isnan(retained[2]) and retained[3] == 1.0
    assert retention_by_stage([whole], [[kept]])[0].retention == [pytest.approx(170 / 220)]
    assert area.window_retention(kept, (0, 3)) == 0.75  # frames 0 and 2: 150 of 200
    assert area.window_retention(kept, (4, 6)) == 1.0 and area.lost_in_window(kept, (4, 6)) is False
    other = [1, 2]  # step 0's right cell (frame 2's right half), step 1's left cell (nothing)
    assert area.frame_retention(other)[:2] == [0.0, 0.5]
    assert area.lost_in_window(other, (4, 6)) is True and area.lost_in_window(other, (0, 3)) is False
    assert area.lost_in_window(other, (4, 5)) is None  # frame 4 holds no pixels
    assert area.lost_in_window(other, (7, 9)) is None  # no sampled frame in the window
    assert area.lost_in_window(other, None) is False
    assert retention_by_stage([whole], [[[2]]])[0].lost == [True] and area.lost_in_window([2], None) is True
    # the window's object alone (intervene's swap region): frames 0 and 2 -> step 0; frame 6 -> step 1's right cell
    assert (
        area.window_area((0, 3)).area_per_token.tolist() == [150, 50, 0, 0]
        and area.window_area((0, 3)).total_area == 200
    )
    assert (
        area.window_area((5, 6)).area_per_token.tolist() == [0, 0, 0, 20] and area.window_area((5, 6)).total_area == 20
    )
    assert (
        area.window_area(None).area_per_token.tolist() == [150, 50, 0, 20] and area.window_area(None).total_area == 220
    )
    assert not area.window_area((4, 4)).has_mask


def test_videos_after_the_first_find_their_own_frames():
    second = {"id": 12, "file_names": [f"run/{i:05d}.jpg" for i in range(3)], "width": W, "height": H}
    data = tracks()
    data["videos"] = [*data["videos"], second]
    data["annotations"] = [*data["annotations"], {"id": 3, "video_id": 12, "category_id": 2,
                                                  "segmentations": [None, rle(MASKS[0]), None]}]  # fmt: skip
    loaded = VideoTracks(data, "tracks.json")
    masks = loaded.category_masks("run", "dog", range(3))
    assert [int(mask.sum()) for mask in masks] == [0, 100, 0]
    assert not loaded.category_masks("walk", "dog", [0])[0].any()  # the first video's frame 0 holds no dog
    with pytest.raises(PruneAuditError, match="two videos have the id 11"):
        VideoTracks({**data, "videos": [data["videos"][0], {**second, "id": 11}]}, "tracks.json")
