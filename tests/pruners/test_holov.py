"""HoloV against an independent re-derivation of obananas/HoloV ``utils.py::HoloV`` (commit ddcc937e).

``official_holov`` is written from the official code's math, loop by loop, in float32, and shares no code
with the package. It returns the official ``final_positions`` without the ``-1`` padding: the kept set.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import InputSignals, get_selector, selector_class
from prune_audit.pruners.arithmetic import SelectorWork

TOKENS = 576
BUDGETS = (64, 128, 192)
CASES = [(seed, budget) for seed in range(10) for budget in BUDGETS]


def official_holov(tokens: torch.Tensor, attention: torch.Tensor, patches: int, budget: int) -> set[int]:
    """Kept positions of the official ``HoloV(image_tokens, attention, num_patches, new_image_token_num)``.

    Args:
        tokens: (N, D) projector outputs.
        attention: (N,) head-mean CLS attention to the patches.
    """
    n = tokens.shape[0]
    esp, alpha, beta = 1e-6, 1.0, 0.09
    base, extra = n // patches, n % patches
    pieces, start = [], 0
    for p in range(patches):
        size = base + (1 if p < extra else 0)
        if size > 0:
            pieces.append(torch.arange(start, start + size))
        start += size
    scores = []
    for index in pieces:
        x, a = tokens[index], attention[index]
        m = len(index)
        if m <= 1:
            scores.append(a.mean())
            continue
        f = x / (x.norm(dim=1, keepdim=True) + esp)
        s = torch.mm(f, f.t()) * (1 - torch.eye(m))
        mean = s.sum(dim=1) / (m - 1)
        var = ((s - mean.unsqueeze(1)) ** 2).sum(dim=1) / (m - 1)
        a_scaled = a * 1e3
        var_scaled = var * (torch.mean(torch.abs(a_scaled)) / (torch.mean(torch.abs(var)) + esp))
        scores.append((alpha * a_scaled + beta * var_scaled).mean())
    weights = torch.stack(scores) / (torch.stack(scores).sum() + esp)
    allocated = (weights * budget).floor().long()
    remaining = budget - allocated.sum()
    if remaining > 0:
        for idx in torch.topk(weights, k=min(remaining.item(), len(weights))).indices[:remaining]:
            allocated[idx] += 1
    kept: list[int] = []
    for index, alloc in zip(pieces, allocated.tolist(), strict=True):
        if alloc <= 0:
            continue
        if alloc >= len(index):
            kept += index.tolist()
        else:
            kept += index[torch.topk(attention[index], k=alloc).indices].tolist()
    return set(kept[:budget])


def llava_case(seed: int, spike: float = 5.0) -> InputSignals:
    """576 tokens on 24 x 24: 4096-dim projector outputs with a shared direction, and a 16-head CLS row
    (softmax over CLS + 576 patches, CLS column dropped, not renormalised) with two artifact patches that
    every head favours by ``spike`` logits, as CLIP's high-norm tokens: at budget 192 the share of their crops
    exceeds 36 tokens in 9 of the 10 seeds."""
    generator = torch.Generator().manual_seed(seed)
    features = 0.5 * torch.randn(4096, generator=generator) + torch.randn(TOKENS, 4096, generator=generator)
    logits = torch.randn(16, TOKENS + 1, generator=generator)
    logits[:, torch.randint(1, TOKENS + 1, (2,), generator=generator)] += spike
    return InputSignals(grid=(24, 24), features=features, cls_attention=torch.softmax(logits, dim=-1)[:, 1:])


@pytest.mark.parametrize(("seed", "budget"), CASES)
@pytest.mark.parametrize("ties", ["lower", "topk"])
def test_holov_reproduces_the_official_kept_set(seed, budget, ties):
    signals = llava_case(seed)
    official = official_holov(signals.features, signals.cls_attention.mean(dim=0), 16, budget)
    kept = get_selector("holov", ties=ties).select(signals, budget).kept
    assert set(kept.tolist()) == official
    assert kept.numel() <= budget


def test_the_random_cases_include_crops_whose_share_exceeds_their_size():
    short = [
        budget for seed, budget in CASES if get_selector("holov").select(llava_case(seed), budget).kept.numel() < budget
    ]
    assert short == [192] * 9


def test_a_crop_share_above_its_size_is_dropped_or_refilled():
    """One crop with nearly all the attention: its share exceeds its 36 tokens; ``drop`` keeps fewer than the
    budget (the official set), ``refill`` spends the rest on the unkept tokens of highest attention."""
    signals = llava_case(0, spike=0.0)
    attention = signals.cls_attention.clone()
    attention[:, :36] += 1.0  # the first crop
    signals.cls_attention = attention
    dropped = get_selector("holov").select(signals, 128).kept
    official = official_holov(signals.features, attention.mean(dim=0), 16, 128)
    assert set(dropped.tolist()) == official and set(range(36)) <= official and dropped.numel() < 128
    refilled = get_selector("holov", leftover="refill").select(signals, 128).kept
    assert refilled.numel() == 128 and set(dropped.tolist()) <= set(refilled.tolist())
    rest = attention.mean(dim=0).clone()
    rest[dropped] = float("-inf")
    extra = torch.topk(rest, 128 - dropped.numel()).indices
    assert set(refilled.tolist()) == set(dropped.tolist()) | set(extra.tolist())


def test_uneven_crops_put_the_longer_runs_first_and_single_tokens_score_their_attention():
    """N = 20 over 16 crops: four crops of 2 tokens, then twelve of 1 (the official special case)."""
    generator = torch.Generator().manual_seed(4)
    signals = InputSignals(
        grid=(4, 5),
        features=torch.randn(20, 32, generator=generator),
        cls_attention=torch.softmax(torch.randn(4, 21, generator=generator), dim=-1)[:, 1:],
    )
    for budget in (3, 8, 15):
        kept = get_selector("holov").select(signals, budget).kept
        assert set(kept.tolist()) == official_holov(signals.features, signals.cls_attention.mean(dim=0), 16, budget)


@pytest.mark.parametrize("crops", [16, 7])
def test_flops_count_every_product_the_selection_runs(crops):
    signals = llava_case(1)
    with FlopCounterMode(display=False) as counter:
        get_selector("holov", crops=crops).select(signals, 64)
    work = SelectorWork(tokens=TOKENS, kept=64, feature_width=4096, options={"crops": crops})
    assert selector_class("holov").flops(work) == counter.get_total_flops() > 0
    assert selector_class("holov").flops(SelectorWork(tokens=TOKENS, kept=TOKENS, feature_width=4096)) == 0


def test_the_fidelity_row_quotes_these_cases():
    assert selector_class("holov").fidelity.agreement_cases == len(CASES) == 30
