"""The task seam: registry and plug-ins, POPE through the seam, GQA end to end on a tiny offline LLaVA."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import refused
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.gqa import INSTRUCTION
from prune_audit.errors import PruneAuditError
from prune_audit.plugins import PluginRegistry
from prune_audit.records.schema import RUN_COLUMNS, task_columns
from prune_audit.tasks import Scored, Task, get_task, list_tasks, manifest_task, register_task, registry

runner = CliRunner()


def test_committed_tasks_doc_matches_the_task_classes():
    from prune_audit.tasks.docs import tasks_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"
    assert doc.read_text(encoding="utf-8") == tasks_markdown(), (
        "docs/tasks.md is stale: run python -m prune_audit.tasks.docs"
    )


def test_builtin_tasks_are_listed_and_unknown_names_refused():
    assert {"pope", "gqa"} <= set(list_tasks())
    with pytest.raises(PruneAuditError, match=r"unknown task 'vqa'; choose one of .*gqa.*pope"):
        get_task("vqa")


def test_a_plugin_task_registers_under_its_entry_point_name(monkeypatch):
    class Plugin(Task):
        def read_questions(self, paths):
            return []

        def answer_mode(self, question):
            raise NotImplementedError

        def score(self, question, reduced):
            return Scored("", (), False, 0.0, {})

        def load_evidence(self, path, questions):
            raise NotImplementedError

        def score_answers(self, answers, question_files):
            return {}

    class Entry:
        name = "myplugin"

        def load(self):
            return Plugin

    import prune_audit.plugins

    tasks = PluginRegistry("task", "prune_audit.tasks")
    tasks.classes.update(registry.TASKS.classes)
    monkeypatch.setattr(registry, "TASKS", tasks)
    monkeypatch.setattr(
        prune_audit.plugins, "entry_points", lambda group: [Entry()] if group == "prune_audit.tasks" else []
    )
    assert "myplugin" in list_tasks()
    assert isinstance(get_task("myplugin"), Plugin)
    with pytest.raises(ValueError, match="already registered"):
        register_task(type("Other", (Plugin,), {"name": "myplugin"}))


def test_generation_limit_belongs_to_generating_tasks():
    assert get_task("gqa").max_new_tokens == 128 and get_task("gqa", 5).max_new_tokens == 5
    assert get_task("pope").max_new_tokens is None
    with pytest.raises(PruneAuditError, match="pope answers by its first token"):
        get_task("pope", 4)
    with pytest.raises(PruneAuditError, match="whole number from 1 to 1,000,000"):
        get_task("gqa", 0)
    assert (get_task("gqa").confidence, get_task("caption").confidence, get_task("pope").confidence) == (
        "sequence",
        "mean-token",
        None,
    )
    with pytest.raises(PruneAuditError, match="choose sequence or mean-token"):
        get_task("gqa", None, "mean")
    with pytest.raises(PruneAuditError, match="pope; it has one definition"):
        get_task("pope", None, "sequence")


def test_manifest_names_the_task_and_an_older_manifest_means_pope():
    assert manifest_task({"task": "gqa", "max_new_tokens": 7}).max_new_tokens == 7
    assert manifest_task({}).name == "pope"


def test_every_task_column_belongs_to_a_registered_task_and_is_nullable():
    """... and a task's scored columns are exactly its schema columns (pyarrow would drop any other silently)."""
    for column in RUN_COLUMNS:
        assert set(column.tasks) <= set(list_tasks()), column.name
        if column.tasks:
            assert column.field().nullable
    assert [c.name for c in task_columns("pope")] == [
        "object",
        "label",
        "answer",
        "p_yes",
        "p_no",
        "p_yes_2way",
        "logit_diff",
    ]


# ----- runs through the seam -------------------------------------------------------------------------------


def pope_args(ws: dict[str, Path], out: Path, *extra: str) -> list[str]:
    args = [
        "run",
        "--model",
        str(ws["model"]),
        "--images",
        str(ws["images"]),
        "--annotations",
        str(ws["instances"]),
        "--out",
        str(out),
    ]
    for path in ws["pope"]:
        args += ["--pope", str(path)]
    return args + list(extra)


def test_pope_run_records_the_task_and_its_core_columns(workspace, tmp_path):
    out = tmp_path / "pope"
    result = runner.invoke(app, pope_args(workspace, out, "--limit", "12", "--selector", "random", "--budget", "6"))
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task"] == "pope" and manifest["max_new_tokens"] is None
    records = pq.read_table(out / "records.parquet").to_pylist()
    for row in records:
        assert row["task"] == "pope" and row["answer_text"] == row["answer"] and row["references"] == [row["label"]]
        assert row["correct"] == (row["answer"] == row["label"])
        assert row["confidence"] == max(row["p_yes_2way"], 1 - row["p_yes_2way"])
        # the per-object evidence columns repeat the single queried object's first-stage loss
        assert row["evidence_objects"] == ([row["object"]] if row["label"] == "yes" else [])
        assert row["evidence_objects_lost"] == ([row["lost"]] if row["label"] == "yes" else [])


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (("--task", "vqa"), ("unknown task 'vqa'",)),
        (("--task", "gqa"), ("--pope names POPE question files", "--questions")),
        (("--max-new-tokens", "4"), ("pope answers by its first token",)),
    ],
)
def test_bad_task_options_are_refused_in_one_line(workspace, tmp_path, extra, needles):
    out = tmp_path / "bad"
    refused(runner.invoke(app, pope_args(workspace, out, *extra)), *needles)
    assert not out.exists()


def gqa_inputs(ws: dict[str, Path], folder: Path) -> dict[str, Path]:
    """GQA's question JSON, LLaVA's question file and scene graphs over the workspace's synthetic scenes: per
    image, "What is the largest shape?" answered by its largest object's category, that object as evidence."""
    coco = json.loads(Path(ws["instances"]).read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    questions, graphs, llava = {}, {}, []
    for image in sorted(coco["images"], key=lambda i: i["id"])[:6]:
        annotations = [a for a in coco["annotations"] if a["image_id"] == image["id"]]
        largest = max(annotations, key=lambda a: a["area"])
        name = names[largest["category_id"]]
        stem = Path(image["file_name"]).stem
        objects = {
            str(a["id"]): {"name": names[a["category_id"]], **dict(zip("xywh", (int(v) for v in a["bbox"])))}
            for a in annotations
        }
        graphs[stem] = {"width": image["width"], "height": image["height"], "objects": objects}
        qid = str(1000 + image["id"])
        questions[qid] = {
            "imageId": stem,
            "question": "What is the largest shape?",
            "answer": name,
            "annotations": {"question": {}, "answer": {"0": str(largest["id"])}, "fullAnswer": {}},
        }
        llava.append(
            {
                "question_id": qid,
                "image": image["file_name"],
                "text": f"What is the largest shape?\n{INSTRUCTION}",
                "category": "gqa",
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "questions": folder / "testdev_questions.json",
        "llava": folder / "llava_gqa.jsonl",
        "graphs": folder / "sceneGraphs.json",
    }
    paths["questions"].write_text(json.dumps(questions))
    paths["llava"].write_text("".join(json.dumps(row) + "\n" for row in llava))
    paths["graphs"].write_text(json.dumps(graphs))
    return paths


def gqa_args(ws: dict[str, Path], inputs: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--task",
        "gqa",
        "--model",
        str(ws["model"]),
        "--images",
        str(ws["images"]),
        "--questions",
        str(inputs["questions"]),
        "--questions",
        str(inputs["llava"]),
        "--annotations",
        str(inputs["graphs"]),
        "--out",
        str(out),
        *extra,
    ]


def test_gqa_run_generates_scores_and_measures_evidence(workspace, tmp_path):
    from prune_audit.data.gqa import exact_match

    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        gqa_args(
            workspace,
            inputs,
            out,
            "--selector",
            "random",
            "--budget",
            "6",
            "--max-new-tokens",
            "3",
            "--batch-size",
            "4",
        ),
    )
    assert result.exit_code == 0, result.output
    assert "task gqa |" in result.output and "mean retention of the annotated objects" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task"] == "gqa" and manifest["max_new_tokens"] == 3
    records = pq.read_table(out / "records.parquet").to_pylist()
    answers = json.loads(inputs["questions"].read_text())
    assert len(records) == 6
    for row in records:
        assert row["task"] == "gqa" and row["split"] == "gqa" and row["label"] is None and row["p_yes"] is None
        assert row["references"] == [answers[str(row["question_id"])]["answer"]]
        assert row["correct"] == exact_match(row["answer_text"], row["references"][0])
        assert row["answer_tokens"] <= 3 and (row["stopped"] or row["answer_tokens"] == 3)
        assert row["confidence"] == row["sequence_prob"]
        assert row["mean_token_prob"] >= row["sequence_prob"] - 1e-12  # geometric mean >= product of probs <= 1
        assert row["evidence_object_ids"] and 0.0 <= row["retention"] <= 1.0 and row["lost"] in (True, False)
        assert row["object_area"] > 0
        assert len(row["evidence_objects"]) == len(row["evidence_object_ids"]) == len(row["evidence_objects_lost"])
        assert row["lost"] == all(row["evidence_objects_lost"])  # one box: the region is lost exactly when it is
    # batching does not change a generated answer
    single = tmp_path / "single"
    result = runner.invoke(
        app,
        gqa_args(
            workspace,
            inputs,
            single,
            "--selector",
            "random",
            "--budget",
            "6",
            "--max-new-tokens",
            "3",
            "--batch-size",
            "1",
        ),
    )
    assert result.exit_code == 0, result.output
    again = pq.read_table(single / "records.parquet").to_pylist()
    assert [r["answer_text"] for r in again] == [r["answer_text"] for r in records]
    np.testing.assert_allclose([r["confidence"] for r in again], [r["confidence"] for r in records], rtol=1e-5)
    # the length-normalised confidence, as an option: recorded in the manifest, same answers
    normalised = tmp_path / "normalised"
    result = runner.invoke(
        app,
        gqa_args(
            workspace,
            inputs,
            normalised,
            "--selector",
            "random",
            "--budget",
            "6",
            "--max-new-tokens",
            "3",
            "--confidence",
            "mean-token",
        ),
    )
    assert result.exit_code == 0, result.output
    assert json.loads((normalised / "manifest.json").read_text())["confidence"] == "mean-token"
    rows = pq.read_table(normalised / "records.parquet").to_pylist()
    assert [r["confidence"] for r in rows] == [r["mean_token_prob"] for r in rows]
    assert [r["answer_text"] for r in rows] == [r["answer_text"] for r in records]


def test_gqa_inputs_are_checked_before_anything_is_written(workspace, tmp_path):
    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    out = tmp_path / "run"
    only_llava = [
        "run",
        "--task",
        "gqa",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--questions",
        str(inputs["llava"]),
        "--out",
        str(out),
    ]
    refused(runner.invoke(app, only_llava), "have no reference answer", "question JSON")
    graphs = json.loads(inputs["graphs"].read_text())
    graphs.pop(next(iter(graphs)))
    inputs["graphs"].write_text(json.dumps(graphs))
    refused(runner.invoke(app, gqa_args(workspace, inputs, out)), "has no scene graph")
    refused(runner.invoke(app, gqa_args(workspace, inputs, out, "--split", "random")), "gqa has no splits")
    assert not out.exists()


def test_analyses_read_a_task_without_a_yes_no_answer_by_its_top_label_confidence(workspace, tmp_path):
    from prune_audit.analysis.runs import load_run

    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    pruned, dense = tmp_path / "pruned", tmp_path / "dense"
    for out, extra in ((pruned, ("--selector", "random", "--budget", "6")), (dense, ())):
        result = runner.invoke(app, gqa_args(workspace, inputs, out, "--max-new-tokens", "2", *extra))
        assert result.exit_code == 0, result.output
    run = load_run(pruned)
    records = pq.read_table(pruned / "records.parquet").to_pylist()
    assert run.questions.top_label and list(run.questions.label_yes) == [r["correct"] for r in records]
    assert list(run.questions.p_yes) == [r["confidence"] for r in records]
    assert list(run.questions.answer) == [r["answer_text"].strip().rstrip(".").lower() for r in records]
    calibrated = runner.invoke(
        app,
        [
            "calibrate",
            str(pruned),
            "--reference",
            str(dense),
            "--bootstrap",
            "20",
            "--json",
            "--out",
            str(tmp_path / "calibration"),
        ],
    )
    assert calibrated.exit_code == 0, calibrated.output
    overall = json.loads(calibrated.stdout)["runs"][0]["metrics"]["all"]
    assert {"accuracy", "ece", "brier", "auroc"} <= set(overall) and not {"f1", "yes_ratio"} & set(overall)
    assert overall["accuracy"]["value"] == pytest.approx(np.mean([r["correct"] for r in records]))
    brier = np.mean([(r["confidence"] - r["correct"]) ** 2 for r in records])
    assert overall["brier"]["value"] == pytest.approx(brier)  # the top-label Brier score
    cascade = runner.invoke(
        app,
        [
            "cascade",
            str(pruned),
            "--reference",
            str(dense),
            "--epsilon",
            "0.3",
            "--splits",
            "5",
            "--json",
            "--out",
            str(tmp_path / "cascade"),
        ],
    )
    assert cascade.exit_code == 0, cascade.output
    validity = json.loads(cascade.stdout)["cascades"][0]["validity"]
    assert validity["sem_disagreement"] == pytest.approx(validity["std_disagreement"] / math.sqrt(5))
    assert validity["mean_within_one_sem_of_epsilon"] == (
        validity["mean_disagreement"] <= 0.3 + validity["sem_disagreement"]
    )
    # visualize --run redraws any task's record, naming its evidence objects and reference answers
    row = records[0]
    drawn = runner.invoke(
        app,
        [
            "visualize",
            "--run",
            str(pruned),
            "--question-id",
            str(row["question_id"]),
            "--out",
            str(tmp_path / "figure.png"),
        ],
    )
    assert drawn.exit_code == 0, drawn.output
    assert f"about {row['evidence_objects'][0]} (reference {row['references'][0]})" in drawn.stdout
    assert f"answer {row['answer_text']} (confidence" in drawn.stdout and (tmp_path / "figure.png").is_file()


def test_gqa_image_ids_are_stable_int64():
    from prune_audit.data.files import stable_image_id

    assert stable_image_id("2354786") == 2354786
    assert stable_image_id("n161313") == stable_image_id("n161313") != stable_image_id("n161314")
    assert 0 <= stable_image_id("n161313") < 2**63
    assert not math.isnan(stable_image_id("x"))


# ----- ScienceQA-IMG ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def letters_model(workspace, tmp_path_factory) -> Path:
    """A tiny LLaVA whose vocabulary spells the option letters A-D as single tokens."""
    from prune_audit.data.scenes import CATEGORIES
    from prune_audit.models.llava import LlavaModel

    words = ["Is", "there", "in", "the", "image", "Which", "shape", "A", "B", "C", "D", *CATEGORIES]
    return LlavaModel.build_tiny(
        tmp_path_factory.mktemp("letters") / "model", words=words, image_size=56, patch_size=14, text_layers=2, seed=1
    )


def scienceqa_file(ws: dict[str, Path], folder: Path, count: int = 5) -> Path:
    """LLaVA's ScienceQA layout over the workspace's images: 2 to 4 options, answers cycling through the letters."""
    images = sorted(p.name for p in Path(ws["images"]).iterdir())[:count]
    entries = []
    for index, image in enumerate(images):
        options = ["circle", "square", "triangle", "star"][: 2 + index % 3]
        lines = "\n".join(f"{'ABCD'[k]}. {option}" for k, option in enumerate(options))
        entries.append(
            {
                "id": str(10 + index),
                "image": image,
                "conversations": [
                    {"from": "human", "value": f"<image>\nContext: a drawing.\nWhich shape is largest?\n{lines}"},
                    {"from": "gpt", "value": "ABCD"[index % len(options)]},
                ],
            }
        )
    entries.append(
        {
            "id": "99",
            "conversations": [  # no image: not in the IMG subset
                {"from": "human", "value": "Which is a shape?\nA. circle\nB. blue"},
                {"from": "gpt", "value": "A"},
            ],
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llava_test_CQM-A.json"
    path.write_text(json.dumps(entries))
    return path


def test_scienceqa_run_answers_by_option_letter(workspace, letters_model, tmp_path):
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    out = tmp_path / "run"
    args = [
        "run",
        "--task",
        "scienceqa",
        "--model",
        str(letters_model),
        "--images",
        str(workspace["images"]),
        "--questions",
        str(questions),
        "--out",
        str(out),
        "--selector",
        "random",
        "--budget",
        "6",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pylist()
    entries = {e["id"]: e for e in json.loads(questions.read_text())}
    assert [r["question_id"] for r in records] == [10, 11, 12, 13, 14]  # the entry without an image is left out
    for row in records:
        offered = row["options_offered"]
        assert row["task"] == "scienceqa" and row["image_id"] == row["question_id"]  # each question its own unit
        assert row["references"] == [entries[str(row["question_id"])]["conversations"][1]["value"]]
        assert len(row["letter_probs"]) == offered and row["answer_text"] in "ABCD"[:offered]
        best = int(np.argmax(row["letter_probs"]))
        assert row["answer_text"] == "ABCD"[best]
        assert row["confidence"] == pytest.approx(row["letter_probs"][best] / sum(row["letter_probs"]))
        assert row["correct"] == (row["answer_text"] == row["references"][0])
        assert math.isnan(row["retention"]) and row["lost"] is None  # ScienceQA names no evidence region
    refused(
        runner.invoke(app, [*args[:-6], "--out", str(tmp_path / "ann"), "--annotations", str(workspace["instances"])]),
        "drop --annotations",
    )


def test_a_model_without_single_letter_tokens_is_refused(workspace, tmp_path):
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    result = runner.invoke(
        app,
        [
            "run",
            "--task",
            "scienceqa",
            "--model",
            str(workspace["model"]),
            "--images",
            str(workspace["images"]),
            "--questions",
            str(questions),
            "--out",
            str(tmp_path / "r"),
        ],
    )
    refused(result, "no single token for the option letter 'B'")
    assert not (tmp_path / "r").exists()


# ----- captions ---------------------------------------------------------------------------------------------


def test_caption_run_scores_mentions_and_measures_each_object(workspace, tmp_path):
    from prune_audit.data.chair import default_vocabulary, score_caption, with_categories

    out = tmp_path / "run"
    instances = str(workspace["instances"])
    args = [
        "run",
        "--task",
        "caption",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--questions",
        instances,
        "--annotations",
        instances,
        "--out",
        str(out),
        "--limit",
        "4",
        "--max-new-tokens",
        "4",
        "--selector",
        "random",
        "--budget",
        "4",
    ]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "omitted among objects lost at the first stage" in result.stdout and "CHAIR-s" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task"] == "caption" and manifest["max_new_tokens"] == 4
    coco = json.loads(Path(instances).read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    for row in pq.read_table(out / "records.parquet").to_pylist():
        annotated = list(
            dict.fromkeys(names[a["category_id"]] for a in coco["annotations"] if a["image_id"] == row["question_id"])
        )
        # the shapes are no COCO objects: CHAIR's list plus the file's category names
        score = score_caption(
            row["answer_text"], annotated, vocabulary=with_categories(default_vocabulary(), names.values())
        )
        assert row["evidence_objects"] == annotated == row["references"]
        assert len(row["evidence_objects_lost"]) == len(annotated)
        assert row["omitted"] == list(score.omitted) and row["hallucinated"] == list(score.hallucinated)
        assert row["correct"] == (not score.chair_s) and row["recall"] == pytest.approx(score.recall)
        assert row["confidence"] == row["mean_token_prob"] and row["answer_tokens"] <= 4
        # the union region is lost exactly when every object is
        assert row["lost"] == all(row["evidence_objects_lost"])


def test_omission_by_fate_counts_objects_by_hand():
    from prune_audit.tasks.caption import omission_by_fate

    rows = [
        {"evidence_objects": ["dog", "cat", "car"], "evidence_objects_lost": [True, False, None], "omitted": ["dog"]},
        {"evidence_objects": ["dog", "cup"], "evidence_objects_lost": [True, True], "omitted": ["dog", "cup"]},
        {"evidence_objects": ["cat"], "evidence_objects_lost": [False], "omitted": []},
    ]
    # lost: dog, dog, cup (all 3 omitted); kept: cat, cat (none omitted); car has no pixels
    assert omission_by_fate(rows) == {"lost": (3, 3), "kept": (2, 0)}


def test_caption_questions_need_one_instances_file(workspace, tmp_path):
    out = tmp_path / "run"
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "A red circle."}]}))
    refused(
        runner.invoke(
            app,
            [
                "run",
                "--task",
                "caption",
                "--model",
                str(workspace["model"]),
                "--images",
                str(workspace["images"]),
                "--questions",
                str(captions),
                "--out",
                str(out),
            ],
        ),
        "one COCO instances file",
    )
    assert not out.exists()


def test_every_metric_a_task_reports_is_declared_once_in_the_metric_table():
    from prune_audit.analysis.metric_table import ANSWER_METRICS, METRIC_NAMES

    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    for name in list_tasks():
        assert set(get_task(name).report_metrics) <= set(METRIC_NAMES), name
    yes_no_only = {metric.name for metric in ANSWER_METRICS} - {"accuracy"}
    assert yes_no_only <= set(get_task("pope").report_metrics)
    assert not yes_no_only & set(get_task("gqa").report_metrics)


# ----- scoring released answers ------------------------------------------------------------------------------


def answers_file(path: Path, rows: list[tuple[object, str]]) -> Path:
    path.write_text("".join(json.dumps({"question_id": qid, "text": text}) + "\n" for qid, text in rows))
    return path


def score_json(*args: str) -> dict:
    result = runner.invoke(app, ["score", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_score_gqa_answers_by_hand(workspace, tmp_path):
    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    truth = {qid: entry["answer"] for qid, entry in json.loads(inputs["questions"].read_text()).items()}
    ids = list(truth)
    rows = [(ids[0], truth[ids[0]].capitalize() + "."), (ids[1], "no idea"), *((qid, truth[qid]) for qid in ids[2:])]
    report = score_json(
        str(answers_file(tmp_path / "a.jsonl", rows)),
        "--task",
        "gqa",
        "--questions",
        str(inputs["questions"]),
        "--questions",
        str(inputs["llava"]),
    )
    # "Circle." -> "circle" under LLaVA's rule; "no idea" is wrong: 5 of 6
    assert report["n"] == 6 and report["correct"] == 5 and report["accuracy"] == pytest.approx(5 / 6)


def test_score_scienceqa_answers_by_hand(workspace, tmp_path):
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    entries = json.loads(questions.read_text())
    truth = {e["id"]: e["conversations"][1]["value"] for e in entries}
    rows = [
        ("10", truth["10"]),
        ("11", f"The answer is {truth['11']}."),
        ("12", f"{truth['12']}. a shape"),
        ("13", "Z"),
        ("14", "I cannot tell"),
        ("99", "A"),
    ]
    report = score_json(
        str(answers_file(tmp_path / "a.jsonl", rows)), "--task", "scienceqa", "--questions", str(questions)
    )
    # letter alone, "The answer is X.", "X. ..." parse; Z is not offered; free text fails; 99 (no image) is right
    assert (report["n"], report["correct"]) == (6, 4)
    assert (report["img"]["n"], report["img"]["correct"]) == (5, 3)


def test_score_caption_answers_by_hand(workspace, tmp_path):
    coco = json.loads(Path(workspace["instances"]).read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    image = coco["images"][0]
    annotated = list(
        dict.fromkeys(names[a["category_id"]] for a in coco["annotations"] if a["image_id"] == image["id"])
    )
    absent = next(name for name in ("dog", "car", "person", "cat") if name not in annotated)
    one_image = {
        **coco,
        "images": [image],
        "annotations": [a for a in coco["annotations"] if a["image_id"] == image["id"]],
    }
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps(one_image))
    caption = f"There is a {absent} and two {absent}s next to something."
    report = score_json(
        str(answers_file(tmp_path / "a.jsonl", [(image["id"], caption)])),
        "--task",
        "caption",
        "--questions",
        str(instances),
    )
    metrics = report["metrics"]
    assert metrics["chair_s"] == 1.0 and metrics["chair_i"] == 1.0  # both mentions name an absent object
    assert metrics["recall"] == 0.0 and metrics["omitted"] == len(annotated)


def test_score_pope_through_the_task_matches_pope_score(workspace, tmp_path):
    pope = workspace["pope"][0]
    rows = [(json.loads(line)["question_id"], "Yes") for line in pope.read_text().splitlines() if line.strip()]
    answers = str(answers_file(tmp_path / "a.jsonl", rows))
    by_task = score_json(answers, "--questions", str(pope))
    result = runner.invoke(app, ["pope", "score", answers, "--pope", str(pope), "--json"])
    assert by_task == json.loads(result.stdout)
    assert next(iter(by_task["splits"].values()))["yes_ratio"] == 1.0


def test_score_needs_question_files(tmp_path):
    refused(runner.invoke(app, ["score", str(answers_file(tmp_path / "a.jsonl", [])), "--task", "gqa"]), "--questions")


def test_study_runs_another_task_and_plans_its_commands(workspace, tmp_path):
    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    common = [
        "study",
        "--task",
        "gqa",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--questions",
        str(inputs["questions"]),
        "--questions",
        str(inputs["llava"]),
        "--annotations",
        str(inputs["graphs"]),
        "--max-new-tokens",
        "2",
        "--selectors",
        "random",
        "--budgets",
        "6",
        "--out",
        str(tmp_path / "study"),
    ]
    planned = runner.invoke(app, [*common, "--plan"])
    assert planned.exit_code == 0, planned.output
    assert "--task gqa --questions" in planned.stdout and "--max-new-tokens 2" in planned.stdout
    assert "--pope" not in planned.stdout
    result = runner.invoke(app, [*common, "--epsilons", "0.34", "--bootstrap", "20", "--splits", "5", "--quiet"])
    assert result.exit_code == 0, result.output
    import pandas as pd

    summary = pd.read_csv(tmp_path / "study" / "summary.csv").set_index("run")
    assert list(summary.index) == ["dense", "random@6"] and summary["f1"].isna().all()
    records = pq.read_table(tmp_path / "study" / "runs" / "random-6" / "records.parquet").to_pylist()
    assert summary.loc["random@6", "accuracy"] == pytest.approx(np.mean([r["correct"] for r in records]))
