"""Object-area retention: single and batched, masks cached once per (image, category)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prune_audit.data.geometry import clip_geometry, qwen_geometry
from prune_audit.data.retention import ObjectAreaCache, object_area, retention, retention_batch
from prune_audit.errors import PruneAuditError


def test_retention_of_a_kept_set():
    area = np.array([0, 5, 0, 3, 2], dtype=np.int64)
    assert retention(area, 10, [1, 2]) == (0.5, 1, False)
    assert retention(area, 12, [0, 1, 3, 4]) == (10 / 12, 3, False)  # 2 px outside every token
    assert retention(area, 10, [0, 2]) == (0.0, 0, True)
    assert retention(area, 10, [1, 1, 1]) == (0.5, 1, False)  # repeats count once
    value, tokens, lost = retention(np.zeros(5, np.int64), 0, [1])
    assert math.isnan(value) and tokens == -1 and lost is None
    with pytest.raises(PruneAuditError, match="out of range"):
        retention(area, 10, [5])


def test_object_area_reports_the_visible_fraction_of_a_cropped_mask():
    geometry = clip_geometry((640, 480), mode="hf_crop")  # sees x in [80, 560)
    mask = np.zeros((480, 640), bool)
    mask[100:120, 40:120] = True  # 40 of 80 columns are cropped away
    area = object_area(mask, geometry)
    assert area.total_area == 1600 and area.area_per_token.sum() == 800
    assert area.visible_fraction == 0.5 and area.has_mask
    assert math.isnan(object_area(np.zeros((480, 640), bool), geometry).visible_fraction)


def test_batch_equals_the_single_version_on_ragged_grids():
    rng = np.random.default_rng(0)
    areas, totals, kept, expected = [], [], [], []
    for q in range(40):
        n = int(rng.integers(5, 30))
        area = rng.integers(0, 4, n) * (rng.random(n) < 0.4)
        total = int(area.sum() + rng.integers(0, 3)) if q % 7 else 0
        keep = rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False)
        areas.append(area), totals.append(total), kept.append(keep)
        expected.append(retention(area, total, keep))
    batch = retention_batch(areas, totals, kept)
    for q, (value, tokens, lost) in enumerate(expected):
        if lost is None:
            assert math.isnan(batch.retention[q]) and batch.object_tokens_kept[q] == -1
            assert not batch.has_mask[q] and not batch.lost[q]
        else:
            assert batch.retention[q] == pytest.approx(value) and batch.object_tokens_kept[q] == tokens
            assert batch.lost[q] == lost and batch.has_mask[q]


def test_batch_checks_every_kept_index_against_its_own_grid():
    with pytest.raises(PruneAuditError, match="out of range"):
        retention_batch([np.ones(3, np.int64), np.ones(10, np.int64)], [3, 10], [[5], [5]])
    with pytest.raises(PruneAuditError, match="one kept set"):
        retention_batch([np.ones(3, np.int64)], [3], [[0], [1]])


def test_cache_decodes_each_image_category_once(shared_data):
    from prune_audit.data.coco import CocoInstances

    coco = CocoInstances.load(shared_data / "coco" / "tiny_coco_val2017" / "instances_val2017.json")
    calls = []
    original = coco.category_mask
    coco.category_mask = lambda image_id, name: calls.append((image_id, name)) or original(image_id, name)
    cache = ObjectAreaCache(coco, lambda size: qwen_geometry(size))
    first = cache.get(397133, "person")
    assert cache.get(397133, "person") is first and calls == [(397133, "person")]
    assert first.area_per_token.shape == (345,) and first.total_area == 18463
    assert not cache.get(397133, "giraffe").has_mask and len(cache) == 2


def test_retention_by_stage_equals_the_single_version_at_every_stage():
    from prune_audit.data.retention import ObjectArea, retention_by_stage

    rng = np.random.default_rng(4)
    areas, stages = [], []
    for size in (9, 16, 12):
        area = rng.integers(0, 3, size) * rng.integers(0, 2, size)
        areas.append(ObjectArea(area, int(area.sum()) + 5, 0.9))
        first = rng.choice(size, 6, replace=False)
        stages.append([first, first[:3], first[:0]])
    areas.append(None)  # a "no" question
    stages.append([[0, 1]])
    results = retention_by_stage(areas, stages)
    for area, kept_stages, result in zip(areas[:-1], stages[:-1], results):
        expected = [retention(area.area_per_token, area.total_area, kept) for kept in kept_stages]
        assert result.retention == pytest.approx([e[0] for e in expected])
        assert result.object_tokens_kept == [e[1] for e in expected] and result.lost == [e[2] for e in expected]
        assert result.lost[-1] is True  # an empty stage loses every object
    assert np.isnan(results[-1].retention).all() and results[-1].lost == [None]


def test_retention_over_several_token_grids_is_the_mean_of_their_kept_shares():
    """LLaVA-NeXT's base view and tiles both see the object: keeping every token retains the visible fraction
    (1, not 2), keeping one grid half of it."""
    from prune_audit.data.multigrid import anyres_geometry

    geometry = anyres_geometry((130, 100), pinpoints=[[56, 112], [112, 56], [112, 112]], tile=56)
    mask = np.zeros((100, 130), dtype=bool)
    mask[20:60, 30:90] = True
    area = object_area(mask, geometry)
    base = geometry.grids[0].num_tokens
    assert (area.grids, area.counted_area, area.visible_fraction) == (2, 2 * 40 * 60, 1.0)
    assert retention(area.area_per_token, area.counted_area, range(geometry.num_tokens))[0] == 1.0
    assert retention(area.area_per_token, area.counted_area, range(base))[0] == 0.5
