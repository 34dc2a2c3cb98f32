"""Questions about a synthetic clip (``data.scene_clips``): temporal presence and multiple choice.

Two kinds, one per video task the tool audits:

* ``presence`` (``video_presence``): "Is there a {shape} at the beginning of the video?", "... at the end of the
  video?", "... in the video?", answered yes or no. Its ``window`` is the inclusive frame range asked about: the
  clip's first quarter of frames (beginning), its last quarter (end), the whole clip ("in the video", written
  None in the files). The answer is yes when some frame of the window shows at least ``MIN_VISIBLE_PIXELS`` of
  the shape, no when no frame of the window shows any pixel of it; a shape the window shows only as a sliver is
  never asked about there. Questions are balanced (half yes, half no); half the no-questions about the beginning
  or the end are *hard negatives* where the clip allows: the shape is in the clip, only not in the window.
* ``choice`` (``video_mc``, MVBench's layout): "Which shape appears last?", "Which shape disappears first?",
  "Which shape moves from left to right?" / "... right to left?", four candidate shapes, the answer a candidate's
  text. A form is asked only when its answer is unambiguous (one shape first-visible strictly last; one shape
  last-visible strictly first and before the clip ends; one shape moving at least ``MOVE_SHARE`` of the frame
  that way, mostly sideways, every other shape moving less than ``STILL_SHARE`` that way).

Each question names, in ``evidence``, the clip objects it asks about (``ClipObject`` indices): for presence the
queried shape when it is in the clip, for choice the answer's shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from prune_audit.data.scene_clips import SceneClip
from prune_audit.data.scenes import CATEGORIES, CATEGORY_PRIOR, MIN_VISIBLE_PIXELS
from prune_audit.demo.scene_questions import CHOICE_LETTERS
from prune_audit.models.build import WORD_PATTERN

WINDOWS: tuple[str, ...] = ("beginning", "end", "video")
PRESENCE_TEMPLATES: dict[str, str] = {
    "beginning": "Is there {article} {shape} at the beginning of the video?",
    "end": "Is there {article} {shape} at the end of the video?",
    "video": "Is there {article} {shape} in the video?",
}
CHOICE_FORMS: dict[str, str] = {
    "appears_last": "Which shape appears last?",
    "disappears_first": "Which shape disappears first?",
    "left_to_right": "Which shape moves from left to right?",
    "right_to_left": "Which shape moves from right to left?",
}
MOVE_SHARE = 0.25  # the answer of a direction question moves at least this share of the frame width that way
STILL_SHARE = 0.1  # and every other shape less than this share that way
HARD_NEGATIVE_SHARE = 0.5
MVBENCH_POST_PROMPT = "Only give the best option.\n"
CHOICE_LINE = "({letter}) {option}"  # an option's line in MVBench's prompt
_WORD = re.compile(WORD_PATTERN)  # the demo tokenizer's pre-tokenizer


@dataclass(frozen=True)
class ClipQuestion:
    """One question about a clip.

    Attributes:
        kind: ``presence`` or ``choice``.
        form: presence: its window name (``WINDOWS``); choice: its form (``CHOICE_FORMS``).
        question: the question alone.
        prompt: the text the model is asked (choice: MVBench's prompt with its options, ``choice_prompt``).
        answer: ``yes`` / ``no``, or the answer candidate's text.
        category: presence: the shape asked about; choice: the answer's shape.
        window: presence: the inclusive (first, last) frames asked about, None for the whole clip.
        candidates: choice: the four candidate shapes in option order.
        evidence: indices into ``clip.objects`` of the objects the question asks about.
    """

    kind: str
    form: str
    question: str
    prompt: str
    answer: str
    category: str
    window: tuple[int, int] | None = None
    candidates: tuple[str, ...] = ()
    evidence: tuple[int, ...] = ()

    @property
    def letter(self) -> str:
        """The answer's option letter (choice questions)."""
        return CHOICE_LETTERS[self.candidates.index(self.answer)]


def window_frames(window: str, frames: int) -> tuple[int, int] | None:
    """The inclusive frames of ``window`` in a clip of ``frames`` frames (None: the whole clip)."""
    quarter = frames // 4
    if window == "beginning":
        return (0, quarter - 1)
    if window == "end":
        return (frames - quarter, frames - 1)
    if window == "video":
        return None
    raise ValueError(f"unknown window {window!r}; choose one of {', '.join(WINDOWS)}")


def presence_answer(clip: SceneClip, category: str, window: str) -> str | None:
    """``yes`` / ``no`` for ``category`` in ``window`` of ``clip``; None when the window shows it only as a sliver."""
    first, last = window_frames(window, clip.num_frames) or (0, clip.num_frames - 1)
    mine = [obj for obj in clip.objects if obj.category == category]
    if not mine or not mine[0].shown(first, last):
        return "no"
    pixels = mine[0].masks[first : last + 1].sum(axis=(1, 2))
    return "yes" if pixels.max() >= MIN_VISIBLE_PIXELS else None


def presence_question(clip: SceneClip, category: str, window: str) -> ClipQuestion:
    """The presence question about ``category`` in ``window``; refused (ValueError) where the answer is a sliver."""
    answer = presence_answer(clip, category, window)
    if answer is None:
        raise ValueError(f"the {category} is only a sliver in the {window} window; ask about another shape")
    article = "an" if category[0] in "aeiou" else "a"
    question = PRESENCE_TEMPLATES[window].format(article=article, shape=category)
    evidence = tuple(i for i, obj in enumerate(clip.objects) if obj.category == category)
    return ClipQuestion(
        "presence", window, question, question, answer, category, window_frames(window, clip.num_frames), (), evidence
    )


def presence_questions(rng: np.random.Generator, clip: SceneClip, count: int) -> list[ClipQuestion]:
    """``count // 2`` yes-questions then as many no-questions (``count`` even); module docstring for the draw."""
    if count < 2 or count % 2:
        raise ValueError(f"presence questions come in yes/no pairs: count must be even and >= 2, got {count}")
    yes, no = [], []
    for _ in range(count // 2):
        window = WINDOWS[int(rng.integers(len(WINDOWS)))]
        shown = [c for c in clip.categories if presence_answer(clip, c, window) == "yes"]
        if not shown:  # the clip's every shape enters late or leaves early: the whole clip shows them
            window, shown = "video", [c for c in clip.categories if presence_answer(clip, c, "video") == "yes"]
        yes.append(presence_question(clip, shown[int(rng.integers(len(shown)))], window))
    for _ in range(count // 2):
        window = WINDOWS[int(rng.integers(len(WINDOWS)))]
        hard = [c for c in clip.categories if presence_answer(clip, c, window) == "no"]
        if hard and rng.random() < HARD_NEGATIVE_SHARE:
            no.append(presence_question(clip, hard[int(rng.integers(len(hard)))], window))
        else:
            no.append(presence_question(clip, _absent(rng, clip), window))
    return yes + no


def _absent(rng: np.random.Generator, clip: SceneClip) -> str:
    """A class absent from the whole clip: uniform or prior-weighted, half each (POPE's random and popular)."""
    absent = [c for c in CATEGORIES if c not in clip.categories]
    weights = np.ones(len(absent))
    if rng.random() < 0.5:
        weights = np.array([CATEGORY_PRIOR[CATEGORIES.index(c)] for c in absent])
    return absent[int(rng.choice(len(absent), p=weights / weights.sum()))]


def choice_prompt(question: str, candidates: tuple[str, ...]) -> str:
    """MVBench's prompt as lmms-eval writes it (EvolvingLMMs-Lab/lmms-eval ``tasks/mvbench/utils.py``
    ``mvbench_doc_to_text`` with the sub-tasks' ``post_prompt``): ``"Question:" + question + "\\nOption:\\n"``, one
    ``(X) candidate`` line per candidate, then ``"Only give the best option.\\n"``; the answer is the letter."""
    lines = "".join(f"({letter}) {candidate}\n" for letter, candidate in zip(CHOICE_LETTERS, candidates))
    return "Question:" + question + "\nOption:\n" + lines + MVBENCH_POST_PROMPT


def choice_answers(clip: SceneClip) -> dict[str, int]:
    """Form -> index of the answer object, for every choice form ``clip`` answers unambiguously."""
    found: dict[str, int] = {}
    visible = [obj.visible_frames for obj in clip.objects]
    if len(clip.objects) >= 2 and all(visible):
        firsts, lasts = [v[0] for v in visible], [v[-1] for v in visible]
        latest = int(np.argmax(firsts))
        if sorted(firsts)[-2] < firsts[latest]:
            found["appears_last"] = latest
        earliest = int(np.argmin(lasts))
        if sorted(lasts)[1] > lasts[earliest] and lasts[earliest] < clip.num_frames - 1:
            found["disappears_first"] = earliest
    width = clip.frames.shape[2]
    for form, sign in (("left_to_right", 1.0), ("right_to_left", -1.0)):
        moves = [sign * (obj.end[0] - obj.start[0]) for obj in clip.objects]
        sideways = [abs(obj.end[0] - obj.start[0]) >= 2 * abs(obj.end[1] - obj.start[1]) for obj in clip.objects]
        movers = [i for i, m in enumerate(moves) if m >= MOVE_SHARE * width and sideways[i]]
        others_still = all(m < STILL_SHARE * width for i, m in enumerate(moves) if i not in movers)
        if len(movers) == 1 and others_still:
            found[form] = movers[0]
    return found


def choice_question(rng: np.random.Generator, clip: SceneClip, form: str, answer: int) -> ClipQuestion:
    """The ``form`` question whose answer is object ``answer``: four candidates, the clip's other shapes first,
    then shapes absent from the clip, shuffled."""
    right = clip.objects[answer].category
    others = [c for c in clip.categories if c != right]
    absent = [c for c in CATEGORIES if c not in clip.categories]
    wrong = [*rng.permutation(others).tolist(), *rng.permutation(absent).tolist()][: len(CHOICE_LETTERS) - 1]
    candidates = tuple(str(c) for c in rng.permutation([right, *wrong]).tolist())
    question = CHOICE_FORMS[form]
    return ClipQuestion(
        "choice", form, question, choice_prompt(question, candidates), right, right, None, candidates, (answer,)
    )


def choice_questions(rng: np.random.Generator, clip: SceneClip, count: int) -> list[ClipQuestion]:
    """``count`` choice questions, each of a form drawn uniformly among those the clip answers (none when it
    answers none)."""
    answers = choice_answers(clip)
    forms = list(answers)
    if not forms:
        return []
    drawn = [forms[int(rng.integers(len(forms)))] for _ in range(count)]
    return [choice_question(rng, clip, form, answers[form]) for form in drawn]


def clip_vocabulary_words() -> tuple[str, ...]:
    """Every word (as the demo tokenizer splits it) of the clip prompts and answers, shapes first."""
    texts = (
        *(template.format(article="an", shape="arrow") for template in PRESENCE_TEMPLATES.values()),
        *CHOICE_FORMS.values(),
        choice_prompt("", CATEGORIES[:4]),
        "a an yes no",
    )
    words = dict.fromkeys(CATEGORIES)
    for text in texts:
        words.update(dict.fromkeys(_WORD.findall(text)))
    return tuple(words)


__all__ = [
    "WINDOWS",
    "CHOICE_FORMS",
    "ClipQuestion",
    "window_frames",
    "presence_answer",
    "presence_question",
    "presence_questions",
    "choice_prompt",
    "choice_answers",
    "choice_question",
    "choice_questions",
    "clip_vocabulary_words",
]
