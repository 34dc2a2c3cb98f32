"""What a record's values obey beyond their column types, defined once for every writer of records.

``run`` checks each record it writes (``RecordStore.append``); ``import`` checks each line of a kept-set file
with the same rules before anything is written (``records.interchange``, ``runner.imported``), naming the line.
Each rule returns None when the values obey it, else what is wrong with them, in words. Torch-free.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from prune_audit.records.schema import COST_COLUMNS, TIMING_COLUMNS, Record

PROBABILITY_SLACK = 1e-3
"""How far probabilities of disjoint outcomes may sum beyond 1 (the softmax of a half-precision model rounds)."""
LOG_SLACK = 1e-6
"""How far a generation's log sequence probability may differ from answer_tokens x its log mean token probability
(both are computed from the same token probabilities in double precision)."""
UNDERFLOW_LOG = math.log(sys.float_info.min)
"""Below this log probability (the smallest normal double, about 2.2e-308) a double is 0 or subnormal, with fewer
significant bits the closer it is to 0: a long answer's sequence probability, a product of its token probabilities,
underflows there and loses the relative precision the comparison with its mean token probability needs (a 484-token
caption's 5.484e-322 lies 2.4 % from 0.2169 to the 484th power)."""
BUDGET_FACTOR = 2.0
"""How far (a factor either way, give or take a token) the realised visual tokens may lie from the budget: in-LLM
schedules realise their budget on average only (PDrop's paper rule: 62.1 for 64)."""
INT64_MAX = 2**63 - 1
_COST_TYPES = {
    column.name: column.type
    for column in COST_COLUMNS
    if column.name not in TIMING_COLUMNS and not pa.types.is_list(column.type)
}
"""The analytic cost columns (FLOPs, KV bytes, equivalent tokens) and their Arrow types."""


def disjoint_probabilities_problem(names: str, probabilities: Sequence[float]) -> str | None:
    """Full-vocabulary probabilities of disjoint answers (p_yes and p_no; the offered letters) sum to at most 1."""
    total = math.fsum(probabilities)
    if total > 1 + PROBABILITY_SLACK:
        return f"{names} sum to {total:.4g}, but probabilities of different answers sum to at most 1"
    return None


def generation_problem(text: str, sequence_prob: float, mean_token_prob: float, answer_tokens: int) -> str | None:
    """A generation's summary agrees with itself: the sequence probability is the mean token probability to the
    power of the answer's tokens, and a text took at least one token (an answer of none is empty, at probability
    1; generated tokens may still decode to an empty text, such as whitespace)."""
    if answer_tokens == 0:
        if text.strip() or sequence_prob != 1 or mean_token_prob != 1:
            return (
                f"an answer of 0 tokens is the empty text at probability 1, got {text[:30]!r} at sequence "
                f"probability {sequence_prob:.4g}"
            )
        return None
    log_sequence = math.log(sequence_prob) if sequence_prob > 0 else -math.inf
    log_mean = answer_tokens * math.log(mean_token_prob) if mean_token_prob > 0 else -math.inf
    if max(log_sequence, log_mean) < UNDERFLOW_LOG or abs(log_sequence - log_mean) <= LOG_SLACK * answer_tokens:
        return None
    return (
        f"sequence probability {sequence_prob:.4g} is not mean token probability {mean_token_prob:.4g} to the "
        f"power of its {answer_tokens} tokens ({math.exp(log_mean):.4g})"
    )


def stage_cells_problem(kept: Sequence[int], merged: Sequence[Sequence[int]]) -> str | None:
    """A stage's kept cells reach the model through their own tokens only, and each merged token carries distinct
    cells that are not kept. Merged tokens may share a cell: adaptive average pooling's bins overlap by a cell where
    the pooled grid does not divide the grid (``pool``'s documented bins)."""
    kept_cells = set(kept)
    for sources in merged:
        twice = kept_cells.intersection(sources)
        if twice:
            return (
                f"grid cell {min(twice)} is both kept and merged; a kept cell reaches the model through its own token"
            )
        if len(set(sources)) != len(sources):
            cell = next(i for i in sources if sources.count(i) > 1)
            return f"a merged token carries grid cell {cell} twice; a token averages distinct cells"
    return None


def visual_tokens_problem(fed: int, num_visual: int) -> str | None:
    """A stage feeds at most the image's visual tokens: pruning removes tokens, it never adds them."""
    if fed > num_visual:
        return f"{fed} visual tokens, but the image has {num_visual}; a stage feeds at most the image's tokens"
    return None


def budget_problem(budget: Any, expected: float, realised: float) -> str | None:
    """The visual tokens a run realised on average lie near what its ``budget`` keeps on the same images
    (``expected``: the budget resolved per image, at most its tokens)."""
    if realised > BUDGET_FACTOR * expected + 1 or realised < expected / BUDGET_FACTOR - 1:
        return (
            f"budget {budget} keeps {expected:.4g} visual tokens on average on these images, but the kept sets "
            f"feed {realised:.4g}"
        )
    return None


def cost_problem(cost: Mapping[str, Any]) -> str | None:
    """The analytic cost columns fit their types (whole numbers within int64 for the integer ones, finite and
    non-negative) and flops is the sum of its parts."""
    for name, value in cost.items():
        if name not in _COST_TYPES or value is None:
            continue
        if not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        ):
            return f"{name} must be a finite non-negative number, got {value!r}"
        if pa.types.is_integer(_COST_TYPES[name]) and not (float(value).is_integer() and value <= INT64_MAX):
            return f"{name} must be a whole number of at most {INT64_MAX}, got {value!r}"
    parts: list[Any] = [cost.get(name) for name in ("flops_vision", "flops_selector", "flops_llm")]
    if cost.get("flops") is not None and None not in parts and cost["flops"] != sum(parts):
        return f"flops {cost['flops']} is not flops_vision + flops_selector + flops_llm ({sum(parts)})"
    return None


def record_problem(record: Record) -> str | None:
    """The first rule above that a run record (``RUN_SCHEMA`` columns) breaks, or None."""
    checks = [cost_problem(record)]
    checks += [
        stage_cells_problem(kept, merged) for kept, merged in zip(record["kept_stages"], record["merged_stages"])
    ]
    if record.get("p_yes") is not None:
        checks.append(disjoint_probabilities_problem("p_yes and p_no", [record["p_yes"], record["p_no"]]))
    if record.get("letter_probs") is not None:
        checks.append(disjoint_probabilities_problem("letter_probs", record["letter_probs"]))
    if record.get("sequence_prob") is not None:
        checks.append(
            generation_problem(
                record["answer_text"], record["sequence_prob"], record["mean_token_prob"], record["answer_tokens"]
            )
        )
    return next((problem for problem in checks if problem is not None), None)


__all__ = [
    "budget_problem",
    "cost_problem",
    "disjoint_probabilities_problem",
    "generation_problem",
    "record_problem",
    "stage_cells_problem",
    "visual_tokens_problem",
]
