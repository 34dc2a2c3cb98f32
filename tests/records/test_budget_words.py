"""The words beside a run's budget: "(layer average)" only where the selector's stages average the budget."""

from __future__ import annotations

import pytest

from prune_audit.pruners.composed import parse_selector
from prune_audit.pruners.registry import get_selector
from prune_audit.records.stages import budget_words
from prune_audit.runner.manifest_selector import averages_budget


def test_an_in_llm_budget_is_a_layer_average_unless_the_selector_keeps_exactly_it():
    assert budget_words(64, [0]) == "budget 64"
    assert budget_words(64, [0, 2, 6]) == "budget 64 (layer average)"
    assert budget_words(64, [0, 2], averaged=False) == "budget 64"
    assert budget_words([128, 64], [0, 2]) == "budget 128,64 (input, then in-LLM layer average)"
    assert budget_words([128, 1], [0, 11], averaged=False) == "budget 128,1 (input, then in-LLM)"


@pytest.mark.parametrize(
    ("name", "options", "averaged"),
    [
        ("fastv", {}, True),
        ("pdrop", {"budget_rule": "paper"}, True),  # the paper's own schedules average the budget
        ("flowcut", {}, True),
        ("flowcut", {"budget_rule": "paper"}, False),  # exactly the budget after layer 1
        ("mustdrop", {"budget_rule": "paper"}, False),  # the official thresholds, whatever the budget
        ("visionzip", {}, True),
        ("prunevid_llm", {}, False),  # the official share of each group, whatever the budget
        ("prunevid_llm", {"budget_rule": "average"}, True),
    ],
)
def test_each_selector_says_whether_it_averages_and_its_manifest_reads_back_the_same(name, options, averaged):
    selector = get_selector(name, **options)
    assert selector.averages_budget is averaged
    assert averages_budget({"name": name, "options": selector.options()}) is averaged


def test_a_composed_selector_follows_its_in_llm_part_and_an_unknown_selector_averages():
    composed = parse_selector("visionzip+fastv", [])
    assert composed.averages_budget
    assert averages_budget({"name": composed.name, "options": composed.options(), "parts": [{}, {}]})
    assert averages_budget({"name": "not-installed-here", "options": {}})


def test_a_composed_selector_whose_in_llm_part_ignores_the_budget_names_no_average():
    composed = parse_selector("prunevid+prunevid_llm", [])
    parts = [{"name": part.name, "options": part.options()} for part in composed.parts]
    assert not composed.averages_budget
    assert not averages_budget({"name": composed.name, "options": composed.options(), "parts": parts})
