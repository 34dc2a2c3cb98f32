"""Questions beyond yes/no about a synthetic scene, each with the objects that are its evidence.

Six kinds, one per task the tool audits (``prune_audit.tasks``):

* ``yesno`` (POPE): "Is there a {shape} in the image?", evidence the shape when present;
* ``short`` (GQA): which shape is left of / above X, how many shapes there are, which shape is
  the largest; answered by one word;
* ``choice`` (ScienceQA): which of four shapes is in the image, options A-D, exactly one present;
* ``caption``: "Describe this image in detail.", answered by the shapes listed left to right;
* ``text`` (TextVQA): "What is written in the image?" about a scene drawn with a word (``data.scene_text``),
  answered by the word; its evidence is the word's ink box (the "OCR token"), not an object;
* ``ground`` (RefCOCO): a referring expression ("the red circle", "the shape left of the star", "the largest
  shape"), answered by the referred shape's box as LLaVA-1.5 writes boxes (``data.boxes``: ``[x1, y1, x2, y2]``,
  two decimals, 0-1 of the square image); its evidence is the referred shape.

Each question names, in ``evidence``, the scene objects its question and answer refer to; the
evidence mask is the union of their exact visible masks (``evidence_mask``). A spatial question
is asked only when its answer is unambiguous: exactly one shape lies on that side of X, and every
shape is at least ``SPATIAL_MARGIN`` of the image side away from X along that axis. "Largest" is
asked only when the largest visible area beats the runner-up by ``LARGEST_RATIO``.

Prompt texts are the tasks' own (GQA's and ScienceQA's LLaVA prompts, the caption prompt), so a
model trained on these questions is asked the same text by ``prune-audit run``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from prune_audit.data import captions as caption_data
from prune_audit.data import gqa as gqa_data
from prune_audit.data import scienceqa as scienceqa_data
from prune_audit.data.boxes import BOX_CONVENTIONS
from prune_audit.data.pope_build import question_text
from prune_audit.data.scene_text import SCENE_WORDS
from prune_audit.data.scenes import CATEGORIES, CATEGORY_COLOUR_NAMES, Scene
from prune_audit.models.build import WORD_PATTERN

KINDS: tuple[str, ...] = ("yesno", "short", "choice", "caption", "text", "ground")
GROUND_FORMS: tuple[str, ...] = ("colour", "left", "above", "largest")
TEXT_QUESTION = "what is written in the image?"  # as TextVQA's files write questions; the task capitalises it
GROUNDING = BOX_CONVENTIONS["llava-1.5"]  # the demo is a LLaVA: its prompt, its box syntax
BOX_NUMBERS: tuple[str, ...] = tuple(f"{n / 100:.2f}" for n in range(101))
"""Every number a demo box writes (0-1, two decimals; one word each in the demo tokenizers)."""
SHORT_FORMS: tuple[str, ...] = ("left", "above", "count", "largest")
COUNT_WORDS: tuple[str, ...] = ("one", "two", "three", "four")
CHOICE_LETTERS: tuple[str, ...] = scienceqa_data.LETTERS[:4]
CHOICE_QUESTION = "Which of these shapes is in the image?"
SPATIAL_MARGIN = 0.08  # centroid distance along the axis, as a share of the image side
LARGEST_RATIO = 1.3  # visible area of the largest shape over the runner-up's
_WORD = re.compile(WORD_PATTERN)  # the demo tokenizer's pre-tokenizer


@dataclass(frozen=True)
class SceneQuestion:
    """One question about a scene.

    Attributes:
        kind: one of ``KINDS``.
        form: for ``short`` one of ``SHORT_FORMS``; else the kind.
        question: the question alone (no instruction, no options).
        prompt: the text the model is asked (the task's instruction and options included).
        answer: the reference answer: a word, an option letter, or the caption.
        evidence: indices into ``scene.objects`` of the objects question and answer refer to (``text``: into
            ``scene.texts``).
        options: the offered shapes (``choice`` only), in letter order.
    """

    kind: str
    form: str
    question: str
    prompt: str
    answer: str
    evidence: tuple[int, ...]
    options: tuple[str, ...] = ()


def evidence_mask(scene: Scene, question: SceneQuestion) -> np.ndarray:
    """(H, W) bool: the union of the visible masks of the question's evidence objects."""
    mask = np.zeros(scene.image.shape[:2], dtype=bool)
    for index in question.evidence:
        mask |= scene.objects[index].mask
    return mask


def _centroid(mask: np.ndarray) -> tuple[float, float]:
    """(x, y) of a mask's pixel centres."""
    rows, cols = np.nonzero(mask)
    return float(cols.mean()) + 0.5, float(rows.mean()) + 0.5


def gqa_prompt(question: str) -> str:
    return f"{question}\n{gqa_data.INSTRUCTION}"


def choice_prompt(options: tuple[str, ...]) -> str:
    """ScienceQA's LLaVA prompt: question, one ``X. choice`` line per option, instruction."""
    lines = [f"{letter}. {option}" for letter, option in zip(CHOICE_LETTERS, options)]
    return "\n".join([CHOICE_QUESTION, *lines, scienceqa_data.INSTRUCTION])


def yesno_question(category: str, answer: str, scene: Scene) -> SceneQuestion:
    """The POPE question about ``category``; its evidence is the object when present."""
    evidence = tuple(i for i, obj in enumerate(scene.objects) if obj.category == category)
    text = question_text(category)
    return SceneQuestion("yesno", "yesno", text, text, answer, evidence)


def spatial_question(scene: Scene, anchor: int, axis: str) -> SceneQuestion | None:
    """ "Which shape is left of / above the {anchor}?" when exactly one shape is clearly on that side."""
    margin = SPATIAL_MARGIN * scene.image.shape[0]
    coordinate = 0 if axis == "left" else 1
    at = _centroid(scene.objects[anchor].mask)[coordinate]
    offsets = {i: _centroid(obj.mask)[coordinate] - at for i, obj in enumerate(scene.objects) if i != anchor}
    if not offsets or any(abs(offset) < margin for offset in offsets.values()):
        return None
    before = [i for i, offset in offsets.items() if offset < 0]
    if len(before) != 1:
        return None
    relation = "left of" if axis == "left" else "above"
    text = f"Which shape is {relation} the {scene.objects[anchor].category}?"
    return SceneQuestion("short", axis, text, gqa_prompt(text), scene.objects[before[0]].category, (anchor, before[0]))


def count_question(scene: Scene) -> SceneQuestion:
    text = "How many shapes are there?"
    return SceneQuestion(
        "short", "count", text, gqa_prompt(text), COUNT_WORDS[len(scene.objects) - 1], tuple(range(len(scene.objects)))
    )


def largest_question(scene: Scene) -> SceneQuestion | None:
    """ "Which shape is the largest?" when the largest visible area clearly beats the runner-up."""
    areas = sorted(((int(obj.mask.sum()), i) for i, obj in enumerate(scene.objects)), reverse=True)
    if len(areas) > 1 and areas[0][0] < LARGEST_RATIO * areas[1][0]:
        return None
    text = "Which shape is the largest?"
    return SceneQuestion(
        "short",
        "largest",
        text,
        gqa_prompt(text),
        scene.objects[areas[0][1]].category,
        tuple(range(len(scene.objects))),
    )


def short_questions(scene: Scene) -> list[SceneQuestion]:
    """Every unambiguous short-answer question about ``scene``, in ``SHORT_FORMS`` order."""
    spatial = [
        spatial_question(scene, anchor, axis) for axis in ("left", "above") for anchor in range(len(scene.objects))
    ]
    found = [*spatial, count_question(scene), largest_question(scene)]
    return [question for question in found if question is not None]


def choice_question(rng: np.random.Generator, scene: Scene) -> SceneQuestion:
    """Four shapes, exactly one of them present (a random one of the scene's); the answer is its letter."""
    present = int(rng.integers(len(scene.objects)))
    absent = [c for c in CATEGORIES if c not in scene.categories]
    options = [scene.objects[present].category, *rng.choice(absent, size=len(CHOICE_LETTERS) - 1, replace=False)]
    order = rng.permutation(len(options))
    shuffled = tuple(str(options[i]) for i in order)
    letter = CHOICE_LETTERS[int(np.flatnonzero(order == 0)[0])]
    return SceneQuestion("choice", "choice", CHOICE_QUESTION, choice_prompt(shuffled), letter, (present,), shuffled)


def caption_text(categories: list[str]) -> str:
    """ "a circle , a star and a heart": the shapes with their articles, commas and a final "and"."""
    named = [f"{'an' if c[0] in 'aeiou' else 'a'} {c}" for c in categories]
    return named[0] if len(named) == 1 else f"{' , '.join(named[:-1])} and {named[-1]}"


def caption_question(scene: Scene) -> SceneQuestion:
    """The caption prompt; the answer lists every shape left to right (by centroid)."""
    order = sorted(range(len(scene.objects)), key=lambda i: _centroid(scene.objects[i].mask)[0])
    answer = caption_text([scene.objects[i].category for i in order])
    return SceneQuestion("caption", "caption", caption_data.PROMPT, caption_data.PROMPT, answer, tuple(order))


def text_question(scene: Scene) -> SceneQuestion | None:
    """ "What is written in the image?" about a scene with a word; None for a scene without one."""
    if not scene.texts:
        return None
    return SceneQuestion("text", "text", TEXT_QUESTION, text_prompt(), scene.texts[0].word, (0,))


def text_prompt() -> str:
    """The text question as ``--task textvqa`` asks it from TextVQA's JSON (lmms-eval's prompt: the question
    capitalised, then the short-answer instruction GQA's prompt also ends with)."""
    return gqa_prompt(TEXT_QUESTION.capitalize())


def box_answer(scene: Scene, index: int) -> str:
    """The box of object ``index`` as LLaVA-1.5 writes it: ``[x1, y1, x2, y2]`` in 0-1 of the square image,
    two decimals, from the tight box of its visible mask (pixel edges)."""
    rows, cols = np.nonzero(scene.objects[index].mask)
    side = scene.image.shape[0]
    numbers = (cols.min() / side, rows.min() / side, (cols.max() + 1) / side, (rows.max() + 1) / side)
    return "[" + ", ".join(f"{value:.2f}" for value in numbers) + "]"


def ground_questions(scene: Scene) -> list[SceneQuestion]:
    """Every unambiguous referring expression of ``scene``, in ``GROUND_FORMS`` order: each shape by its colour,
    the shape left of / above each anchor (``spatial_question``'s rule), the largest shape (``largest_question``'s).
    """
    found = [
        (f"the {CATEGORY_COLOUR_NAMES[obj.category]} {obj.category}", "colour", i)
        for i, obj in enumerate(scene.objects)
    ]
    for axis in ("left", "above"):
        for anchor in range(len(scene.objects)):
            spatial = spatial_question(scene, anchor, axis)
            if spatial is not None:
                relation = "left of" if axis == "left" else "above"
                found.append((f"the shape {relation} the {scene.objects[anchor].category}", axis, spatial.evidence[1]))
    largest = largest_question(scene)
    if largest is not None and len(scene.objects) > 1:
        found.append(("the largest shape", "largest", scene.categories.index(largest.answer)))
    return [
        SceneQuestion("ground", form, expression, GROUNDING.prompt(expression), box_answer(scene, i), (i,))
        for expression, form, i in found
    ]


def vocabulary_words() -> tuple[str, ...]:
    """Every word (as the demo tokenizer splits it) of the prompts and answers above, shapes first."""
    texts = (
        question_text("arrow"),
        gqa_prompt("Which shape is left of above the largest?"),
        "How many shapes are there?",
        " ".join(COUNT_WORDS),
        choice_prompt(CATEGORIES[:4]),
        caption_data.PROMPT,
        caption_text(list(CATEGORIES[:3])),
        "an",
    )
    words = dict.fromkeys(CATEGORIES)
    for text in texts:
        words.update(dict.fromkeys(_WORD.findall(text)))
    return tuple(words)


def reading_words() -> tuple[str, ...]:
    """The words the ``text`` and ``ground`` kinds add to ``vocabulary_words``: the question, the scene words, the
    grounding prompt, colours, relations and every number a box writes (``0.00``-``1.00``, one word each)."""
    texts = (
        text_prompt(),
        " ".join(SCENE_WORDS),
        GROUNDING.prompt("the red shape left of above the largest"),
        " ".join(CATEGORY_COLOUR_NAMES.values()),
        "[0.00, 1.00]",
        " ".join(BOX_NUMBERS),
    )
    words: dict[str, None] = {}
    for text in texts:
        words.update(dict.fromkeys(_WORD.findall(text)))
    return tuple(words)
