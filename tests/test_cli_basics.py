import json
import subprocess
import sys

from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()


def test_help_does_not_import_torch():
    code = "import sys, prune_audit.cli.main; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_selectors_lists_every_registered_selector():
    from prune_audit.pruners import list_selectors

    result = runner.invoke(app, ["selectors", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list_selectors()
    for row in rows:
        assert row["stage"] in {"input", "llm"}
        assert row["paper"] and row["repository"]
