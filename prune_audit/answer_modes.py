"""Answer modes and their reductions: how a question is answered, and what the answer is.

A task (``prune_audit.tasks``) chooses the mode of each question and scores the reduction;
the model (``models.answers``, ``VisionLanguageModel.answer``) carries the mode out and fills
the reduction. This plain, torch-free module sits below both, so that reading a run's task
never loads torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prune_audit.errors import PruneAuditError

MAX_NEW_TOKENS = 1_000_000
"""The largest generation limit taken (``--max-new-tokens``, ``max_new_tokens=``): a million new tokens is past
every model's context; each model's own positions are checked against the prompt too (``models.context``)."""


@dataclass(frozen=True)
class YesNoMode:
    """Answer by the first token's yes/no probabilities (``models.answers.reduce_yes_no``)."""


YES_NO = YesNoMode()


@dataclass(frozen=True)
class OptionLetters:
    """Answer by the first token over ``letters`` (``("A", "B", ...)``), ``models.answers.reduce_letters``."""

    letters: tuple[str, ...]


@dataclass(frozen=True)
class Greedy:
    """Answer by greedy decoding of at most ``max_new_tokens`` tokens after the pruned prefill."""

    max_new_tokens: int


def check_max_new_tokens(value: object, name: str = "max_new_tokens") -> int:
    """``value`` when it is a whole number from 1 to :data:`MAX_NEW_TOKENS`; else one line naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        raise PruneAuditError(
            f"{name} must be a whole number from 1 to {MAX_NEW_TOKENS:,}, got {value!r}; pass how "
            f"many tokens an answer may have at most"
        )
    return value


@dataclass(frozen=True)
class Continuation:
    """Score ``text`` as the answer: teacher-forced through the pruned KV cache (``models.answers.score_continuation``),
    the log-probability of its tokens (leading whitespace removed, tokenized alone, as greedy answers are stripped)."""

    text: str


AnswerMode = YesNoMode | OptionLetters | Greedy | Continuation
"""How one question is answered."""


@dataclass(frozen=True)
class YesNo:
    """First-token yes/no reduction of one question."""

    p_yes: float
    p_no: float
    p_yes_2way: float
    logit_diff: float
    answer: str
    confidence: float

    @classmethod
    def from_probabilities(cls, p_yes: float, p_no: float) -> YesNo:
        """The reduction of full-vocabulary ``p_yes`` and ``p_no``: two-way renormalised (0.5 when both are 0),
        the answer by the two-way probability (yes on a tie) and its log-odds."""
        two_way = p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.5
        if p_yes > 0 and p_no > 0:
            diff = math.log(p_yes) - math.log(p_no)
        else:  # underflow of one side: the sign still says which answer wins
            diff = 0.0 if p_yes == p_no else math.copysign(math.inf, p_yes - p_no)
        return cls(p_yes, p_no, two_way, diff, "yes" if two_way >= 0.5 else "no", max(two_way, 1 - two_way))


@dataclass(frozen=True)
class LetterChoice:
    """First-token reduction over option letters.

    Attributes:
        letter_probs: full-vocabulary probability of each offered letter (its spellings summed), in letter order.
        answer: the most probable letter (the first on a tie).
        confidence: the answer's probability renormalised over the offered letters.
    """

    letter_probs: tuple[float, ...]
    answer: str
    confidence: float

    @classmethod
    def from_probabilities(cls, letter_probs: tuple[float, ...], letters: tuple[str, ...]) -> LetterChoice:
        """The reduction of each letter's full-vocabulary probability: the first most probable letter."""
        total = sum(letter_probs)
        best = max(range(len(letter_probs)), key=lambda k: letter_probs[k])  # ties go to the earlier letter
        confidence = letter_probs[best] / total if total > 0 else 1 / len(letter_probs)
        return cls(tuple(letter_probs), letters[best], confidence)


@dataclass(frozen=True)
class Generation:
    """Greedy decoding of one question.

    Attributes:
        answer: the decoded text, special tokens skipped, stripped.
        token_probs: probability of each generated token (full-vocabulary softmax), the end token excluded; empty
            for a generation known only by its summary (:meth:`from_summary`, an imported answer).
        confidence: the sequence probability, the product of the token probabilities (1.0 for an empty answer).
        stopped: the model emitted an end-of-sequence token (False: cut at ``max_new_tokens``).
        mean_token_prob: the length-normalised probability, the geometric mean of the token probabilities (1.0 for
            an empty answer).
        answer_tokens: number of generated tokens.
    """

    answer: str
    token_probs: tuple[float, ...]
    confidence: float
    stopped: bool
    mean_token_prob: float
    answer_tokens: int

    @classmethod
    def from_token_probs(cls, answer: str, token_probs: tuple[float, ...], stopped: bool) -> Generation:
        """The generation of tokens of these probabilities (the mean of logs, so long answers do not underflow)."""
        logs = [math.log(p) if p > 0 else -math.inf for p in token_probs]
        mean_log = sum(logs) / len(logs) if logs else 0.0
        return cls(
            answer, tuple(token_probs), float(math.prod(token_probs)), stopped, math.exp(mean_log), len(token_probs)
        )

    @classmethod
    def from_summary(
        cls, answer: str, sequence_prob: float, mean_token_prob: float, answer_tokens: int, stopped: bool
    ) -> Generation:
        """A generation known by its summary only (no per-token probabilities)."""
        return cls(answer, (), sequence_prob, stopped, mean_token_prob, answer_tokens)


@dataclass(frozen=True)
class ContinuationScore:
    """A given answer scored under the pruned prefill (lmms-eval's ``loglikelihood`` request).

    Attributes:
        answer: the scored continuation, as given.
        token_probs: probability of each continuation token given the prompt and the tokens before it
            (full-vocabulary softmax).
        log_probability: sum of the tokens' log-probabilities (0.0 for a continuation of no tokens).
        is_greedy: every continuation token is the argmax at its position (greedy decoding would produce it);
            lmms-eval's ``is_greedy``.
        confidence: the continuation's probability, ``exp(log_probability)``.
    """

    answer: str
    token_probs: tuple[float, ...]
    log_probability: float
    is_greedy: bool

    @property
    def confidence(self) -> float:
        return math.exp(self.log_probability)


Reduction = YesNo | LetterChoice | Generation | ContinuationScore
"""What an answer mode makes of one question's logits."""


__all__ = [
    "YES_NO",
    "AnswerMode",
    "Continuation",
    "ContinuationScore",
    "Generation",
    "Greedy",
    "LetterChoice",
    "OptionLetters",
    "Reduction",
    "YesNo",
    "YesNoMode",
]
