"""Training and monitoring batches for the demo model: scenes, questions, patch labels.

Yes/no questions follow POPE's balance: per image, half ask about a present class and half
about an absent one. Absent classes mix POPE's three negative kinds: uniform
(random), prior-weighted (popular) and same-group (adversarial, co-occurring).
The task mix (``mix``) adds, per image, short-answer, multiple-choice, caption, reading and grounding
questions (``demo.scene_questions``); a short-answer (grounding) form is drawn uniformly among the forms
the scene allows, then one of its questions, so spatial questions are not outnumbered by counting (by
colour). A mix with reading questions draws every scene with a word (``generate_scene(words=True)``);
the rare scene whose word found no free spot is asked grounding questions instead, so every image keeps
the same number of questions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from prune_audit.data.scene_text import SCENE_WORDS
from prune_audit.data.scenes import (
    CATEGORIES,
    CATEGORY_PRIOR,
    CO_OCCURRENCE_GROUPS,
    Scene,
    generate_scene,
)
from prune_audit.demo.scene_questions import (
    KINDS,
    SceneQuestion,
    caption_question,
    choice_question,
    ground_questions,
    short_questions,
    text_question,
    yesno_question,
)

BACKGROUND_CLASS = len(CATEGORIES)
# a mix that reads also labels words: word w is class BACKGROUND_CLASS + 1 + w (patches) and column C + w (presence)
WORD_CLASSES = len(SCENE_WORDS)
PATCH_COVERAGE_THRESHOLD = 0.25  # a patch is labelled with a class covering more than this share


@dataclass(frozen=True)
class Question:
    """One yes/no question about image ``image`` (index into the batch's scenes)."""

    image: int
    category: str
    answer: str


@dataclass(frozen=True)
class MixQuestion:
    """One question of the task mix about image ``image`` (index into the batch's scenes)."""

    image: int
    question: SceneQuestion


@dataclass(frozen=True)
class SceneBatch:
    """Scenes with their questions and dense vision targets.

    Attributes:
        scenes: the generated scenes.
        questions: ``questions_per_image`` per scene (with a ``mix``, ``sum(mix)`` ``MixQuestion``s),
            grouped by image in scene order.
        presence: (B, C) float, 1 where class c is in scene b; (B, C + W) when the scenes carry words, whose
            columns say which of the W ``SCENE_WORDS`` is written.
        patch_labels: (B, N) long, the class covering a patch or ``BACKGROUND_CLASS`` (or, with words, the word
            whose box covers it: ``BACKGROUND_CLASS + 1 + w``).
    """

    scenes: tuple[Scene, ...]
    questions: tuple[Question, ...] | tuple[MixQuestion, ...]
    presence: Tensor
    patch_labels: Tensor


def sample_batch(
    seed: int,
    step: int,
    *,
    images: int,
    questions_per_image: int,
    image_size: int,
    patch_size: int,
    split: str = "train",
    mix: tuple[int, ...] | None = None,
) -> SceneBatch:
    """Batch ``step`` of the stream ``(split, seed)``: scenes ``step*images ...`` and their questions.

    Args:
        mix: questions per image of each kind in ``KINDS`` order (yes/no, short, choice, caption, text, ground;
            kinds left out: none); None: ``questions_per_image`` yes/no questions (``Question``) as before the mix.
    """
    if mix is not None:
        check_mix(mix)
    elif questions_per_image < 2 or questions_per_image % 2:
        raise ValueError(f"questions_per_image must be even and at least 2, got {questions_per_image}")
    words = mix is not None and mix_reads(mix)
    scenes = tuple(
        generate_scene(seed, step * images + i, image_size=image_size, split=split, words=words) for i in range(images)
    )
    rng = np.random.default_rng([seed, step, len(CATEGORIES)])
    if mix is None:
        questions: tuple = tuple(
            q for b, scene in enumerate(scenes) for q in sample_questions(rng, scene, b, questions_per_image)
        )
    else:
        questions = tuple(q for b, scene in enumerate(scenes) for q in sample_mix_questions(rng, scene, b, mix))
    presence = torch.zeros(images, len(CATEGORIES) + (WORD_CLASSES if words else 0))
    for b, scene in enumerate(scenes):
        presence[b, [CATEGORIES.index(c) for c in scene.categories]] = 1.0
        presence[b, [len(CATEGORIES) + SCENE_WORDS.index(text.word) for text in scene.texts]] = 1.0
    labels = torch.stack([patch_labels(scene, patch_size) for scene in scenes])
    return SceneBatch(scenes, questions, presence, labels)


def sample_questions(rng: np.random.Generator, scene: Scene, image: int, count: int) -> list[Question]:
    """``count // 2`` yes-questions (present classes, cycled) then as many no-questions."""
    present = list(scene.categories)
    yes = [present[i % len(present)] for i in rng.permutation(max(len(present), count // 2))[: count // 2]]
    no = [_negative(rng, present) for _ in range(count // 2)]
    return [Question(image, c, "yes") for c in yes] + [Question(image, c, "no") for c in no]


def check_mix(mix: tuple[int, ...]) -> None:
    """Refuse a mix that is not one whole count per kind (the first four at least), yes/no even (half present,
    half absent), sum >= 1."""
    if not 4 <= len(mix) <= len(KINDS) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in mix):
        raise ValueError(f"the mix needs 4 to {len(KINDS)} non-negative whole counts ({', '.join(KINDS)}), got {mix}")
    if mix[0] % 2 or sum(mix) < 1:
        raise ValueError(f"the mix needs an even yes/no count and at least one question per image, got {mix}")


def full_mix(mix: tuple[int, ...]) -> tuple[int, ...]:
    """``mix`` with a zero count for every kind it leaves out (the mixes before reading and grounding had four)."""
    return (*mix, *(0,) * (len(KINDS) - len(mix)))


def mix_reads(mix: tuple[int, ...]) -> bool:
    """Whether ``mix`` asks reading questions, so that its scenes are drawn with a word."""
    return full_mix(mix)[KINDS.index("text")] > 0


def sample_mix_questions(rng: np.random.Generator, scene: Scene, image: int, mix: tuple[int, ...]) -> list[MixQuestion]:
    """The mix's questions about ``scene``: yes/no (balanced), short answers (form drawn first), choice, caption,
    reading (the scene's word), grounding (form drawn first)."""
    yesno, short, choice, caption, text, ground = full_mix(mix)
    found: list[SceneQuestion] = []
    if yesno:
        found += [yesno_question(q.category, q.answer, scene) for q in sample_questions(rng, scene, image, yesno)]
    found += _by_form(rng, short_questions(scene), short)  # never empty: the counting question is always asked
    found += [choice_question(rng, scene) for _ in range(choice)]
    found += [caption_question(scene)] * caption
    reading = text_question(scene) if text else None
    if text and reading is None:  # no free spot for a word: grounding questions keep the count per image
        ground, text = ground + text, 0
    found += [reading] * text  # type: ignore[list-item]
    if ground:  # the four-kind mixes skip the expressions' spatial tests on every training scene
        found += _by_form(rng, ground_questions(scene), ground)  # never empty: each shape by its colour
    return [MixQuestion(image, question) for question in found]


def _by_form(rng: np.random.Generator, candidates: list[SceneQuestion], count: int) -> list[SceneQuestion]:
    """``count`` of ``candidates``, each drawn by form first (uniform over the forms present), then within it."""
    forms = list(dict.fromkeys(q.form for q in candidates))
    drawn = []
    for _ in range(count):
        form = forms[int(rng.integers(len(forms)))]
        of_form = [q for q in candidates if q.form == form]
        drawn.append(of_form[int(rng.integers(len(of_form)))])
    return drawn


def _negative(rng: np.random.Generator, present: list[str]) -> str:
    """An absent class: uniform, prior-weighted or from a present class's group, one third each."""
    absent = [c for c in CATEGORIES if c not in present]
    kind = int(rng.integers(3))
    if kind == 0:
        weights = np.ones(len(absent))
    elif kind == 1:
        weights = np.array([CATEGORY_PRIOR[CATEGORIES.index(c)] for c in absent])
    else:
        groups = [g for g in CO_OCCURRENCE_GROUPS if set(g) & set(present)]
        weights = np.array([1.0 + 4.0 * any(c in g for g in groups) for c in absent])
    return absent[int(rng.choice(len(absent), p=weights / weights.sum()))]


def patch_labels(scene: Scene, patch_size: int) -> Tensor:
    """(rows * cols,) long: per patch (row-major) the class (or word) covering most of it if above 25 %."""
    size = scene.image.shape[0]
    grid = size // patch_size
    labels = torch.full((grid * grid,), BACKGROUND_CLASS, dtype=torch.long)
    best = torch.full((grid * grid,), PATCH_COVERAGE_THRESHOLD)
    regions = [(obj.mask, CATEGORIES.index(obj.category)) for obj in scene.objects]
    for text in scene.texts:  # a word's region is its ink box: its thin strokes alone would rarely cover a patch
        x1, y1, x2, y2 = text.box
        box = np.zeros_like(text.mask)
        box[y1:y2, x1:x2] = True
        regions.append((box, BACKGROUND_CLASS + 1 + SCENE_WORDS.index(text.word)))
    for mask, label in regions:
        cells = mask[: grid * patch_size, : grid * patch_size].reshape(grid, patch_size, grid, patch_size)
        coverage = torch.from_numpy(cells.mean(axis=(1, 3)).reshape(-1)).float()
        wins = coverage > best
        labels[wins] = label
        best = torch.maximum(best, coverage)
    return labels
