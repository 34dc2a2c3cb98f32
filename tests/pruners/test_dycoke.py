"""DyCoke (``pruners.dycoke``) against an independent re-derivation of KD-TAO/DyCoke (dd746349): ``dycole_ttm``'s
two loops over the frames (here temporal steps) token by token in float64 for the input stage, and
``PrunableDynamicCache.update_cache`` for the decode-time stage (``dycoke_kv``); several seeds, grids, ratios and
budgets."""

from __future__ import annotations

import math

import pytest
import torch

from prune_audit.pruners import Stage, get_selector
from prune_audit.pruners.dycoke import kv_kept_count, ttm_plan
from prune_audit.pruners.fidelity import RANDOM_CASES, fidelity_entries
from prune_audit.pruners.signals import InputSignals, LayerSignals

# (T, h, w, D) clips at Qwen2.5-VL-like shapes: 4 to 9 temporal steps
GRIDS = [(4, 6, 8, 64), (5, 6, 6, 96), (6, 7, 9, 64), (8, 8, 6, 128), (9, 4, 5, 64)]
SEEDS = range(3)
RATIOS = [0.3, 0.5, 0.7, 0.9]
FRACTIONS = [0.1, 0.3, 0.5, 0.8]


def clip_signals(grid: tuple[int, int, int], width: int, seed: int) -> InputSignals:
    """A clip whose every step is a noisy copy of the previous one with a quarter of its tokens replaced."""
    steps, rows, cols = grid
    generator = torch.Generator().manual_seed(seed)
    features = [torch.randn(rows * cols, width, generator=generator)]
    for _ in range(steps - 1):
        step = features[-1] + 0.1 * torch.randn(rows * cols, width, generator=generator)
        moved = torch.randperm(rows * cols, generator=generator)[: max(1, rows * cols // 4)]
        step[moved] = torch.randn(moved.numel(), width, generator=generator)
        features.append(step)
    return InputSignals(grid=(steps * rows, cols), features=torch.cat(features), video_grid=(steps, rows, cols))


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / max(math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)), 1e-8)


def least_similar(frame1: list[list[float]], frame2: list[list[float]], keep: int) -> list[int]:
    """``similarity.topk(keep, largest=False)`` of frame2's tokens to frame1's, exact ties to the lower index."""
    similarity = [cosine(a, b) for a, b in zip(frame1, frame2, strict=True)]
    return sorted(range(len(similarity)), key=lambda i: (similarity[i], i))[:keep]


def rederived_dycole_ttm(features: torch.Tensor, per_step: int, merging_ratio: float) -> list[int]:
    """``dycole_ttm`` frame by frame, as kept token indices: the pair loop over ``range(0, F - 1, 2)`` keeps frame
    i and frame i + 1's least similar tokens to it; the group loop over ``range(0, F - 4, 4)`` replaces frame
    i + 2 by its least similar tokens to frame i."""
    values = features.double().tolist()
    frames = len(values) // per_step
    frame = [values[f * per_step : (f + 1) * per_step] for f in range(frames)]
    keep = int((1 - merging_ratio) * per_step)
    chosen: dict[int, list[int]] = {}
    for i in range(0, frames - 1, 2):
        chosen[i] = list(range(per_step))
        chosen[i + 1] = least_similar(frame[i], frame[i + 1], keep)
    for i in range(0, frames - 4, 4):
        chosen[i + 2] = least_similar(frame[i], frame[i + 2], keep)
    return sorted(f * per_step + token for f, tokens in chosen.items() for token in tokens)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_official_ratio_equals_the_rederived_dycole_ttm(seed, grid, ratio):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    selector = get_selector("dycoke", merging_ratio=ratio)
    kept = selector.select(signals, signals.num_tokens).kept.tolist()  # a budget of every token: the official count
    assert kept == rederived_dycole_ttm(signals.features, rows * cols, ratio)
    capped = selector.select(signals, rows * cols + 1).kept  # the budget caps the official count
    assert capped.numel() == min(len(kept), rows * cols + 1)


def rederived_budget_kept(features: torch.Tensor, grid: tuple[int, int, int], budget: int) -> list[int]:
    """The budget rule over the official roles: whole steps first (their first tokens when the budget is short),
    then the rest split evenly over the pruned steps in time order, each keeping its least similar tokens."""
    steps, rows, cols = grid
    per_step = rows * cols
    values = features.double().tolist()
    frame = [values[f * per_step : (f + 1) * per_step] for f in range(steps)]
    role = {}  # step -> the step it is pruned against (itself: whole); absent: dropped
    for i in range(0, steps - 1, 2):
        role[i], role[i + 1] = i, i
    for i in range(0, steps - 4, 4):
        role[i + 2] = i
    whole = [f * per_step + t for f in sorted(role) if role[f] == f for t in range(per_step)]
    kept = whole[:budget]
    pruned = [f for f in sorted(role) if role[f] != f]
    rest = max(0, min(budget - len(whole), len(pruned) * per_step))
    for position, f in enumerate(pruned):
        quota = rest // len(pruned) + (1 if position < rest % len(pruned) else 0)
        kept += [f * per_step + t for t in least_similar(frame[role[f]], frame[f], quota)]
    return sorted(kept)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_budget_split_equals_the_rederived_quotas(seed, grid, fraction):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    budget = max(1, round(fraction * signals.num_tokens))
    kept = get_selector("dycoke").select(signals, budget).kept.tolist()
    assert kept == rederived_budget_kept(signals.features, (steps, rows, cols), budget)
    dropped = rows * cols if steps % 2 else 0  # an odd last step never survives the official loops
    assert len(kept) == min(budget, signals.num_tokens - dropped)


@pytest.mark.parametrize("grid", GRIDS)
def test_keep_all_is_dense(grid):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, 0)
    for budget in (signals.num_tokens, signals.num_tokens + 3):
        assert get_selector("dycoke").select(signals, budget).kept.tolist() == list(range(signals.num_tokens))


def test_the_plan_follows_the_official_loop_bounds_and_complete_takes_every_step():
    assert ttm_plan(8) == [0, 0, 0, 2, 4, 4, 6, 6]  # range(0, 4, 4): the last group's third step stays whole
    assert ttm_plan(8, "complete") == [0, 0, 0, 2, 4, 4, 4, 6]
    assert ttm_plan(5) == [0, 0, 0, 2, -1]  # an odd last step is dropped whole
    assert ttm_plan(5, "complete") == [0, 0, 0, 2, 4]
    assert ttm_plan(1) == [0]  # nothing to compare: kept whole


def test_complete_edges_keep_an_odd_last_step():
    signals = clip_signals((5, 3, 4), 32, 2)
    kept = get_selector("dycoke", edges="complete", merging_ratio=0.5).select(signals, signals.num_tokens).kept
    assert set(range(48, 60)) <= set(kept.tolist())  # the fifth step whole
    assert kept.numel() == 2 * 12 + 3 * 6  # steps 0 and 4 whole, 1 to 3 pruned to half


def test_a_budget_below_the_whole_steps_keeps_their_first_tokens():
    signals = clip_signals((4, 2, 4), 8, 1)
    assert get_selector("dycoke").select(signals, 5).kept.tolist() == [0, 1, 2, 3, 4]


def test_a_still_image_or_a_wrong_grid_is_refused():
    signals = clip_signals((3, 2, 4), 8, 1)
    with pytest.raises(ValueError, match="video_grid"):
        get_selector("dycoke").select(InputSignals(grid=signals.grid, features=signals.features), 5)
    wrong = InputSignals(grid=signals.grid, features=signals.features, video_grid=(2, 2, 4))
    with pytest.raises(ValueError, match="does not hold"):
        get_selector("dycoke").select(wrong, 5)


# --- the decode-time stage (dycoke_kv) --------------------------------------------------------------


def rederived_update_cache(row: list[float], ratio: float) -> list[int]:
    """``update_cache`` on one head-mean attention row over the visual span: ``img_len`` is one short of the span
    (``image_feature.size()[0] - 1``), ``int(img_len (1 - dycoke_p))`` of those ranked, the span's last token kept
    with the text after it (``full_range[start_idx + img_len:]``); exact ties to the lower index."""
    img_len = len(row) - 1
    keep = int(img_len * (1 - ratio))
    ranked = sorted(range(img_len), key=lambda i: (-row[i], i))[:keep]
    return sorted(ranked + [img_len])


@pytest.mark.parametrize("case", range(RANDOM_CASES))
def test_kv_stage_equals_the_rederived_update_cache(case):
    generator = torch.Generator().manual_seed(case)
    heads, rows, n = 4 + case % 3, 3 + case % 5, 40 + 7 * case
    logits = torch.randn(heads, rows, n + 20, generator=generator) * 3
    probs = logits.softmax(dim=-1)[:, :, 5 : 5 + n]  # the visual columns of rows that see text too
    ratio = [0.8, 0.7, 0.5][case % 3]
    selector = get_selector("dycoke_kv", budget_rule="paper", pruning_ratio=ratio)
    (stage,) = selector.schedule(28, n, n - 1)
    assert stage == Stage(3, kv_kept_count(n, ratio, "kept"))
    signals = LayerSignals(alive=torch.arange(n), grid=(1, n), layer=3, num_layers=28, text_probs=probs)
    kept = selector.prune(stage, signals, {}).tolist()
    official_row = probs[:, -1, :].double().mean(dim=0).tolist()  # attn.mean(1)[0, -1] over the span
    assert kept == rederived_update_cache(official_row, ratio)


def test_kv_paper_count_is_capped_at_the_budget_and_keeps_all_at_every_token():
    selector = get_selector("dycoke_kv", budget_rule="paper")
    assert selector.schedule(28, 576, 64) == [Stage(3, 64)]
    assert selector.schedule(28, 576, 300) == [Stage(3, int(575 * (1 - 0.8)) + 1)]
    assert selector.schedule(28, 576, 576) == [Stage(3, 576)]
    assert get_selector("dycoke_kv", budget_rule="paper", last_token="ranked").schedule(28, 576, 300) == [
        Stage(3, int(576 * (1 - 0.8)))
    ]


def test_kv_last_token_is_kept_unless_ranked():
    probs = torch.full((2, 3, 10), 0.01)
    probs[:, -1, :4] = 0.2  # the first four best attended, the last token least
    signals = LayerSignals(alive=torch.arange(10), grid=(1, 10), layer=3, num_layers=28, text_probs=probs)
    assert get_selector("dycoke_kv").prune(Stage(3, 4), signals, {}).tolist() == [0, 1, 2, 9]
    assert get_selector("dycoke_kv", last_token="ranked").prune(Stage(3, 4), signals, {}).tolist() == [0, 1, 2, 3]


def test_the_fidelity_rows_quote_these_case_counts():
    rows = fidelity_entries()
    clips = len(SEEDS) * len(GRIDS)
    assert f"all {clips * len(RATIOS)} random clips" in rows["dycoke"].agreement
    assert f"all {clips * len(FRACTIONS)} at budgets" in rows["dycoke"].agreement
    assert rows["dycoke_kv"].agreement_cases == RANDOM_CASES
