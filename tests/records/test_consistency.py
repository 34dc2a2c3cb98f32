"""A generation's summary agrees with itself (``records.consistency.generation_problem``), by hand, down to sequence
probabilities that underflow."""

from __future__ import annotations

import math
import sys

import pytest

from prune_audit.records.consistency import UNDERFLOW_LOG, generation_problem


def product(probability: float, tokens: int) -> float:
    """The sequence probability as a generation multiplies it, token by token (it goes subnormal below 2.2e-308)."""
    total = 1.0
    for _ in range(tokens):
        total *= probability
    return total


@pytest.mark.parametrize(("probability", "tokens"), [(0.9, 3), (0.5, 1000), (0.2169, 460)])
def test_a_product_of_normal_doubles_must_match_its_mean_to_the_power(probability, tokens):
    sequence = product(probability, tokens)
    assert sequence >= sys.float_info.min and generation_problem("text", sequence, probability, tokens) is None
    assert "is not mean token probability" in generation_problem("text", sequence * 1.01, probability, tokens)


@pytest.mark.parametrize("tokens", [470, 484, 490, 600])
def test_a_subnormal_or_zero_sequence_probability_is_not_compared(tokens):
    # 0.2169 ** 484 = 5.48e-322 as multiplied: a subnormal 2.4 % from the exact power, and 0 from about 490 tokens on
    sequence = product(0.2169, tokens)
    assert sequence < sys.float_info.min and generation_problem("caption", sequence, 0.2169, tokens) is None


def test_the_underflow_bound_is_the_smallest_normal_double():
    assert UNDERFLOW_LOG == math.log(sys.float_info.min)
    assert generation_problem("a", 0.5, 0.1, 3) is not None  # far from 0.001: refused, whatever the bound
