"""Token geometry: formulas, golden values of evaluation spec D5, and the real transformers processors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from prune_audit.data.geometry import (
    TokenGeometry,
    clip_geometry,
    geometry_from_processor,
    mask_area_per_token,
    qwen_geometry,
    smart_resize,
    token_footprints,
    token_index_map,
)
from prune_audit.errors import PruneAuditError

SIZES = [(640, 427), (352, 230), (427, 640), (333, 501), (640, 640)]
PAD_COLOUR = (122, 116, 104)  # int(255 * CLIP mean)
IMAGE_BLUE = 250  # blue channel of every original pixel in the token-id image


def test_llava_pad_leaves_three_padding_rows_each_side_of_640x480():
    geometry = clip_geometry((640, 480), mode="llava_pad")
    tokens = np.unique(token_index_map(geometry))
    rows_with_image = np.unique(tokens // 24)
    assert geometry.num_tokens == 576
    assert rows_with_image.tolist() == list(range(3, 21))
    boxes = token_footprints(geometry)
    np.testing.assert_allclose(boxes[0], [0, -80, 640 / 24, 640 / 24 - 80])


def test_hf_crop_of_640x480_sees_x_80_to_560_in_20_pixel_tokens():
    geometry = clip_geometry((640, 480), mode="hf_crop")
    boxes = token_footprints(geometry)
    np.testing.assert_allclose(boxes[0], [80, 0, 100, 20])
    np.testing.assert_allclose(boxes[-1], [540, 460, 560, 480])
    index = token_index_map(geometry)
    assert (index[:, :80] == -1).all() and (index[:, 560:] == -1).all()
    assert (index[:, 80:560] >= 0).all()


@pytest.mark.parametrize(
    ("size", "tokens"),
    [((640, 480), 391), ((640, 427), 345), ((500, 375), 234), ((352, 230), 104), ((640, 640), 529)],
)
def test_qwen_token_counts_match_the_spec(size, tokens):
    assert qwen_geometry(size).num_tokens == tokens


def test_smart_resize_scales_into_the_pixel_limits():
    assert smart_resize(20, 30, 28, 3136, 12845056) == (56, 84)  # too small: scaled up with ceil
    height, width = smart_resize(480, 640, 28, 3136, 100000)
    assert (height, width) == (252, 364) and height * width <= 100000
    assert smart_resize(14 * 28 + 14, 28, 28, 1, 10**9) == (392, 28)  # 14.5 rounds half to even
    with pytest.raises(PruneAuditError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 3136, 12845056)


@pytest.mark.parametrize("mode", ["llava_pad", "hf_crop", "qwen_smart_resize"])
@pytest.mark.parametrize("size", SIZES)
def test_each_pixel_centre_lies_in_its_tokens_footprint(mode, size):
    geometry = qwen_geometry(size) if mode == "qwen_smart_resize" else clip_geometry(size, mode=mode)
    index = token_index_map(geometry)
    boxes = token_footprints(geometry)
    ys, xs = np.nonzero(index >= 0)
    box = boxes[index[ys, xs]]
    x, y, tol = xs + 0.5, ys + 0.5, 1e-7  # float borders; exact ties go right/down
    assert ((box[:, 0] - tol <= x) & (x < box[:, 2] - tol) & (box[:, 1] - tol <= y) & (y < box[:, 3] - tol)).all()
    full = mask_area_per_token(np.ones((size[1], size[0]), bool), geometry)
    assert full.sum() == np.count_nonzero(index >= 0)


def test_mask_shape_must_match_the_geometry():
    with pytest.raises(PruneAuditError, match="does not match"):
        mask_area_per_token(np.zeros((10, 10), bool), clip_geometry((640, 480)))


def test_geometry_serialises_to_json_and_back():
    geometry = qwen_geometry((640, 427), min_pixels=200704, max_pixels=1605632)
    restored = TokenGeometry(**json.loads(json.dumps(geometry.to_dict())))
    assert restored == geometry
    assert geometry.to_dict()["mode"] == "qwen_smart_resize" and geometry.grid == (15, 23)


def test_invalid_geometry_is_refused():
    with pytest.raises(PruneAuditError, match="unknown geometry mode"):
        TokenGeometry("anyres", 10, 10, 14, 14, 1, 1, 14, 1.0, 1.0)
    with pytest.raises(PruneAuditError, match="not a multiple"):
        clip_geometry((640, 480), crop_size=(330, 330))


# Worked golden values, evaluation spec D5: (image, category, mask px, [(mode, tokens, visible, touched,
# keep even, keep first half)]).
D5 = [
    (
        397133,
        "person",
        18463,
        [
            ("llava_pad", 576, 1.0, 47, 0.4031, 0.5374),
            ("hf_crop", 576, 0.9434, 81, 0.4764, 0.5338),
            ("qwen_smart_resize", 345, 1.0, 43, 0.4708, 0.4836),
        ],
    ),
    (
        397133,
        "dining table",
        54088,
        [
            ("llava_pad", 576, 1.0, 86, 0.5221, 0.0),
            ("hf_crop", 576, 0.7439, 143, 0.3890, 0.0),
            ("qwen_smart_resize", 345, 1.0, 83, 0.5035, 0.0),
        ],
    ),
    (
        37777,
        "oven",
        3611,
        [
            ("llava_pad", 576, 1.0, 27, 0.4655, 0.0),
            ("hf_crop", 576, 1.0, 55, 0.5109, 0.0),
            ("qwen_smart_resize", 104, 1.0, 9, 0.4846, 0.0),
        ],
    ),
    (
        233771,
        "clock",
        303,
        [
            ("llava_pad", 576, 1.0, 4, 0.6007, 1.0),
            ("hf_crop", 576, 1.0, 4, 0.6007, 1.0),
            ("qwen_smart_resize", 529, 1.0, 4, 0.3531, 1.0),
        ],
    ),
]


@pytest.mark.parametrize(("image_id", "category", "mask_pixels", "expected"), D5)
def test_worked_values_of_spec_d5(tiny_coco, image_id, category, mask_pixels, expected):
    from prune_audit.data.retention import object_area, retention

    mask = tiny_coco.category_mask(image_id, category)
    size = tiny_coco.image(image_id).size
    assert mask.sum() == mask_pixels
    for mode, tokens, visible, touched, keep_even, keep_first_half in expected:
        geometry = qwen_geometry(size) if mode == "qwen_smart_resize" else clip_geometry(size, mode=mode)
        area = object_area(mask, geometry)
        assert geometry.num_tokens == tokens
        assert area.visible_fraction == pytest.approx(visible, abs=5e-5)
        assert np.count_nonzero(area.area_per_token) == touched
        every = np.arange(tokens)
        assert retention(area.area_per_token, area.total_area, every)[0] == pytest.approx(visible, abs=5e-5)
        assert retention(area.area_per_token, area.total_area, every[::2])[0] == pytest.approx(keep_even, abs=5e-5)
        first_half = every[: tokens // 2]
        assert retention(area.area_per_token, area.total_area, first_half)[0] == pytest.approx(
            keep_first_half, abs=5e-5
        )


@pytest.fixture(scope="module")
def tiny_coco(shared_data):
    from prune_audit.data.coco import CocoInstances

    return CocoInstances.load(shared_data / "coco" / "tiny_coco_val2017" / "instances_val2017.json")


# --- verification against the real transformers image processors (PIL backend, small configs) ---


@pytest.fixture(scope="module")
def processors():
    transformers = pytest.importorskip("transformers")
    crop = {"height": 336, "width": 336}
    return {
        "clip": lambda **kw: transformers.CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size=crop, **kw),
        "llava_pad": lambda **kw: transformers.LlavaImageProcessorPil(
            size={"shortest_edge": 336}, crop_size=crop, do_pad=True, **kw
        ),
        "qwen": lambda **kw: transformers.Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, **kw),
        "qwen_small": lambda **kw: transformers.Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=100000, **kw),
    }


@pytest.mark.slow  # imports transformers
def test_modes_come_from_the_processor_configuration(processors):
    assert geometry_from_processor(processors["clip"](), (640, 480)).mode == "hf_crop"
    assert geometry_from_processor(processors["llava_pad"](), (640, 480)).mode == "hf_pad"
    assert geometry_from_processor(processors["clip"](), (640, 480), image_aspect_ratio="pad").mode == "llava_pad"
    qwen = geometry_from_processor(processors["qwen_small"](), (640, 480))
    assert (qwen.mode, qwen.grid, qwen.max_pixels) == ("qwen_smart_resize", (9, 13), 100000)
    wrapped = SimpleNamespace(image_processor=processors["clip"](), patch_size=14)
    assert geometry_from_processor(wrapped, (640, 480)) == clip_geometry((640, 480), mode="hf_crop")
    with pytest.raises(PruneAuditError, match="no token geometry"):
        geometry_from_processor(SimpleNamespace(size={}), (640, 480))


def _token_id_image(geometry: TokenGeometry) -> np.ndarray:
    """(H, W, 3) uint8 image whose colour encodes the token each pixel is assigned to."""
    index = token_index_map(geometry)
    image = np.empty((geometry.image_height, geometry.image_width, 3), np.uint8)
    image[..., 0] = index % 256
    image[..., 1] = index // 256 * 40 + 20
    image[..., 2] = IMAGE_BLUE
    return image


def _processed_pixels(processor, image: np.ndarray) -> np.ndarray:
    """(3, H', W') processed image, un-normalised; Qwen's merge-grouped patches are put back in place."""
    out = processor(images=image, return_tensors="np", do_rescale=False, do_normalize=False)
    pixels = out["pixel_values"]
    if "image_grid_thw" not in out:
        return pixels[0]
    _, grid_h, grid_w = out["image_grid_thw"][0]
    merge, patch = processor.merge_size, processor.patch_size
    pixels = pixels.reshape(
        grid_h // merge, grid_w // merge, merge, merge, 3, processor.temporal_patch_size, patch, patch
    )
    return pixels[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, grid_h * patch, grid_w * patch)


def _expected_tokens(geometry: TokenGeometry) -> np.ndarray:
    rows = np.arange(geometry.processed_height) // geometry.token_pixels
    cols = np.arange(geometry.processed_width) // geometry.token_pixels
    return rows[:, None] * geometry.grid_cols + cols[None, :]


@pytest.mark.slow  # imports transformers
@pytest.mark.parametrize("name", ["clip", "llava_pad", "qwen"])
@pytest.mark.parametrize("size", SIZES)
def test_token_id_image_through_the_bicubic_processor_lands_on_the_predicted_tokens(processors, name, size):
    """Away from token borders (3 px: bicubic support), every processed pixel shows its own token's id,
    and tokens the formula leaves without image pixels show only the padding colour."""
    processor = processors[name]()
    geometry = geometry_from_processor(processor, size)
    pixels = np.rint(_processed_pixels(processor, _token_id_image(geometry))).astype(int)
    assert pixels.shape[1:] == (geometry.processed_height, geometry.processed_width)
    within = (np.arange(geometry.processed_height) % geometry.token_pixels)[:, None]
    across = (np.arange(geometry.processed_width) % geometry.token_pixels)[None, :]
    inner = (within >= 3) & (within < geometry.token_pixels - 3) & (across >= 3) & (across < geometry.token_pixels - 3)
    expected = _expected_tokens(geometry)
    shows_image = pixels[2] == IMAGE_BLUE
    decoded = pixels[0] + 256 * ((pixels[1] - 20) // 40)
    assert (decoded[inner & shows_image] == expected[inner & shows_image]).all()
    padding_tokens = ~np.isin(expected, token_index_map(geometry))
    assert (pixels[:, inner & padding_tokens].T == PAD_COLOUR).all()
    assert (inner & shows_image).sum() > 0.3 * inner.sum()


@pytest.mark.slow  # imports transformers
@pytest.mark.parametrize("name", ["clip", "llava_pad", "qwen_small"])
@pytest.mark.parametrize("size", [(640, 427), (427, 640), (640, 640), (500, 375)])
def test_nearest_resampling_matches_the_geometry_at_every_pixel(processors, name, size):
    """With nearest resampling and downscaling, each processed pixel copies one original pixel whose
    centre the formula puts in that pixel's token; padding appears exactly where the formula puts none."""
    processor = processors[name](resample=0)
    geometry = geometry_from_processor(processor, size)
    assert geometry.scale_x <= 1 and geometry.scale_y <= 1
    pixels = np.rint(_processed_pixels(processor, _token_id_image(geometry))).astype(int)
    shows_image = pixels[2] == IMAGE_BLUE
    decoded = pixels[0] + 256 * ((pixels[1] - 20) // 40)
    expected = _expected_tokens(geometry)
    assert (decoded[shows_image] == expected[shows_image]).all()
    centre_y = (np.arange(geometry.processed_height) + 0.5 - geometry.offset_y) / geometry.scale_y
    centre_x = (np.arange(geometry.processed_width) + 0.5 - geometry.offset_x) / geometry.scale_x
    inside = ((centre_y >= 0) & (centre_y < size[1]))[:, None] & ((centre_x >= 0) & (centre_x < size[0]))[None, :]
    np.testing.assert_array_equal(shows_image, inside)
