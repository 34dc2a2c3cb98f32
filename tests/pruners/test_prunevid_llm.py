"""PruneVid's in-LLM stage (``prunevid_llm``): its kept set against a transcription of the official
``VTPWindowCache.process_attention`` on random attention and token groups, the alpha share of each group, ties,
keep-all, the two budget rules and the groups the stage before the LLM hands it."""

from __future__ import annotations

import pytest
import torch

from prune_audit.pruners import LayerSignals, Stage, get_selector
from prune_audit.pruners.prunevid import TOKEN_GROUPS
from prune_audit.pruners.schedule import average_visual_tokens
from prune_audit.pruners.signals import InputSignals

SEEDS = range(10)
ALPHAS = (0.4, 0.25, 0.5)  # the official 0.4 first
HEADS, ROWS = 4, 6


def official_windows(generator: torch.Generator) -> list[tuple[int, int, int]]:
    """(static size, dynamic size per frame, frames) of each window (segment), as merge_frames_dynamic returns
    them: a static size 0 among them, frames 1 to 4, groups of 0 to 30 tokens."""
    windows = []
    for index in range(int(torch.randint(2, 5, (1,), generator=generator))):
        static = 0 if index == 1 else int(torch.randint(1, 31, (1,), generator=generator))
        dynamic = int(torch.randint(1, 21, (1,), generator=generator))
        windows.append((static, dynamic, int(torch.randint(1, 5, (1,), generator=generator))))
    return windows


def rederived_process_attention(attention: torch.Tensor, windows: list[tuple[int, int, int]], alpha: float):
    """The official selection, transcribed: ``attention`` (1, H, Q, n) max over heads then text rows; per window
    the ``int(static alpha)`` best of its static tokens and, frame by frame (``view(window_size, -1)``), the
    ``int(dynamic alpha)`` best of its dynamic ones; indices into the n tokens, ascending (``prompt_prefill``)."""
    scores = attention[0].max(dim=0)[0].max(dim=0)[0]
    start, picked = 0, []
    for static, dynamic, frames in windows:
        end = start + static + dynamic * frames
        window = scores[start:end]
        picked.append(torch.topk(window[:static], k=int(static * alpha)).indices + start)
        rows = window[static:].view(frames, -1)
        top = torch.topk(rows, k=int(rows.shape[-1] * alpha), dim=-1).indices
        picked += [top[i] + start + static + dynamic * i for i in range(frames)]
        start = end
    return torch.cat(picked).sort().values


def window_groups(windows: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The groups prunevid hands its in-LLM part for ``windows``: each static group, then each frame's dynamic."""
    groups, start = [], 0
    for static, dynamic, frames in windows:
        groups.append(torch.arange(start, start + static))
        start += static
        for _ in range(frames):
            groups.append(torch.arange(start, start + dynamic))
            start += dynamic
    return [group for group in groups if group.numel()]


def stage_signals(probs: torch.Tensor, video_grid=(1, 1, 1), alive=None) -> LayerSignals:
    n = probs.shape[-1]
    alive = torch.arange(n) if alive is None else alive
    return LayerSignals(alive=alive, grid=(1, n), layer=11, num_layers=32, text_probs=probs, video_grid=video_grid)


def random_probs(n: int, generator: torch.Generator) -> torch.Tensor:
    """(H, T, n) text rows' probabilities (softmax over more keys than the visual ones)."""
    return torch.softmax(torch.randn(HEADS, ROWS, n + 7, generator=generator), dim=-1)[..., :n]


@pytest.mark.parametrize("alpha", ALPHAS)
def test_stage_equals_the_rederived_process_attention(alpha):
    identical = 0
    for seed in SEEDS:
        generator = torch.Generator().manual_seed(seed)
        windows = official_windows(generator)
        n = sum(static + dynamic * frames for static, dynamic, frames in windows)
        probs = random_probs(n, generator)
        selector = get_selector("prunevid_llm", alpha=alpha)
        kept = selector.prune(Stage(11, n), stage_signals(probs), {TOKEN_GROUPS: window_groups(windows)})
        expected = rederived_process_attention(probs[None], windows, alpha)
        identical += torch.equal(kept, expected)
    assert identical == len(SEEDS)  # 10 of 10 for each alpha: 30 of 30 (the fidelity row)


def test_alone_each_step_is_a_group_at_its_alpha_share():
    generator = torch.Generator().manual_seed(3)
    steps, rows, cols = 4, 3, 5
    n = steps * rows * cols
    probs = random_probs(n, generator)
    kept = get_selector("prunevid_llm").prune(Stage(11, n), stage_signals(probs, (steps, rows, cols)), {})
    assert torch.equal(kept, rederived_process_attention(probs[None], [(0, rows * cols, steps)], 0.4))
    per_step = torch.bincount(kept // (rows * cols), minlength=steps)
    assert per_step.tolist() == [int(rows * cols * 0.4)] * steps  # 6 of each step's 15


def test_ties_go_to_the_lower_index_in_each_group():
    groups = [torch.arange(0, 10), torch.arange(10, 15), torch.arange(15, 20)]
    probs = torch.full((HEADS, ROWS, 20), 0.01)
    kept = get_selector("prunevid_llm", alpha=0.4).prune(Stage(11, 20), stage_signals(probs), {TOKEN_GROUPS: groups})
    assert kept.tolist() == [0, 1, 2, 3, 10, 11, 15, 16]


def test_alpha_one_keeps_all_and_a_small_alpha_drops_small_groups():
    generator = torch.Generator().manual_seed(1)
    probs = random_probs(12, generator)
    groups = [torch.arange(0, 2), torch.arange(2, 12)]
    everything = get_selector("prunevid_llm", alpha=1.0).prune(Stage(11, 12), stage_signals(probs), {})
    assert everything.tolist() == list(range(12))
    kept = get_selector("prunevid_llm", alpha=0.4).prune(Stage(11, 12), stage_signals(probs), {TOKEN_GROUPS: groups})
    assert kept.numel() == 4 and int(kept.min()) >= 2  # int(2 x 0.4) = 0 of the first group


def test_the_official_rule_ignores_the_budget_and_the_average_rule_solves_it():
    official = get_selector("prunevid_llm")
    assert not official.averages_budget and official.schedule_follows_tower
    assert official.schedule(32, 576, 64) == official.schedule(32, 576, 300) == [Stage(11, 576)]
    assert official.schedule(28, 391, 64) == [Stage(10, 391)]  # layer 11 of 32 scaled to 28
    average = get_selector("prunevid_llm", budget_rule="average")
    assert average.averages_budget and not average.schedule_follows_tower
    for budget in (198, 300, 500):
        stages = average.schedule(32, 576, budget)
        assert [s.layer for s in stages] == [11] and average_visual_tokens(stages, 32, 576) == pytest.approx(
            budget, 0.01
        )
    assert average.schedule(32, 576, 576) == [Stage(11, 576)]


def test_an_unreachable_average_budget_is_refused_naming_the_smallest_reachable():
    with pytest.raises(ValueError, match="average at least 198; raise the budget to 198") as refusal:
        get_selector("prunevid_llm", budget_rule="average").schedule(32, 576, 197)
    assert "\n" not in str(refusal.value)


def test_the_average_rule_splits_the_count_over_the_groups_by_size():
    generator = torch.Generator().manual_seed(5)
    probs = random_probs(30, generator)
    groups = [torch.arange(0, 20), torch.arange(20, 30)]
    selector = get_selector("prunevid_llm", budget_rule="average")
    kept = selector.prune(Stage(11, 9), stage_signals(probs), {TOKEN_GROUPS: groups})
    scores = probs.amax(dim=(0, 1))
    first, second = kept[kept < 20], kept[kept >= 20]
    assert (first.numel(), second.numel()) == (6, 3)  # 9 x 20 / 30, 9 x 10 / 30
    assert set(first.tolist()) == set(scores[:20].topk(6).indices.tolist())
    assert set(second.tolist()) == set((scores[20:].topk(3).indices + 20).tolist())
    assert selector.prune(Stage(11, 30), stage_signals(probs), {TOKEN_GROUPS: groups}).tolist() == list(range(30))


def test_groups_that_do_not_cover_the_stage_are_refused():
    probs = torch.full((HEADS, ROWS, 10), 0.1)
    with pytest.raises(ValueError, match="groups hold 4 tokens, the stage 10"):
        get_selector("prunevid_llm").prune(Stage(11, 10), stage_signals(probs), {TOKEN_GROUPS: [torch.arange(4)]})


@pytest.mark.parametrize("merge", [False, True])
def test_prunevid_hands_its_groups_as_positions_among_the_tokens_fed(merge):
    """Each group's positions are its outputs among the tokens fed: in clip order without merging (the sorted
    anchors), in output order with it; every token fed in one group, one group per segment's static / step's
    dynamic tokens that has outputs."""
    generator = torch.Generator().manual_seed(2)
    steps, rows, cols = 6, 4, 5
    features = torch.randn(steps * rows * cols, 16, generator=generator)
    features[: 3 * rows * cols] = features[:1].repeat(3 * rows * cols, 1) + 0.01 * features[: 3 * rows * cols]
    signals = InputSignals(grid=(steps * rows, cols), features=features, video_grid=(steps, rows, cols))
    selection = get_selector("prunevid", merge=merge, cluster_ratio=0.5).select(signals, 500)
    groups = selection.llm_state[TOKEN_GROUPS]
    fed = selection.num_output_tokens
    assert torch.equal(torch.cat(groups).sort().values, torch.arange(fed))
    if not merge:  # each group's anchors lie in one step (a static group's: its segment's first)
        assert all((selection.kept[group] // (rows * cols)).unique().numel() == 1 for group in groups)
    else:
        sizes = [group.numel() for group in groups]
        assert all(torch.equal(g, torch.arange(int(g[0]), int(g[0]) + g.numel())) for g in groups)  # contiguous
        assert sum(sizes) == fed
