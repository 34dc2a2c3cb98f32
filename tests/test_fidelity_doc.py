"""docs/fidelity.md and `prune-audit selectors --fidelity --markdown` come from one source and say the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import list_selectors
from prune_audit.pruners.fidelity import fidelity_entries, fidelity_markdown
from prune_audit.pruners.registry import selector_from_strings

FIDELITY = fidelity_entries()  # each selector class's row, by name

DOC = Path(__file__).resolve().parents[1] / "docs" / "fidelity.md"


def test_doc_matches_the_metadata():
    assert DOC.read_text() == fidelity_markdown(), "regenerate docs/fidelity.md from prune_audit/pruners/fidelity.py"


def test_cli_prints_the_same_table():
    result = CliRunner().invoke(app, ["selectors", "--fidelity", "--markdown"])
    assert result.exit_code == 0
    assert result.output == DOC.read_text()
    rows = json.loads(CliRunner().invoke(app, ["selectors", "--fidelity", "--json"]).output)
    assert [row["selector"] for row in rows] == list_selectors()


@pytest.mark.parametrize("name", list_selectors())
def test_every_selector_has_a_row_whose_exact_options_are_valid(name):
    entry = FIDELITY[name]
    assert entry.commit and entry.default and entry.differences and entry.agreement
    selector_from_strings(name, list(entry.exact))  # each reference-exact option is a valid --option
