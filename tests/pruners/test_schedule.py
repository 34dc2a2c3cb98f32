"""Schedules of the in-LLM selectors and the layer-average budget convention; a single selector's own schedule
tests are in ``tests/pruners/test_<name>.py``."""

from __future__ import annotations

import pytest
from selector_cases import averaging, counts

from prune_audit.pruners import Stage, get_selector, list_selectors, selector_class
from prune_audit.pruners.options import option_domains
from prune_audit.pruners.schedule import (
    average_visual_tokens,
    merge_stages,
    nearest_setting,
    scale_layers,
    solve_geometric_schedule,
    solve_schedule,
    tokens_per_layer,
)

LLM_SELECTORS = [name for name in list_selectors() if selector_class(name).stage == "llm"]
MODELS = [(32, 576), (28, 391)]  # LLaVA-1.5-7B; a Qwen2.5-VL-like depth with an odd token count


def test_tokens_per_layer_and_average_follow_the_stages():
    stages = [Stage(2, 10), Stage(4, 5)]
    assert tokens_per_layer(stages, 6, 20) == [20, 20, 10, 10, 5, 5]
    assert average_visual_tokens(stages, 6, 20) == pytest.approx(70 / 6)


def test_scale_layers_is_proportional_and_strictly_increasing():
    assert scale_layers([3, 17, 22], 32, 32) == [3, 17, 22]
    assert scale_layers([3, 17, 22], 32, 28) == [3, 15, 19]
    assert scale_layers([1, 2, 3], 32, 4) == [1, 2, 3]
    # too shallow for distinct layers: the deepest stages share the last layer
    assert scale_layers([1, 2, 3], 32, 3) == [1, 2, 2]
    with pytest.raises(ValueError, match="no layer after the first"):
        scale_layers([3], 32, 1)


def test_stages_on_a_shared_layer_merge_keeping_the_deepest_count():
    assert merge_stages([1, 2, 2], [20, 8, 0]) == ([1, 2], [20, 0])
    assert merge_stages([3, 17, 22], [122, 48, 42]) == ([3, 17, 22], [122, 48, 42])


@pytest.mark.parametrize("name", ["e2s", "v2drop", "sparsevlm", "pdrop", "fastv", "dart"])
def test_shallow_models_get_a_merged_schedule_that_hits_the_budget(name):
    selector = get_selector(name)
    stages = selector.schedule(3, 144, 64)
    layers = [stage.layer for stage in stages]
    assert layers == sorted(set(layers)) and all(1 <= layer <= 2 for layer in layers)
    assert average_visual_tokens(stages, 3, 144) == pytest.approx(64, rel=0.02)


def test_solve_schedule_hits_the_average_and_keeps_the_shape():
    stages = solve_schedule([3, 17, 22], [122, 48, 42], 32, 576, 100)
    assert average_visual_tokens(stages, 32, 576) == pytest.approx(100, abs=0.1)
    keeps = [s.keep for s in stages]
    assert keeps == sorted(keeps, reverse=True)
    assert keeps[0] / keeps[1] == pytest.approx(122 / 48, rel=0.05)


def test_solve_schedule_rejects_budgets_below_the_unpruned_layers():
    with pytest.raises(ValueError, match="raise the budget or prune earlier"):
        solve_schedule([3, 17, 22], [1, 1, 1], 32, 576, 50)  # 3 * 576 / 32 = 54 already


def test_solve_schedule_keeps_everything_for_a_budget_of_all_tokens():
    assert counts(solve_schedule([2, 8], [2, 1], 32, 576, 576)) == [(2, 576), (8, 576)]


def test_geometric_schedule_matches_pdrop_structure():
    stages = solve_geometric_schedule([2, 8, 16], 32, 576, 192)
    assert average_visual_tokens(stages, 32, 576) == pytest.approx(192, abs=0.1)
    first, second, third = (s.keep for s in stages)
    ratio = first / 576  # the maintainer-derived lambda for 192 is about 0.56
    assert ratio == pytest.approx(0.56, abs=0.02)
    assert second == pytest.approx(576 * ratio**2, abs=2)
    assert third == pytest.approx(576 * ratio**3, abs=2)


def test_nearest_setting_compares_fractions_of_the_visual_tokens():
    settings = {64: "a", 128: "b", 192: "c"}
    assert nearest_setting(settings, 100, 576) == "b"
    assert nearest_setting(settings, 64, 288) == "b"  # 64 of 288 tokens is 128 of 576
    assert nearest_setting(settings, 96, 576) == "a"  # a tie goes to the smaller budget


@pytest.mark.parametrize("name", LLM_SELECTORS)
@pytest.mark.parametrize("num_layers, num_visual", MODELS)
@pytest.mark.parametrize("budget", [64, 128, 192])
def test_default_schedule_realises_the_average_budget(name, num_layers, num_visual, budget):
    selector, budget = averaging(name, num_visual, budget)
    stages = selector.schedule(num_layers, num_visual, budget)
    keeps = [s.keep for s in stages]
    assert keeps == sorted(keeps, reverse=True)
    assert [s.layer for s in stages] == sorted({s.layer for s in stages})
    assert average_visual_tokens(stages, num_layers, num_visual) == pytest.approx(budget, rel=0.02)


@pytest.mark.parametrize("name", LLM_SELECTORS)
@pytest.mark.parametrize("rule", ["average", "paper"])
def test_budget_of_all_tokens_keeps_everything(name, rule):
    if rule not in option_domains(selector_class(name))["budget_rule"].values:
        pytest.skip(f"{name} has no budget_rule={rule}")
    stages = get_selector(name, budget_rule=rule).schedule(32, 576, 576)
    assert all(s.keep == 576 for s in stages)
    assert average_visual_tokens(stages, 32, 576) == 576


@pytest.mark.parametrize("name", LLM_SELECTORS)
def test_impossible_budget_raises_a_clear_error(name):
    selector, budget = averaging(name, 576, 64)
    if selector.schedule(32, 576, budget)[0].layer > 0:  # a stage at layer 0 (VScan) makes any budget feasible
        with pytest.raises(ValueError, match="raise the budget"):
            selector.schedule(32, 576, 10)
    else:
        assert average_visual_tokens(selector.schedule(32, 576, 10), 32, 576) == 10
    with pytest.raises(ValueError, match="positive integer"):
        get_selector(name).schedule(32, 576, 0)


@pytest.mark.parametrize("name", LLM_SELECTORS)
def test_unknown_budget_rule_is_rejected(name):
    with pytest.raises(ValueError, match="budget_rule"):
        get_selector(name, budget_rule="exact")
    with pytest.raises(ValueError, match="positions"):
        get_selector(name, positions="shifted")


PAPER_TABLES = {
    # selector: {budget: [(layer, keep), ...]} on LLaVA-1.5-7B (selectors spec sections 2, 7, 8, 10.2, 10.3)
    # SparseVLM prunes the outputs of layers 2, 6, 15 (signal_layer="previous"): stages at the inputs of 3, 7, 16
    "sparsevlm": {
        192: [(3, 300), (7, 200), (16, 110)],
        128: [(3, 303), (7, 110), (16, 36)],
        96: [(3, 238), (7, 48), (16, 26)],
        64: [(3, 66), (7, 30), (16, 17)],
    },
    "pdrop": {
        192: [(2, 300), (6, 200), (16, 110)],
        128: [(2, 303), (6, 110), (16, 36)],
        64: [(2, 66), (6, 30), (16, 17)],
    },
    "v2drop": {
        192: [(3, 288), (17, 86), (22, 0)],
        128: [(3, 161), (17, 40), (22, 0)],
        64: [(3, 28), (17, 1), (22, 0)],
    },
    "fastv": {192: [(2, 192)], 128: [(2, 128)], 64: [(2, 64)]},
    "dart": {192: [(2, 196)], 128: [(2, 132)], 64: [(2, 68)]},
}


@pytest.mark.parametrize("name, budget", [(n, b) for n, table in PAPER_TABLES.items() for b in table])
def test_paper_counts_match_the_references(name, budget):
    stages = get_selector(name, budget_rule="paper").schedule(32, 576, budget)
    assert counts(stages) == PAPER_TABLES[name][budget]


@pytest.mark.parametrize(
    "name, layers, average",
    [("pdrop", [(8, 288), (16, 144), (24, 72)], 270.0), ("v2drop", [(3, 288), (17, 144), (22, 1)], 202.8125)],
)
def test_official_rule_gives_the_code_default_and_refuses_other_budgets(name, layers, average):
    selector = get_selector(name, budget_rule="official")
    stages = selector.schedule(32, 576, round(average))
    assert counts(stages) == layers
    assert average_visual_tokens(stages, 32, 576) == average
    with pytest.raises(
        ValueError, match=f"realises an average of {average:.2f} visual tokens .* not 128; use budget {round(average)}"
    ):
        selector.schedule(32, 576, 128)
    assert [s.keep for s in selector.schedule(32, 576, 576)] == [576] * len(layers)


@pytest.mark.parametrize("name", ["fastv", "sparsevlm", "dart", "e2s"])
def test_official_rule_is_refused_where_the_selector_has_none(name):
    with pytest.raises(ValueError, match="budget_rule=official of selector .* must be one of average, paper$"):
        get_selector(name, budget_rule="official")


@pytest.mark.parametrize("name", ["sparsevlm", "pdrop", "v2drop", "e2s"])
def test_paper_rule_names_its_budgets_for_an_unknown_one(name):
    with pytest.raises(
        ValueError,
        match=r"64 \(average [\d.]+\), .*128 \(average [\d.]+\), .*192 \(average [\d.]+\) only on 32 layers x 576 tokens; use budget_rule='average'",
    ):
        get_selector(name, budget_rule="paper").schedule(32, 576, 100)


def test_paper_counts_scale_with_the_token_count():
    assert counts(get_selector("e2s", budget_rule="paper").schedule(32, 288, 128)) == [(3, 61), (17, 24), (22, 21)]
    assert counts(get_selector("v2drop", budget_rule="paper").schedule(32, 288, 192)) == [(3, 144), (17, 43), (22, 0)]


def test_single_stage_layer_option_moves_the_stage():
    assert counts(get_selector("fastv", layer=3).schedule(32, 576, 128)) == [(3, 82)]
    assert get_selector("dart", layer=2).schedule(28, 391, 128)[0].layer == 2
    with pytest.raises(ValueError, match="layer must be"):
        get_selector("fastv", layer=0)


def test_pdrop_default_uses_layers_2_8_16_and_compact_positions():
    selector = get_selector("pdrop")
    assert [s.layer for s in selector.schedule(32, 576, 128)] == [2, 8, 16]
    assert selector.positions == "compact"
    assert get_selector("sparsevlm").positions == "compact"
    assert {get_selector(n).positions for n in ("fastv", "dart", "v2drop", "e2s")} == {"keep_original"}
