"""What users read: --version, and --help of every command in ordinary metavars (no Python types)."""

import re

import click
import pytest
import typer.main
from typer.testing import CliRunner

from prune_audit import __version__
from prune_audit.cli.main import app

runner = CliRunner()


def command_paths(command: click.Command, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command and subcommand of the CLI by its argument tuple, the root included."""
    paths = {prefix: command}
    for name, child in getattr(command, "commands", {}).items():
        paths.update(command_paths(child, (*prefix, name)))
    return paths


COMMANDS = command_paths(typer.main.get_command(app))
PYTHON_LEAKS = re.compile(r"<(list\[|bool|int|str|path|float|[a-z]+ range)|\[x[<>]=|x>=|\bNone\b")


def test_every_command_is_scanned():
    assert {("run",), ("visualize",), ("calibrate",), ("cascade",), ("demo", "train"), ("pope", "build")} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "prune-audit")
def test_help_shows_ordinary_metavars(path):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not PYTHON_LEAKS.search(result.stdout), PYTHON_LEAKS.search(result.stdout).group(0)
    flags = {"--help", *(opt for p in COMMANDS[path].params if getattr(p, "is_flag", False) for opt in p.opts)}
    for line in result.stdout.splitlines():  # an option taking a value names its kind as click does
        option = re.match(r"\W*(--[a-z][a-z-]*)", line)
        if option and option.group(1) not in flags:
            assert re.search(r"\b(PATH|INTEGER|FLOAT|TEXT)\b|\[[a-z0-9_|-]+\]", line), line


def test_version_option():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"prune-audit {__version__}"
