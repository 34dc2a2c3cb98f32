"""The textvqa task: the official VQA accuracy by hand, the readers' refusals, OCR-box evidence, and a run of the
bundled demo over real COCO images (the demo never learned to read: only the records and columns are checked)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import refused
from test_task_visualize import drawn_panels  # noqa: F401 (fixture)
from typer.testing import CliRunner

from prune_audit.analysis.overlay import MASK_OUTLINE, box_outline, compose, legend_entries
from prune_audit.cli.main import app
from prune_audit.data.textvqa import (
    OcrBox,
    annotator_matches,
    answer_boxes,
    box_mask,
    load_rosetta_ocr,
    load_textvqa,
    normalize_answer,
    vqa_accuracy,
)
from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import task_columns
from prune_audit.tasks import get_task
from prune_audit.tasks.prompts import SHORT_ANSWER

runner = CliRunner()


# ----- the official VQA accuracy, by hand -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("The Cat.", "cat"),  # lower case, article and final period dropped
        ("Two dogs", "2 dogs"),  # number words as digits
        ("3.5", "3.5"),  # a period before a digit stays
        ("coca-cola", "coca cola"),  # '-' inside a word becomes a space ...
        ("x - y", "x y"),  # ... and is dropped where it touches a space
        ("dont", "don't"),  # contractions restored
        ("couldnt've", "couldn't've"),
        ("couldntve", "couldntve"),  # only one apostrophe may be missing
        ("what's it?", "what 's it"),  # "'s" split off, '?' dropped
        ("1,000", "1000"),
        ("an apple", "apple"),
    ],
)
def test_answers_are_normalised_as_the_official_evaluation_does(raw, normalised):
    assert normalize_answer(raw) == normalised


@pytest.mark.parametrize(
    ("matching", "accuracy"),
    # k of 10 annotators gave the answer; leaving out one of them leaves k-1, leaving out another leaves k:
    # (k * min(1, (k-1)/3) + (10-k) * min(1, k/3)) / 10
    [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)],
)
def test_vqa_accuracy_averages_min_of_matches_over_three_over_the_ten_leave_one_out_subsets(matching, accuracy):
    answers = ["yes"] * matching + ["no"] * (10 - matching)
    assert vqa_accuracy("Yes.", answers) == pytest.approx(accuracy)
    assert annotator_matches("Yes.", answers) == matching


def test_normalisation_decides_a_match_on_both_sides():
    answers = ["two", "2", "Two.", "the 2", "3", "3", "3", "3", "3", "3"]
    assert annotator_matches("2", answers) == 4 and vqa_accuracy("2", answers) == 1.0
    assert vqa_accuracy("three", answers) == 1.0 and vqa_accuracy("four", answers) == 0.0


def test_vqa_accuracy_needs_ten_annotators():
    with pytest.raises(PruneAuditError, match="needs 10 human answers, got 9"):
        vqa_accuracy("yes", ["yes"] * 9)


# ----- OCR boxes as evidence -------------------------------------------------------------------------------------


def box(word: str, x: float = 0.0, y: float = 0.0, w: float = 0.1, h: float = 0.1) -> OcrBox:
    return OcrBox(word, x, y, w, h)


def test_answer_tokens_are_runs_of_consecutive_ocr_words_spelling_a_normalised_answer():
    tokens = [box("Coca"), box("Cola"), box("-"), box("COLA"), box("the"), box("Stop."), box("coca")]
    assert answer_boxes(["coca cola"] * 10, tokens) == [0, 1]
    assert answer_boxes(["cola"], tokens) == [1, 3]
    assert answer_boxes(["stop"], tokens) == [5]  # "Stop." normalises to "stop"
    assert answer_boxes(["pepsi", ""], tokens) == []


def test_a_box_covers_the_pixels_whose_centre_lies_in_it_clipped_to_the_image():
    mask = box_mask(OcrBox("w", 0.25, 0.5, 0.5, 0.25), width=8, height=4)  # x in [2, 6), y in [2, 3)
    assert mask.shape == (4, 8) and np.argwhere(mask).tolist() == [[2, c] for c in range(2, 6)]
    assert box_mask(OcrBox("w", 0.9, -0.2, 0.3, 0.5), width=10, height=10).sum() == 1 * 3  # column 9, rows 0..2


# ----- files in the released formats ----------------------------------------------------------------------------


def image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def textvqa_files(folder: Path, images: list[tuple[str, tuple[int, int]]]) -> dict[str, Path]:
    """TextVQA's question JSON, LLaVA's question file and a Rosetta OCR file: on the first image a sign reading
    "STOP" (two questions, one of them answered by no OCR token), on the second a "Coca Cola" label."""
    (first, first_size), (second, second_size) = images
    entries = [
        (101, first, first_size, "what does the sign say?", ["stop"] * 4 + ["stop sign"] * 3 + ["go"] * 3),
        (102, first, first_size, "what color is the sign?", ["red"] * 10),
        (103, second, second_size, "what brand is this?", ["coca cola"] * 6 + ["coke"] * 4),
    ]
    ocr = {
        first: [("STOP", 0.1, 0.1, 0.3, 0.2), ("sign", 0.5, 0.1, 0.2, 0.1), ("!", 0.8, 0.8, 0.05, 0.05)],
        second: [("Coca", 0.2, 0.4, 0.2, 0.1), ("Cola", 0.42, 0.4, 0.2, 0.1), ("12oz", 0.3, 0.6, 0.1, 0.05)],
    }
    data = [
        {
            "question_id": qid,
            "image_id": image,
            "question": question,
            "answers": answers,
            "image_width": size[0],
            "image_height": size[1],
            "ocr_tokens": [word for word, *_ in ocr[image]],
            "set_name": "val",
        }
        for qid, image, size, question, answers in entries
    ]
    llava = [
        {
            "question_id": image,
            "image": f"{image}.jpg",
            "text": f"{question.capitalize()}\nReference OCR token: {', '.join(w for w, *_ in ocr[image])}\n"
            f"{SHORT_ANSWER}",
            "category": "default",
        }
        for _, image, _, question, _ in entries
    ]
    rosetta = [
        {
            "image_id": image,
            "ocr_tokens": [word for word, *_ in tokens],
            "ocr_info": [
                {"word": w, "bounding_box": {"top_left_x": x, "top_left_y": y, "width": bw, "height": bh}}
                for w, x, y, bw, bh in tokens
            ],
        }
        for image, tokens in ocr.items()
    ]
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "TextVQA_0.5.1_val.json", "llava": folder / "llava_textvqa.jsonl"}
    paths["ocr"] = folder / "TextVQA_Rosetta_OCR_v0.2_val.json"
    paths["json"].write_text(json.dumps({"dataset_name": "textvqa", "data": data}))
    paths["llava"].write_text("".join(json.dumps(row) + "\n" for row in llava))
    paths["ocr"].write_text(json.dumps({"data": rosetta}))
    return paths


@pytest.fixture
def files(tmp_path):
    return textvqa_files(tmp_path / "textvqa", [("img_a", (64, 48)), ("img_b", (40, 40))])


def test_llava_lines_are_matched_by_image_and_question_and_keep_their_prompt(files):
    questions = load_textvqa(files["json"], files["llava"])
    assert [q.question_id for q in questions] == [101, 102, 103]
    assert questions[0].text == f"What does the sign say?\nReference OCR token: STOP, sign, !\n{SHORT_ANSWER}"
    task = get_task("textvqa")
    [asked] = [q for q in task.read_questions([files["json"], files["llava"]]) if q.question_id == 101]
    assert task.prompt_text(asked) == asked.text  # the instruction is there once
    json_only = task.read_questions([files["json"]])
    assert task.prompt_text(json_only[0]) == f"What does the sign say?\n{SHORT_ANSWER}"  # lmms-eval's default
    ocr_variant = type("OcrTextVqa", (type(task),), {"ocr_reference": True})(None, None)
    assert (
        ocr_variant.read_questions([files["json"]])[0].text
        == "What does the sign say?\nReference OCR token: STOP, sign, !"
    )


def rewrite(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["data"][0].update(answers=["stop"] * 9), "answers must be a list of 10 strings"),
        (lambda d: d["data"][1].update(question_id=True), "question_id must be a non-negative integer"),
        (lambda d: d["data"][1].update(question_id=101), "question_id 101 repeats entry 0"),
        (lambda d: d["data"][2].update(image_width=0), "image_width and image_height must be positive"),
        (lambda d: d["data"][2].update(image_id="../x"), "leads outside the images folder"),
        (lambda d: d.pop("data"), "expected TextVQA's question JSON"),
    ],
)
def test_a_malformed_question_json_is_refused_naming_file_and_entry(files, change, needle):
    rewrite(files["json"], change)
    with pytest.raises(PruneAuditError, match="TextVQA_0.5.1_val.json") as error:
        load_textvqa(files["json"])
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["data"][0]["ocr_info"][0]["bounding_box"].update(width=-0.1), "width must not be negative"),
        (lambda d: d["data"][0]["ocr_info"][1]["bounding_box"].pop("top_left_y"), "top_left_y must be a finite"),
        (lambda d: d["data"][1]["ocr_info"][0].pop("word"), "needs a word"),
        (lambda d: d["data"].append(d["data"][0]), "is listed twice"),
    ],
)
def test_a_malformed_ocr_file_is_refused_naming_file_image_and_token(files, change, needle):
    rewrite(files["ocr"], change)
    with pytest.raises(PruneAuditError, match="Rosetta_OCR") as error:
        load_rosetta_ocr(files["ocr"])
    assert needle in str(error.value) and "--annotations" in str(error.value)


def test_a_llava_line_without_its_question_in_the_json_is_refused(files):
    lines = files["llava"].read_text().splitlines()
    files["llava"].write_text(lines[0].replace("What does", "Where does") + "\n")
    with pytest.raises(PruneAuditError, match=r"llava_textvqa.jsonl:1: no question 'Where does the sign say\?'"):
        load_textvqa(files["json"], files["llava"])


def test_the_task_declares_its_columns_and_scores_a_generation(files):
    from prune_audit.answer_modes import Generation

    assert [c.name for c in task_columns("textvqa")][-3:] == ["vqa_accuracy", "annotator_matches", "answer_normalized"]
    task = get_task("textvqa")
    question = task.read_questions([files["json"]])[0]
    scored = task.score(question, Generation.from_token_probs("Stop sign.", (0.5, 0.5), True))
    assert scored.references == tuple(["stop"] * 4 + ["stop sign"] * 3 + ["go"] * 3)
    assert scored.columns["annotator_matches"] == 3 and scored.columns["vqa_accuracy"] == pytest.approx(0.9)
    assert scored.correct and scored.confidence == 0.25 and scored.columns["answer_normalized"] == "stop sign"


# ----- the CLI on the bundled demo over real images ---------------------------------------------------------------


@pytest.fixture(scope="module")
def coco_files(shared_data, tmp_path_factory):
    """The files over the first two real COCO images (the test skips without ../shared/data)."""
    images = shared_data / "coco" / "tiny_coco_val2017" / "val2017"
    names = sorted(images.glob("*.jpg"))[:2]
    paths = textvqa_files(tmp_path_factory.mktemp("tvqa"), [(p.stem, image_size(p)) for p in names])
    return {**paths, "images": images}


def run_args(paths: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--task",
        "textvqa",
        "--model",
        "demo",
        "--images",
        str(paths["images"]),
        "--questions",
        str(paths["json"]),
        "--questions",
        str(paths["llava"]),
        "--annotations",
        str(paths["ocr"]),
        "--out",
        str(out),
        *extra,
    ]


def test_demo_run_records_vqa_accuracy_and_the_answer_tokens_retention(coco_files, tmp_path, drawn_panels):  # noqa: F811
    out = tmp_path / "run"
    result = runner.invoke(
        app, run_args(coco_files, out, "--selector", "random", "--budget", "16", "--max-new-tokens", "3")
    )
    assert result.exit_code == 0, result.output
    assert "task textvqa |" in result.output and "VQA accuracy (official" in result.output
    assert json.loads((out / "manifest.json").read_text())["task"] == "textvqa"
    rows = {row["question_id"]: row for row in pq.read_table(out / "records.parquet").to_pylist()}
    assert sorted(rows) == [101, 102, 103]
    for row in rows.values():
        assert row["task"] == "textvqa" and row["split"] == "textvqa" and len(row["references"]) == 10
        assert row["vqa_accuracy"] == pytest.approx(vqa_accuracy(row["answer_text"], row["references"]))
        assert row["correct"] == (row["annotator_matches"] >= 3) and row["confidence"] == row["sequence_prob"]
        assert row["answer_normalized"] == normalize_answer(row["answer_text"]) and row["label"] is None
    # "STOP" and "STOP sign" spell answers on the first image, "Coca" "Cola" on the second; nothing spells "red"
    assert rows[101]["evidence_objects"] == ["STOP", "sign"] and rows[103]["evidence_objects"] == ["Coca", "Cola"]
    for qid in (101, 103):
        row = rows[qid]
        assert 0.0 <= row["retention"] <= 1.0 and row["lost"] in (True, False) and row["object_area"] > 0
        assert len(row["retention_stages"]) == len(row["lost_stages"]) == len(row["diluted_stages"]) >= 1
        assert len(row["evidence_objects_lost"]) == len(row["evidence_objects"])
    assert rows[102]["evidence_objects"] == [] and math.isnan(rows[102]["retention"]) and rows[102]["lost"] is None
    drawn = runner.invoke(
        app, ["visualize", "--run", str(out), "--question-id", "103", "--out", str(tmp_path / "f.png")]
    )
    assert drawn.exit_code == 0, drawn.output
    assert (tmp_path / "f.png").is_file() and "about Coca" in drawn.stdout
    # the figure frames each answer token's OCR box, labelled with its word, in the task's legend words
    [panel] = drawn_panels
    width, height = image_size(coco_files["images"] / rows[103]["image"])
    expected = [("Coca", (0.2, 0.4, 0.4, 0.5)), ("Cola", (0.42, 0.4, 0.62, 0.5))]
    assert [word for word, _ in panel.evidence_boxes] == ["Coca", "Cola"] and panel.answer_boxes == []
    for (_, box), (_, (x1, y1, x2, y2)) in zip(panel.evidence_boxes, expected):
        assert box.as_list() == pytest.approx([x1 * width, y1 * height, x2 * width, y2 * height])
    assert "answer's OCR text (cyan outline)" in [label for label, _ in legend_entries([panel])]
    pixels = np.full((height, width, 3), 90, dtype=np.uint8)
    picture = compose(pixels, panel, 0)
    for _, box in panel.evidence_boxes:
        edge = box_outline((height, width), box)
        assert edge.any() and (picture[edge] == MASK_OUTLINE).all()
        top, left = math.ceil(box.y1 - 0.5), math.ceil(box.x1 - 0.5)
        assert (picture[top, left] == MASK_OUTLINE).all()  # the box's top-left pixel is on the frame


def test_demo_run_refuses_bad_inputs_before_writing(coco_files, tmp_path):
    out = tmp_path / "run"
    only_llava = [a for a in run_args(coco_files, out) if a != str(coco_files["json"])]
    only_llava.remove("--questions")
    refused(runner.invoke(app, only_llava), "one TextVQA question JSON")
    ocr = tmp_path / "ocr.json"
    ocr.write_text(json.dumps({"data": json.loads(coco_files["ocr"].read_text())["data"][:1]}))
    args = run_args(coco_files, out)
    args[args.index(str(coco_files["ocr"]))] = str(ocr)
    refused(runner.invoke(app, args), "is not in the OCR file", "TextVQA_Rosetta_OCR_v0.2_val.json")
    assert not out.exists()


def test_score_reads_an_answers_file_by_textvqa_question_id(files, tmp_path):
    answers = tmp_path / "answers.jsonl"
    rows = [(101, "Stop"), (102, "blue"), (103, "Coca-Cola")]
    answers.write_text("".join(json.dumps({"question_id": q, "text": t}) + "\n" for q, t in rows))
    result = runner.invoke(
        app, ["score", str(answers), "--task", "textvqa", "--questions", str(files["json"]), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # stop: 4 annotators -> 1.0; blue: 0; "coca cola" (the hyphen becomes a space): 6 -> 1.0
    assert report["n"] == 3 and report["accuracy"] == pytest.approx(2 / 3) and report["exact"] == pytest.approx(2 / 3)


def test_a_llava_line_naming_another_image_than_its_id_is_refused(files):
    lines = files["llava"].read_text().splitlines()
    files["llava"].write_text(lines[0].replace('"image": "img_a.jpg"', '"image": "img_b.jpg"') + "\n")
    with pytest.raises(PruneAuditError, match=r"llava_textvqa.jsonl:1: image 'img_b.jpg' is not the image"):
        load_textvqa(files["json"], files["llava"])


def test_evidence_falls_back_to_every_box_only_when_asked_and_checks_the_image_size(files):
    from prune_audit.tasks.textvqa import OcrEvidence

    ocr = load_rosetta_ocr(files["ocr"])
    assert OcrEvidence(ocr, {}).boxes("img_a.jpg", ["red"] * 10) == []
    fallback = OcrEvidence(ocr, {}, fallback=True).boxes("img_a.jpg", ["red"] * 10)
    assert [word for word, _ in fallback] == ["STOP", "sign", "!"]
    evidence = get_task("textvqa").load_evidence(files["ocr"], get_task("textvqa").read_questions([files["json"]]))
    evidence.check_image_size("img_a.jpg", (64, 48), Path("img_a.jpg"))
    with pytest.raises(PruneAuditError, match="is 48x64 pixels but the question JSON says 64x48"):
        evidence.check_image_size("img_a.jpg", (48, 64), Path("img_a.jpg"))
