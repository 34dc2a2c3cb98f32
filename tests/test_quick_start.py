"""Issue 29, items 7 and 12: a quick start that works, one rule for derived outputs.

A ``--limit`` run gets its own default folder (``runs/demo-dense-limit12``), so a quick try never lands
in, nor is refused by, a full run's folder; comparing runs that hold other questions is refused naming
both runs, their question counts and the fix; ``intervene`` writes next to ``calibration/`` and
``figures/``, never inside the run it reads; and the README's quick-start block runs as written.
Refusals are checked as in tests/test_data_safety.py (``refused``, ``snapshot``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import refused, snapshot
from typer.testing import CliRunner

from prune_audit.cli.main import app

REPO_ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A working folder (the cwd during the module's tests) with demo runs in their default folders:
    dense and random@36 of 12 questions, dense of 6, and shard 0/2 of a dense run of 12."""
    root = tmp_path_factory.mktemp("quick")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for args in (
            ["--limit", "12"],
            ["--selector", "random", "--budget", "36", "--limit", "12"],
            ["--limit", "6"],
            ["--limit", "12", "--shard", "0/2", "--out", "shard"],
        ):
            result = invoke("run", *args, "--quiet")
            assert result.exit_code == 0, result.output
        yield root


# ----- item 7: the limit in the default folder, the refusal names both runs and the fix -----


def test_the_default_run_folder_names_the_limit(quick):
    assert sorted(p.name for p in (quick / "runs").iterdir()) == [
        "demo-dense-limit12",
        "demo-dense-limit6",
        "demo-random-36-limit12",
    ]
    assert not (quick / "runs" / "demo-dense").exists()  # a full run's folder stays free


@pytest.mark.parametrize("command", ["calibrate", "cascade"])
@pytest.mark.parametrize("force", [[], ["--force"]])  # other questions cannot be paired: --force does not help
def test_runs_of_other_limits_are_refused_naming_both_runs_counts_and_fix(quick, command, force):
    before = snapshot(quick / "runs")
    out = quick / f"{command}-refused"
    result = invoke(
        command, "runs/demo-random-36-limit12", "--reference", "runs/demo-dense-limit6", *force, "--out", out
    )
    refused(
        result,
        "runs/demo-random-36-limit12 holds 12 questions (--limit 12)",
        "runs/demo-dense-limit6 holds 6 questions (--limit 6)",
        "do not hold the same questions",
        "re-run runs/demo-random-36-limit12 with --limit 6",
    )
    assert snapshot(quick / "runs") == before and not out.exists()


def test_a_run_without_limit_is_named_so(quick):
    from dataclasses import replace

    from prune_audit.analysis.runs import check_comparable, load_run
    from prune_audit.errors import PruneAuditError

    limited = load_run(quick / "runs" / "demo-dense-limit6")
    unlimited = replace(load_run(quick / "runs" / "demo-dense-limit12"), path=Path("runs/demo-dense"))
    unlimited.manifest["limit"] = None  # as a run of every question of its files records it
    with pytest.raises(PruneAuditError) as refusal:
        check_comparable([unlimited, limited], force=True)
    message = str(refusal.value)
    assert "runs/demo-dense holds 12 questions (no --limit)" in message
    assert "re-run runs/demo-dense with --limit 6" in message and "\n" not in message


def test_a_shard_against_a_complete_run_says_finish_it(quick):
    before = snapshot(quick / "runs", quick / "shard")
    result = invoke("calibrate", "runs/demo-dense-limit12", "--reference", "shard", "--out", quick / "shard-refused")
    refused(
        result,
        "runs/demo-dense-limit12 holds 12 questions (--limit 12)",
        "shard holds 6 of its 12 questions (a shard or a stopped run)",
        "finish shard",
    )
    assert snapshot(quick / "runs", quick / "shard") == before and not (quick / "shard-refused").exists()


def test_runs_of_the_same_limit_compare(quick):
    result = invoke(
        "calibrate",
        "runs/demo-random-36-limit12",
        "--reference",
        "runs/demo-dense-limit12",
        "--bootstrap",
        "20",
        "--out",
        "calibration-limit12",
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert (quick / "calibration-limit12" / "calibration.json").is_file()


# ----- item 12: derived outputs never go inside a run directory -----


def test_intervene_defaults_to_a_folder_outside_the_run(quick):
    run_dir = quick / "runs" / "demo-random-36-limit12"
    before = snapshot(run_dir)
    result = invoke("intervene", "runs/demo-random-36-limit12", "--mode", "remove", "--bootstrap", "10")
    assert result.exit_code == 0, result.output
    out = quick / "intervene" / "demo-random-36-limit12-remove"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "intervention.json",
        "records.parquet",
    ]
    assert "intervene/demo-random-36-limit12-remove" in "".join(result.stdout.split())  # rich wraps the line
    assert snapshot(run_dir) == before  # the run folder holds the run's outputs only


def test_visualize_run_writes_outside_the_run(quick):
    run_dir = quick / "runs" / "demo-random-36-limit12"
    before = snapshot(run_dir)
    result = invoke("visualize", "--run", "runs/demo-random-36-limit12", "--question-id", "1", "--split", "random")
    assert result.exit_code == 0, result.output
    assert (quick / "figures" / "demo-random-36-limit12" / "tokens-random-1.png").is_file()
    assert snapshot(run_dir) == before


# ----- the README's quick start, as written -----


def readme_quick_start() -> list[str]:
    """The commands of the first bash block under README's "## Quick start" heading."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README's quick start has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def run_readme_commands(commands: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = []
    for command in commands:
        words = shlex.split(command, comments=True)
        assert words[0] == "prune-audit", command
        completed = subprocess.run(
            [sys.executable, "-m", "prune_audit.cli.main", *words[1:]], cwd=cwd, env=env, capture_output=True, text=True
        )
        assert completed.returncode == 0, f"{command}\n{completed.stderr[-2000:]}"
        done.append(completed)
    return done


def test_readme_quick_start_folders_agree_at_a_smaller_limit(tmp_path):
    """The same commands at --limit 12 (and a question among the first 12): every folder one command reads
    is one an earlier command wrote by default."""
    commands = [
        re.sub(r"--question-id \d+", "--question-id 1", line).replace("900", "12") for line in readme_quick_start()
    ]
    run_readme_commands(commands, tmp_path)
    assert (tmp_path / "calibration-limit12" / "calibration.json").is_file()
    assert list((tmp_path / "figures" / "demo-e2s-64-limit12").glob("tokens-*.png"))


@pytest.mark.slow
def test_readme_quick_start_runs_as_written(tmp_path):
    commands = readme_quick_start()
    assert 3 <= len(commands) <= 5 and all("--limit 900" in line for line in commands if " run " in f" {line} ")
    run_readme_commands(commands, tmp_path)
    assert (tmp_path / "calibration-limit900" / "calibration.json").is_file()
    assert (tmp_path / "figures" / "demo-e2s-64-limit900" / "tokens-random-201.png").is_file()
