"""How a model answers (answer modes), their reductions, and the per-question :class:`Answer`.

Three answer modes, chosen by the task (``prune_audit.tasks``), never by the model:

- :data:`YES_NO` (POPE, evaluation spec E): the first token decides. ``p_yes`` sums the
  full-vocabulary softmax probability of every single-token spelling of "yes" (case variants,
  with and without the tokenizer's word-start marker), ``p_no`` likewise; the two-way
  probability renormalises them.
- :class:`OptionLetters` (multiple choice): the first token over the offered letters, each
  letter's spellings summed as for yes/no; the chosen letter's probability renormalised over
  the offered letters is the confidence.
- :class:`Greedy` (short answers, captions): greedy decoding that reuses the pruned KV cache;
  the product of the generated tokens' probabilities is the sequence probability.
- :class:`Continuation` (lmms-eval's loglikelihood requests): a given answer fed token by token through
  the same pruned KV cache (teacher forcing); its log-probability and whether greedy decoding would produce it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from prune_audit.answer_modes import (
    YES_NO,
    AnswerMode,
    Continuation,
    ContinuationScore,
    Generation,
    Greedy,
    LetterChoice,
    OptionLetters,
    Reduction,
    YesNo,
    YesNoMode,
)
from prune_audit.errors import PruneAuditError

if TYPE_CHECKING:
    from prune_audit.compute.cost import PrefillCost
    from prune_audit.models.executor import LanguageLoop, Prefill
    from prune_audit.pruners.base import Selection

# word-start markers: SentencePiece (Llama) and byte-level BPE (Qwen)
_PREFIXES = ("", "\u2581", "\u0120")


def answer_token_ids(tokenizer, word: str) -> list[int]:
    """Ascending ids of the single tokens spelling ``word`` (lower/Capital/UPPER, with/without space)."""
    unknown = tokenizer.unk_token_id
    vocabulary = tokenizer.get_vocab()
    ids = set()
    for variant in {word.lower(), word.capitalize(), word.upper()}:
        for prefix in _PREFIXES:
            token_id = vocabulary.get(prefix + variant)
            if token_id is not None and token_id != unknown:
                ids.add(token_id)
        for text in (variant, " " + variant):
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] != unknown:
                ids.add(encoded[0])
    return sorted(ids)


def reduce_yes_no(logits: Tensor, yes_ids: list[int], no_ids: list[int]) -> list[YesNo]:
    """Reduce (B, V) first-token logits to yes/no probabilities, one entry per row."""
    probs = torch.softmax(logits.double(), dim=-1)
    p_yes = probs[:, yes_ids].sum(dim=-1).tolist()
    p_no = probs[:, no_ids].sum(dim=-1).tolist()
    return [YesNo.from_probabilities(yes, no) for yes, no in zip(p_yes, p_no)]


def letter_token_ids(tokenizer, letter: str, model_id: str) -> list[int]:
    """The single tokens spelling an option letter (case and word-start variants, as yes/no); a one-line
    PruneAuditError naming ``model_id`` when there is none."""
    ids = answer_token_ids(tokenizer, letter)
    if not ids:
        raise PruneAuditError(f"the tokenizer of {model_id} has no single token for the option letter {letter!r}")
    return ids


def reduce_letters(logits: Tensor, letter_ids: Sequence[Sequence[int]], letters: Sequence[str]) -> list[LetterChoice]:
    """Reduce (B, V) first-token logits over the letters whose token ids are ``letter_ids[k]``, one entry per row."""
    probs = torch.softmax(logits.double(), dim=-1)
    per_letter = torch.stack([probs[:, list(ids)].sum(dim=-1) for ids in letter_ids], dim=-1)  # (B, K)
    return [LetterChoice.from_probabilities(tuple(row), tuple(letters)) for row in per_letter.tolist()]


def greedy_generations(
    loop: LanguageLoop, prefill: Prefill, eos_ids: Sequence[int], tokenizer, max_new_tokens: Sequence[int]
) -> list[Generation]:
    """Greedy decoding of every row of a cached prefill (``use_cache=True``), one :class:`Generation` per row.

    Each step feeds every row its argmax token through ``loop.decode_step`` (which reuses the pruned KV
    cache); a row that emitted an end token or reached its own ``max_new_tokens[b]`` keeps being fed (its
    attention is its own, so the others do not change) until every row is done.
    """
    if min(max_new_tokens) < 1:
        raise PruneAuditError(f"max_new_tokens must be at least 1, got {min(max_new_tokens)}")
    stop = set(eos_ids)
    rows = prefill.logits.shape[0]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    probs: list[list[float]] = [[] for _ in range(rows)]
    stopped = [False] * rows
    logits = prefill.logits
    for step in range(max(max_new_tokens)):
        chosen = logits.argmax(dim=-1)
        chosen_probs = torch.softmax(logits.double(), dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        for b, (token, prob) in enumerate(zip(chosen.tolist(), chosen_probs)):
            if stopped[b] or step >= max_new_tokens[b]:
                continue
            if token in stop:
                stopped[b] = True
            else:
                tokens[b].append(token)
                probs[b].append(prob)
        if all(done or step >= limit - 1 for done, limit in zip(stopped, max_new_tokens)):
            break
        logits = loop.decode_step(prefill.decode, chosen)
    return [
        Generation.from_token_probs(tokenizer.decode(row, skip_special_tokens=True).strip(), tuple(row_probs), done)
        for row, row_probs, done in zip(tokens, probs, stopped)
    ]


def continuation_token_ids(tokenizer, text: str) -> list[int]:
    """The tokens a greedy answer spelling ``text`` would consist of: leading whitespace removed (the prompt ends
    at the assistant's turn, and greedy answers are stripped), encoded alone without special tokens."""
    return tokenizer.encode(text.lstrip(), add_special_tokens=False) if text.strip() else []


def score_continuation(
    loop: LanguageLoop, prefill: Prefill, token_ids: Sequence[int], text: str
) -> list[ContinuationScore]:
    """Teacher-forced scoring of the same continuation (``token_ids``, spelling ``text``) on every row of a cached
    prefill (``use_cache=True``), one :class:`ContinuationScore` per row.

    Token ``k`` is scored by the (B, V) logits after the prompt and tokens ``< k``, fed through
    ``loop.decode_step`` as greedy decoding feeds its own tokens, so a continuation equal to the greedy answer
    gets exactly the greedy answer's probabilities. Log-probabilities are taken in float64 (no underflow).
    """
    rows = prefill.logits.shape[0]
    log_probs: list[list[float]] = [[] for _ in range(rows)]
    greedy = [True] * rows
    logits = prefill.logits
    for step, token in enumerate(token_ids):
        chosen = torch.full((rows,), token, dtype=torch.long, device=logits.device)
        scores = torch.log_softmax(logits.double(), dim=-1)[:, token].tolist()
        for b, (score, best) in enumerate(zip(scores, logits.argmax(dim=-1).tolist())):
            log_probs[b].append(score)
            greedy[b] = greedy[b] and best == token
        if step < len(token_ids) - 1:
            logits = loop.decode_step(prefill.decode, chosen)
    return [
        ContinuationScore(text, tuple(math.exp(x) for x in row), float(sum(row)), is_greedy)
        for row, is_greedy in zip(log_probs, greedy)
    ]


@dataclass
class Answer:
    """The answer of one question (``reduced``, by its mode) and the provenance of the visual tokens.

    ``kept_stages`` holds the kept grid indices after each stage (one entry for
    input-level selection, none unpruned); ``kept`` those reaching the last layer;
    ``merged_stages`` per stage, the ascending grid indices each merged token alive
    after it carries, in feed order (an input-level merge such as VisionZip's
    contextual tokens at its single stage, an in-LLM merge at each of its stages;
    empty lists without merging).
    ``latency_ms`` is the wall time of the batch prefill (vision, selection,
    language model) divided by the batch size; ``latency_parts`` splits it the same way
    into ``vision``, ``selection`` (input-level signals and selection; in-LLM selectors
    score inside ``prefill``) and ``prefill`` (the decoder layers and the LM head).
    ``cost`` holds the analytic FLOPs and KV-cache bytes (``prune_audit.compute``).
    """

    reduced: Reduction
    kept: list[int]
    kept_stages: list[list[int]]
    stage_layers: list[int]
    tokens_per_layer: list[int]
    visual_tokens_avg: float
    prefill_tokens: int
    latency_ms: float
    merged_stages: list[list[list[int]]] = field(default_factory=list)
    latency_parts: dict[str, float] = field(default_factory=dict)
    cost: PrefillCost | None = None

    @property
    def answer(self) -> str:
        """ "yes"/"no", the chosen letter, or the generated text."""
        return self.reduced.answer

    @property
    def confidence(self) -> float:
        return self.reduced.confidence

    @property
    def yes_no(self) -> YesNo:
        """The yes/no reduction; a ValueError for an answer given in another mode."""
        if not isinstance(self.reduced, YesNo):
            raise ValueError(f"this answer was not given by its yes/no first token ({type(self.reduced).__name__})")
        return self.reduced

    @property
    def p_yes(self) -> float:
        return self.yes_no.p_yes

    @property
    def p_no(self) -> float:
        return self.yes_no.p_no

    @property
    def p_yes_2way(self) -> float:
        return self.yes_no.p_yes_2way

    @property
    def logit_diff(self) -> float:
        return self.yes_no.logit_diff


def answer_record(
    num_visual: int,
    prefill: Prefill,
    b: int,
    selection: Selection | None,
    reduced: Reduction,
    latency: float,
    latency_parts: dict[str, float],
) -> Answer:
    """Row ``b`` of a pruned prefill as an :class:`Answer`.

    ``selection`` is the row's input-level selection (None for in-LLM selectors and
    unpruned runs), its stage first; the in-LLM stages come from ``prefill`` (a composed selector has both: the
    in-LLM kept sets are grid indices, and an input merged token alive there is a merged entry, CLS without cells
    an empty one); ``num_visual`` the grid size.
    """
    kept_stages, stage_layers = list(prefill.kept_stages[b]), list(prefill.stage_layers[b])
    merged_stages = list(prefill.merged_stages[b]) if prefill.merged_stages else [[] for _ in kept_stages]
    if selection is not None:  # the input stage at layer 0, before any in-LLM stage (a composed selector's)
        tower = selection.tower_stages  # a tower selector's cuts before it (negative stage layers)
        kept_stages = [*(cells.tolist() for _, cells in tower), selection.kept.tolist(), *kept_stages]
        stage_layers = [*(layer for layer, _ in tower), 0, *stage_layers]
        merged_stages = [*([] for _ in tower), selection.merged_sources(), *merged_stages]
    counts = prefill.tokens_per_layer[b]
    return Answer(
        reduced=reduced,
        kept=kept_stages[-1] if kept_stages else list(range(num_visual)),
        kept_stages=kept_stages,
        stage_layers=stage_layers,
        tokens_per_layer=counts,
        visual_tokens_avg=sum(counts) / len(counts),
        prefill_tokens=prefill.prefill_tokens[b],
        latency_ms=latency,
        merged_stages=merged_stages,
        latency_parts=latency_parts,
    )


__all__ = [
    "YES_NO",
    "AnswerMode",
    "Answer",
    "Continuation",
    "ContinuationScore",
    "Generation",
    "Greedy",
    "LetterChoice",
    "OptionLetters",
    "Reduction",
    "YesNo",
    "YesNoMode",
    "answer_record",
    "answer_token_ids",
    "continuation_token_ids",
    "greedy_generations",
    "letter_token_ids",
    "reduce_letters",
    "reduce_yes_no",
    "score_continuation",
]
