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


@pytest.mark.parametrize("bad", BAD_BUDGETS)
def test_lmms_eval_plugin_refuses_a_bad_budget_as_the_home_does(bad):
    pytest.importorskip("lmms_eval")  # the optional extra, as in test_lmms_eval_plugin.py
    from prune_audit.api.lmms_eval import _budget
    from prune_audit.api.pruning import _selector_and_budget

    assert _message(_selector_and_budget, "fastv", _budget(bad), {}) == _message(parse_requested_budget, bad)


@pytest.mark.parametrize("bad", BAD_BUDGETS)
def test_cli_run_refuses_a_bad_budget_as_the_home_does(workspace, tmp_path, bad):
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--annotations",
        str(workspace["instances"]),
        "--out",
        str(out),
        "--pope",
        str(workspace["pope"][0]),
        "--selector",
        "fastv",
        "--budget",
        bad,
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "Traceback" not in result.output and not out.exists()
    assert f"error: {_message(parse_requested_budget, bad)}" in result.output


def test_the_study_grid_keeps_no_budget_parser_of_its_own():
    source = Path(__file__).parents[1] / "prune_audit" / "runner" / "study" / "grid.py"
    defined = {
        node.name
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef)
    }
    assert "parse_budget" not in defined
