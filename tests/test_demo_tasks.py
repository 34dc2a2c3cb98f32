"""The demo's questions beyond yes/no: generation with evidence, and training on the task mix."""

from __future__ import annotations

import numpy as np
import pytest

from prune_audit.data.scenes import CATEGORIES, Scene, SceneObject, generate_scene
from prune_audit.demo.scene_questions import (
    CHOICE_LETTERS,
    caption_question,
    choice_question,
    count_question,
    evidence_mask,
    largest_question,
    short_questions,
    spatial_question,
    vocabulary_words,
)

SIZE = 64


def disc(cx: float, cy: float, radius: float) -> np.ndarray:
    """(SIZE, SIZE) bool disc with pixel centres inside."""
    coords = np.arange(SIZE) + 0.5
    x, y = np.meshgrid(coords, coords)
    return (x - cx) ** 2 + (y - cy) ** 2 <= radius**2


def scene_of(*objects: tuple[str, np.ndarray]) -> Scene:
    return Scene(np.zeros((SIZE, SIZE, 3), np.uint8), tuple(SceneObject(name, mask) for name, mask in objects))


def test_spatial_questions_name_the_one_shape_on_that_side_and_both_objects_as_evidence():
    scene = scene_of(("star", disc(10, 10, 5)), ("heart", disc(40, 50, 5)), ("ring", disc(54, 20, 5)))
    left = spatial_question(scene, 1, "left")
    assert left is not None and left.answer == "star" and left.evidence == (1, 0)
    assert left.prompt == "Which shape is left of the heart?\nAnswer the question using a single word or phrase."
    above = spatial_question(scene, 1, "above")  # star and ring are both above the heart: ambiguous
    assert above is None
    assert spatial_question(scene, 0, "left") is None  # nothing is left of the star
    ring_above = spatial_question(scene, 0, "above")
    assert ring_above is None  # the ring (y 20) is below the star (y 10)
    close = scene_of(("star", disc(20, 10, 4)), ("heart", disc(22, 40, 4)), ("ring", disc(50, 40, 4)))
    assert spatial_question(close, 1, "left") is None  # the star is within the margin of the heart's x


def test_count_largest_choice_and_caption_answers_and_evidence():
    scene = scene_of(("arrow", disc(12, 12, 9)), ("circle", disc(45, 15, 5)), ("star", disc(30, 48, 5)))
    count = count_question(scene)
    assert count.answer == "three" and count.evidence == (0, 1, 2)
    largest = largest_question(scene)
    assert largest is not None and largest.answer == "arrow" and largest.evidence == (0, 1, 2)
    even = scene_of(("arrow", disc(12, 12, 5)), ("circle", disc(45, 15, 5)))
    assert largest_question(even) is None  # equal areas: no clear largest
    caption = caption_question(scene)
    assert caption.answer == "an arrow , a star and a circle" and caption.evidence == (0, 2, 1)
    assert caption.prompt == "Describe this image in detail."
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = choice_question(rng, scene)
        present = [option for option in choice.options if option in scene.categories]
        assert len(choice.options) == 4 and len(set(choice.options)) == 4 and len(present) == 1
        assert choice.options[CHOICE_LETTERS.index(choice.answer)] == present[0]
        assert scene.objects[choice.evidence[0]].category == present[0]
        assert choice.prompt.splitlines()[1:5] == [f"{letter}. {option}" for letter, option in zip("ABCD", choice.options)]


def test_evidence_masks_are_the_union_of_the_named_objects_visible_masks():
    scene = generate_scene(0, 5, image_size=96)
    for question in short_questions(scene):
        expected = np.logical_or.reduce([scene.objects[i].mask for i in question.evidence])
        assert np.array_equal(evidence_mask(scene, question), expected)


def test_generated_questions_cover_every_form_and_use_only_vocabulary_words():
    import re

    words = set(vocabulary_words())
    forms, letters = set(), set()
    rng = np.random.default_rng(1)
    for index in range(60):
        scene = generate_scene(2, index, image_size=96, split="train")
        questions = [*short_questions(scene), choice_question(rng, scene), caption_question(scene)]
        forms |= {q.form for q in questions}
        letters |= {q.answer for q in questions if q.kind == "choice"}
        for question in questions:
            assert set(re.findall(r"\w+|[^\w\s]+", f"{question.prompt} {question.answer}")) <= words
    assert forms == {"left", "above", "count", "largest", "choice", "caption"} and letters == set(CHOICE_LETTERS)
    assert set(CATEGORIES) <= words
