"""E2S-Pruner: Dempster's rule, the per-head evidence masses and the selector's scores, fusion and switches on
cases small enough to check by hand; the paper's schedules and its Table 3 presets."""

from __future__ import annotations

import pytest
import torch
from selector_cases import counts, signals

from prune_audit.pruners import LayerSignals, Stage, get_selector
from prune_audit.pruners.dempster_shafer import dempster_combine, head_masses, priority, vacuous_mass
from prune_audit.pruners.e2s import novelty_bonus
from prune_audit.pruners.schedule import average_visual_tokens

# --- Dempster's rule --------------------------------------------------------------------------------------------------


def test_dempster_matches_a_hand_computed_case():
    m1, m2 = torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.4, 0.4, 0.2])
    combined, conflict = dempster_combine(m1, m2)
    # K = .5*.4 + .2*.4 = .28; I = (.2 + .1 + .12)/.72; U = (.08 + .04 + .12)/.72; Theta = .06/.72
    assert conflict.item() == pytest.approx(0.28)
    assert combined.tolist() == pytest.approx([7 / 12, 1 / 3, 1 / 12])


def test_dempster_masses_sum_to_one_and_the_rule_commutes():
    generator = torch.Generator().manual_seed(0)
    m1, m2 = (raw / raw.sum(-1, keepdim=True) for raw in torch.rand(2, 50, 3, generator=generator))
    combined, conflict = dempster_combine(m1, m2)
    swapped, swapped_conflict = dempster_combine(m2, m1)
    assert torch.allclose(combined.sum(-1), torch.ones(50), atol=1e-6)
    assert torch.allclose(combined, swapped, atol=1e-7) and torch.equal(conflict, swapped_conflict)
    assert bool((combined >= 0).all())


def test_dempster_without_conflict_reduces_to_the_product_form():
    a, b = 0.3, 0.6
    combined, conflict = dempster_combine(torch.tensor([a, 0.0, 1 - a]), torch.tensor([b, 0.0, 1 - b]))
    assert conflict.item() == 0
    assert combined[2].item() == pytest.approx((1 - a) * (1 - b))  # ignorance multiplies
    assert combined[0].item() == pytest.approx(1 - (1 - a) * (1 - b))  # noisy-or of the support
    mass = torch.tensor([0.2, 0.5, 0.3])
    unchanged, none = dempster_combine(vacuous_mass(), mass)
    assert torch.allclose(unchanged, mass) and none.item() == 0


def test_total_conflict_gives_ignorance_without_nan():
    combined, conflict = dempster_combine(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0]))
    assert conflict.item() == 1.0
    assert combined.tolist() == [0.0, 0.0, 1.0]
    assert priority(combined, conflict).item() == 1.0


# --- E2S --------------------------------------------------------------------------------------------------------------


# head 0 attends 1/2, 1/4, 1/8, 1/8; head 1 uniformly. With n = 4: support p = 4r/(1+4r)
# head 0: 2/3, 1/2, 1/3, 1/3; head 1: 1/2 everywhere; pbar = 7/12, 1/2, 5/12, 5/12.
# clarity |2(pbar - .5)| = 1/6, 0, 1/6, 1/6; consistency 1 - (|p0 - pbar| + |p1 - pbar|) = 5/6, 1, 5/6, 5/6.
# rho = 5/36, 0, 5/36, 5/36; m = [rho pbar, rho (1 - pbar), 1 - rho].
HEAD_LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]]))


EXPECTED_MASSES = torch.tensor(
    [
        [35 / 432, 25 / 432, 31 / 36],
        [0.0, 0.0, 1.0],
        [25 / 432, 35 / 432, 31 / 36],
        [25 / 432, 35 / 432, 31 / 36],
    ]
)
EXPECTED_PRIORITY = torch.tensor([407 / 432, 1.0, 397 / 432, 397 / 432])  # 1 - m(U) at the first stage


def e2s_logits(head_logits: torch.Tensor = HEAD_LOGITS) -> torch.Tensor:
    """(H, 2, n): two text rows whose mean is ``head_logits`` (shifted by +-1)."""
    return torch.stack([head_logits + 1.0, head_logits - 1.0], dim=1)


def test_head_masses_by_hand():
    assert torch.allclose(head_masses(e2s_logits()), EXPECTED_MASSES, atol=1e-6)


def test_e2s_first_stage_scores_by_hand_with_novelty_bonus():
    # grid 1 x 4 with 2 x 2 cells: tokens {0, 1} and {2, 3}; best q: token 1, then token 2 (tie, lower index)
    selector = get_selector("e2s", cells=2)
    state: dict = {}
    scores = selector.score(Stage(3, 2), signals(4, grid=(1, 4), text_logits=e2s_logits()), state)
    expected = 0.9 * EXPECTED_PRIORITY + 0.1 * torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert torch.allclose(scores, expected, atol=1e-6)
    assert torch.allclose(state["cumulative_mass"], EXPECTED_MASSES, atol=1e-6)
    kept = selector.prune(Stage(3, 2), signals(4, grid=(1, 4), text_logits=e2s_logits()), {})
    assert kept.tolist() == [1, 2]


def test_e2s_novelty_blocks_lie_on_each_grid_of_a_several_grid_image():
    """Tokens 0, 1 one grid (1 x 2) and 2, 3 another (LLaVA-NeXT: ``grid`` (1, 4), ``grid_parts``): with one cell per
    grid the bonus goes to each grid's best priority, token 1 and token 2 (tie with 3, lower index); on the one
    (1, 4) grid the same single cell would give it to token 1 alone."""
    selector = get_selector("e2s", cells=1)
    parts = signals(4, grid=(1, 4), text_logits=e2s_logits(), grid_parts=((1, 2), (1, 2)))
    scores = selector.score(Stage(3, 2), parts, {})
    assert torch.allclose(scores, 0.9 * EXPECTED_PRIORITY + 0.1 * torch.tensor([0.0, 1.0, 1.0, 0.0]), atol=1e-6)
    one_grid = selector.score(Stage(3, 2), signals(4, grid=(1, 4), text_logits=e2s_logits()), {})
    assert torch.allclose(one_grid, 0.9 * EXPECTED_PRIORITY + 0.1 * torch.tensor([0.0, 1.0, 0.0, 0.0]), atol=1e-6)


def test_e2s_without_novelty_keeps_the_top_priorities():
    kept = get_selector("e2s", novelty_weight=0.0).prune(Stage(3, 2), signals(4, text_logits=e2s_logits()), {})
    assert kept.tolist() == [0, 1]


def test_novelty_bonus_marks_the_best_token_of_each_occupied_cell():
    alive = torch.tensor([0, 1, 4, 5, 10, 15])  # 4 x 4 grid, 2 x 2 cells of 2 x 2
    scores = torch.tensor([0.2, 0.7, 0.7, 0.1, 0.3, 0.9])
    bonus = novelty_bonus(alive, [(4, 4)], scores, cells=2)
    # cell 0 = {0, 1, 4, 5}: tie 0.7 at positions 1 and 2 -> position 1; cell 3 = {10, 15}: 15
    assert bonus.tolist() == [0, 1, 0, 0, 0, 1]


def test_novelty_bonus_has_the_blocks_of_each_grid_on_a_several_grid_image():
    """LLaVA-NeXT's base view then tile grid: tokens 0..3 a 2 x 2 grid, 4..11 a 2 x 4 grid; with 1 x 1 cells each
    grid is one block, so each grid's best token gets the bonus (by hand: 0.5 at token 2, 0.8 at token 9); with
    2 x 2 cells the tile grid's blocks are its 1 x 2 quarters."""
    alive = torch.tensor([0, 2, 3, 4, 5, 9, 11])
    scores = torch.tensor([0.1, 0.5, 0.4, 0.3, 0.2, 0.8, 0.6])
    assert novelty_bonus(alive, [(2, 2), (2, 4)], scores, cells=1).tolist() == [0, 1, 0, 0, 0, 1, 0]
    # cells=2: base blocks = its four tokens; tile blocks {4,5}, {6,7}, {8,9}, {10,11}
    assert novelty_bonus(alive, [(2, 2), (2, 4)], scores, cells=2).tolist() == [1, 1, 1, 1, 0, 1, 1]


def test_e2s_fuses_evidence_across_stages_by_grid_index():
    selector = get_selector("e2s", novelty_weight=0.0)
    state: dict = {}
    selector.prune(Stage(3, 3), signals(4, text_logits=e2s_logits()), state)
    second = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]]))
    stage_two = signals(3, grid=(1, 4), alive=[0, 1, 2], text_logits=e2s_logits(second))
    scores = selector.score(Stage(17, 1), stage_two, state)
    fused, conflict = dempster_combine(EXPECTED_MASSES[:3], head_masses(e2s_logits(second)))
    assert torch.allclose(scores, priority(fused, conflict), atol=1e-6)
    assert torch.allclose(state["cumulative_mass"][:3], fused, atol=1e-6)
    assert torch.allclose(state["cumulative_mass"][3], EXPECTED_MASSES[3], atol=1e-6)  # pruned: untouched


def test_e2s_fuses_a_stage_that_prunes_nothing():
    state: dict = {}
    kept = get_selector("e2s").prune(Stage(3, 4), signals(4, text_logits=e2s_logits()), state)
    assert kept.tolist() == [0, 1, 2, 3]
    assert torch.allclose(state["cumulative_mass"], EXPECTED_MASSES, atol=1e-6)


def test_e2s_reliability_switch_uses_bare_support():
    # without reliability, q = Pl(I) = pbar at the first stage: 7/12, 1/2, 5/12, 5/12 -> token 0 wins;
    # with it the unreliable token 1 (rho = 0) is fully plausible and wins
    layer = signals(4, text_logits=e2s_logits())
    assert get_selector("e2s", novelty_weight=0.0).prune(Stage(3, 1), layer, {}).tolist() == [1]
    off = get_selector("e2s", novelty_weight=0.0, reliability=False)
    assert torch.allclose(off.score(Stage(3, 1), layer, {}), torch.tensor([7 / 12, 1 / 2, 5 / 12, 5 / 12]))
    assert off.prune(Stage(3, 1), layer, {}).tolist() == [0]


def conflicting_stages() -> tuple[LayerSignals, LayerSignals]:
    """Token 0 is strongly supported at the first stage and strongly refuted at the second."""
    first = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.9, 0.05, 0.05]]))
    second = torch.log(torch.tensor([[0.01, 0.6, 0.39], [0.01, 0.6, 0.39]]))
    return signals(3, text_logits=e2s_logits(first)), signals(3, text_logits=e2s_logits(second))


def test_e2s_fusion_switch_uses_the_current_layer_only():
    first, second = conflicting_stages()
    fused = get_selector("e2s", novelty_weight=0.0)
    alone = get_selector("e2s", novelty_weight=0.0, fusion=False)
    state: dict = {}
    fused.score(Stage(3, 3), first, state)
    alone_state: dict = {}
    alone.score(Stage(3, 3), first, alone_state)
    assert alone_state == {}
    assert torch.allclose(alone.score(Stage(17, 1), second, alone_state), priority(head_masses(second.text_logits)))
    assert not torch.allclose(fused.score(Stage(17, 1), second, state), priority(head_masses(second.text_logits)))


def test_e2s_conflict_protection_switch():
    first, second = conflicting_stages()
    scores = {}
    for protect in (True, False):
        selector = get_selector("e2s", novelty_weight=0.0, conflict_protection=protect)
        state: dict = {}
        selector.score(Stage(3, 3), first, state)
        scores[protect] = selector.score(Stage(17, 1), second, state)
    fused, conflict = dempster_combine(head_masses(first.text_logits), head_masses(second.text_logits))
    assert conflict[0] > 0.05
    assert torch.allclose(scores[False], 1 - fused[:, 1])
    assert torch.allclose(scores[True], priority(fused, conflict))
    assert scores[True][0] > scores[False][0]  # conflict protects token 0


def test_e2s_plain_attention_is_attention_top_k():
    selector = get_selector("e2s", plain_attention=True)
    scores = selector.score(Stage(3, 1), signals(4, text_logits=e2s_logits()), {})
    assert torch.allclose(scores, torch.tensor([0.375, 0.25, 0.1875, 0.1875]))
    assert selector.prune(Stage(3, 1), signals(4, text_logits=e2s_logits()), {}).tolist() == [0]


def test_e2s_rejects_bad_options():
    with pytest.raises(ValueError, match="novelty_weight"):
        get_selector("e2s", novelty_weight=1.5)
    with pytest.raises(ValueError, match="cells"):
        get_selector("e2s", cells=0)


# --- the paper's Table 3 schedules (arXiv 2608.23253, section 5.4) ----------------------------------------------------


# the rows of Table 3 as printed: 576 -> a -> b -> c visual tokens, pruning after layers 3, 17, 22 (1-based)
E2S_TABLE3_ROWS = [(122, 48, 42), (132, 40, 32), (142, 32, 22), (147, 38, 12), (152, 44, 2)]


@pytest.mark.parametrize("row", E2S_TABLE3_ROWS)
def test_every_e2s_table3_row_is_a_preset_averaging_128(row):
    from prune_audit.pruners.schedule import average_visual_tokens

    preset = "table3_" + "_".join(map(str, row))
    stages = get_selector("e2s", budget_rule="paper", schedule_preset=preset).schedule(32, 576, 128)
    assert [(stage.layer, stage.keep) for stage in stages] == list(zip((3, 17, 22), row))
    # layers 0-2 see 576 tokens, 3-16 the first count, 17-21 the second, 22-31 the third
    assert (3 * 576 + 14 * row[0] + 5 * row[1] + 10 * row[2]) / 32 == average_visual_tokens(stages, 32, 576) == 128


# --- the paper's schedules on LLaVA-1.5 -------------------------------------------------------------------------------


@pytest.mark.parametrize("budget, expected", [(192, [194, 148, 96]), (128, [122, 48, 42]), (64, [20, 8, 0])])
@pytest.mark.parametrize("rule", ["average", "paper"])
def test_e2s_paper_schedules_are_exact_on_llava(budget, expected, rule):
    stages = get_selector("e2s", budget_rule=rule).schedule(32, 576, budget)
    assert counts(stages) == list(zip([3, 17, 22], expected))
    assert average_visual_tokens(stages, 32, 576) == budget


def test_e2s_presets_name_the_paper_schedules():
    preset = get_selector("e2s", budget_rule="paper", schedule_preset="table3_132_40_32").schedule(32, 576, 128)
    assert counts(preset) == [(3, 132), (17, 40), (22, 32)]
    assert average_visual_tokens(preset, 32, 576) == 128
    assert counts(get_selector("e2s", budget_rule="paper").schedule(32, 576, 128)) == [(3, 122), (17, 48), (22, 42)]
