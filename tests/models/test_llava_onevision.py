"""What only LLaVA-OneVision has: its real-size anyres_max processor (384-px SigLIP crops) and the refusal of the
CLS selectors (SigLIP has no CLS token). What every family shares is in tests/models/test_families_registry.py;
what it shares with LLaVA-NeXT in tests/models/test_multi_grid_families.py."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import WORDS

from prune_audit.data.geometry import token_index_map
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for
from prune_audit.pruners import get_selector


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (500, 333), (2000, 1500)])
def test_llava_onevision_real_size_processor_puts_every_pixel_on_its_predicted_token(size):
    """At llava-onevision's 384-px SigLIP crops (27 patches of 14 px, the last 6 px unseen) and anyres_max_9: the
    token count equals the processor's rule (2000 x 1500 is downsampled), and a token-id image of each grid
    through the bicubic processor shows, away from token borders, the predicted token on the base crop and on
    the seen part of the joined, unpadded tiles; padding pixels lie where the geometry puts no image."""
    from types import SimpleNamespace

    import transformers
    from test_geometry import IMAGE_BLUE

    from prune_audit.data.multigrid import anyres_layout, onevision_geometry

    processor = transformers.LlavaOnevisionImageProcessorPil()  # the llava-hf OneVision defaults: 384 px, 36 canvases
    pinpoints = processor.image_grid_pinpoints
    geometry = onevision_geometry(size, pinpoints=pinpoints)
    base, tiles = geometry.grids
    stock = SimpleNamespace(image_processor=processor, num_image_tokens=729, vision_aspect_ratio="anyres_max_9")
    stock._get_unpadded_features = lambda *a: transformers.LlavaOnevisionProcessor._get_unpadded_features(stock, *a)
    count = transformers.LlavaOnevisionProcessor._get_number_of_features(stock, size[1], size[0], 384, 384)
    assert count == geometry.num_tokens + tiles.grid[0]
    assert (tiles.mode == "anyres_tiles_downsampled") == (size == (2000, 1500))
    if tiles.mode == "anyres_tiles_downsampled":
        return  # the bilinear resize happens in the model: no processed pixel shows a downsampled token
    layout = anyres_layout(size, pinpoints, 384, 14)
    tile_rows, tile_cols = layout.canvas[0] // 384, layout.canvas[1] // 384
    for grid in (base, tiles):
        index = token_index_map(grid)
        image = np.stack([index % 256, index // 256 * 16 + 8, np.full_like(index, IMAGE_BLUE)], axis=-1)
        crops = processor(images=image.astype(np.uint8), return_tensors="np", do_rescale=False, do_normalize=False)[
            "pixel_values"
        ][0]
        if grid is base:
            seen, canvas_y, canvas_x = crops[0][:, :378, :378], np.arange(378), np.arange(378)
            inside_y = inside_x = np.ones(378, dtype=bool)
            expected = (canvas_y // 14)[:, None] * 27 + (canvas_x // 14)[None, :]
        else:  # each tile's seen 378 px, joined, then the unpadded window
            joined = crops[1:].reshape(tile_rows, tile_cols, 3, 384, 384)[..., :378, :378].transpose(2, 0, 3, 1, 4)
            joined = joined.reshape(3, tile_rows * 378, tile_cols * 378)
            top, left = layout.cut[0] * 14, layout.cut[1] * 14
            rows, cols = grid.grid
            seen = joined[:, top : top + rows * 14, left : left + cols * 14]
            seen_y, seen_x = np.arange(top, top + rows * 14), np.arange(left, left + cols * 14)
            canvas_y, canvas_x = seen_y // 378 * 384 + seen_y % 378, seen_x // 378 * 384 + seen_x % 378
            inside_y = (canvas_y + 0.5 >= layout.paste[1] + 3) & (
                canvas_y + 0.5 <= layout.paste[1] + layout.resized[1] - 3
            )
            inside_x = (canvas_x + 0.5 >= layout.paste[0] + 3) & (
                canvas_x + 0.5 <= layout.paste[0] + layout.resized[0] - 3
            )
            outside_y = (canvas_y + 0.5 < layout.paste[1] - 3) | (
                canvas_y + 0.5 > layout.paste[1] + layout.resized[1] + 3
            )
            outside_x = (canvas_x + 0.5 < layout.paste[0] - 3) | (
                canvas_x + 0.5 > layout.paste[0] + layout.resized[0] + 3
            )
            assert (np.rint(seen[2])[outside_y[:, None] | outside_x[None, :]] == 0).all()  # zero padding
            expected = (np.arange(rows * 14) // 14)[:, None] * cols + (np.arange(cols * 14) // 14)[None, :]
        pixels = np.rint(seen).astype(int)
        ys, xs = np.arange(pixels.shape[1]), np.arange(pixels.shape[2])
        inner = ((ys % 14 >= 3) & (ys % 14 < 11))[:, None] & ((xs % 14 >= 3) & (xs % 14 < 11))[None, :]
        shown = inner & inside_y[:, None] & inside_x[None, :]
        decoded = pixels[0] + 256 * ((pixels[1] - 8) // 16)
        assert shown.any() and (pixels[2][shown] == IMAGE_BLUE).all()
        assert (decoded[shown] == expected[shown]).all()


def test_llava_onevision_refuses_cls_selectors_in_one_line(tmp_path):
    """SigLIP has no CLS token: the CLS-attention selectors are refused on LLaVA-OneVision, naming the reason."""
    vlm = load_vlm(
        adapter_for("llava_onevision", "test").build_tiny(tmp_path / "model", words=[*WORDS, "Is"]), device="cpu"
    )
    for name in ("cls_attn", "vispruner", "scope", "visionzip"):
        with pytest.raises(PruneAuditError) as error:
            vlm.check_selector(get_selector(name))
        assert "no CLS token" in str(error.value) and "\n" not in str(error.value)
