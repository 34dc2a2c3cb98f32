"""``prune-audit calibrate`` on synthetic run directories written as docs/records.md describes."""

import csv
import hashlib
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import f1_score, precision_score, roc_auc_score
from test_calibration import direct_ece
from typer.testing import CliRunner

from prune_audit.analysis import metrics
from prune_audit.analysis.temperature import split_images
from prune_audit.cli.main import app
from prune_audit.records.manifest import run_id_of
from prune_audit.records.schema import RUN_SCHEMA, SCHEMA_VERSION
from prune_audit.records.store import stamped
from prune_audit.safety.lock import LOCK_FILE
from prune_audit.safety.ownership import OWNER_FILE

runner = CliRunner()

SPLITS = ("random", "popular", "adversarial")


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def manifest(selector="divprune", budget=64):
    selector_fields = {
        "name": selector or "none",
        "stage": "input" if selector else None,
        "options": {},
        "positions": "keep_original" if selector else None,
    }
    return {
        "version": "0.1.0",
        "records_schema": SCHEMA_VERSION,
        "git_revision": None,
        "versions": {"python": "3.11", "torch": "2.13.0", "transformers": "5.24.0"},
        "model": {"id": "llava-hf/llava-1.5-7b-hf", "config_hash": "abc"},
        "processor": {"mode": "llava_pad", "grid": [24, 24]},
        "prompt": {"template": "USER: <image>\n{question} ASSISTANT:", "system": None},
        "dtype": "float16",
        "device": "cpu",
        "attn_implementation": "eager",
        "selector": selector_fields,
        "budget": budget,
        "realised_visual_tokens_avg": budget or 576,
        "question_files": [{"path": f"coco_pope_{split}.json", "sha256": sha256(split)} for split in SPLITS],
        "annotations": {"path": "instances_val2014.json", "sha256": sha256("annotations")},
        "images": {"path": "val2014", "sha256": sha256("images"), "files": {}},
        "split": "all",
        "limit": None,
        "seed": 0,
        "command": "prune-audit run",
    }


def write_run(directory, seed, strength, tokens, images=24, lost_share=0.0, selector="divprune", budget=64, **fields):
    """A run over POPE-shaped questions: per split, 6 questions per image alternating yes/no.

    ``strength`` scales the evidence in the logit; a share ``lost_share`` of "yes" questions lost
    their object, and those answer "no" more often.
    """
    rng = np.random.default_rng(seed)
    image_ids = np.arange(images) * 11 + 139
    rows = []
    shared = np.random.default_rng(99).normal(0.0, 1.0, (images, 6))  # image difficulty shared by all runs
    for split in SPLITS:
        for index, image_id in enumerate(image_ids):
            for slot in range(6):
                label_yes = slot % 2 == 0
                lost = bool(label_yes and rng.random() < lost_share) if label_yes else None
                evidence = (-1.0 if lost else 1.0) * strength * (1 if label_yes else -1)
                logit = evidence + 1.5 * shared[index, slot] + rng.normal(0.0, 1.0)
                p_yes = 1.0 / (1.0 + np.exp(-logit))
                answer = "yes" if logit > 0 else "no"
                retention = (0.0 if lost else float(rng.choice([0.1, 0.3, 0.7, 1.0]))) if label_yes else float("nan")
                rows.append(
                    {
                        "question_id": index * 6 + slot + 1,
                        "split": split,
                        "task": "pope",
                        "image": f"COCO_val2014_{image_id:012d}.jpg",
                        "image_id": int(image_id),
                        "object": "dog",
                        "label": "yes" if label_yes else "no",
                        "answer": answer,
                        "answer_text": answer,
                        "references": ["yes" if label_yes else "no"],
                        "p_yes": 0.9 * p_yes,
                        "p_no": 0.9 * (1.0 - p_yes),
                        "p_yes_2way": p_yes,
                        "logit_diff": logit,
                        "confidence": max(p_yes, 1.0 - p_yes),
                        "correct": answer == ("yes" if label_yes else "no"),
                        "kept": [0, 1, 2],
                        "kept_stages": [[0, 1, 2]],
                        "merged_stages": [[]],
                        "stage_layers": [0],
                        "visual_tokens_avg": float(budget or 576),
                        "prefill_tokens": tokens + rng.integers(0, 5),
                        "cost_tokens": float(tokens),
                        "retention": retention,
                        "retention_stages": [retention],
                        "visible_fraction": 1.0 if label_yes else float("nan"),
                        "object_tokens_kept": (0 if lost else 2) if label_yes else -1,
                        "object_tokens_kept_stages": [(0 if lost else 2) if label_yes else -1],
                        "lost": lost,
                        "lost_stages": [lost],
                        "diluted": False if label_yes else None,
                        "diluted_stages": [False if label_yes else None],
                        "object_area": 500 if label_yes else 0,
                        "evidence_objects": ["dog"] if label_yes else [],
                        "evidence_objects_lost": [lost] if label_yes else [],
                        "latency_ms": 10.0,
                        "flops": int(tokens) * 1000,
                        "flops_vision": 60,
                        "flops_selector": 0,
                        "flops_llm": int(tokens) * 1000 - 60,
                        "flops_dense": 600_000,
                        "flops_decode_token": 2,
                        "kv_bytes": 64,
                        "flop_equivalent_tokens": 10.0,
                        "latency_vision_ms": 0.2,
                        "latency_selection_ms": 0.1,
                        "latency_prefill_ms": 0.7,
                        "geometry": "{}",
                        "order": len(rows),
                    }
                )
    directory.mkdir(parents=True)
    written = {**manifest(selector=selector, budget=budget), "num_questions": len(rows), **fields}
    written["run_id"] = run_id_of(written)
    (directory / "manifest.json").write_text(json.dumps(written))
    pq.write_table(
        stamped(pa.Table.from_pylist(rows, schema=RUN_SCHEMA), written["run_id"]), directory / "records.parquet"
    )
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "pruned": write_run(root / "pruned", seed=1, strength=1.5, tokens=100, lost_share=0.3),
        "dense": write_run(root / "dense", seed=2, strength=3.0, tokens=600, selector=None, budget=None),
    }


@pytest.fixture(scope="module")
def audit(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration")
    arguments = ["calibrate", str(runs["pruned"]), "--reference", str(runs["dense"]), "--bootstrap", "300"]
    result = runner.invoke(app, [*arguments, "--seed", "7", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def frame(directory):
    return pq.read_table(directory / "records.parquet").to_pandas()


def test_writes_json_csv_and_pictures(audit):
    out, report = audit
    assert json.loads((out / "calibration.json").read_text()) == report
    names = {path.name for path in out.iterdir()}
    stems = ["reliability_overlay", "retention"]
    for run in ("divprune_64", "dense"):
        stems += [f"reliability_{run}", f"confidence_{run}"]
    for stem in stems:
        png, svg = out / f"{stem}.png", out / f"{stem}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, stem
        assert b"<svg" in svg.read_bytes()[:1000]
    assert {name for name in names if name.startswith(".")} == {OWNER_FILE, LOCK_FILE}  # no staging leftovers
    rows = list(csv.DictReader((out / "calibration.csv").open()))
    key = ("divprune@64", "metrics", "all", "accuracy")
    (accuracy,) = [r for r in rows if (r["run"], r["section"], r["group"], r["metric"]) == key]
    assert float(accuracy["value"]) == pytest.approx(report["runs"][0]["metrics"]["all"]["accuracy"]["value"])
    assert {r["section"] for r in rows} == {"metrics", "temperature", "survival", "difference_vs_reference"}
    (temperature,) = [r for r in rows if r["run"] == "divprune@64" and r["metric"] == "temperature"]
    assert float(temperature["value"]) == report["runs"][0]["temperature"]["temperature"]
    assert temperature["ci_low"] == temperature["ci_high"] == ""


def test_json_numbers_match_an_independent_computation(audit, runs):
    _, report = audit
    pruned, dense = frame(runs["pruned"]), frame(runs["dense"])
    run = report["runs"][0]
    assert run["model"] == "llava-hf/llava-1.5-7b-hf" and run["selector"] == "divprune" and run["budget"] == 64
    assert run["stage"] == report["reference"]["stage"] == "first (decoder layer 0)"
    overall = run["metrics"]["all"]
    correct, confidence = pruned["correct"].to_numpy(), pruned["confidence"].to_numpy()
    assert overall["accuracy"]["value"] == pytest.approx(correct.mean())
    assert overall["auroc"]["value"] == pytest.approx(roc_auc_score(correct, confidence))
    assert overall["ece"]["value"] == pytest.approx(direct_ece(confidence, correct, np.linspace(0, 1, 16)))
    assert overall["brier"]["value"] == pytest.approx(np.mean((pruned["p_yes_2way"] - (pruned["label"] == "yes")) ** 2))
    for split in ("random", "popular", "adversarial"):
        part = pruned[pruned["split"] == split]
        truth, guess = part["label"] == "yes", part["answer"] == "yes"
        assert run["metrics"][split]["precision"]["value"] == pytest.approx(precision_score(truth, guess))
        assert run["metrics"][split]["f1"]["value"] == pytest.approx(f1_score(truth, guess))
    for metric in overall.values():
        low, high = metric["ci95"]
        assert low <= high and low - 1e-9 <= metric["value"] <= high + 1e-9 or metric is overall["mce"]
    # object survival, under pruning and for the dense run on the same questions
    lost = pruned["lost"].fillna(False).astype(bool).to_numpy()
    merged = pruned.merge(dense, on=["split", "question_id"], suffixes=("", "_dense"))
    assert run["survival"]["lost"]["count"]["value"] == lost.sum() > 0
    assert run["survival"]["lost"]["accuracy"]["value"] == pytest.approx(correct[lost].mean())
    assert run["survival"]["lost"]["reference_accuracy"]["value"] == pytest.approx(merged["correct_dense"][lost].mean())
    difference = run["difference_vs_reference"]["survival"]["lost"]["accuracy"]
    assert difference["value"] == pytest.approx(correct[lost].mean() - merged["correct_dense"][lost].mean())
    assert difference["ci95"][1] < 0  # losing the object hurts: the paired interval excludes 0
    bin_rows = (pruned["retention"] > 0.5) & (pruned["retention"] <= 1.0)
    assert run["survival"]["retention (0.5, 1]"]["accuracy"]["value"] == pytest.approx(correct[bin_rows].mean())
    overall_difference = run["difference_vs_reference"]["metrics"]["all"]["accuracy"]["value"]
    assert overall_difference == pytest.approx(correct.mean() - dense["correct"].mean())


def test_temperature_is_fitted_on_calibration_images_and_keeps_accuracy_and_auroc(audit, runs):
    _, report = audit
    pruned = frame(runs["pruned"])
    calibration_ids, test_ids = split_images(pruned["image_id"].to_numpy(), 0.5, seed=7)
    assert report["split"]["calibration_images"] == len(calibration_ids) == 12
    rows = pruned["image_id"].isin(calibration_ids)
    logit, label = pruned["logit_diff"][rows].to_numpy(), (pruned["label"][rows] == "yes").to_numpy()
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 40001))
    best = grid[np.argmin([metrics.nll(logit / t, label) for t in grid])]
    temperature = report["runs"][0]["temperature"]
    assert temperature["temperature"] == pytest.approx(best, rel=1e-3)
    assert temperature["invariant"] == {"accuracy": True, "auroc": True}
    test = pruned[pruned["image_id"].isin(test_ids)]
    assert temperature["test_before"]["accuracy"]["value"] == pytest.approx(test["correct"].mean())
    assert temperature["test_after"]["accuracy"]["value"] == temperature["test_before"]["accuracy"]["value"]
    assert temperature["test_after"]["nll"]["value"] < temperature["test_before"]["nll"]["value"] + 0.05


def test_table_output_names_runs_and_sections(runs, tmp_path):
    arguments = ["calibrate", str(runs["pruned"]), "--reference", str(runs["dense"]), "--bootstrap", "20"]
    result = runner.invoke(app, [*arguments, "--binning", "mass", "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in (
        "divprune@64",
        "dense (reference)",
        "temperature T",
        "ECE (mass)",
        "if lost",
        "minus reference",
        "ECE (mass) after scaling (test)",
        "debiased L2 error (equal-mass)",
        "dense accuracy if lost (same",
        "retention stage read",
        "first (decoder layer 0)",
    ):
        assert text in result.stdout
    (aurc_line,) = [line for line in result.stdout.splitlines() if line.lstrip("│| ").startswith("AURC")]
    value = re.search(r"AURC\W+([0-9.e-]+) \[", aurc_line).group(1)
    assert len(value.replace("0.", "", 1).lstrip("0")) == 4  # 4 significant digits


def test_reliability_bins_carry_counts_and_bootstrap_intervals(audit, runs):
    _, report = audit
    reliability = report["runs"][0]["reliability"]
    assert set(reliability) == {"lower", "upper", "count", "confidence", "accuracy", "accuracy_ci95"}
    assert len(reliability["accuracy_ci95"]) == len(reliability["count"]) == 15
    for count, accuracy, (low, high) in zip(
        reliability["count"], reliability["accuracy"], reliability["accuracy_ci95"]
    ):
        if count:
            assert low - 1e-9 <= accuracy <= high + 1e-9
        else:
            assert low is None and high is None


def test_debiased_error_uses_equal_mass_bins_whatever_the_binning(runs, tmp_path):
    pruned = frame(runs["pruned"])
    confidence, correct = pruned["confidence"].to_numpy(), pruned["correct"].to_numpy()
    expected = metrics.debiased_calibration_error(confidence, correct, 15, "mass")
    for binning in ("width", "mass"):
        arguments = ["calibrate", str(runs["pruned"]), "--bootstrap", "5", "--binning", binning, "--json"]
        result = runner.invoke(app, [*arguments, "--out", str(tmp_path / binning)])
        value = json.loads(result.stdout)["runs"][0]["metrics"]["all"]["ce_debiased_l2"]["value"]
        assert value == pytest.approx(expected)


def test_refuses_runs_of_other_models_or_prompts_unless_forced(runs, tmp_path):
    model = {"id": "Qwen/Qwen2.5-VL-3B-Instruct", "config_hash": "x"}
    prompt = {"template": "other", "system": None}
    other = write_run(tmp_path / "other", seed=3, strength=1.0, tokens=100, model=model, prompt=prompt)
    arguments = ["calibrate", str(runs["pruned"]), str(other), "--bootstrap", "20", "--out", str(tmp_path / "out")]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "model.id" in result.stderr and "prompt.template" in result.stderr and "--force" in result.stderr
    assert not (tmp_path / "out").exists()
    forced = runner.invoke(app, [*arguments, "--force", "--json"])
    assert forced.exit_code == 0, forced.output
    assert "model.id" in json.loads(forced.stdout)["compared_despite_differences"][0]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["calibrate", "{missing}"], "run directory not found"),
        (["calibrate", "{pruned}", "--binning", "quantile"], "--binning must be one of width, mass"),
        (["calibrate", "{pruned}", "--calibration-fraction", "1.5"], "strictly between 0 and 1"),
        (["calibrate", "{pruned}", "--stage", "deepest"], "--stage must be first, last or a stage index"),
        (["calibrate", "{pruned}", "--stage", "1"], "--stage 1: records of"),
        (["calibrate", "{broken}"], "lacks column logit_diff: it was written by an older prune-audit"),
        (["calibrate", "{empty}"], "not a run directory"),
    ],
)
def test_user_errors_are_one_line_without_output(runs, tmp_path, arguments, message):
    broken = write_run(tmp_path / "broken", seed=4, strength=1.0, tokens=100)
    table = pq.read_table(broken / "records.parquet")
    pq.write_table(table.drop_columns(["logit_diff"]), broken / "records.parquet")
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "nowhere", "pruned": runs["pruned"], "broken": broken, "empty": tmp_path / "empty"}
    arguments = [argument.format(**paths) for argument in arguments]
    result = runner.invoke(app, [*arguments, "--bootstrap", "10", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "out").exists()


def test_figure_titles_name_a_local_model_folder_without_its_path():
    from prune_audit.analysis.runs import display_model

    assert display_model("/home/me/models/llava-1.5-7b-hf/") == "llava-1.5-7b-hf"
    assert display_model("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"
