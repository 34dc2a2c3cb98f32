"""Half precision against the official arithmetic itself (issue 30, items 2 and 3).

Each ``official_*_half`` function below re-derives a selector's official code path step by step in the
model's half dtype, as that code runs on the same hardware: the dtype of every intermediate is the one
the official code leaves it in, reductions of half tensors are torch's (float32 accumulation, rounded
once), and the ranking is ``torch.topk`` on the half values, so its order among exact ties is the
kernel's. The selectors run with ``score_dtype=model`` and ``ties=topk`` (where they rank with top-k)
on the float32 signals the adapters pass, beside ``model_dtype``. Shapes are LLaVA-1.5's: 576 visual
tokens, 4096-dim LLM states, 32 heads x 128, 1024-dim CLIP features; 10 seeds x budgets 64/128/192 per
dtype, plus tie-heavy cases (duplicated rows, quantised values). The counts asserted here are the
half-precision agreement quoted in ``docs/fidelity.md``.
"""

from __future__ import annotations

import pytest
import torch

from prune_audit.pruners import LayerSignals, Stage, get_selector
from prune_audit.pruners.fidelity import FIDELITY

TOKENS = 576
BUDGETS = (64, 128, 192)
SEEDS = range(10)
HALF_DTYPES = [torch.float16, torch.bfloat16]
PREFIX = 35  # LLaVA-1.5's system prompt + "USER:" before the image
TEXT = 40  # question and template suffix after the image
LLM_DIM, HEADS, HEAD_DIM = 4096, 32, 128


def duplicate_rows(values: torch.Tensor, generator: torch.Generator, share: float = 0.25) -> torch.Tensor:
    """A copy of (L, ...) ``values`` in which ``share`` of the rows repeat other rows (exact ties downstream)."""
    values = values.clone()
    rows = values.shape[0]
    targets = torch.randperm(rows, generator=generator)[: int(rows * share)]
    values[targets] = values[torch.randint(rows, (targets.numel(),), generator=generator)]
    return values


# --- DART (fork xqy1111111/DART 02476570, llava/model/language_model/modeling_llama_self.py) ----------------


def dart_half_case(seed: int, dtype: torch.dtype, duplicated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer K-1's post-RoPE keys (H, L, d) and the final-normed layer output (L, 4096) of one prompt, in ``dtype``.

    ``duplicated``: a quarter of the rows repeat others (equal key norms and cosines)."""
    generator = torch.Generator().manual_seed(3000 + seed)
    length = PREFIX + TOKENS + TEXT
    keys = torch.randn(length, HEADS, HEAD_DIM, generator=generator) * (1 + torch.rand(length, 1, 1, generator=generator))
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
        sequence_index=torch.arange(PREFIX, PREFIX + TOKENS), text_sequence_index=torch.arange(PREFIX + TOKENS, normed.shape[0]),
        model_dtype=normed.dtype,
    )  # fmt: skip
    selector = get_selector("dart", budget_rule="paper", pivot_order="set", **options)
    return selector.prune(Stage(2, selector.paper_keep(budget)), signals, {}).tolist()


def dart_half_agreement(dtype: torch.dtype, duplicated: bool, **options) -> int:
    identical = 0
    for seed in SEEDS:
        keys, normed = dart_half_case(seed, dtype, duplicated)
        for budget in BUDGETS:
            identical += dart_half_kept(keys, normed, budget, **options) == official_dart_half(keys, normed, budget)
    return identical


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_dart_model_dtype_reproduces_the_official_half_precision_cosine(dtype):
    """score_dtype=model + ties=topk: 30 of 30 random and 30 of 30 duplicated-row cases per dtype."""
    exact = {"score_dtype": "model", "ties": "topk"}
    assert dart_half_agreement(dtype, False, **exact) == 30 == FIDELITY["dart"].half_cases[dtype_name(dtype)]
    assert dart_half_agreement(dtype, True, **exact) == 30
    assert dart_half_agreement(dtype, False) < 30  # float32 cosines rounded afterwards: ~46 % differ by an ulp


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
