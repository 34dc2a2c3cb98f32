"""Issue 23 (second pass), options: every option and environment variable is checked before anything is written.

Each refusal is checked as in tests/test_data_safety.py (``refused``): exit code 2, one ``error:`` line
naming the cause and the fix, no traceback, no signal, and every pre-existing file's bytes unchanged
(``outputs_kept``). Runs are tiny (``--limit``) and shared by a module fixture; a real process is used
where the property is about the process (a crash signal).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import refused, snapshot
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError
from prune_audit.threads import usable_cores

REPO_ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: object, env: dict[str, str] | None = None):
    return runner.invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    """A dense and a random@36 demo run (12 questions each)."""
    from prune_audit.demo.assets import demo_assets

    root = tmp_path_factory.mktemp("options")
    runs = {"dense": root / "dense", "pruned": root / "pruned"}
    assert invoke("run", "--limit", "12", "--out", runs["dense"]).exit_code == 0
    pruned = invoke("run", "--selector", "random", "--budget", "36", "--limit", "12", "--out", runs["pruned"])
    assert pruned.exit_code == 0, pruned.output
    assets = demo_assets()
    return {"root": root, **runs, "pope": assets.pope_files[0], "images": assets.images_dir}


@pytest.fixture
def outputs_kept(demo):
    """Asserts after the test that no file of the shared runs changed."""
    before = snapshot(demo["dense"], demo["pruned"])
    yield
    assert snapshot(demo["dense"], demo["pruned"]) == before


# ----- 4. thread counts: --threads and OMP_NUM_THREADS --------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--limit", "2"],
        ["intervene", "{pruned}", "--mode", "remove"],
        ["visualize", "{image}"],
        ["demo", "train", "--steps", "1"],
    ],
)
def test_more_threads_than_cores_are_refused_by_every_command(demo, tmp_path, outputs_kept, command):
    image = next(demo["images"].iterdir())
    args = [part.format(pruned=demo["pruned"], image=image) for part in command]
    cores = usable_cores()
    refused(
        invoke(*args, "--threads", "100000", "--out", tmp_path / "out"),
        f"--threads 100000 is more than the {cores} cores",
        f"pass --threads 1 to {cores}",
    )
    assert not (tmp_path / "out").exists()


def test_omp_num_threads_is_checked_in_a_real_process(demo, tmp_path, outputs_kept):
    """100000 threads crashed OpenBLAS with SIGSEGV after "interrupted: nothing was written"."""
    out = tmp_path / "out"
    for value, needle in (
        ("100000", "is more than the"),
        ("abc", "must be a positive integer"),
        ("²", "positive integer"),
    ):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": value}
        done = subprocess.run(
            [sys.executable, "-m", "prune_audit.cli.main", "run", "--limit", "2", "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2, done.stderr  # an exit code, not a signal (negative)
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("error: OMP_NUM_THREADS") and needle in line and "unset it" in line, line
        assert not out.exists()


# ----- 13. integers: ASCII digits only; launcher variables ---------------------------------


@pytest.mark.parametrize("value", ["²", "١", "+1", "1_0", "-1"])
def test_stage_takes_ascii_digits_only(demo, tmp_path, outputs_kept, value):
    refused(
        invoke("calibrate", demo["pruned"], "--stage", value, "--out", tmp_path / "out"),
        "--stage must be first, last or a stage index",
        repr(value),
    )
    assert not (tmp_path / "out").exists()


def test_question_id_takes_ascii_digits_only(demo, tmp_path, outputs_kept):
    pope = tmp_path / "demo_pope_random.json"
    lines = demo["pope"].read_text(encoding="utf-8").splitlines()[:4]
    first = json.loads(lines[0])
    first["question_id"] = "²"
    pope.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    refused(
        invoke("run", "--pope", pope, "--images", demo["images"], "--out", out), "question_id must be an integer", "'²'"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"WORLD_SIZE": "abc"}, ("WORLD_SIZE must be a non-negative integer", "'abc'", "unset it")),
        ({"WORLD_SIZE": "2", "RANK": "²"}, ("RANK must be a non-negative integer", "'²'")),
        ({"WORLD_SIZE": "2", "RANK": "5"}, ("RANK=5 is not below WORLD_SIZE=2",)),
    ],
)
def test_launcher_variables_are_checked(demo, tmp_path, outputs_kept, env, needles):
    out = tmp_path / "out"
    refused(invoke("run", "--limit", "2", "--out", out, env=env), *needles)
    assert not out.exists()


def test_integer_parser_refuses_what_int_accepts():
    from prune_audit.integers import is_digits, parse_integer

    assert parse_integer("-3") == -3 and parse_integer("032") == 32 and is_digits("0") and not is_digits("-1")
    for text in ("²", "١", "+1", "1_0", " 1", "", "1.0"):
        with pytest.raises(ValueError):
            parse_integer(text)


# ----- 11. duplicates and conflicts -------------------------------------------------------------


def test_a_repeated_option_is_refused(demo, tmp_path, outputs_kept):
    out = tmp_path / "out"
    refused(
        invoke(
            "run",
            "--selector",
            "fastv",
            "--budget",
            "32",
            "--option",
            "layer=2",
            "--option",
            "layer=3",
            "--limit",
            "2",
            "--out",
            out,
        ),
        "--option layer is given twice",
        "once",
    )
    refused(
        invoke("run", "--selector", "fastv", "--budget", "32", "--option", "layer=²", "--limit", "2", "--out", out),
        "option layer=² of selector 'fastv' is not allowed",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--budgets", "32,032"], ("--budgets lists '32' and '032', the same budget", "list it once")),
        (["--budgets", "11%,11.0%"], ("--budgets lists '11%' and '11.0%', the same budget",)),
        (["--budgets", "32,+32"], ("'+32'",)),
        (["--budgets", "all,144"], ("--budgets all and 144 both keep 144 visual tokens", "once")),
        (["--budgets", "500"], ("--budget 500 is more than the model's 144 visual tokens",)),
        (["--stage", "99"], ("--stage 99", "one stage (index 0)", "pass first, last or 0")),
        (["--stage", "²"], ("--stage must be first, last or a stage index",)),
        (["--bins", "1000000"], ("--bins must be 1 to 1000", "1000000")),
    ],
)
@pytest.mark.parametrize("plan", [["--plan"], []], ids=["plan", "study"])
def test_study_grid_is_checked_before_anything_runs(demo, tmp_path, outputs_kept, extra, needles, plan):
    out = tmp_path / "study"
    refused(invoke("study", "--selectors", "random", "--limit", "4", *extra, *plan, "--out", out), *needles)
    assert not out.exists()


def test_study_budgets_are_read_as_run_reads_them():
    from prune_audit.runner.study.grid import parse_budgets

    assert parse_budgets(" 032, 11%, all") == ("32", "11%", "all")
    with pytest.raises(PruneAuditError, match="lists '64' and '064', the same budget"):
        parse_budgets("64,064")


def test_visualize_refuses_an_image_with_run(demo, tmp_path, outputs_kept):
    image = next(demo["images"].iterdir())
    out = tmp_path / "figure.png"
    refused(
        invoke("visualize", image, "--run", demo["pruned"], "--question-id", "1", "--out", out),
        "IMAGE does not apply with --run",
        "drop IMAGE or --run",
    )
    refused(
        invoke("visualize", "--run", demo["pruned"], "--question-id", "1", "--budget", "0", "--out", out),
        "--budget does not apply with --run",
    )
    refused(invoke("visualize", image, "--question-id", "1", "--out", out), "--question-id applies only with --run")
    assert not out.exists()


# ----- 5 and 10. analyses: bins, confidences, references ----------------------------------------


def test_calibrate_bins_are_bounded(demo, tmp_path, outputs_kept):
    out = tmp_path / "out"
    refused(invoke("calibrate", demo["pruned"], "--bins", "1000000", "--out", out), "--bins must be 1 to 1000")
    refused(invoke("calibrate", demo["pruned"], "--bins", "0", "--out", out), "--bins must be 1 to 1000")
    assert not out.exists()


@pytest.mark.parametrize("value", [float("nan"), 7.5, 0.2])
def test_calibrate_and_cascade_refuse_impossible_confidences_alike(demo, tmp_path, value):
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(demo["pruned"], broken)
    records = pq.read_table(broken / "records.parquet")
    column = records["confidence"].to_pylist()
    column[3] = value
    index = records.column_names.index("confidence")
    pq.write_table(records.set_column(index, "confidence", pa.array(column, pa.float64())), broken / "records.parquet")
    before = snapshot(broken, demo["dense"])
    lines = set()
    for command in (
        ["calibrate", broken, "--reference", demo["dense"], "--bootstrap", "5"],
        ["cascade", broken, "--reference", demo["dense"], "--epsilon", "0.5", "--splits", "2"],
    ):
        out = tmp_path / command[0]
        lines.add(
            refused(
                invoke(*command, "--out", out),
                f"records of {broken}: confidence",
                "is not a probability in [0.5, 1]",
                "re-run",
            )
        )
        assert not out.exists()
    assert len(lines) == 1  # the same check, the same words
    assert snapshot(broken, demo["dense"]) == before


def test_a_run_compared_with_itself_is_refused(demo, tmp_path, outputs_kept):
    link = tmp_path / "link"
    link.symlink_to(demo["pruned"], target_is_directory=True)
    out = tmp_path / "out"
    refused(
        invoke("calibrate", demo["pruned"], "--reference", demo["pruned"], "--out", out),
        f"{demo['pruned']} is given twice",
        "compared with itself",
        "two different runs",
    )
    refused(
        invoke("cascade", link, "--reference", demo["pruned"], "--out", out),
        f"{demo['pruned']} and {link} are one run",
        "compared with itself",
    )
    refused(invoke("calibrate", demo["pruned"], link, "--force", "--out", out), "are one run")
    assert not out.exists()


def test_a_pruned_reference_is_named_by_its_selector_and_budget(demo, tmp_path, outputs_kept):
    calibration = invoke(
        "calibrate",
        demo["dense"],
        "--reference",
        demo["pruned"],
        "--bootstrap",
        "5",
        "--out",
        tmp_path / "cal",
        env={"COLUMNS": "200"},
    )
    assert calibration.exit_code == 0, calibration.output
    report = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert report["reference"]["label"] == "random@36" and report["reference"]["selector"] == "random"
    assert report["reference"]["budget"] == 36 and report["runs"][0]["label"] == "dense"
    assert "random@36 (reference)" in calibration.stdout and "dense accuracy if lost" not in calibration.stdout
    cascade = invoke(
        "cascade",
        demo["dense"],
        "--reference",
        demo["pruned"],
        "--epsilon",
        "0.5",
        "--splits",
        "2",
        "--out",
        tmp_path / "cascade",
        env={"COLUMNS": "200"},
    )
    assert cascade.exit_code == 0, cascade.output
    report = json.loads((tmp_path / "cascade" / "cascade.json").read_text())
    assert report["reference"]["label"] == "random@36"
    assert "relative to the reference random@36" in cascade.stdout


def test_cascade_refuses_an_empty_sweep(demo, tmp_path, outputs_kept):
    out = tmp_path / "out"
    refused(
        invoke("cascade", demo["pruned"], "--reference", demo["dense"], "--sweep", "", "--out", out),
        "--sweep takes comma-separated numbers, got ''",
    )
    assert not out.exists()


def test_intervene_warns_on_an_incomplete_run(demo, tmp_path):
    shard = tmp_path / "shard"
    made = invoke("run", "--selector", "random", "--budget", "36", "--limit", "24", "--shard", "0/2", "--out", shard)
    assert made.exit_code == 0, made.output
    result = invoke("intervene", shard, "--mode", "remove", "--bootstrap", "5", "--out", tmp_path / "out", "--quiet")
    assert f"warning: {shard} is incomplete" in result.stderr, result.output


# ----- 13. a full disk while the study reports ------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_while_the_study_reports_names_the_report(demo, tmp_path, monkeypatch):
    out = tmp_path / "study"
    write_bytes = Path.write_bytes

    def full_in_the_report(self, data):
        if Path(self).parent.parent == out:  # the report's staging folder, not a run's files
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_in_the_report)
    args = [
        "study",
        "--selectors",
        "random",
        "--budgets",
        "36",
        "--limit",
        "12",
        "--bootstrap",
        "5",
        "--splits",
        "2",
        "--epsilons",
        "0.5",
        "--out",
        out,
        "--quiet",
    ]
    line = refused(invoke(*args), code=1)
    assert line.startswith(f"error: no space left on the device writing {out}/")
    assert ".staging" not in line and f"questions are saved in {out / 'runs'};" in line
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    assert invoke(*args).exit_code == 0
