"""Issues 44 (item 8) and 47 (item 7): task data that was accepted where a refusal was due.

Each case is refused in one ``error:`` line naming the cause and the fix, with a non-zero exit, no
traceback and nothing written (no run folder, no exported file, every input byte unchanged). The inputs
are the workspace's synthetic scenes and tiny model (``conftest.workspace``) and the task files
``test_gqa``, ``test_scienceqa`` and ``test_lmms_parquet`` build over them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import answers_file, refused, snapshot
from test_data_safety import record_count
from test_gqa import gqa_inputs
from test_lmms_parquet import gqa_instruction_columns, scienceqa_columns, write_parquet
from test_scienceqa import scienceqa_file
from test_task_parquet import pope_parquet
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(arg) for arg in args])


def run_args(ws: dict[str, Path], out: Path, *extra: object) -> list[object]:
    return ["run", "--model", ws["model"], "--out", out, *extra]


# ----- issue 44 item 8: duplicate question ids across files --------------------------------------------------------


def test_scienceqa_score_refuses_the_same_question_file_twice(workspace, tmp_path):
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    answers = answers_file(
        tmp_path / "answers.jsonl", [(entry["id"], "A") for entry in json.loads(questions.read_text())]
    )
    before = snapshot(tmp_path)
    refused(
        invoke("score", answers, "--task", "scienceqa", "--questions", questions, "--questions", questions),
        f"{questions} is given twice",
        "pass each question file once",
    )
    assert snapshot(tmp_path) == before


def test_scienceqa_run_refuses_an_id_repeated_in_another_file(workspace, tmp_path):
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    copy = Path(shutil.copy(questions, tmp_path / "copy.json"))
    out = tmp_path / "run"
    args = run_args(
        workspace,
        out,
        "--task",
        "scienceqa",
        "--images",
        workspace["images"],
        "--questions",
        questions,
        "--questions",
        copy,
    )
    refused(invoke(*args), f"{copy}: entry 0: id 10 repeats {questions}: entry 0", "keep each question once")
    assert not out.exists()


def test_pope_score_by_order_refuses_the_same_split_file_twice(workspace, tmp_path):
    """Answers matched by order (POPE's own format) carry no id, so only the question files can tell."""
    split = workspace["pope"][0]
    lines = [json.loads(line) for line in split.read_text().splitlines() if line.strip()]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"answer": row["label"]}) + "\n" for row in lines * 2))
    copy = Path(shutil.copy(split, tmp_path / split.name))
    refused(
        invoke("score", answers, "--questions", split, "--questions", copy),
        f"{copy}:1: question_id {lines[0]['question_id']} of split",
        f"repeats {split}:1",
        "pass each question file once",
    )


def test_pope_run_names_both_files_of_a_repeated_question(workspace, tmp_path):
    split = workspace["pope"][0]
    copy = Path(shutil.copy(split, tmp_path / split.name))
    out = tmp_path / "run"
    refused(
        invoke(*run_args(workspace, out, "--images", workspace["images"], "--pope", split, "--pope", copy)),
        f"{copy}:1:",
        f"repeats {split}:1",
        "keep each question once",
    )
    assert not out.exists()


def test_gqa_instructions_files_repeating_a_question_are_refused_naming_both_rows(tmp_path):
    first = write_parquet(tmp_path / "testdev_balanced_instructions.parquet", gqa_instruction_columns())
    second = Path(shutil.copy(first, tmp_path / "copy_instructions.parquet"))
    answers = answers_file(tmp_path / "answers.jsonl", [("201", "laptop"), ("203", "white")])
    refused(
        invoke("score", answers, "--task", "gqa", "--questions", first, "--questions", second),
        f"{second}: row 0: question 201 repeats {first}: row 0",
        "pass each question file once",
    )


def test_a_parquet_file_given_twice_is_refused(workspace, tmp_path):
    """lmms-lab/ScienceQA has no problem id (ids are row numbers), so the same file twice is refused by its path."""
    parquet = write_parquet(tmp_path / "test-00000-of-00001.parquet", scienceqa_columns())
    out = tmp_path / "run"
    refused(
        invoke(*run_args(workspace, out, "--task", "scienceqa", "--questions", parquet, "--questions", parquet)),
        f"{parquet} is given twice",
        "pass each Parquet file once",
    )
    assert not out.exists()


# ----- issue 44 item 8: a caption run's --annotations from another instances file --------------------------------


def caption_args(ws: dict[str, Path], out: Path, questions: Path, annotations: Path) -> list[object]:
    return run_args(
        ws,
        out,
        "--task",
        "caption",
        "--images",
        ws["images"],
        "--questions",
        questions,
        "--annotations",
        annotations,
        "--max-new-tokens",
        "2",
    )


def _other_mask(data: dict) -> None:
    first = data["annotations"][0]
    x, y, w, h = first["bbox"]
    first["segmentation"] = [[x, y, x + w / 2, y, x + w / 2, y + h / 2, x, y + h / 2]]


def _without_first_image(data: dict) -> None:
    first = data["images"].pop(0)["id"]
    data["annotations"] = [ann for ann in data["annotations"] if ann["image_id"] != first]


@pytest.mark.parametrize(
    ("change", "needle"), [(_other_mask, "annotates otherwise"), (_without_first_image, "does not hold")]
)
def test_caption_run_refuses_annotations_from_another_instances_file(workspace, tmp_path, change, needle):
    data = json.loads(Path(workspace["instances"]).read_text())
    change(data)
    other = tmp_path / "other_instances.json"
    other.write_text(json.dumps(data))
    out = tmp_path / "run"
    refused(
        invoke(*caption_args(workspace, out, workspace["instances"], other)),
        str(other),
        needle,
        "pass the instances file of --questions with --annotations too",
    )
    assert not out.exists()


def test_caption_evidence_may_come_from_a_file_annotating_the_images_alike(workspace, tmp_path):
    """A superset of the question file (more images, other category ids and annotation fields) is the same
    evidence for the questions' images, so it is accepted."""
    from prune_audit.tasks import get_task

    data = json.loads(Path(workspace["instances"]).read_text())
    questions = tmp_path / "questions.json"
    subset = {image["id"] for image in data["images"][:3]}
    questions.write_text(
        json.dumps(
            {
                **data,
                "images": data["images"][:3],
                "annotations": [a for a in data["annotations"] if a["image_id"] in subset],
            }
        )
    )
    for category in data["categories"]:
        category["id"] += 100
    for ann in data["annotations"]:
        ann["category_id"] += 100
        ann["id"] += 1000
    superset = tmp_path / "superset.json"
    superset.write_text(json.dumps(data))
    task = get_task("caption")
    loaded = task.read_questions([questions])
    assert task.load_evidence(superset, loaded) is not None


# ----- issue 44 item 8: Parquet rows naming one image with different bytes ---------------------------------------


def test_parquet_rows_naming_one_image_with_different_bytes_are_refused(workspace, tmp_path):
    parquet = pope_parquet(workspace, tmp_path / "pope.parquet")
    table = pq.read_table(parquet)
    sources, pictures = table["image_source"].to_pylist(), table["image"].to_pylist()
    other = next(n for n, data in enumerate(pictures) if data["bytes"] != pictures[0]["bytes"])
    sources[other] = sources[0]
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("image_source"), "image_source", pa.array(sources, type=pa.string())
        ),
        parquet,
    )
    out = tmp_path / "run"
    refused(
        invoke(*run_args(workspace, out, "--questions", parquet, "--annotations", workspace["instances"])),
        f"{parquet}: row {other} and {parquet}: row 0 both name image {sources[0]}",
        "embed different images",
        "give each image its own image name",
    )
    assert not out.exists()


# ----- issue 47 item 7: blank GQA reference answers, one rule for JSON and Parquet -------------------------------


@pytest.mark.parametrize("blank", ["", "   "])
def test_gqa_json_refuses_a_blank_reference_answer(workspace, tmp_path, blank):
    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    questions = json.loads(inputs["questions"].read_text())
    first = next(iter(questions))
    questions[first]["answer"] = blank
    inputs["questions"].write_text(json.dumps(questions))
    out = tmp_path / "run"
    args = run_args(
        workspace,
        out,
        "--task",
        "gqa",
        "--images",
        workspace["images"],
        "--questions",
        inputs["questions"],
        "--questions",
        inputs["llava"],
    )
    refused(
        invoke(*args),
        f"question {first}: answer must be text and not blank",
        "marks every answer wrong",
        "give the reference answer or leave the field out",
    )
    assert not out.exists()
    answers = answers_file(tmp_path / "answers.jsonl", [(qid, "circle") for qid in questions])
    refused(
        invoke("score", answers, "--task", "gqa", "--questions", inputs["questions"]),
        "answer must be text and not blank",
    )


def test_gqa_parquet_refuses_a_blank_reference_answer_by_the_same_rule(tmp_path):
    columns = gqa_instruction_columns()
    kind, answers = columns["answer"]
    columns["answer"] = (kind, ["  ", *answers[1:]])
    parquet = write_parquet(tmp_path / "testdev_balanced_instructions.parquet", columns)
    replies = answers_file(tmp_path / "answers.jsonl", [(qid, "x") for qid in columns["id"][1]])
    refused(
        invoke("score", replies, "--task", "gqa", "--questions", parquet),
        f"{parquet}: row 0: answer must be text and not blank",
        "give the reference answer or leave the field out",
    )


# ----- issue 47 item 7: caption category names CHAIR cannot match ----------------------------------------------


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a", "every caption would mention it"),
        ("the", "every caption would mention it"),
        ("2", "every caption would mention it"),
        ("Red Circle", "it never matches"),
    ],
)
def test_caption_category_a_caption_cannot_name_sensibly_is_refused(workspace, tmp_path, name, reason):
    data = json.loads(Path(workspace["instances"]).read_text())
    data["categories"][0]["name"] = name
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps(data))
    out = tmp_path / "run"
    refused(
        invoke(*caption_args(workspace, out, instances, instances)),
        f"category {name!r} of {instances}",
        reason,
        "rename it in the instances file",
    )
    assert not out.exists()


# ----- issue 47 item 7: export of a run holding fewer questions than planned ---------------------------------------


def test_export_refuses_a_run_with_fewer_questions_than_planned(workspace, tmp_path):
    shard = tmp_path / "shard"
    pope = [arg for path in workspace["pope"] for arg in ("--pope", path)]
    done = invoke(
        *run_args(workspace, shard, "--images", workspace["images"], *pope, "--limit", "24", "--shard", "0/2")
    )
    assert done.exit_code == 0, done.output
    held = record_count(shard)
    assert 0 < held < 24
    before = snapshot(tmp_path)
    out = tmp_path / "kept.jsonl"
    refused(
        invoke("export", shard, "--out", out),
        f"{shard} holds {held} of its 24 planned questions",
        "finish it with the same prune-audit run command (or merge its shards), then export",
    )
    assert not out.exists() and snapshot(tmp_path) == before
