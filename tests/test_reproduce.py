"""``prune-audit reproduce`` (issue 40, item 3): the seed study's figures with their tolerances in the dry run,
refusals without weights or data, and the comparison table from study outputs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from cli_checks import refused, snapshot
from typer.testing import CliRunner

from prune_audit.analysis.reproduce import (
    CASCADE_EPSILON,
    GRID_BUDGETS,
    GRID_SELECTORS,
    SEED_FIGURES,
    STUDY_FOLDER,
    TABLE_COLUMNS,
    TIMING_FOLDER,
    TIMING_SELECTOR,
    comparison_rows,
    read_outputs,
    seed_figure,
)
from prune_audit.cli.main import app

runner = CliRunner()

# The seed's figures as the issue states them: (figure key, seed value as printed, tolerance as printed)
ISSUE_FIGURES = {
    "dense.accuracy": ("87.0 %", "+-1.0 points"),
    "dense.confidence": ("0.910", "+-0.02"),
    "fastv64.accuracy": ("71.1 %", "+-1.0 points"),
    "fastv64.confidence": ("0.920", "+-0.02"),
    "cls_attn64.accuracy": ("80.5 %", "+-1.0 points"),
    "cls_attn64.confidence": ("0.890", "+-0.02"),
    "coverage64.accuracy": ("85.1 %", "+-1.0 points"),
    "cdpruner64.accuracy": ("88.0 %", "+-1.0 points"),
    "dense.auroc": ("0.801", "+-0.02"),
    "fastv64.auroc": ("0.674", "+-0.02"),
    "fastv64.lost_accuracy": ("17.0 %", "+-5.0 points"),
    "fastv64.lost_reference_accuracy": ("59.0 %", "+-5.0 points"),
    "fastv64.lost_confidence": ("0.820", "+-0.03"),
    "fastv64.lost_reference_confidence": ("0.800", "+-0.03"),
    "coverage64.cascade_cost": ("36.0 %", "+-5.0 points"),
    "fastv64.cascade_cost": ("105.0 %", "+-5.0 points"),
    "fastv64.uninformative_cost": ("97.0 %", "+-5.0 points"),
    "dense.ms_b1": ("52.7 ms", "+-20%"),
    "timing.throughput_b32": ("5.00x", "+-20%"),
    "golden13b.f1": ("0.8595", "+-0.0001"),
}


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The Markdown table in ``text``, row by figure key."""
    header = "| " + " | ".join(TABLE_COLUMNS) + " |"
    lines = text[text.index(header) :].splitlines()[2:]
    rows = [
        dict(zip(TABLE_COLUMNS, (cell.strip() for cell in line.strip("|").split(" | "))))
        for line in lines
        if line.startswith("| ")
    ]
    return {row["figure"]: row for row in rows}


def test_dry_run_lists_every_seed_figure_with_its_tolerance(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["reproduce", "--dry-run"])
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert {key: (row["seed"], row["tolerance"]) for key, row in rows.items()} == ISSUE_FIGURES
    assert all(row["status"] == "planned" and row["measured from"] for row in rows.values())
    plan = result.stdout
    for selector in GRID_SELECTORS:
        assert all(f"{selector}@{budget}" in plan for budget in GRID_BUDGETS)
    assert "11 runs" in plan and "9,000 questions each (adversarial, popular, random)" in plan
    assert (
        "prune-audit study --selectors fastv,cls_attn,coverage,cdpruner,divprune --budgets 64,128 --batch-size 1"
        in plan
        and "--out reproduce/timing-b32" in plan
    )
    assert "estimated time: about 1.5 h on one H200 (an estimate" in plan
    assert list(tmp_path.iterdir()) == []  # the dry run writes nothing


def test_dry_run_time_scales_with_the_questions(tmp_path):
    result = runner.invoke(app, ["reproduce", "--dry-run", "--limit", "900", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "900 questions each" in result.stdout and "about 0.2 h" in result.stdout  # 11 x 900 + 2 x 640 at 52.7 ms
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args", [[], ["--model", "llava-hf/llava-1.5-7b-hf"], ["--model", "{tmp}/empty"]])
def test_refuses_without_the_weights_in_one_line_writing_nothing(tmp_path, monkeypatch, args):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # empty
    (tmp_path / "empty").mkdir()
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["reproduce", *args, "--out", str(tmp_path / "out")])
    refused(result, "llava-hf/llava-1.5-7b-hf", "huggingface-cli download llava-hf/llava-1.5-7b-hf", "--model PATH")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_hub_id_is_read_from_the_local_cache(workspace, tmp_path, monkeypatch):
    """A downloaded hub id passes the weights check (then the missing CLIP tower is refused), never fetched."""
    import shutil

    cache = tmp_path / "hub-cache"
    snapshot_dir = cache / "models--llava-hf--llava-1.5-7b-hf" / "snapshots" / "0123abcd"
    shutil.copytree(workspace["model"], snapshot_dir)
    (cache / "models--llava-hf--llava-1.5-7b-hf" / "refs").mkdir()
    (cache / "models--llava-hf--llava-1.5-7b-hf" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    result = runner.invoke(app, ["reproduce", "--model", "llava-hf/llava-1.5-7b-hf", "--out", str(tmp_path / "out")])
    refused(result, "reproduce needs the openai/clip-vit-large-patch14-336 weights")
    (snapshot_dir / "model.safetensors").unlink()  # config without weights: not downloaded
    result = runner.invoke(app, ["reproduce", "--model", "llava-hf/llava-1.5-7b-hf", "--out", str(tmp_path / "out")])
    refused(result, "no config.json and weights found locally", "huggingface-cli download llava-hf/llava-1.5-7b-hf")


@pytest.fixture(scope="module")
def clip(workspace):
    from prune_audit.models.build import build_clip

    return build_clip(
        workspace["root"] / "clip", words=["Is", "there", "a", "in", "the", "image"], vision_hidden_size=64
    )


def data_args(workspace, clip, pope_files: list[Path] | None = None) -> list[str]:
    chosen = workspace["pope"] if pope_files is None else pope_files
    pope = [arg for path in chosen for arg in ("--pope", str(path))]
    return [
        "--model",
        str(workspace["model"]),
        "--clip-text",
        str(clip),
        *pope,
        "--images",
        str(workspace["images"]),
        "--annotations",
        str(workspace["instances"]),
        "--device",
        "cpu",
        "--quiet",
    ]


@pytest.mark.parametrize(
    ("drop", "needles"),
    [
        ("--clip-text", ("openai/clip-vit-large-patch14-336", "huggingface-cli download")),
        ("--pope", ("POPE questions", "--pope coco_pope_adversarial.json")),
        ("--images", ("COCO val2014 images", "--images")),
        ("--annotations", ("instances_val2014.json", "--annotations")),
    ],
)
def test_refuses_without_each_input_writing_nothing(workspace, clip, tmp_path, drop, needles):
    args = data_args(workspace, clip)
    kept = [arg for index, arg in enumerate(args) if drop not in (arg, args[index - 1] if index else "")]
    result = runner.invoke(app, ["reproduce", *kept, "--out", str(tmp_path / "out")])
    refused(result, *needles)
    assert not (tmp_path / "out").exists()


def test_refuses_pope_files_without_every_split(workspace, clip, tmp_path):
    two_splits = [path for path in workspace["pope"] if "adversarial" not in path.name]
    result = runner.invoke(app, ["reproduce", *data_args(workspace, clip, two_splits), "--out", str(tmp_path / "out")])
    refused(result, "no file of the adversarial split", "--pope coco_pope_random.json")
    assert not (tmp_path / "out").exists()


def test_runs_the_study_preset_up_to_the_models_check(workspace, clip, tmp_path):
    """On CPU with a tiny LLaVA the preset goes through `study` to the loaded model, whose 16 visual tokens the
    seed's 64-token budget exceeds: study's own one-line refusal, and the new folder is removed again."""
    args = [*data_args(workspace, clip), "--limit", "6", "--out", str(tmp_path / "out")]
    result = runner.invoke(app, ["reproduce", *args])
    refused(result, "--budget 64 is more than the model's 16 visual tokens")
    assert not (tmp_path / "out").exists()


def test_runs_the_seed_grid_and_the_timing_pair_then_compares(workspace, clip, tmp_path, monkeypatch):
    """The preset: the grid and the batch-32 timing pair through `study` (recorded here, writing study outputs as
    the real one would), then the table in OUT."""
    calls = []

    def study(**options):
        calls.append(options)
        if len(calls) == 2:
            fake_outputs(tmp_path / "out")

    monkeypatch.setattr("prune_audit.cli.study.study", study)
    result = runner.invoke(app, ["reproduce", *data_args(workspace, clip), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    grid, timing = calls
    assert (grid["selectors"], grid["budgets"], grid["batch_size"]) == (",".join(GRID_SELECTORS), "64,128", 1)
    assert grid["out"] == tmp_path / "out" / STUDY_FOLDER and "limit" not in grid
    assert "epsilons" not in grid and grid["pope"] == workspace["pope"]  # study's sweep, which holds 0.02
    assert (timing["selectors"], timing["budgets"], timing["batch_size"], timing["limit"]) == (
        TIMING_SELECTOR,
        "64",
        32,
        640,
    )
    assert grid["model"] == timing["model"] == str(workspace["model"]) and grid["clip_text"] == clip
    assert "18 of 20 figures within tolerance." in result.stdout
    assert (tmp_path / "out" / "reproduce.md").is_file() and (tmp_path / "out" / "reproduce.csv").is_file()
    assert json.loads((tmp_path / "out" / ".prune-audit-owner.json").read_text())["command"] == "reproduce"


def summary_row(run: str, accuracy: float, **columns: float) -> dict:
    return {"run": run, "accuracy": accuracy, "mean_confidence": 0.9, "auroc": 0.8, "latency_ms": 50.0, **columns}


def write_study(folder: Path, rows: list[dict], cascades: dict[str, dict] | None = None) -> None:
    """A study folder as `study` writes its summary (analysis.study.summary_files) and cascade.json."""
    from prune_audit.analysis.outputs import to_json
    from prune_audit.analysis.study import summary_files

    folder.mkdir(parents=True)
    for name, data in summary_files(rows).items():
        (folder / name).write_bytes(data)
    entries = [
        {"label": label, "results": [{"epsilon": CASCADE_EPSILON, **result}]}
        for label, result in (cascades or {}).items()
    ]
    (folder / "cascade.json").write_text(to_json({"cascades": entries}))
    (folder / ".prune-audit-owner.json").write_text(json.dumps({"command": "study"}))


def fake_outputs(out: Path) -> None:
    """Study outputs that meet every figure but FastV@64's accuracy (75.0 %, 3.9 points off)."""
    eps = f"cascade_cost_eps{CASCADE_EPSILON:g}"
    lost = {
        "lost_accuracy": 0.18,
        "lost_reference_accuracy": 0.58,
        "lost_confidence": 0.81,
        "lost_reference_confidence": 0.80,
    }
    write_study(
        out / STUDY_FOLDER,
        [
            summary_row("dense", 0.872, mean_confidence=0.905, auroc=0.80, latency_ms=55.0),
            summary_row("fastv@64", 0.75, mean_confidence=0.92, auroc=0.68, **{eps: 1.04}, **lost),
            summary_row("cls_attn@64", 0.806, mean_confidence=0.89),
            summary_row("coverage@64", 0.85, **{eps: 0.37}),
            summary_row("cdpruner@64", 0.88),
        ],
        {"fastv@64": {"relative_cost": 1.04, "uninformative_cost": 0.965}},
    )
    write_study(
        out / TIMING_FOLDER,
        [summary_row("dense", 0.87, latency_ms=20.0), summary_row(f"{TIMING_SELECTOR}@64", 0.8, latency_ms=4.2)],
    )


def test_comparison_marks_each_figure_pass_fail_or_not_measured(tmp_path):
    fake_outputs(tmp_path)
    rows = {row["figure"]: row for row in comparison_rows(read_outputs(tmp_path))}
    assert rows["fastv64.accuracy"]["status"] == "fail" and rows["fastv64.accuracy"]["difference"] == "+3.9"
    assert rows["golden13b.f1"]["status"] == "not measured" and rows["golden13b.f1"]["measured"] == ""
    assert rows["timing.throughput_b32"]["measured"] == "4.76x"  # 20.0 / 4.2 ms per question
    assert rows["fastv64.uninformative_cost"]["measured"] == "96.5 %"
    passing = {key for key, row in rows.items() if row["status"] == "pass"}
    assert passing == set(ISSUE_FIGURES) - {"fastv64.accuracy", "golden13b.f1"}


def test_a_figure_passes_at_its_tolerance_and_fails_beyond(tmp_path):
    figure = seed_figure("dense.ms_b1")
    assert math.isclose(figure.allowed(), 52.7 * 0.2)
    for latency, status in ((52.7 * 1.19, "pass"), (52.7 * 1.21, "fail"), (52.7 * 0.81, "pass")):
        out = tmp_path / f"{latency:.2f}"
        write_study(out / STUDY_FOLDER, [summary_row("dense", 0.87, latency_ms=latency)])
        write_study(out / TIMING_FOLDER, [summary_row("dense", 0.87)])
        assert comparison_rows(read_outputs(out), [figure])[0]["status"] == status


def test_report_writes_the_table_as_markdown_and_csv(tmp_path):
    out = tmp_path / "out"
    fake_outputs(out)
    (out / ".prune-audit-owner.json").write_text(json.dumps({"command": "reproduce"}))
    result = runner.invoke(app, ["reproduce", "--report", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "18 of 20 figures within tolerance." in result.stdout
    markdown = (out / "reproduce.md").read_text()
    assert table_rows(markdown) == table_rows(result.stdout)
    with (out / "reproduce.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["figure"] for row in rows] == [figure.key for figure in SEED_FIGURES]
    assert {row["figure"]: row["status"] for row in rows} == {k: v["status"] for k, v in table_rows(markdown).items()}


def test_report_scores_the_golden_answers_through_score(tmp_path, shared_data):
    """The 13B row reads the F1 that `score` computes: all-"yes" answers to the official files."""
    out = tmp_path / "out"
    fake_outputs(out)
    (out / ".prune-audit-owner.json").write_text(json.dumps({"command": "reproduce"}))
    pope = sorted((shared_data / "pope").glob("coco_pope_*.json"))
    answers = tmp_path / "answers.jsonl"
    lines = [
        {"question_id": json.loads(line)["question_id"], "category": path.stem.rsplit("_", 1)[1], "text": "Yes"}
        for path in pope
        for line in path.read_text().splitlines()
    ]
    answers.write_text("".join(json.dumps(line) + "\n" for line in lines))
    scored = runner.invoke(
        app, ["score", str(answers), *(arg for path in pope for arg in ("--questions", str(path))), "--json"]
    )
    f1 = json.loads(scored.stdout)["splits"]["average"]["f1"]
    result = runner.invoke(
        app,
        [
            "reproduce",
            "--report",
            "--out",
            str(out),
            "--golden-answers",
            str(answers),
            *(arg for path in pope for arg in ("--pope", str(path))),
        ],
    )
    assert result.exit_code == 0, result.output
    row = table_rows(result.stdout)["golden13b.f1"]
    assert row["measured"] == f"{f1:.4f}" and row["status"] == "fail"  # 2/3 is far from 0.8595


def test_report_without_study_outputs_is_refused_writing_nothing(tmp_path):
    result = runner.invoke(app, ["reproduce", "--report", "--out", str(tmp_path / "out")])
    refused(result, "summary.csv not found", "run prune-audit reproduce without --report first")
    assert not (tmp_path / "out").exists()


def test_report_adopts_a_folder_of_the_printed_study_commands(tmp_path):
    """`study` commands run apart (as --dry-run prints them) leave OUT with the two study folders only: reproduce
    --report writes its table there."""
    out = tmp_path / "out"
    fake_outputs(out)  # no reproduce marker: OUT holds the two study folders
    result = runner.invoke(app, ["reproduce", "--report", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "reproduce.md").is_file()


def test_a_folder_holding_one_study_is_not_a_reproduction(tmp_path):
    out = tmp_path / "out"
    fake_outputs(out)
    import shutil

    shutil.rmtree(out / TIMING_FOLDER)  # a user's folder where `study` wrote its default study/
    before = snapshot(out)
    refused(runner.invoke(app, ["reproduce", "--report", "--out", str(out)]), "no prune-audit reproduce wrote (study)")
    assert snapshot(out) == before


def test_refuses_a_folder_holding_other_files(tmp_path):
    out = tmp_path / "out"
    fake_outputs(out)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    result = runner.invoke(app, ["reproduce", "--report", "--out", str(out)])
    refused(result, "no prune-audit reproduce wrote", "notes.txt", "pass a new or empty folder")
    assert snapshot(out) == before


def test_dry_run_and_report_exclude_each_other(tmp_path):
    refused(
        runner.invoke(app, ["reproduce", "--dry-run", "--report", "--out", str(tmp_path)]),
        "--dry-run and --report exclude each other",
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--golden-questions", "{tmp}/llava_pope_test.jsonl"],
            ("--golden-questions only applies with --golden-answers",),
        ),
        (
            ["--golden-answers", "{tmp}/missing.jsonl"],
            ("--golden-answers", "missing.jsonl not found", "drop the option"),
        ),
    ],
)
def test_golden_options_are_checked_before_anything_is_written(tmp_path, args, needles):
    out = tmp_path / "out"
    fake_outputs(out)
    (out / ".prune-audit-owner.json").write_text(json.dumps({"command": "reproduce"}))
    before = snapshot(out)
    files = [tmp_path / f"coco_pope_{split}.json" for split in ("adversarial", "popular", "random")]
    for path in files:
        path.write_text("")
    pope = [arg for path in files for arg in ("--pope", str(path))]
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    refused(runner.invoke(app, ["reproduce", "--report", "--out", str(out), *pope, *args]), *needles)
    assert snapshot(out) == before
