"""`score --task video_mc|video_presence`: released answers (LLaVA's question_id + text lines) scored by hand —
lmms-eval's letter rules (75571cfe: MVBench's ``mcq_acc``, Video-MME's ``extract_mcq_answer``, worked out here by
hand from its code) on MVBench and Video-MME question files (JSON and Video-MME's Parquet), and POPE's evaluate.py on
the presence questions; the one-line refusals of ambiguous, unknown, repeated and missing answers."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import answers_file, refused, runner, score_json, write_json, write_lines

from prune_audit.cli.main import app
from prune_audit.data.files import stable_image_id
from prune_audit.data.video_answers import mvbench_normal_form, videomme_letter

MVBENCH = [
    {"video": "a.webm", "question": "What is done?", "candidates": ["Not sure", "Scattering", "Piling"],
     "answer": "Piling"},
    {"video": "b.mp4", "question": "How many times?", "candidates": ["3", "5"], "answer": "3"},
    {"video": "c.mp4", "question": "Which animal?", "candidates": ["a cat", "a dog"], "answer": "a dog"},
]  # fmt: skip
VIDEOMME = [
    {"videoID": "v1", "question_id": "001-1", "duration": "short", "question": "Which is most?",
     "options": ["A. Apples.", "B. Candles.", "C. Berries.", "D. Same."], "answer": "C"},
    {"videoID": "v2", "question_id": "002-3", "question": "Who?", "options": ["A. Me.", "B. You."], "answer": "B"},
    {"videoID": "v3", "question_id": "003-1", "duration": "long", "question": "When?",
     "options": ["A. Now.", "B. Then.", "C. Never.", "D. Always."], "answer": "A"},
]  # fmt: skip
PRESENCE = [
    {"question_id": 1, "video": "s.mp4", "question": "Is there a cat at the beginning of the video?", "answer": "yes",
     "category": "cat", "window": [0, 1]},
    {"question_id": 2, "video": "s.mp4", "question": "Is there a cat at the end of the video?", "answer": "no",
     "category": "cat", "window": [4, 5]},
    {"question_id": 3, "video": "s.mp4", "question": "Is there a dog in the video?", "answer": "no",
     "category": "dog", "window": None},
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("B. Scattering", "B"),  # "X. ..." at the start
        ("(C) Piling", "C"),  # "(" spaced out, ")" beside a space deleted: "c piling"
        ("The answer is (b).", "B"),  # the first stand-alone letter, either case
        ("a cat", "A"),  # upstream's quirk: the article reads as letter A
        ("Piling", "piling"),  # no stand-alone letter: the normalised text
        ("5", "5"),
    ],
)
def test_mvbench_normal_form_by_hand(text, form):
    assert mvbench_normal_form(text) == form


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("C", "C"),  # a starting letter (rank 10)
        ("The answer is B.", "B"),  # an ending letter (9) over the phrase's (7)
        ("I think (A) but maybe D", "D"),  # the ending letter over "(A)" (6)
        ("Berries.", "B"),  # no form: the last letter anywhere (a capital B)
        ("The best answer is (C) since", "C"),  # the phrase's letter (7) over "(C)" (6)
        ("none", ""),
        ("  ", ""),
    ],
)
def test_videomme_letter_by_hand(text, letter):
    assert videomme_letter(text) == letter


def test_mvbench_answers_by_hand_one_file_or_two_with_splits(tmp_path):
    questions = write_json(tmp_path / "action_antonym.json", MVBENCH)
    answers = answers_file(tmp_path / "a.jsonl", [(0, "(C) Piling"), (1, "5"), (2, "")])
    report = score_json(str(answers), "--task", "video_mc", "--questions", str(questions))
    # C right; "5" is not A; the empty answer is left out of the accuracy (mvbench_aggregate_results)
    assert (report["n"], report["answered"], report["correct"], report["accuracy"]) == (3, 2, 1, 0.5)
    assert report["splits"] == {"action_antonym": {"n": 3, "answered": 2, "correct": 1, "accuracy": 0.5}}
    assert [row["parsed"] for row in report["per_question"]] == ["C", "5", ""]
    other = write_json(tmp_path / "moving_count.json", MVBENCH[2:])
    both = ["--task", "video_mc", "--questions", str(questions), "--questions", str(other)]
    refused(runner.invoke(app, ["score", str(answers), *both]), "give every answer line a 'split'")
    rows = [{"question_id": 0, "split": "action_antonym", "text": "C"}, {"question_id": 1, "split": "action_antonym",
            "text": "A"}, {"question_id": 2, "split": "action_antonym", "text": "B"},
            {"question_id": 0, "split": "moving_count", "text": "a dog"}]  # fmt: skip
    report = score_json(str(write_lines(tmp_path / "split.jsonl", rows)), *both)
    assert report["splits"]["action_antonym"]["correct"] == 3 and report["splits"]["moving_count"]["correct"] == 0


def test_videomme_answers_by_hand_in_json_and_parquet(tmp_path):
    questions = write_json(tmp_path / "videomme.json", VIDEOMME)
    rows = [("001-1", "Berries."), ("002-3", "The answer is B."), ("003-1", "")]
    answers = answers_file(tmp_path / "a.jsonl", rows)
    report = score_json(str(answers), "--task", "video_mc", "--questions", str(questions))
    # "Berries." reads as B (its last capital letter), not C; an empty answer counts, wrong
    assert (report["n"], report["answered"], report["correct"]) == (3, 3, 1)
    assert report["accuracy"] == pytest.approx(1 / 3)
    assert {split: scores["correct"] for split, scores in report["splits"].items()} == {
        "short": 0, "videomme": 1, "long": 0,
    }  # fmt: skip
    parquet = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "duration": row.get("duration", "")} for row in VIDEOMME]), parquet)
    from_parquet = score_json(str(answers), "--task", "video_mc", "--questions", str(parquet))
    assert from_parquet["per_question"] == report["per_question"]
    exported = answers_file(tmp_path / "e.jsonl", [(stable_image_id(key), text) for key, text in rows])
    from_ids = score_json(str(exported), "--task", "video_mc", "--questions", str(questions))  # export --answers' ids
    assert from_ids["per_question"] == report["per_question"]


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([("001-1", "A"), ("002-3", "A"), ("004-1", "A")], "answer for question 004-1, which is not among"),
        ([("001-1", "A"), ("001-1", "B"), ("002-3", "A"), ("003-1", "A")], "a second answer to the question of line 1"),
        ([("001-1", "A")], "2 questions have no answer (first: videomme/002-3)"),
    ],
)
def test_unknown_repeated_or_missing_answers_are_refused_in_one_line(tmp_path, rows, needle):
    questions = write_json(tmp_path / "videomme.json", VIDEOMME)
    answers = answers_file(tmp_path / "a.jsonl", rows)
    refused(runner.invoke(app, ["score", str(answers), "--task", "video_mc", "--questions", str(questions)]), needle)


def test_presence_answers_scored_as_pope_by_hand(tmp_path):
    questions = write_json(tmp_path / "presence.json", PRESENCE)
    answers = answers_file(tmp_path / "a.jsonl", [(1, "Yes, there is."), (2, "No."), (3, "There is a cat.")])
    report = score_json(str(answers), "--task", "video_presence", "--questions", str(questions))
    scores = report["splits"]["video_presence"]  # 1: yes (right), 2: no (right), 3: yes (label no)
    assert (scores["tp"], scores["fp"], scores["tn"], scores["fn"]) == (1, 1, 1, 0) and report["matched_by"] == "id"
    assert scores["accuracy"] == pytest.approx(2 / 3) and scores["precision"] == 0.5 and scores["recall"] == 1.0
    by_order = write_lines(tmp_path / "pope.jsonl", [{"answer": "no"}, {"answer": "no"}, {"answer": "no"}])
    report = score_json(str(by_order), "--task", "video_presence", "--questions", str(questions))
    assert report["matched_by"] == "order" and report["splits"]["video_presence"]["accuracy"] == pytest.approx(2 / 3)
    parquet = tmp_path / "presence.parquet"
    pq.write_table(pa.Table.from_pylist([{"question_id": 1}]), parquet)
    result = runner.invoke(app, ["score", str(answers), "--task", "video_presence", "--questions", str(parquet)])
    refused(result, "video_presence reads JSON question lists, not Parquet")
    assert json.loads(questions.read_text()) == PRESENCE
