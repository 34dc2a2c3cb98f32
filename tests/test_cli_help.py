"""What users read: --version, and --help of every command in ordinary metavars (no Python types)."""

import re

import click
import pytest
import typer.main
from typer.testing import CliRunner

from prune_audit import __version__
from prune_audit.cli.main import app

runner = CliRunner()


def command_paths(command: click.Command, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of the CLI as argument tuples, the root included."""
    paths = [prefix]
    for name, child in getattr(command, "commands", {}).items():
        paths += command_paths(child, (*prefix, name))
    return paths


COMMANDS = command_paths(typer.main.get_command(app))
PYTHON_LEAKS = re.compile(r"<(list\[|bool|int|str|path|float|[a-z]+ range)|\[x[<>]=|x>=|\bNone\b")


def test_every_command_is_scanned():
    assert {("run",), ("visualize",), ("calibrate",), ("cascade",), ("demo", "train"), ("pope", "build")} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "prune-audit")
def test_help_shows_ordinary_metavars(path):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not PYTHON_LEAKS.search(result.stdout), PYTHON_LEAKS.search(result.stdout).group(0)
    options = [line for line in result.stdout.splitlines() if re.match(r"\W*--[a-z]", line)]
    for line in options:  # an option taking a value names its kind as click does
        kinds = re.findall(r"\b(PATH|INTEGER|FLOAT|TEXT)\b", line)
        assert kinds or re.search(r"--(help|json|force|version|multi-stage|quiet|plan|report|fidelity)\b", line), line


def test_version_option():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"prune-audit {__version__}"
