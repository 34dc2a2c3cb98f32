"""POPE: question files, answer parsing, metrics, matching, the build rules and the CLI; the pope task's run and
``score`` through the task seam."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import answers_file, score_json
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.pope import (
    attach_labels,
    file_sha256,
    load_pope,
    parse_answer,
    parse_object,
    pope_metrics,
    split_from_file_name,
)
from prune_audit.data.pope_score import PopeAnswer, load_scored_questions, match_answers, score_by_split
from prune_audit.errors import PruneAuditError

runner = CliRunner()
INSTRUCTION = "\nAnswer the question using a single word or phrase."


def _write_lines(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _question(qid, image, obj, label=None, **extra):
    article = "an" if obj[0] in "aeiou" else "a"
    row = {"question_id": qid, "image": image, "text": f"Is there {article} {obj} in the image?", **extra}
    if label is not None:
        row["label"] = label
    return row


@pytest.fixture(scope="module")
def official(shared_data):
    return {
        split: load_pope(shared_data / "pope" / f"coco_pope_{split}.json")
        for split in ("random", "popular", "adversarial")
    }


# --- question files ---


def test_official_files_load_with_the_documented_counts(official, shared_data):
    categories = {c["name"] for c in json.loads((shared_data / "coco" / "coco80_categories.json").read_text())}
    images = None
    yes_questions = None
    for split, questions in official.items():
        assert len(questions) == 3000 and {q.split for q in questions} == {split}
        assert Counter(q.label for q in questions) == {"yes": 1500, "no": 1500}
        assert [q.label for q in questions[:6]] == ["yes", "no"] * 3
        assert {q.object for q in questions} <= categories
        split_images = {q.image for q in questions}
        split_yes = {(q.image, q.object) for q in questions if q.label == "yes"}
        assert len(split_images) == 500
        assert images in (None, split_images) and yes_questions in (None, split_yes)
        images, yes_questions = split_images, split_yes
    assert official["random"][0].image_id == 310196 and official["random"][0].object == "snowboard"
    assert len({q.object for qs in official.values() for q in qs}) == 79


def test_file_sha256_is_the_sha_of_the_bytes(tmp_path):
    path = tmp_path / "x.json"
    path.write_bytes(b"abc")
    assert file_sha256(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize(
    ("text", "obj"),
    [
        ("Is there a dining table in the image?", "dining table"),
        ("Is there an apple in the imange?", "apple"),  # early POPE builder typo
        ("Is there a tv in the image?" + INSTRUCTION, "tv"),  # LLaVA's merged file
    ],
)
def test_parse_object(text, obj):
    assert parse_object(text) == obj


def test_parse_object_refuses_other_questions():
    with pytest.raises(PruneAuditError, match="not a POPE question"):
        parse_object("What is in the image?")


def test_split_from_file_name():
    assert split_from_file_name("out/coco_pope_adversarial.json") == "adversarial"
    assert split_from_file_name("pope_random.jsonl") == "random"
    assert split_from_file_name("questions.jsonl") == "questions"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"question_id": 3, "image": "a.jpg", "text": "Is there a cat in the image?", "label": "yes"',
            r"bad_pope_random\.json:3: malformed JSON line",
        ),
        ('{"question_id": 3, "image": "a.jpg", "label": "yes"}', r":3: missing text"),
        ('{"question_id": 3, "image": "a.jpg", "text": "Is there a cat in the image?", "label": "Yes"}', r":3: label"),
        (
            '{"question_id": 1, "image": "a.jpg", "text": "Is there a cat in the image?", "label": "no"}',
            r":3: question_id 1 of split random repeats line 1",
        ),
        ('{"question_id": "x", "image": "a.jpg", "text": "Is there a cat in the image?"}', r":3: question_id must be"),
        ('{"question_id": 3, "image": "a.jpg", "text": "Describe the image."}', r":3: not a POPE question"),
        ("[1, 2]", r":3: expected a JSON object"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, message):
    path = _write_lines(tmp_path / "bad_pope_random.json", [_question(1, "a.jpg", "cat", "yes"), "", line])
    with pytest.raises(PruneAuditError, match=message):
        load_pope(path)


def _llava_merged(tmp_path):
    """A miniature llava_pope_test.jsonl: categories, appended instruction, offset ids, no labels."""
    rows = []
    for block, split in enumerate(("adversarial", "random")):
        for i, obj in enumerate(("cat", "apple", "dog", "car")):
            row = _question(block * 10_000_000 + i + 1, f"COCO_val2014_00000000000{i // 2}.jpg", obj, category=split)
            row["text"] += INSTRUCTION
            rows.append(row)
    return _write_lines(tmp_path / "llava_pope_test.jsonl", rows)


def _label_file(tmp_path, split, objects=("cat", "apple", "dog", "car"), labels=("yes", "no", "yes", "no")):
    rows = [
        _question(i + 1, f"COCO_val2014_00000000000{i // 2}.jpg", obj, label)
        for i, (obj, label) in enumerate(zip(objects, labels))
    ]
    return _write_lines(tmp_path / f"coco_pope_{split}.json", rows)


def test_llava_merged_file_gets_labels_by_split_and_order(tmp_path):
    merged = load_pope(_llava_merged(tmp_path))
    assert [q.split for q in merged] == ["adversarial"] * 4 + ["random"] * 4
    assert {q.label for q in merged} == {None} and merged[4].question_id == 10_000_001
    labelled = load_pope(_label_file(tmp_path, "adversarial")) + load_pope(_label_file(tmp_path, "random"))
    with_labels = attach_labels(merged, labelled)
    assert [q.label for q in with_labels] == ["yes", "no"] * 4
    assert with_labels[5].question_id == 10_000_002 and with_labels[5].object == "apple"


def test_scored_questions_take_labels_from_the_label_files(tmp_path):
    labels = [_label_file(tmp_path, "adversarial"), _label_file(tmp_path, "random")]
    merged = load_scored_questions([_llava_merged(tmp_path), *labels])
    assert [q.label for q in merged] == ["yes", "no"] * 4
    assert load_scored_questions(labels) == load_pope(labels[0]) + load_pope(labels[1])
    mixed = tmp_path / "mixed.json"
    _write_lines(mixed, [_question(1, "a.jpg", "dog", "yes"), _question(2, "a.jpg", "cat")])
    with pytest.raises(PruneAuditError, match="some questions have labels and some do not"):
        load_scored_questions([mixed])


def test_attach_labels_refuses_a_different_file_version(tmp_path):
    merged = load_pope(_llava_merged(tmp_path))
    shifted = load_pope(_label_file(tmp_path, "adversarial", objects=("cat", "apple", "dog", "bus")))
    random_split = load_pope(_label_file(tmp_path, "random"))
    with pytest.raises(PruneAuditError, match="does not match label row 4"):
        attach_labels(merged, shifted + random_split)
    with pytest.raises(PruneAuditError, match="no label file for split 'random'"):
        attach_labels(merged, load_pope(_label_file(tmp_path, "adversarial")))
    longer = load_pope(
        _label_file(
            tmp_path, "random", objects=("cat", "apple", "dog", "car", "bus"), labels=("yes", "no", "yes", "no", "no")
        )
    )
    with pytest.raises(PruneAuditError, match="4 questions but 5 labels"):
        attach_labels(merged, load_pope(_label_file(tmp_path, "adversarial")) + longer)


# --- answers and metrics ---


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("Yes, there is a cat in the image.", "yes"),
        ("No, there is no cat.", "no"),
        ("There is not a cat", "no"),
        ("no.", "no"),
        ("Yes. No cat though.", "yes"),  # only the first sentence counts
        ("", "yes"),
        ("Nope", "yes"),
        ("NO", "yes"),  # only "No", "no" and "not" are negative words
        ("No\n", "yes"),  # split on single spaces keeps the newline in the word
        ("yes,no", "yes"),  # commas are deleted, not split on
        ("I do not know", "no"),
    ],
)
def test_parse_answer_follows_popes_evaluate_py(text, parsed):
    assert parse_answer(text) == parsed


def test_pope_metrics_by_hand():
    labels = ["yes", "yes", "yes", "no", "no", "no", "no", "yes"]
    predictions = ["yes", "yes", "no", "yes", "no", "no", "no", "no"]
    metrics = pope_metrics(labels, predictions)
    assert (metrics["tp"], metrics["fp"], metrics["tn"], metrics["fn"], metrics["n"]) == (2, 1, 3, 2, 8)
    assert metrics["accuracy"] == 5 / 8 and metrics["precision"] == 2 / 3 and metrics["recall"] == 0.5
    assert metrics["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    assert metrics["yes_ratio"] == 3 / 8  # share of predictions, not of labels
    as_bools = pope_metrics(np.array(labels) == "yes", np.array(predictions) == "yes")
    assert as_bools == metrics


def test_pope_metrics_edge_cases():
    never_yes = pope_metrics(["yes", "no"], ["no", "no"])
    assert math.isnan(never_yes["precision"]) and never_yes["recall"] == 0 and math.isnan(never_yes["f1"])
    with pytest.raises(PruneAuditError, match="must be 'yes' or 'no'"):
        pope_metrics(["yes", "maybe"], ["yes", "no"])
    with pytest.raises(PruneAuditError, match="equal-length"):
        pope_metrics(["yes"], ["yes", "no"])


def test_match_by_order_and_by_id(tmp_path):
    questions = load_pope(_label_file(tmp_path, "random"))
    texts, how = match_answers(questions, [PopeAnswer(t) for t in ("Yes", "No", "No", "Yes")])
    assert (texts, how) == (["Yes", "No", "No", "Yes"], "order")
    with pytest.raises(PruneAuditError, match="3 answers for 4 questions"):
        match_answers(questions, [PopeAnswer("Yes")] * 3)
    shuffled = [PopeAnswer(f"a{qid}", question_id=qid) for qid in (3, 1, 4, 2)]
    assert match_answers(questions, shuffled) == (["a1", "a2", "a3", "a4"], "id")
    with pytest.raises(PruneAuditError, match="unknown question 9"):
        match_answers(questions, shuffled[:3] + [PopeAnswer("x", question_id=9)])
    with pytest.raises(PruneAuditError, match="two answers for question 3"):
        match_answers(questions, shuffled[:3] + [PopeAnswer("x", question_id=3)])
    with pytest.raises(PruneAuditError, match="1 questions have no answer"):
        match_answers(questions, shuffled[:3])
    with pytest.raises(PruneAuditError, match="some answers have a question_id"):
        match_answers(questions, shuffled[:3] + [PopeAnswer("x")])


def test_ids_repeating_across_splits_need_a_split_on_the_answers(tmp_path):
    questions = load_pope(_label_file(tmp_path, "random")) + load_pope(_label_file(tmp_path, "popular"))
    plain = [PopeAnswer("yes", question_id=q.question_id) for q in questions]
    with pytest.raises(PruneAuditError, match="question ids repeat"):
        match_answers(questions, plain)
    keyed = [PopeAnswer(q.split, question_id=q.question_id, split=q.split) for q in reversed(questions)]
    texts, how = match_answers(questions, keyed)
    assert how == "id" and texts == [q.split for q in questions]


def test_scores_per_split_and_average(tmp_path):
    questions = load_pope(_label_file(tmp_path, "random")) + load_pope(_label_file(tmp_path, "popular"))
    answers = ["Yes", "No", "Yes", "No"] + ["Yes", "Yes", "Yes", "Yes"]
    results = score_by_split(questions, answers)
    assert list(results) == ["random", "popular", "average"]
    assert results["random"]["accuracy"] == 1.0 and results["popular"]["accuracy"] == 0.5
    assert results["average"]["accuracy"] == 0.75 and results["average"]["n"] == 8
    assert results["average"]["yes_ratio"] == pytest.approx((0.5 + 1.0) / 2)


# --- CLI ---


def test_cli_score_official_random_split(shared_data, tmp_path):
    pope_file = shared_data / "pope" / "coco_pope_random.json"
    questions = load_pope(pope_file)
    # Right on every question except the first 100 "yes" ones, answered "No, ...".
    wrong = set([q.question_id for q in questions if q.label == "yes"][:100])
    rows = [
        {
            "question": q.text,
            "answer": ("No, there is not." if q.question_id in wrong else "Yes." if q.label == "yes" else "No."),
        }
        for q in questions
    ]
    answers = _write_lines(tmp_path / "answers.jsonl", rows)
    result = runner.invoke(app, ["pope", "score", str(answers), "--pope", str(pope_file), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    metrics = report["splits"]["random"]
    assert report["matched_by"] == "order" and report["question_files"][0]["sha256"] == file_sha256(pope_file)
    assert (metrics["tp"], metrics["fn"], metrics["tn"], metrics["fp"]) == (1400, 100, 1500, 0)
    assert metrics["accuracy"] == pytest.approx(2900 / 3000) and metrics["yes_ratio"] == pytest.approx(1400 / 3000)
    table = runner.invoke(app, ["pope", "score", str(answers), "--pope", str(pope_file)])
    assert table.exit_code == 0 and "random" in table.stdout and "0.9667" in table.stdout


def test_cli_score_llava_answers_through_the_merged_file(tmp_path):
    merged = _llava_merged(tmp_path)
    labels = [_label_file(tmp_path, "adversarial"), _label_file(tmp_path, "random")]
    answers = [{"question_id": q.question_id, "text": "Yes"} for q in load_pope(merged)]
    answer_file = _write_lines(tmp_path / "llava_answers.jsonl", reversed(answers))
    args = [
        "pope",
        "score",
        str(answer_file),
        "--pope",
        str(merged),
        "--pope",
        str(labels[0]),
        "--pope",
        str(labels[1]),
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    splits = json.loads(result.stdout)["splits"]
    assert set(splits) == {"adversarial", "random", "average"}
    assert splits["random"]["yes_ratio"] == 1.0 and splits["random"]["precision"] == 0.5


def test_cli_score_count_mismatch_is_one_line_error(tmp_path):
    pope_file = _label_file(tmp_path, "random")
    answers = _write_lines(tmp_path / "answers.jsonl", [{"answer": "Yes"}] * 3)
    result = runner.invoke(app, ["pope", "score", str(answers), "--pope", str(pope_file)])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: 3 answers for 4 questions (matched by order)"
    assert result.stdout == ""


def test_cli_info_counts_and_malformed_line(shared_data, tmp_path):
    pope_file = shared_data / "pope" / "coco_pope_popular.json"
    result = runner.invoke(app, ["pope", "info", str(pope_file), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)[0]["splits"]["popular"]
    assert summary == {"questions": 3000, "images": 500, "yes": 1500, "no": 1500, "unlabelled": 0}
    bad = _write_lines(tmp_path / "coco_pope_random.json", [_question(1, "a.jpg", "cat", "yes"), "{oops"])
    result = runner.invoke(app, ["pope", "info", str(bad)])
    assert result.exit_code == 2 and result.stderr.strip().startswith(f"error: {bad}:2: malformed JSON line")


# --- building POPE sets from COCO ---


@pytest.fixture(scope="module")
def tiny_coco_path(shared_data):
    return shared_data / "coco" / "tiny_coco_val2017" / "instances_val2017.json"


def test_cli_build_follows_popes_rules(tiny_coco_path, tmp_path):
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope_build import sample_pope_images

    out = tmp_path / "pope"
    result = runner.invoke(
        app, ["pope", "build", "--annotations", str(tiny_coco_path), "--out", str(out), "--images", "20", "--seed", "3"]
    )
    assert result.exit_code == 0, result.output
    coco = CocoInstances.load(tiny_coco_path)
    sampled = sample_pope_images(coco, 20, seed=3)
    objects = {coco.images[i].file_name: coco.object_names(i) for i in sampled}
    popularity = Counter(obj for names in objects.values() for obj in names)
    sets = {split: load_pope(out / f"coco_pope_{split}.json") for split in ("random", "popular", "adversarial")}
    for split, questions in sets.items():
        assert len(questions) == 120 and Counter(q.label for q in questions) == {"yes": 60, "no": 60}
        assert [q.question_id for q in questions] == list(range(1, 121))
        assert [q.image for q in questions[::6]] == [coco.images[i].file_name for i in sampled]
        for start in range(0, 120, 6):
            block = questions[start : start + 6]
            image_objects = objects[block[0].image]
            assert [q.object for q in block[0::2]] == image_objects[:3]  # first three objects are the positives
            negatives = [q.object for q in block[1::2]]
            assert not set(negatives) & set(image_objects) and len(set(negatives)) == 3
            assert set(negatives) <= set(popularity)
            if split == "popular":
                absent = [obj for obj, _ in popularity.most_common() if obj not in image_objects]
                assert negatives == absent[:3]
    info = runner.invoke(
        app,
        [
            "pope",
            "info",
            *(str(p) for p in sorted(out.glob("coco_pope_*.json"))),
            "--annotations",
            str(tiny_coco_path),
            "--json",
        ],
    )
    for entry in json.loads(info.stdout):
        for summary in entry["splits"].values():
            assert summary["yes_without_mask"] == 0 and summary["unknown_objects"] == []
            assert summary["images"] == 20 and summary["images_not_in_annotations"] == 0


def test_build_is_deterministic_and_adversarial_uses_co_occurrence(tiny_coco_path):
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope_build import build_pope, pope_lines

    coco = CocoInstances.load(tiny_coco_path)
    first = build_pope(coco, sample_images=None, seed=0)
    again = build_pope(coco, sample_images=None, seed=0, splits=("adversarial", "random"))
    assert pope_lines(first["random"]) == pope_lines(again["random"])
    assert pope_lines(first["adversarial"]) == pope_lines(again["adversarial"])
    assert pope_lines(build_pope(coco, sample_images=None, seed=1)["random"]) != pope_lines(first["random"])
    object_lists = {}
    for q in first["random"]:
        object_lists.setdefault(q.image, coco.object_names(coco.image_id(q.image)))
    co_counts = Counter()
    for names in object_lists.values():
        co_counts.update((a, b) for a in names for b in names if a != b)
    questions = first["adversarial"]
    for index in range(0, len(questions), 2):
        positive, negative = questions[index].object, questions[index + 1].object
        image_objects = object_lists[questions[index].image]
        asked = {q.object for q in questions[index - index % 6 : index + 1]}
        candidates = [
            o for (p, o), _ in co_counts.items() if p == positive and o not in image_objects and o not in asked
        ]
        if candidates:
            assert co_counts[(positive, negative)] == max(co_counts[(positive, o)] for o in candidates)


def test_build_refuses_more_images_than_eligible(tiny_coco_path, tmp_path):
    result = runner.invoke(
        app, ["pope", "build", "--annotations", str(tiny_coco_path), "--out", str(tmp_path / "o"), "--images", "500"]
    )
    assert result.exit_code == 2 and "have 3 or more objects" in result.stderr
    assert not (tmp_path / "o").exists()


def test_info_flags_yes_objects_without_mask_and_unknown_names(tmp_path):
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope import summarize_questions

    coco = CocoInstances(
        {
            "images": [{"id": 1, "file_name": "000000000001.jpg", "width": 10, "height": 10}],
            "categories": [{"id": 3, "name": "car"}, {"id": 4, "name": "cat"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 4, "segmentation": [[1, 1, 5, 1, 5, 5]]}],
        }
    )
    rows = [
        _question(1, "COCO_val2014_000000000001.jpg", "cat", "yes"),
        _question(2, "COCO_val2014_000000000001.jpg", "car", "yes"),  # no car instance: flagged
        _question(3, "COCO_val2014_000000000001.jpg", "unicorn", "no"),
        _question(4, "COCO_val2014_000000000002.jpg", "cat", "yes"),
    ]
    summary = summarize_questions(load_pope(_write_lines(tmp_path / "coco_pope_random.json", rows)), coco)["random"]
    assert summary["yes_without_mask"] == 1 and summary["unknown_objects"] == ["unicorn"]
    assert summary["images_not_in_annotations"] == 1 and summary["images"] == 2


# --- the pope task through the seam ---


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


def test_score_pope_through_the_task_matches_pope_score(workspace, tmp_path):
    pope = workspace["pope"][0]
    rows = [(json.loads(line)["question_id"], "Yes") for line in pope.read_text().splitlines() if line.strip()]
    answers = str(answers_file(tmp_path / "a.jsonl", rows))
    by_task = score_json(answers, "--questions", str(pope))
    result = runner.invoke(app, ["pope", "score", answers, "--pope", str(pope), "--json"])
    assert by_task == json.loads(result.stdout)
    assert next(iter(by_task["splits"].values()))["yes_ratio"] == 1.0
