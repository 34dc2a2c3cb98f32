"""Words rendered into synthetic scenes: a small pixel font, exact glyph masks, one sign per scene.

The text demo's reading task (TextVQA's format) needs text whose pixels are known exactly, as the shapes' are,
so the "OCR box" of a word is exact and its tokens' retention is measurable. Glyphs are drawn from a 5x7 pixel
font (no font files, no antialiasing: the same pixels on every machine), in two faces (regular, and bold: every
stroke one pixel wider) and two sizes (2x, letters 14 px tall, and 3x for words of at most three letters). Each word
has its own ink colour, as each shape class has its own: the demo's from-scratch vision tower tells colours apart
within its CPU budget, not monochrome glyphs (in near-black / near-white ink, word-patch accuracy stayed at 4-8 %
after 200-300 training steps, at 1x and at 2x, and the words' monitor at chance), so a word is read by its colour and
its letters together, and pruning that drops its tokens drops both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCENE_WORDS: tuple[str, ...] = ("stop", "exit", "open", "taxi", "cafe", "bus", "zoo", "sale", "park", "hotel")
"""The words a scene's sign may read (the text demo's answers)."""

_GLYPHS: dict[str, tuple[str, ...]] = {
    "a": (".....", ".....", ".###.", "....#", ".####", "#...#", ".####"),
    "b": ("#....", "#....", "####.", "#...#", "#...#", "#...#", "####."),
    "c": (".....", ".....", ".###.", "#....", "#....", "#...#", ".###."),
    "e": (".....", ".....", ".###.", "#...#", "#####", "#....", ".###."),
    "f": ("..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."),
    "h": ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "i": ("..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."),
    "k": ("#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."),
    "l": (".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "n": (".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "o": (".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."),
    "p": (".....", ".....", "####.", "#...#", "####.", "#....", "#...."),
    "r": (".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."),
    "s": (".....", ".....", ".####", "#....", ".###.", "....#", "####."),
    "t": (".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."),
    "u": (".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"),
    "x": (".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"),
    "z": (".....", ".....", "#####", "...#.", "..#..", ".#...", "#####"),
}
GLYPH_WIDTH, GLYPH_HEIGHT, LETTER_GAP = 5, 7, 1
FACES: tuple[str, ...] = ("regular", "bold")
SCALE = 2  # letters 10 x 14 px: each covers about two of the demo's 8 px patches
LARGE_WORD_LETTERS = 3  # words this short may be drawn at three times the glyphs' size
SIGN_MARGIN = 2  # pixels kept free between the sign and the image border or any shape
WORD_COLOURS: dict[str, tuple[int, int, int]] = {
    "stop": (150, 85, 30),  # brown
    "exit": (125, 125, 20),  # olive
    "open": (25, 35, 125),  # navy
    "taxi": (0, 130, 130),  # teal
    "cafe": (125, 0, 50),  # maroon
    "bus": (165, 250, 70),  # lime
    "zoo": (250, 0, 210),  # magenta
    "sale": (130, 200, 255),  # sky
    "park": (200, 165, 255),  # lavender
    "hotel": (150, 255, 205),  # mint
}
"""The ink of each word: none is a shape class's colour (``data.scenes.CATEGORY_COLOURS``)."""


@dataclass(frozen=True)
class SceneText:
    """One word drawn in a scene.

    Attributes:
        word: the word (one of ``SCENE_WORDS``).
        mask: (H, W) bool, its ink pixels.
        box: (x1, y1, x2, y2) pixels, its ink's tight box (``x2``, ``y2`` exclusive).
    """

    word: str
    mask: np.ndarray
    box: tuple[int, int, int, int]


def glyph_bitmap(word: str, face: str = "regular", scale: int = 1) -> np.ndarray:
    """(7 * scale, width) bool ink of ``word`` in ``face`` at ``scale`` (letters one pixel apart before scaling)."""
    if face not in FACES:
        raise ValueError(f"unknown face {face!r}; choose one of {', '.join(FACES)}")
    letters = [np.array([[c == "#" for c in row] for row in _GLYPHS[letter]]) for letter in word]
    if face == "bold":  # every stroke one pixel wider to the right (the letter one column wider)
        letters = [np.pad(ink, ((0, 0), (0, 1))) | np.pad(ink, ((0, 0), (1, 0))) for ink in letters]
    gap = np.zeros((GLYPH_HEIGHT, LETTER_GAP), dtype=bool)
    ink = np.concatenate([part for letter in letters for part in (letter, gap)][:-1], axis=1)
    return np.kron(ink, np.ones((scale, scale), dtype=bool)).astype(bool)


def place_word(rng: np.random.Generator, occupied: np.ndarray, tries: int) -> SceneText | None:
    """A random word, face and size at a random free spot of an (H, W) image whose ``occupied`` pixels are the
    shapes'; None when no spot ``SIGN_MARGIN`` pixels clear of every shape was found in ``tries`` tries (or the word
    is wider than the image)."""
    word = SCENE_WORDS[int(rng.integers(len(SCENE_WORDS)))]
    face = FACES[int(rng.integers(len(FACES)))]
    scale = SCALE + 1 if len(word) <= LARGE_WORD_LETTERS and rng.random() < 0.5 else SCALE
    ink = glyph_bitmap(word, face, scale)
    height, width = occupied.shape
    rows, cols = ink.shape
    if rows + 2 * SIGN_MARGIN > height or cols + 2 * SIGN_MARGIN > width:  # a small image: no room for this word
        return None
    for _ in range(tries):
        top = int(rng.integers(SIGN_MARGIN, height - rows - SIGN_MARGIN + 1))
        left = int(rng.integers(SIGN_MARGIN, width - cols - SIGN_MARGIN + 1))
        around = occupied[top - SIGN_MARGIN : top + rows + SIGN_MARGIN, left - SIGN_MARGIN : left + cols + SIGN_MARGIN]
        if not around.any():
            mask = np.zeros_like(occupied)
            mask[top : top + rows, left : left + cols] = ink
            ink_rows, ink_cols = np.nonzero(mask)
            box = (int(ink_cols.min()), int(ink_rows.min()), int(ink_cols.max()) + 1, int(ink_rows.max()) + 1)
            return SceneText(word, mask, box)
    return None


def paint_word(image: np.ndarray, text: SceneText) -> None:
    """Paint ``text`` into the (H, W, 3) float ``image`` in place, in its word's ink (``WORD_COLOURS``)."""
    image[text.mask] = np.array(WORD_COLOURS[text.word], dtype=np.float64)


__all__ = ["FACES", "SCENE_WORDS", "WORD_COLOURS", "SceneText", "glyph_bitmap", "paint_word", "place_word"]
