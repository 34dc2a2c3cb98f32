"""The gqa task: GQA's exact-match rules (LLaVA's and lmms-eval's), the readers of GQA's question JSON, LLaVA's
question file and the scene graphs with their one-line refusals, scoring an answers file, and runs end to end on a
tiny offline LLaVA: generated answers scored, the annotated objects' retention measured, inputs checked before
anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import answers_file, refused, score_json, write_json, write_lines
from conftest import LLAVA_EVAL, SHARED_ABSENT
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data import gqa
from prune_audit.data.gqa import INSTRUCTION
from prune_audit.errors import PruneAuditError

runner = CliRunner()


GQA_QUESTIONS = {
    "201": {
        "imageId": "n1",
        "question": "What is on the table?",
        "answer": "laptop",
        "fullAnswer": "The laptop is on the table.",
        "annotations": {"question": {"4": "10"}, "answer": {"0": "11"}, "fullAnswer": {"1": "11", "5": "10"}},
    },
    "202": {
        "imageId": "n1",
        "question": "Is it sunny?",
        "answer": "no",
        "fullAnswer": "No, it is cloudy.",
        "annotations": {"question": {}, "answer": {}, "fullAnswer": {}},
    },
    "203": {
        "imageId": "n2",
        "question": "What color is the car?",
        "answer": "white",
        "fullAnswer": "The car is white.",
        "annotations": {"question": {"4": "20"}, "answer": {}, "fullAnswer": {"1": "20"}},
    },
}


SCENE_GRAPHS = {
    "n1": {
        "width": 8,
        "height": 6,
        "objects": {
            "10": {"name": "table", "x": 0, "y": 3, "w": 8, "h": 3, "attributes": [], "relations": []},
            "11": {"name": "laptop", "x": 2, "y": 1, "w": 3, "h": 3},
            "12": {"name": "wall", "x": 0, "y": 0, "w": 8, "h": 2},
        },
    },
    "n2": {"width": 4, "height": 4, "objects": {"20": {"name": "car", "x": 2, "y": 2, "w": 5, "h": 5}}},
}


def llava_gqa_rows() -> list[dict]:
    return [
        {
            "question_id": qid,
            "image": f"{entry['imageId']}.jpg",
            "category": "default",
            "text": f"{entry['question']}\n{gqa.INSTRUCTION}",
        }
        for qid, entry in GQA_QUESTIONS.items()
    ]


@pytest.fixture
def gqa_files(tmp_path):
    return (
        write_json(tmp_path / "testdev_balanced_questions.json", GQA_QUESTIONS),
        write_lines(tmp_path / "llava_gqa.jsonl", llava_gqa_rows()),
        write_json(tmp_path / "sceneGraphs.json", SCENE_GRAPHS),
    )


@pytest.mark.parametrize(
    ("prediction", "reference", "llava", "lmms"),
    [
        ("laptop", "laptop", True, True),
        ("Laptop.", "laptop", True, True),  # convert_gqa_for_eval.py: rstrip('.') then lower()
        (" yes\n", "yes", True, False),  # model_vqa_loader strips the output; lmms-eval compares as is
        ("Yes...", "yes", True, True),
        ("yes!", "yes", False, True),  # only trailing periods go under LLaVA's rule
        ("the laptop", "laptop", False, False),  # no article removal: GQA's eval.py is plain equality
        ("two", "2", False, False),  # no number words either (those are VQAv2's rules)
        ("t-shirt", "t-shirt", True, True),
        ("tshirt", "t-shirt", False, True),  # lmms-eval drops punctuation on both sides
        ("Traffic Light", "traffic light", True, True),
        ("laptops", "laptop", False, False),
    ],
)
def test_gqa_exact_match_follows_the_official_rules(prediction, reference, llava, lmms):
    assert gqa.exact_match(prediction, reference) is llava
    assert gqa.exact_match(prediction, reference, rule="lmms-eval") is lmms


def test_gqa_unknown_rule_is_refused():
    with pytest.raises(PruneAuditError, match="unknown GQA scoring rule 'vqa'"):
        gqa.normalize_answer("x", "vqa")


def test_gqa_joins_llava_questions_answers_and_evidence(gqa_files):
    questions_json, llava_file, graphs_file = gqa_files
    graphs = gqa.load_scene_graphs(graphs_file)
    questions = gqa.load_gqa(questions_json, llava_file, graphs)
    first = questions[0]
    assert (first.question_id, first.image, first.image_id, first.answer) == ("201", "n1.jpg", "n1", "laptop")
    assert first.question == "What is on the table?" and first.text.endswith("\n" + gqa.INSTRUCTION)
    assert first.evidence_object_ids == ("10", "11") and first.category == "default"
    mask = gqa.evidence_mask(first, graphs["n1"])
    expected = np.zeros((6, 8), dtype=bool)
    expected[3:6, 0:8] = True
    expected[1:4, 2:5] = True
    assert mask.shape == (6, 8) and (mask == expected).all()
    assert not gqa.evidence_mask(questions[1], graphs["n1"]).any()
    clipped = gqa.evidence_mask(questions[2], graphs["n2"])  # a box past the image edge is clipped
    assert clipped.sum() == 4 and clipped[2:, 2:].all()


def test_gqa_image_size_must_match_its_scene_graph(gqa_files):
    graph = gqa.load_scene_graphs(gqa_files[2])["n1"]
    gqa.check_image_size(graph, (8, 6), "n1.jpg")
    with pytest.raises(PruneAuditError, match=r"image n1.jpg is 6x8 pixels but its scene graph says 8x6"):
        gqa.check_image_size(graph, (6, 8), "n1.jpg")


def test_gqa_questions_from_the_gqa_json_alone(gqa_files):
    questions = gqa.load_gqa(gqa_files[0])
    assert [q.question_id for q in questions] == ["201", "202", "203"]
    assert (
        questions[2].image == "n2.jpg" and questions[2].text == "What color is the car?"
    )  # the task adds the instruction


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda rows, qs, sg: rows.append(dict(rows[0])), r"llava_gqa.jsonl:4: question_id 201 repeats line 1"),
        (lambda rows, qs, sg: rows[1].update(question_id="q2"), r"llava_gqa.jsonl:2: question_id must be digits"),
        (lambda rows, qs, sg: rows[1].pop("text"), r"llava_gqa.jsonl:2: missing text"),
        (lambda rows, qs, sg: rows[0].update(image="../n1.jpg"), r"llava_gqa.jsonl:1: image '../n1.jpg' leads outside"),
        (
            lambda rows, qs, sg: rows[2].update(image="n9.jpg"),
            r"question 203 names image n9.jpg but .* gives imageId n2",
        ),
        (lambda rows, qs, sg: qs.pop("202"), r"question 202 is not in .*testdev_balanced_questions.json"),
        (
            lambda rows, qs, sg: qs["201"]["annotations"].update(answer=["11"]),
            r"question 201: annotations.answer must map",
        ),
        (lambda rows, qs, sg: qs["203"].update(answer=3), r"question 203: answer must be text"),
        (lambda rows, qs, sg: sg["n1"]["objects"].pop("11"), r"annotated object 11 is not in image n1's scene graph"),
        (
            lambda rows, qs, sg: sg.pop("n2"),
            r"image n2 has no scene graph; GQA publishes scene graphs for train and val",
        ),
        (lambda rows, qs, sg: sg["n1"]["objects"]["10"].update(w=-1), r"image n1 object 10 w must be at least 0"),
        (lambda rows, qs, sg: sg["n2"].update(height=2.5), r"image n2 height must be a whole number of pixels"),
    ],
)
def test_gqa_readers_refuse_bad_input_in_one_line(tmp_path, change, message):
    rows, questions, graphs = (
        llava_gqa_rows(),
        json.loads(json.dumps(GQA_QUESTIONS)),
        json.loads(json.dumps(SCENE_GRAPHS)),
    )
    change(rows, questions, graphs)
    with pytest.raises(PruneAuditError, match=message) as caught:
        gqa.load_gqa(
            write_json(tmp_path / "testdev_balanced_questions.json", questions),
            write_lines(tmp_path / "llava_gqa.jsonl", rows),
            gqa.load_scene_graphs(write_json(tmp_path / "sceneGraphs.json", graphs)),
        )
    assert "\n" not in str(caught.value)


def test_gqa_scores_an_answers_file(gqa_files, tmp_path):
    questions = gqa.load_gqa(gqa_files[0], gqa_files[1])
    answers = write_lines(
        tmp_path / "answers.jsonl",
        [
            {"question_id": "203", "prompt": "...", "text": "White.", "answer_id": "x", "model_id": "m"},
            {"question_id": "201", "text": "a laptop"},
            {"question_id": 202, "text": "No"},  # an integer id matches too
        ],
    )
    result = gqa.score_gqa_answers(answers, questions)
    assert (result["n"], result["correct"]) == (3, 2) and result["accuracy"] == pytest.approx(2 / 3)
    assert [row["correct"] for row in result["per_question"]] == [False, True, True]
    assert result["per_question"][0] == {
        "question_id": "201",
        "prediction": "a laptop",
        "reference": "laptop",
        "correct": False,
    }
    assert len(result["answers"]["sha256"]) == 64


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question_id": "201", "text": "x"}], r"answers.jsonl: 2 questions have no answer \(first: 202\)"),
        (
            [{"question_id": "201", "text": "x"}, {"question_id": "201", "text": "y"}],
            r"answers.jsonl:2: question_id 201 repeats line 1",
        ),
        (
            [{"question_id": "999", "text": "x"}],
            r"answers.jsonl:1: answer for question 999, which is not among the questions",
        ),
        ([{"question_id": "201", "answer": "x"}], r"answers.jsonl:1: an answer line needs a string 'text'"),
        ([{"text": "x"}], r"answers.jsonl:1: missing question_id"),
    ],
)
def test_gqa_answers_files_are_matched_by_id_or_refused(gqa_files, tmp_path, rows, message):
    questions = gqa.load_gqa(gqa_files[0], gqa_files[1])
    with pytest.raises(PruneAuditError, match=message):
        gqa.score_gqa_answers(write_lines(tmp_path / "answers.jsonl", rows), questions)


@pytest.mark.skipif(not (LLAVA_EVAL / "llava_gqa_testdev_balanced.jsonl").is_file(), reason=SHARED_ABSENT)
def test_llava_gqa_testdev_file_parses():
    questions = gqa.load_llava_gqa(LLAVA_EVAL / "llava_gqa_testdev_balanced.jsonl")
    assert len(questions) == 12578 and len({q.image for q in questions}) == 398
    assert all(q.text == f"{q.question}\n{gqa.INSTRUCTION}" for q in questions)
    assert questions[0].question == "Is it overcast?" and questions[0].image_id == "n161313"


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


def test_gqa_image_ids_are_stable_int64():
    from prune_audit.data.files import stable_image_id

    assert stable_image_id("2354786") == 2354786
    assert stable_image_id("n161313") == stable_image_id("n161313") != stable_image_id("n161314")
    assert 0 <= stable_image_id("n161313") < 2**63
    assert not math.isnan(stable_image_id("x"))


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
