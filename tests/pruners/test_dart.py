"""DART: pivots and least-similar picks by hand, the official pivot iteration, and the official half-precision cosine
(ZichenWen1/DART; fork xqy1111111/DART 02476570, llava/model/language_model/modeling_llama_self.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rederivation import (
    BUDGETS,
    CASES,
    EXACT,
    FIDELITY,
    HALF_DTYPES,
    HEAD_DIM,
    HEADS,
    LLM_DIM,
    PREFIX,
    SEEDS,
    TEXT,
    TOKENS,
    dtype_name,
    duplicate_rows,
)
from selector_cases import signals

from prune_audit.pruners import LayerSignals, Stage, get_selector


def unit(degrees: float, length: float = 1.0) -> list[float]:
    return [length * math.cos(math.radians(degrees)), length * math.sin(math.radians(degrees))]


def dart_case() -> LayerSignals:
    """14 visual tokens: pivots at positions 1, 4, 8, 11 (largest key norms) pointing at 0 degrees.

    Candidates (position: angle): 0: 90, 2: 180, 3: 195, 5: 10, 6: 150, 7: 235, 9: 270, 10: 260,
    12: 290, 13: 310. Text pivots (text rows 0, 1, 3, 4) point at 90 degrees.
    Visual pivots first take the candidates closest to 180 degrees: 2, 3, 6, 7; the text pivots
    then take those closest to 270 degrees: 9, 10, 12, 13. Positions 0 and 5 are dropped.
    Visiting the text pivots first would take 7 (235) instead of 13 (310) and drop 13 instead of 0.
    """
    angles = {0: 90, 2: 180, 3: 195, 5: 10, 6: 150, 7: 235, 9: 270, 10: 260, 12: 290, 13: 310}
    hidden = torch.tensor([unit(angles.get(j, 0), length=1 + j) for j in range(14)])
    key_norms = torch.ones(14)
    key_norms[[1, 4, 8, 11]] = 5.0
    return signals(
        14,
        grid=(2, 7),
        key_norms=key_norms,
        text_key_norms=torch.tensor([5.0, 4.0, 0.1, 3.0, 2.0]),
        normed_hidden_states=hidden,
        text_normed_hidden_states=torch.tensor([unit(90), unit(90), unit(270), unit(90), unit(90)]),
    )


def test_dart_pivots_and_least_similar_picks_by_hand():
    selector = get_selector("dart", budget_rule="paper")
    (stage,) = selector.schedule(32, 14, 8)
    assert stage.keep == 4 + 8 * (8 // 8)
    kept = selector.prune(stage, dart_case(), {})
    assert kept.tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13]


def test_dart_splits_uneven_picks_over_the_pivots_in_order():
    # keep 6: two picks, one each for the first two visual pivots -> 2 (180) then 3 (195)
    assert get_selector("dart").prune(Stage(2, 6), dart_case(), {}).tolist() == [1, 2, 3, 4, 8, 11]
    # keep 3: only the three visual pivots with the largest key norms (ties to the lower index)
    assert get_selector("dart").prune(Stage(2, 3), dart_case(), {}).tolist() == [1, 4, 8]


# --- half precision ---------------------------------------------------------------------------------------------------


def dart_half_case(seed: int, dtype: torch.dtype, duplicated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer K-1's post-RoPE keys (H, L, d) and the final-normed layer output (L, 4096) of one prompt, in ``dtype``.

    ``duplicated``: a quarter of the rows repeat others (equal key norms and cosines)."""
    generator = torch.Generator().manual_seed(3000 + seed)
    length = PREFIX + TOKENS + TEXT
    keys = torch.randn(length, HEADS, HEAD_DIM, generator=generator)
    keys = keys * (1 + torch.rand(length, 1, 1, generator=generator))  # token-dependent key norms
    normed = 0.5 * torch.randn(LLM_DIM, generator=generator) + torch.randn(length, LLM_DIM, generator=generator)
    if duplicated:
        keys, normed = duplicate_rows(keys, generator), duplicate_rows(normed, generator)
    return keys.transpose(0, 1).to(dtype), normed.to(dtype)


def official_dart_half(keys: torch.Tensor, normed: torch.Tensor, budget: int) -> list[int]:
    """The official ``get_retained_image_token`` in the tensors' dtype, with ``max_num_trunction = budget``.

    L1 key norms in half (``torch.norm(p=1)``), ``topk(4)`` pivots of image and following tokens, pivots
    visited in ``list(set(...))`` order; per pivot the remaining candidates (``list`` of a set of ints:
    ascending) ranked by ``-cosine_similarity`` written out: each norm rounded, each unit vector rounded,
    the elementwise product rounded, its sum rounded once; ``topk(budget // 8)`` of those half values.
    """
    start, per = PREFIX, budget // 8
    flat = keys.permute(1, 0, 2).reshape(keys.shape[1], -1)
    image_norms = torch.norm(flat[start : start + TOKENS], p=1, dim=-1)
    query_norms = torch.norm(flat[start + TOKENS :], p=1, dim=-1)
    assert image_norms.dtype == normed.dtype
    image_indices = (image_norms.topk(4).indices + start).tolist()
    query_indices = (query_norms.topk(4).indices + start + TOKENS).tolist()
    kept = set(image_indices + query_indices)
    candidates = set(range(start, start + TOKENS)) - set(image_indices)
    for pivot in list(set(image_indices + query_indices)):
        pool = list(candidates)
        rows, vector = normed[pool], normed[pivot]
        unit_rows = rows / torch.linalg.vector_norm(rows, dim=-1, keepdim=True)
        unit_vector = vector / torch.linalg.vector_norm(vector)
        products = unit_vector * unit_rows
        dissimilarity = -products.sum(dim=-1)
        assert unit_rows.dtype == products.dtype == dissimilarity.dtype == normed.dtype
        picks = [pool[i] for i in dissimilarity.topk(per).indices.tolist()]
        kept.update(picks)
        candidates.difference_update(picks)
    kept.difference_update(query_indices)
    return sorted(index - start for index in kept)


def dart_half_kept(keys: torch.Tensor, normed: torch.Tensor, budget: int, **options) -> list[int]:
    """DART on the signals the adapter passes: float32 L1 norms of the half keys, float32 copies of the states."""
    norms = keys.float().abs().sum(dim=(0, 2))
    image, text = slice(PREFIX, PREFIX + TOKENS), slice(PREFIX + TOKENS, None)
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32,
        key_norms=norms[image], text_key_norms=norms[text],
        normed_hidden_states=normed[image].float(), text_normed_hidden_states=normed[text].float(),
        sequence_index=torch.arange(PREFIX, PREFIX + TOKENS),
        text_sequence_index=torch.arange(PREFIX + TOKENS, normed.shape[0]),
        model_dtype=normed.dtype,
    )  # fmt: skip
    selector = get_selector("dart", budget_rule="paper", pivot_order="set", **options)
    return selector.prune(Stage(2, selector.paper_keep(budget)), signals, {}).tolist()


def dart_half_agreement(dtype: torch.dtype) -> dict[str, int]:
    """Random cases identical to the official kept set with the reference-exact options and with float32
    cosines (30 each), and duplicated-row cases with the exact options (10: one budget per seed)."""
    identical = {"exact": 0, "float32": 0, "duplicated": 0}
    for seed in SEEDS:
        keys, normed = dart_half_case(seed, dtype, duplicated=False)
        for budget in BUDGETS:
            expected = official_dart_half(keys, normed, budget)
            identical["exact"] += dart_half_kept(keys, normed, budget, **EXACT) == expected
            identical["float32"] += dart_half_kept(keys, normed, budget) == expected
        keys, normed = dart_half_case(seed, dtype, duplicated=True)
        budget = BUDGETS[seed % len(BUDGETS)]
        expected = official_dart_half(keys, normed, budget)
        identical["duplicated"] += dart_half_kept(keys, normed, budget, **EXACT) == expected
    return identical


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_dart_model_dtype_reproduces_the_official_half_precision_cosine(dtype):
    """score_dtype=model + ties=topk: 30 of 30 random and 10 of 10 duplicated-row cases per dtype; measured with
    float32 cosines rounded afterwards (the default) 15 (fp16) and 0 (bf16) of 30."""
    identical = dart_half_agreement(dtype)
    assert identical["exact"] == 30 == FIDELITY["dart"].half_cases[dtype_name(dtype)]
    assert identical["duplicated"] == 10
    assert identical["float32"] < 30


# --- official pivot iteration (ZichenWen1/DART, modeling_llama_self.py::get_retained_image_token) ---------------------


def dart_random_case(seed: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer K-1's post-RoPE keys (H, L, d) and the final-normed output (L, dim) of a whole prompt."""
    generator = torch.Generator().manual_seed(seed)
    length = PREFIX + TOKENS + TEXT
    keys = torch.randn(HEADS, length, HEAD_DIM, generator=generator) * (1 + torch.rand(length, 1, generator=generator))
    normed = 0.5 * torch.randn(dim, generator=generator) + torch.randn(length, dim, generator=generator)
    return keys, normed


def official_dart(keys: torch.Tensor, normed: torch.Tensor, budget: int) -> list[int]:
    """Top-4 L1 key norms of image and of following tokens as pivots, visited in ``set`` order; per = budget // 8."""
    start, per = PREFIX, budget // 8
    flat = keys.permute(1, 0, 2).reshape(keys.shape[1], -1)
    image_norms = flat[start : start + TOKENS].norm(p=1, dim=-1)
    query_norms = flat[start + TOKENS :].norm(p=1, dim=-1)
    image_indices = (image_norms.topk(4).indices + start).tolist()
    query_indices = (query_norms.topk(4).indices + start + TOKENS).tolist()
    kept = set(image_indices + query_indices)
    candidates = set(range(start, start + TOKENS)) - set(image_indices)
    for pivot in list(set(image_indices + query_indices)):
        pool = list(candidates)
        similarity = -F.cosine_similarity(normed[pivot], normed[pool], dim=-1)
        picks = [pool[i] for i in similarity.topk(per).indices.tolist()]
        kept.update(picks)
        candidates.difference_update(picks)
    kept.difference_update(query_indices)
    return sorted(index - start for index in kept)


def dart_kept(keys: torch.Tensor, normed: torch.Tensor, budget: int, **options) -> list[int]:
    start = PREFIX
    flat_norms = keys.permute(1, 0, 2).reshape(keys.shape[1], -1).abs().sum(dim=-1)
    image, text = slice(start, start + TOKENS), slice(start + TOKENS, None)
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32,
        key_norms=flat_norms[image], text_key_norms=flat_norms[text],
        normed_hidden_states=normed[image], text_normed_hidden_states=normed[text],
        sequence_index=torch.arange(start, start + TOKENS), text_sequence_index=torch.arange(start + TOKENS, normed.shape[0]),
    )  # fmt: skip
    selector = get_selector("dart", budget_rule="paper", **options)
    stage = Stage(2, selector.paper_keep(budget))
    return selector.prune(stage, signals, {}).tolist()


def dart_agreement() -> dict[str, int]:
    """Cases identical to the official kept set, per ``pivot_order``."""
    identical = {"set": 0, "sequence": 0}
    for seed, budget, dim in CASES:
        keys, normed = dart_random_case(seed, dim)
        expected = official_dart(keys, normed, budget)
        for order in identical:
            identical[order] += dart_kept(keys, normed, budget, pivot_order=order) == expected
    return identical


def test_dart_set_order_reproduces_the_official_iteration():
    identical = dart_agreement()
    assert identical["set"] == len(CASES) == FIDELITY["dart"].agreement_cases
    assert identical["sequence"] < len(CASES)  # the ascending default differs from the official order
