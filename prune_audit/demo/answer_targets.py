"""Teacher-forced answer targets of the demo trainer: the first token, or every answer token and the end.

A yes/no or multiple-choice question is answered by its first token (POPE's and ScienceQA's
answer modes), so its loss is the cross-entropy of that token at the prompt's last position.
A short answer or a caption is generated, so its loss covers every answer token and the
end-of-sequence token that stops greedy decoding: the answer (but its end) is appended to the
prompt suffix and each position predicts the next token. Each question weighs the same: its
tokens' losses are averaged, then the questions'.

Teacher-forced exact match equals greedy decoding's: greedy output equals the reference
exactly when the argmax at every forced position is the reference token (ties aside), so the
trainer's monitor measures what ``prune-audit run`` would score, without decoding step by step.

A multiple-choice answer needs two hops: which offered shape is present, then its letter. Trained on
the letter alone, the from-scratch demo stayed at chance (0.20-0.32 after 1,000-1,200 steps on both
demos) while every other kind learned. So each option also gets a dense auxiliary target, as the
vision tower gets its patch loss: at the position of the option's last word, the language model's own
head, restricted to ``yes``/``no``, says whether that shape is in the image (``option_loss``). These
are prompt positions, which decoding never samples from, so nothing a user runs reads them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.data.boxes import Box, box_iou
from prune_audit.data.pope_build import question_text
from prune_audit.demo.batches import MixQuestion, Question
from prune_audit.demo.evaluate import prompt_ids, prompt_text
from prune_audit.demo.scene_questions import BOX_NUMBERS, CHOICE_LETTERS

GENERATED_KINDS = ("short", "caption", "text", "ground")
"""The question kinds answered by generation (every answer token and the end trained)."""

if TYPE_CHECKING:
    from prune_audit.models.base import VisionLanguageModel


@dataclass(frozen=True)
class AnswerTarget:
    """What one training question asks and must answer.

    Attributes:
        prompt: question text with its instruction and options, before the chat template.
        answer: the reference answer text.
        every_token: generated answers: loss on every answer token and the end token; else the first token.
        letters: the offered option letters (multiple choice): the answer is the likeliest of them.
        options: the offered option texts, in letter order (multiple choice).
        present: per option whether it is in the image (the auxiliary option targets).
        option_line: how the prompt writes an option's line (``str.format`` of ``letter`` and ``option``), whose
            last token the option target is trained at.
    """

    prompt: str
    answer: str
    every_token: bool
    letters: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    present: tuple[bool, ...] = ()
    option_line: str = "{letter}. {option}"


def answer_target(question: Question | MixQuestion, instruction: str) -> AnswerTarget:
    """The target of a training question; ``instruction`` follows a yes/no question (as POPE prompts vary)."""
    if isinstance(question, Question):
        return AnswerTarget(f"{question_text(question.category)} {instruction}".strip(), question.answer, False)
    asked = question.question
    if asked.kind == "yesno":
        return AnswerTarget(f"{asked.prompt} {instruction}".strip(), asked.answer, False)
    if asked.kind != "choice":
        return AnswerTarget(asked.prompt, asked.answer, asked.kind in GENERATED_KINDS)
    letters = CHOICE_LETTERS[: len(asked.options)]
    present = tuple(letter == asked.answer for letter in letters)
    return AnswerTarget(asked.prompt, asked.answer, False, letters, asked.options, present)


@dataclass(frozen=True)
class PromptPieces:
    """Token ids of the training prompts, split around the image span.

    Attributes:
        prefix: (P,) ids up to and including the last ``<image>`` (shared by all prompts).
        image_positions: (N,) positions of the ``<image>`` tokens in ``prefix``.
        num_image_tokens: N.
        suffixes: prompt text (before the chat template) -> (T,) ids after the image span, filled on use.
    """

    prefix: Tensor
    image_positions: Tensor
    num_image_tokens: int
    suffixes: dict[str, Tensor] = field(default_factory=dict)

    def suffix(self, vlm: VisionLanguageModel, text: str) -> Tensor:
        """(T,) ids after the image span of ``text``'s chat prompt (cached: prompts repeat across steps)."""
        if text not in self.suffixes:
            ids = prompt_ids(vlm, prompt_text(vlm, text), self.num_image_tokens)
            end = int((ids == vlm.model.config.image_token_id).nonzero().max()) + 1
            if not torch.equal(self.prefix, ids[:end]):
                raise ValueError("the chat template puts text before the image that depends on the question")
            self.suffixes[text] = ids[end:]
        return self.suffixes[text]


def prompt_pieces(vlm: VisionLanguageModel, num_image_tokens: int) -> PromptPieces:
    """The shared image prefix of the chat prompts (probed with one question) and an empty suffix cache."""
    ids = prompt_ids(vlm, prompt_text(vlm, question_text("circle")), num_image_tokens)
    image_id = vlm.model.config.image_token_id
    end = int((ids == image_id).nonzero().max()) + 1
    prefix = ids[:end]
    return PromptPieces(prefix, (prefix == image_id).nonzero().flatten(), num_image_tokens)


@dataclass(frozen=True)
class TeacherForcing:
    """Suffixes with their answers appended, and where each target token is predicted.

    Attributes:
        suffixes: per question (T_i,) ids: prompt suffix, then the answer tokens but the last target.
        rows: (K,) question index of each target token.
        cols: (K,) suffix position whose logits predict it (0 when ``every_position`` is False).
        targets: (K,) target token ids.
        allowed: per question the token ids its answer is chosen among (None: the full vocabulary).
        every_position: whether the logits are needed at every position (some answer is generated, or
            some question offers options).
        option_rows: (O,) question index of each offered option (multiple choice).
        option_cols: (O,) suffix position of the option's last word.
        option_present: (O,) bool, whether the option is in the image.
        yes_no: (2,) the ids of ``yes`` and ``no``, the auxiliary option answer.
        numbers: (K,) the value of each target token that is a box number (``BOX_NUMBERS``), NaN for the others.
        number_ids: (B,) the ids of the box numbers the vocabulary holds, (B,) ``number_values`` their values.
    """

    suffixes: list[Tensor]
    rows: Tensor
    cols: Tensor
    targets: Tensor
    allowed: list[Tensor | None]
    every_position: bool
    option_rows: Tensor
    option_cols: Tensor
    option_present: Tensor
    yes_no: Tensor
    numbers: Tensor
    number_ids: Tensor
    number_values: Tensor


def teacher_forcing(vlm: VisionLanguageModel, pieces: PromptPieces, targets: Sequence[AnswerTarget]) -> TeacherForcing:
    """Build the forced suffixes of ``targets`` (first-token answers add nothing to their prompt)."""
    every_position = any(target.every_token or target.options for target in targets)
    end_id = vlm.eos_ids()[0]
    suffixes, rows, cols, tokens, allowed = [], [], [], [], []
    option_rows, option_cols, option_present = [], [], []
    for row, target in enumerate(targets):
        prompt = pieces.suffix(vlm, target.prompt)
        for letter, option, present in zip(target.letters, *_offered(target)):
            option_rows.append(row)
            option_cols.append(_option_end(vlm, prompt, target.option_line.format(letter=letter, option=option)))
            option_present.append(present)
        answer = vlm.tokenizer(target.answer, add_special_tokens=False).input_ids
        forced = [*answer, end_id] if target.every_token else answer[:1]
        suffixes.append(torch.cat([prompt, torch.tensor(forced[:-1], dtype=prompt.dtype)]))
        last = prompt.numel() - 1 if every_position else 0
        rows += [row] * len(forced)
        cols += range(last, last + len(forced))
        tokens += forced
        allowed.append(
            torch.tensor(vlm.tokenizer.convert_tokens_to_ids(list(target.letters))) if target.letters else None
        )
    yes_no = torch.tensor(vlm.tokenizer.convert_tokens_to_ids(["yes", "no"]))
    vocabulary = vlm.tokenizer.get_vocab()
    number_of = {vocabulary[word]: float(word) for word in BOX_NUMBERS if word in vocabulary}
    return TeacherForcing(
        suffixes,
        torch.tensor(rows),
        torch.tensor(cols),
        torch.tensor(tokens),
        allowed,
        every_position,
        torch.tensor(option_rows, dtype=torch.long),
        torch.tensor(option_cols, dtype=torch.long),
        torch.tensor(option_present, dtype=torch.bool),
        yes_no,
        torch.tensor([number_of.get(token, math.nan) for token in tokens]),
        torch.tensor(list(number_of), dtype=torch.long),
        torch.tensor(list(number_of.values())),
    )


def _offered(target: AnswerTarget) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """The option texts and their presence (both empty when the target names no option texts)."""
    if len(target.options) != len(target.present) or len(target.options) > len(target.letters):
        raise ValueError("a choice target needs one presence flag and one letter per option")
    return target.options, target.present


def _option_end(vlm: VisionLanguageModel, suffix: Tensor, text: str) -> int:
    """The position in ``suffix`` of the last token of the option line ``text``."""
    line = vlm.tokenizer(text, add_special_tokens=False).input_ids
    ids = suffix.tolist()
    for start in range(len(ids) - len(line) + 1):
        if ids[start : start + len(line)] == line:
            return start + len(line) - 1
    raise ValueError(f"the option line {text} is not in its prompt's tokens")


def option_loss(logits: Tensor, forcing: TeacherForcing) -> Tensor:
    """Cross-entropy of yes (present) / no at each offered option's last word, over those two logits.

    Args:
        logits: (Q, T, V) at every position.
    """
    pair = logits[forcing.option_rows, forcing.option_cols][:, forcing.yes_no].float()
    return F.cross_entropy(pair, (~forcing.option_present).long())


def answer_loss(logits: Tensor, forcing: TeacherForcing, box_sigma: float | None = None) -> Tensor:
    """Mean over questions of the mean cross-entropy of their target tokens.

    Args:
        logits: (Q, T, V) with ``forcing.every_position``, else (Q, V).
        box_sigma: a box number's target is a Gaussian of this width over the box numbers (``box_number_targets``)
            instead of its one word; None: every target is its one word.
    """
    if not forcing.every_position:  # one token per question: the plain mean, as before the task mix
        return F.cross_entropy(logits[forcing.rows].float(), forcing.targets)
    token_loss = F.cross_entropy(logits[forcing.rows, forcing.cols].float(), forcing.targets, reduction="none")
    is_number = ~forcing.numbers.isnan()
    if box_sigma is not None and bool(is_number.any()):
        number_logits = logits[forcing.rows[is_number], forcing.cols[is_number]].float()
        soft = box_number_targets(forcing, forcing.numbers[is_number], box_sigma, number_logits.shape[-1])
        token_loss = token_loss.masked_scatter(is_number, -(soft * number_logits.log_softmax(-1)).sum(-1))
    questions = len(forcing.suffixes)
    counts = torch.zeros(questions).index_add_(0, forcing.rows, torch.ones_like(token_loss))
    return (torch.zeros(questions).index_add_(0, forcing.rows, token_loss) / counts).mean()


def box_number_targets(forcing: TeacherForcing, values: Tensor, sigma: float, vocabulary_size: int) -> Tensor:
    """(N, V) target distributions of N box numbers of ``values``: over the box-number words, proportional to
    exp(-(w - v)^2 / (2 sigma^2)) for the word of value w, so a near miss costs less than a far one (a one-word target
    treats 0.31 for 0.30 as wrong as 0.90; boxes of the one-word target stayed near-constant, the card)."""
    weights = torch.exp(-((forcing.number_values[None] - values[:, None]) ** 2) / (2 * sigma**2))
    soft = torch.zeros(len(values), vocabulary_size)
    soft[:, forcing.number_ids] = weights / weights.sum(-1, keepdim=True)
    return soft


def forced_box_hits(logits: Tensor, forcing: TeacherForcing, tolerance: float = 0.5) -> Tensor:
    """(Q,) bool: the question's target writes a box (four box numbers) and the box of the argmax numbers at those
    positions has IoU >= ``tolerance`` with it (Acc@0.5 under teacher forcing: the other box tokens forced).

    Args:
        logits: (Q, T, V) at every position.
    """
    is_number = ~forcing.numbers.isnan()
    rows = forcing.rows[is_number]
    argmax = logits[rows, forcing.cols[is_number]].argmax(-1)
    value_of = dict(zip(forcing.number_ids.tolist(), forcing.number_values.tolist(), strict=True))
    hits = torch.zeros(len(forcing.suffixes), dtype=torch.bool)
    for row in rows.unique().tolist():
        mine = rows == row
        truth = forcing.numbers[is_number][mine].tolist()
        guess = [value_of.get(token, math.nan) for token in argmax[mine].tolist()]
        if len(truth) == 4 and not any(math.isnan(v) for v in guess):
            hits[row] = box_iou(Box(*guess), Box(*truth)) >= tolerance
    return hits


def exact_matches(logits: Tensor, forcing: TeacherForcing) -> Tensor:
    """(Q,) bool: every target token is the argmax at its position (among the offered letters for a choice)."""
    per_position = (logits if forcing.every_position else logits[:, None])[forcing.rows, forcing.cols]
    masked = per_position.clone()
    for k, row in enumerate(forcing.rows.tolist()):
        if forcing.allowed[row] is not None:
            keep = torch.full_like(masked[k], -torch.inf)
            keep[forcing.allowed[row]] = masked[k, forcing.allowed[row]]
            masked[k] = keep
    hits = (masked.argmax(dim=-1) == forcing.targets).float()
    questions = len(forcing.suffixes)
    wrong = torch.zeros(questions).index_add_(0, forcing.rows, 1 - hits)
    return wrong == 0
