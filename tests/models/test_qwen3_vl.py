"""What only Qwen3-VL has: its deepstack features, and its real-size image processor (16-px patches) putting
every pixel on its predicted token. What every family shares is in tests/models/test_families_registry.py."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for

NUM_LAYERS = 4


def test_qwen3_vl_keep_all_needs_its_deepstack_features(tmp_path):
    """The stock-forward equality above is sensitive to deepstack: without it the logits move."""
    path = adapter_for("qwen3_vl", "test").build_tiny(tmp_path / "qwen3", words=WORDS, text_layers=NUM_LAYERS)
    vlm = load_vlm(path, device="cpu")
    item = vlm.prepare(random_image(0), QUESTIONS[0])
    with_deepstack = vlm.prefill([item])[0].logits[0]
    vlm.loop.stack.after_layer = None
    assert (vlm.prefill([item])[0].logits[0] - with_deepstack).abs().max() > 1e-3


REAL_PROCESSORS = {
    # the real checkpoints' image-processor settings, without weights
    "qwen3_vl": lambda transformers, **kw: transformers.Qwen2VLImageProcessorPil(
        min_pixels=65536, max_pixels=16777216, patch_size=16, merge_size=2, **kw
    ),
}


def real_geometry(name, processor, size):
    """What the family's ``token_geometry`` computes from these processor settings (no weights to load one)."""
    from prune_audit.data.geometry import qwen_geometry_from_processor

    return qwen_geometry_from_processor(processor, size)


@pytest.mark.parametrize("name", sorted(REAL_PROCESSORS))
@pytest.mark.parametrize("size", [(640, 480), (480, 640), (500, 333), (1000, 667)])
def test_real_size_processors_put_every_pixel_on_its_predicted_token(name, size):
    """At the real checkpoints' sizes (Qwen3-VL's 16-px patches), a token-id image
    through the bicubic processor shows, away from token borders (3 px: bicubic support), the token the
    geometry predicts at every processed pixel (tests/test_geometry.py checks LLaVA and Qwen2.5-VL so)."""
    import transformers
    from test_geometry import (
        IMAGE_BLUE,
        _expected_tokens,
        _processed_pixels,
        _token_id_image,
    )

    processor = REAL_PROCESSORS[name](transformers)
    geometry = real_geometry(name, processor, size)
    pixels = np.rint(_processed_pixels(processor, _token_id_image(geometry))).astype(int)
    assert pixels.shape[1:] == (geometry.processed_height, geometry.processed_width)
    within = (np.arange(geometry.processed_height) % geometry.token_pixels)[:, None]
    across = (np.arange(geometry.processed_width) % geometry.token_pixels)[None, :]
    inner = (within >= 3) & (within < geometry.token_pixels - 3) & (across >= 3) & (across < geometry.token_pixels - 3)
    decoded = pixels[0] + 256 * ((pixels[1] - 20) // 40)
    assert (pixels[2] == IMAGE_BLUE).all()  # no padding in either pipeline
    assert (decoded[inner] == _expected_tokens(geometry)[inner]).all()
