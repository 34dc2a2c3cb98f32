"""First-token yes/no probabilities (evaluation spec E) and the per-question :class:`Answer`.

The answer's first token decides a POPE question. ``p_yes`` sums the full-vocabulary
softmax probability of every single-token spelling of "yes" (case variants, with and
without the tokenizer's word-start marker), ``p_no`` likewise; the two-way probability
renormalises them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from prune_audit.compute.cost import PrefillCost
    from prune_audit.models.executor import Prefill
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


@dataclass(frozen=True)
class YesNo:
    """First-token yes/no reduction of one question."""

    p_yes: float
    p_no: float
    p_yes_2way: float
    logit_diff: float
    answer: str
    confidence: float


def reduce_yes_no(logits: Tensor, yes_ids: list[int], no_ids: list[int]) -> list[YesNo]:
    """Reduce (B, V) first-token logits to yes/no probabilities, one entry per row."""
    probs = torch.softmax(logits.double(), dim=-1)
    p_yes = probs[:, yes_ids].sum(dim=-1).tolist()
    p_no = probs[:, no_ids].sum(dim=-1).tolist()
    results = []
    for yes, no in zip(p_yes, p_no):
        two_way = yes / (yes + no) if yes + no > 0 else 0.5
        if yes > 0 and no > 0:
            diff = math.log(yes) - math.log(no)
        else:  # underflow of one side: the sign still says which answer wins
            diff = 0.0 if yes == no else math.copysign(math.inf, yes - no)
        results.append(
            YesNo(yes, no, two_way, diff, "yes" if two_way >= 0.5 else "no", max(two_way, 1 - two_way))
        )
    return results


@dataclass
class Answer:
    """First-token answer of one question and the provenance of the visual tokens.

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

    p_yes: float
    p_no: float
    p_yes_2way: float
    logit_diff: float
    answer: str
    confidence: float
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


def answer_record(
    num_visual: int, prefill: Prefill, b: int, selection: Selection | None, reduced: YesNo, latency: float,
    latency_parts: dict[str, float],
) -> Answer:
    """Row ``b`` of a pruned prefill as an :class:`Answer`.

    ``selection`` is the row's input-level selection (None for in-LLM selectors and
    unpruned runs, whose kept sets come from ``prefill``); ``num_visual`` the grid size.
    """
    if selection is not None:
        kept_stages, stage_layers, merged_stages = [selection.kept.tolist()], [0], [selection.merged_sources()]
    else:
        kept_stages = prefill.kept_stages[b]
        stage_layers, merged_stages = prefill.stage_layers[b], prefill.merged_stages[b]
    counts = prefill.tokens_per_layer[b]
    return Answer(
        p_yes=reduced.p_yes,
        p_no=reduced.p_no,
        p_yes_2way=reduced.p_yes_2way,
        logit_diff=reduced.logit_diff,
        answer=reduced.answer,
        confidence=reduced.confidence,
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



__all__ = ["answer_token_ids", "YesNo", "reduce_yes_no", "Answer", "answer_record"]
