"""Synthetic clips: determinism, exact per-frame masks, spans and linear motion, and the clip files (frame folders,
presence and MVBench questions, YouTube-VIS tracks read back by pycocotools)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as mask_utils

from prune_audit.data.scene_clips import CLIP_FPS, generate_clip
from prune_audit.data.scenes import CATEGORIES, CATEGORY_COLOURS, generate_scene
from prune_audit.data.video import sample_clip
from prune_audit.demo.clip_files import clip_name, write_clip_files
from prune_audit.demo.clip_questions import presence_answer, window_frames
from prune_audit.demo.clip_train import demo_clip_sampling


def test_same_seed_and_index_give_identical_clips_and_streams_differ():
    first, again = generate_clip(3, 5, split="train"), generate_clip(3, 5, split="train")
    assert np.array_equal(first.frames, again.frames) and first.categories == again.categories
    for a, b in zip(first.objects, again.objects, strict=True):
        assert np.array_equal(a.masks, b.masks) and a.span == b.span
    for other in (generate_clip(3, 6, split="train"), generate_clip(4, 5, split="train"), generate_clip(3, 5)):
        assert not np.array_equal(first.frames, other.frames)
    assert not np.array_equal(generate_clip(3, 5).frames[0], generate_scene(3, 5).image)


def test_clip_shape_and_objects():
    clip = generate_clip(1, 0, image_size=80, frames=12)
    assert clip.frames.shape == (12, 80, 80, 3) and clip.frames.dtype == np.uint8 and clip.fps == CLIP_FPS
    for index in range(30):
        clip = generate_clip(1, index)
        assert 1 <= len(clip.objects) <= 4 and len(set(clip.categories)) == len(clip.categories)
        assert all(obj.masks.shape == (8, 96, 96) for obj in clip.objects)


@pytest.mark.parametrize("index", range(12))
def test_masks_are_disjoint_exact_and_empty_outside_the_span(index):
    clip = generate_clip(2, index, split="train")
    covered = np.zeros(clip.frames.shape[:3], dtype=int)
    for obj in clip.objects:
        first, last = obj.span
        assert not obj.masks[:first].any() and not obj.masks[last + 1 :].any()
        assert set(obj.visible_frames) <= set(range(first, last + 1))
        covered += obj.masks
        colour = np.array(CATEGORY_COLOURS[obj.category], dtype=float)
        for f in obj.visible_frames:  # painted in the class colour (brightness jitter 0.88-1.08, noise sd 8)
            pixels = clip.frames[f][obj.masks[f]].astype(float)
            ratio = pixels.mean(axis=0) / np.maximum(colour, 1.0)
            assert np.all(np.abs(pixels.mean(axis=0) - colour * np.clip(ratio, 0.88, 1.08)) < 12)
    assert covered.max() <= 1  # visible parts never overlap: later objects occlude earlier ones


def test_objects_move_linearly_and_appear_and_disappear():
    spans, checked = set(), 0
    for index in range(60):
        clip = generate_clip(4, index, split="train")
        for obj in clip.objects:
            first, last = obj.span
            spans.add((first > 0, last < 7))
            areas = obj.masks.sum(axis=(1, 2))[first : last + 1]
            if last - first < 2 or areas.min() < 0.95 * areas.max():  # occluded in some frame: centroids shift
                continue
            pixels = [np.nonzero(obj.masks[f]) for f in range(first, last + 1)]
            means = np.array([[xs.mean(), ys.mean()] for ys, xs in pixels])
            progress = np.arange(last - first + 1) / (last - first)
            expected = means[0] + progress[:, None] * (np.array(obj.end) - np.array(obj.start))
            assert np.abs(means - expected).max() < 1.5  # the shape's centroid moves start -> end at constant speed
            checked += obj.start != obj.end
    assert spans == {(False, False), (True, False), (False, True), (True, True)} and checked > 10


def test_invalid_clip_arguments_are_refused():
    with pytest.raises(ValueError, match="split"):
        generate_clip(0, 0, split="test")
    with pytest.raises(ValueError, match="at least 4 frames"):
        generate_clip(0, 0, frames=2)


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    return write_clip_files(tmp_path_factory.mktemp("clips"), seed=5, clips=12)


def test_frame_folders_hold_the_clips_frames_losslessly(clip_files):
    for index in range(12):
        clip = generate_clip(5, index)
        folder = clip_files.videos / clip_name(5, index + 1)
        stored = [np.asarray(Image.open(path)) for path in sorted(folder.iterdir())]
        assert [p.name for p in sorted(folder.iterdir())][:2] == ["frame_0000.png", "frame_0001.png"]
        assert np.array_equal(np.stack(stored), clip.frames)
    read = sample_clip(folder, CLIP_FPS, patch_size=8, merge_size=2, **demo_clip_sampling(96, 8))
    assert read.geometry.frames == tuple(range(8)) and read.frames[0].size == (96, 96)


def test_track_annotations_read_back_equal_the_masks(clip_files):
    tracks = json.loads(clip_files.tracks.read_text())
    assert [c["name"] for c in tracks["categories"]] == list(CATEGORIES)
    assert len(tracks["videos"]) == 12
    for video in tracks["videos"]:
        clip = generate_clip(5, video["id"] - 1)
        assert (video["width"], video["height"], video["length"]) == (96, 96, 8)
        assert video["file_names"][3] == f"{clip_name(5, video['id'])}/frame_0003.png"
        mine = [a for a in tracks["annotations"] if a["video_id"] == video["id"]]
        assert [CATEGORIES[a["category_id"] - 1] for a in mine] == list(clip.categories)
        for annotation, obj in zip(mine, clip.objects, strict=True):
            for f, (rle, area, bbox) in enumerate(
                zip(annotation["segmentations"], annotation["areas"], annotation["bboxes"], strict=True)
            ):
                if rle is None:
                    assert not obj.masks[f].any() and area is None and bbox is None
                    continue
                decoded = mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode()}).astype(bool)
                assert np.array_equal(decoded, obj.masks[f]) and area == obj.masks[f].sum()
                ys, xs = np.nonzero(obj.masks[f])
                assert bbox == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]


def test_question_files_answer_from_the_masks_and_are_deterministic(clip_files, tmp_path):
    presence = json.loads(clip_files.presence.read_text())
    assert sum(q["answer"] == "yes" for q in presence) * 2 == len(presence) > 0
    assert len({q["question_id"] for q in presence}) == len(presence)
    for entry in presence:
        index = int(entry["video"].split("_")[1]) - 1
        clip = generate_clip(5, index)
        window = {None: "video", (0, 1): "beginning", (6, 7): "end"}[
            None if entry["window"] is None else tuple(entry["window"])
        ]
        assert window_frames(window, 8) == (None if entry["window"] is None else tuple(entry["window"]))
        assert presence_answer(clip, entry["category"], window) == entry["answer"] and entry["fps"] == CLIP_FPS
        assert entry["category"] in entry["question"] and entry["question_id"] // 10 == index + 1
    for entry in json.loads(clip_files.mvbench.read_text()):
        assert set(entry) == {"video", "question", "candidates", "answer", "fps"}
        assert entry["answer"] in entry["candidates"] and len(set(entry["candidates"])) == 4
    again = write_clip_files(tmp_path / "again", seed=5, clips=12)
    for name in ("presence", "mvbench", "tracks"):
        assert getattr(again, name).read_text() == getattr(clip_files, name).read_text()
