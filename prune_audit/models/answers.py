"""First-token yes/no probabilities (evaluation spec E).

The answer's first token decides a POPE question. ``p_yes`` sums the full-vocabulary
softmax probability of every single-token spelling of "yes" (case variants, with and
without the tokenizer's word-start marker), ``p_no`` likewise; the two-way probability
renormalises them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

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


__all__ = ["answer_token_ids", "YesNo", "reduce_yes_no"]
