"""Words drawn into synthetic scenes: the pixel font, the placement clear of shapes, the exact ink box."""

from __future__ import annotations

import numpy as np
import pytest

from prune_audit.data.scene_text import FACES, SCENE_WORDS, SIGN_MARGIN, glyph_bitmap, paint_word, place_word
from prune_audit.data.scenes import generate_scene


@pytest.mark.parametrize("word", SCENE_WORDS)
def test_every_scene_word_has_glyphs_and_bold_is_one_column_wider_per_letter(word):
    regular, bold = glyph_bitmap(word, "regular"), glyph_bitmap(word, "bold")
    assert regular.shape == (7, 6 * len(word) - 1) and bold.shape == (7, 7 * len(word) - 1)
    assert regular.any(axis=0).sum() > 3 * len(word)  # every letter inks several columns
    assert glyph_bitmap(word, "regular", 2).shape == (14, 2 * regular.shape[1])
    assert np.array_equal(glyph_bitmap(word, "regular", 2)[::2, ::2], regular)


def test_words_read_apart_and_an_unknown_face_is_refused():
    bitmaps = {glyph_bitmap(word).tobytes() for word in SCENE_WORDS}
    assert len(bitmaps) == len(SCENE_WORDS)
    with pytest.raises(ValueError, match="face"):
        glyph_bitmap("stop", "italic")


def test_a_placed_word_keeps_its_margin_from_every_shape_and_its_box_is_its_ink():
    rng = np.random.default_rng(0)
    occupied = np.zeros((96, 96), dtype=bool)
    occupied[30:60, 20:70] = True
    for _ in range(50):
        text = place_word(rng, occupied, tries=30)
        assert text is not None and text.word in SCENE_WORDS
        x1, y1, x2, y2 = text.box
        rows, cols = np.nonzero(text.mask)
        assert (cols.min(), rows.min(), cols.max() + 1, rows.max() + 1) == (x1, y1, x2, y2)
        grown = occupied.copy()
        grown[30 - SIGN_MARGIN : 60 + SIGN_MARGIN, 20 - SIGN_MARGIN : 70 + SIGN_MARGIN] = True
        assert not (text.mask & grown).any()
    assert place_word(rng, np.ones((96, 96), dtype=bool), tries=5) is None


def test_each_word_is_painted_in_its_own_ink_and_nothing_else_changes():
    from prune_audit.data.scene_text import WORD_COLOURS
    from prune_audit.data.scenes import CATEGORY_COLOURS

    text = place_word(np.random.default_rng(1), np.zeros((64, 64), dtype=bool), tries=5)
    assert text is not None
    image = np.full((64, 64, 3), 128.0)
    paint_word(image, text)
    assert (image[text.mask] == WORD_COLOURS[text.word]).all() and (image[~text.mask] == 128).all()
    assert len(set(WORD_COLOURS.values())) == len(SCENE_WORDS) and set(WORD_COLOURS) == set(SCENE_WORDS)
    assert not set(WORD_COLOURS.values()) & set(CATEGORY_COLOURS.values())


def test_scenes_with_a_word_keep_the_shapes_and_scenes_without_stay_as_they_were():
    for index in range(20):
        plain = generate_scene(5, index, split="train")
        worded = generate_scene(5, index, split="train", words=True)
        assert plain.texts == () and worded.categories == plain.categories
        for a, b in zip(plain.objects, worded.objects, strict=True):
            assert np.array_equal(a.mask, b.mask)
        for text in worded.texts:
            assert not any((text.mask & obj.mask).any() for obj in worded.objects)
            assert text.word in SCENE_WORDS
    assert sum(bool(generate_scene(5, i, words=True).texts) for i in range(50)) >= 40  # a free spot is the rule
    assert set(FACES) == {"regular", "bold"}
