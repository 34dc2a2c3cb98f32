"""COCO instances: mask decoding against pycocotools, hand-made files for every segmentation kind."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from prune_audit.data.coco import CocoInstances, image_id_from_file_name
from prune_audit.errors import PruneAuditError

HEIGHT, WIDTH = 20, 30


def _crowd_mask() -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[12:18, 20:27] = 1
    mask[0:2, 0:3] = 1
    return mask


def _uncompressed_rle(mask: np.ndarray) -> dict:
    """COCO ground-truth style RLE: column-major run lengths starting with a run of zeros."""
    flat = mask.flatten(order="F")
    changes = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate([[0], changes, [flat.size]])).tolist()
    if flat[0] == 1:
        runs = [0] + runs
    return {"size": [HEIGHT, WIDTH], "counts": runs}


def _instances(**overrides) -> dict:
    crowd = _crowd_mask()
    compressed = mask_utils.encode(np.asfortranarray(crowd))
    data = {
        "images": [
            {"id": 7, "file_name": "COCO_val2014_000000000007.jpg", "width": WIDTH, "height": HEIGHT},
            {"id": 9, "file_name": "000000000009.jpg", "width": WIDTH, "height": HEIGHT},
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 3, "name": "car"}, {"id": 5, "name": "dining table"}],
        "annotations": [
            {"id": 100, "image_id": 7, "category_id": 3, "iscrowd": 0, "segmentation": [[2, 3, 8, 3, 8, 9, 2, 9]]},
            {
                "id": 101,
                "image_id": 7,
                "category_id": 1,
                "iscrowd": 0,
                "segmentation": [[10, 1, 14, 1, 14, 5, 10, 5], [16, 1, 19, 1, 19, 4, 16, 4]],
            },
            {"id": 102, "image_id": 7, "category_id": 1, "iscrowd": 1, "segmentation": _uncompressed_rle(crowd)},
            {
                "id": 103,
                "image_id": 7,
                "category_id": 5,
                "iscrowd": 0,
                "segmentation": {"size": [HEIGHT, WIDTH], "counts": compressed["counts"].decode()},
            },
        ],
    }
    data.update(overrides)
    return data


def _write(tmp_path, data, name="instances.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture()
def hand_made(tmp_path):
    return CocoInstances.load(_write(tmp_path, _instances()))


def test_polygon_masks(hand_made):
    car = hand_made.category_mask(7, "car")
    assert car.shape == (HEIGHT, WIDTH) and car.dtype == bool
    assert car.sum() == 36 and car[3:9, 2:8].all()


def test_multi_part_polygon_and_crowd_rle_make_one_union(hand_made):
    person = hand_made.category_mask(7, "person")
    parts = [hand_made.annotation_mask(ann) for ann in hand_made.annotations_by_image[7][1:3]]
    assert parts[0][1:5, 10:14].all() and parts[0][1:4, 16:19].all() and not parts[0][:, 15].any()
    np.testing.assert_array_equal(parts[1], _crowd_mask().astype(bool))
    np.testing.assert_array_equal(person, parts[0] | parts[1])
    assert person.sum() == parts[0].sum() + parts[1].sum()  # disjoint parts


def test_compressed_rle_decodes_to_the_encoded_mask(hand_made):
    np.testing.assert_array_equal(hand_made.category_mask(7, "dining table"), _crowd_mask().astype(bool))


def test_image_without_annotations_and_absent_category(hand_made):
    assert hand_made.object_names(9) == []
    assert not hand_made.category_mask(9, "car").any()
    assert not hand_made.has_instances(9, "car") and hand_made.has_instances(7, "car")
    assert hand_made.object_names(7) == ["car", "person", "dining table"]


def test_unknown_category_is_an_error(hand_made):
    with pytest.raises(PruneAuditError, match="unknown COCO category 'unicorn'"):
        hand_made.category_mask(7, "unicorn")


def test_image_lookup_by_2014_and_2017_names(hand_made):
    assert hand_made.image_id("COCO_val2014_000000000007.jpg") == 7
    assert hand_made.image_id("val2017/000000000007.jpg") == 7
    assert hand_made.image_id("COCO_val2014_000000000009.jpg") == 9
    assert image_id_from_file_name("COCO_val2014_000000310196.jpg") == 310196
    with pytest.raises(PruneAuditError, match="not in"):
        hand_made.image_id("COCO_val2014_000000000008.jpg")


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "images": [],\n  "annotations": [,]\n}\n')
    with pytest.raises(PruneAuditError, match=r"broken\.json:3:\d+: invalid JSON"):
        CocoInstances.load(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["annotations"][0].update(image_id=42), "unknown image 42"),
        (lambda d: d["annotations"][0].update(category_id=99), "unknown category 99"),
        (lambda d: d.pop("categories"), "lacks categories"),
        (lambda d: d["annotations"][0].pop("segmentation"), "annotation 100 lacks segmentation"),
    ],
)
def test_inconsistent_files_are_refused(tmp_path, change, message):
    data = _instances()
    change(data)
    with pytest.raises(PruneAuditError, match=message):
        CocoInstances.load(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("segmentation", "message"),
    [
        ([[1, 1, 5, 1, 5]], "polygon of 5 coordinates"),
        ([], "empty"),
        ([[1, 1, 5, 1, 5, float("nan")]], "non-finite"),
        ([[1, 1, 5e12, 1, 5, 5]], "far outside"),
        ([[1, 1, "5", 1, 5, 5]], "non-numeric"),
        ({"size": [HEIGHT + 1, WIDTH], "counts": [0, 5]}, "RLE size"),
        ({"size": [HEIGHT, WIDTH], "counts": [0, 5]}, "summing to 5"),
        ({"size": [HEIGHT, WIDTH], "counts": [-1, HEIGHT * WIDTH + 1]}, "non-negative"),
        ("polygon", "neither polygons nor RLE"),
    ],
)
def test_bad_segmentations_are_refused_at_load(tmp_path, segmentation, message):
    """Refused when the file is read (before any run directory exists), never handed to pycocotools."""
    data = _instances()
    data["annotations"][0]["segmentation"] = segmentation
    with pytest.raises(PruneAuditError, match=message):
        CocoInstances.load(_write(tmp_path, data))


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # inside pycocotools' annToMask
def test_every_tiny_coco_mask_equals_pycocotools(shared_data):
    from pycocotools.coco import COCO

    path = shared_data / "coco" / "tiny_coco_val2017" / "instances_val2017.json"
    reference = COCO(str(path))
    coco = CocoInstances.load(path)
    annotations = [ann for anns in coco.annotations_by_image.values() for ann in anns]
    assert len(annotations) == 382 and sum(ann["iscrowd"] for ann in annotations) == 5
    for ann in annotations:
        mask = coco.annotation_mask(ann)
        expected = reference.annToMask(reference.anns[ann["id"]])
        assert mask.sum() == expected.sum(), ann["id"]
        np.testing.assert_array_equal(mask, expected.astype(bool))
    assert sum(not coco.annotations_by_image[image_id] for image_id in coco.images) == 2
