"""The budget has one home (issue 39, item 3): ``compute.budget`` parses and checks it, and every entry point
refuses the same bad budget with the same one-line message."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from prune_audit.compute.budget import parse_requested_budget
from prune_audit.errors import PruneAuditError

BAD_BUDGETS = ["0", "-3", "abc", "0%", "101%", "x%"]


def _message(call, *args) -> str:
    with pytest.raises(PruneAuditError) as caught:
        call(*args)
    return str(caught.value)


@pytest.mark.parametrize("bad", BAD_BUDGETS)
def test_study_grid_and_api_refuse_a_bad_budget_as_the_home_does(bad):
    from prune_audit.api.pruning import _selector_and_budget
    from prune_audit.runner.study.grid import check_grid, parse_budgets

    expected = _message(parse_requested_budget, bad)
    assert _message(parse_budgets, bad) == expected
    assert _message(check_grid, ["fastv"], [bad]) == expected
    assert _message(_selector_and_budget, "fastv", bad, {}) == expected


def test_the_study_grid_keeps_no_budget_parser_of_its_own():
    source = Path(__file__).parents[1] / "prune_audit" / "runner" / "study" / "grid.py"
    defined = {node.name for node in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
               if isinstance(node, ast.FunctionDef)}
    assert "parse_budget" not in defined
