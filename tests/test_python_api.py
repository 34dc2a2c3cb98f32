"""The curated ``prune_audit.data`` / ``prune_audit.analysis`` namespaces and the Python snippet of docs/python-api.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_cli import base_args
from typer.testing import CliRunner

import prune_audit.analysis
import prune_audit.data
from prune_audit.cli.main import app

PYTHON_API_DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def readme_python_snippet() -> str:
    """The ```python block after ``<!-- python-api -->`` in docs/python-api.md."""
    text = PYTHON_API_DOC.read_text()
    marker = text.index("<!-- python-api -->")
    start = text.index("```python\n", marker) + len("```python\n")
    return text[start : text.index("\n```", start)]


@pytest.mark.parametrize("package", [prune_audit.data, prune_audit.analysis])
def test_every_exported_name_imports(package):
    assert package.__all__ and len(set(package.__all__)) == len(package.__all__)
    for name in package.__all__:
        assert getattr(package, name) is not None, name
        assert name in dir(package)
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        package.missing  # noqa: B018


def test_importing_the_namespaces_is_cheap():
    code = "import sys, prune_audit.data, prune_audit.analysis; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_readme_python_snippet_runs(workspace, tmp_path):
    """the docs snippet on stand-ins for the demo runs it reads (tiny model: same files, seconds not minutes)."""
    runner = CliRunner()
    for out, extra in [("runs/demo-dense", ()), ("runs/demo-e2s-64", ("--selector", "random", "--budget", "4"))]:
        result = runner.invoke(app, base_args(workspace, tmp_path / out, *extra))
        assert result.exit_code == 0, result.output
    environment = {**os.environ, "PYTHONPATH": str(PYTHON_API_DOC.parents[1])}
    completed = subprocess.run(
        [sys.executable, "-c", readme_python_snippet()], cwd=tmp_path, env=environment, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "objects lost" in completed.stdout and "ECE" in completed.stdout
