"""The scienceqa task (ScienceQA-IMG): option letters parsed as LLaVA's eval_science_qa.py parses them, LLaVA's
question file and its one-line refusals, scoring an answers file, and runs answering by option letter on a tiny
offline LLaVA whose vocabulary spells the letters."""

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
from prune_audit.data import scienceqa
from prune_audit.errors import PruneAuditError

runner = CliRunner()


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("A", "A"),
        ("E", "E"),  # any of A-E parses; whether it is offered is scored later
        ("B. apostrophe", "B"),
        ("C. ", "C"),
        ("A.", scienceqa.FAILED),  # "X. " needs the space
        (" A", scienceqa.FAILED),  # no stripping: the text must be the letter itself
        ("a", scienceqa.FAILED),
        ("F. fifth", scienceqa.FAILED),  # "X. " only for A-E
        ("The answer is C.", "C"),
        ("Because of x, the answer is wrong. The answer is D, clearly", "D"),  # "." in the pattern is any character
        ("The answer is F.", "F"),  # [A-Z]: parsed, then scored wrong (not offered)
        ("The answer is B", scienceqa.FAILED),  # nothing after the letter: no match
        ("The answer is A. The answer is B.", scienceqa.FAILED),  # two matches
        ("Answer: B", scienceqa.FAILED),
        ("", scienceqa.FAILED),
    ],
)
def test_scienceqa_letters_follow_llava_eval_science_qa(text, letter):
    assert scienceqa.parse_letter(text) == letter


def sqa_entry(qid: str, value: str, answer: str = "A", image: str | None = None) -> dict:
    entry = {"id": qid, "conversations": [{"from": "human", "value": value}, {"from": "gpt", "value": answer}]}
    return {**entry, "image": image} if image else entry


SQA_ENTRIES = [
    sqa_entry(
        "5",
        "<image>\nContext: A food web.\nArrows show matter.\nWhich eats grass?\nA. fox\nB. rabbit",
        "B",
        "5/image.png",
    ),
    sqa_entry("6", "Which word fits?\nA. See you soon,\nJanet\nB. See You Soon,\nJanet\nC. bye", "C"),
    sqa_entry("7", "<image>\nWhat is shown?\nA. a map\nB. a cell\nC. a star\nD. a leaf", "D", "7/image.png"),
]


def test_scienceqa_entries_parse_into_question_context_and_options(tmp_path):
    path = write_json(tmp_path / "llava_test_CQM-A.json", SQA_ENTRIES)
    everything = scienceqa.load_scienceqa(path, images_only=False)
    assert [q.question_id for q in scienceqa.load_scienceqa(path)] == ["5", "7"]
    first, second, third = everything
    assert first.context == "A food web.\nArrows show matter." and first.question == "Which eats grass?"
    assert first.options == ("fox", "rabbit") and first.answer == "B" and first.letters == ("A", "B")
    assert first.text.startswith("Context: A food web.") and "<image>" not in first.text
    assert first.text.endswith("\nB. rabbit")  # the scienceqa task adds the instruction (tests/tasks/test_prompts.py)
    assert second.options == ("See you soon,\nJanet", "See You Soon,\nJanet", "bye") and second.context is None
    assert second.image is None and third.image == "7/image.png" and len(third.options) == 4


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (sqa_entry("8", "Q?\nA. x\nC. y"), r"entry 3 \(id 8\): options must be .* found letters A, C"),
        (sqa_entry("8", "Q?\nA. x"), r"found letters A;"),
        (sqa_entry("8", "A. x\nB. y"), r"entry 3 \(id 8\): no question before the options"),
        (sqa_entry("8", "Q?\nA. x\nB. y", answer="C"), r"offered letters A, B, got 'C'"),
        (sqa_entry("8", "<image>\nQ?\nA. x\nB. y"), r"has an image exactly when its question has <image>"),
        (sqa_entry("8", "Q?\nA. x\nB. y", image="/abs/image.png"), r"leads outside the images folder"),
        (sqa_entry("5", "Q?\nA. x\nB. y"), r"entry 3: id 5 repeats entry 0"),
        ({"conversations": []}, r"entry 3: missing id"),
        ({"id": "8", "conversations": [{"from": "gpt", "value": "A"}]}, r"the first turn must be from 'human'"),
        ({"id": True, "conversations": []}, r"question_id must be a string or a non-negative integer"),
    ],
)
def test_scienceqa_reader_refuses_bad_entries_in_one_line(tmp_path, entry, message):
    with pytest.raises(PruneAuditError, match=message) as caught:
        scienceqa.load_scienceqa(write_json(tmp_path / "sqa.json", [*SQA_ENTRIES, entry]))
    assert "\n" not in str(caught.value)


def test_scienceqa_scores_an_answers_file(tmp_path):
    questions = scienceqa.load_scienceqa(write_json(tmp_path / "sqa.json", SQA_ENTRIES), images_only=False)
    answers = write_lines(
        tmp_path / "answers.jsonl",
        [
            {
                "question_id": "5",
                "prompt": "<image>\n...",
                "text": "B",
                "answer_id": "a",
                "model_id": "m",
                "metadata": {},
            },
            {"question_id": "6", "text": "The answer is C."},
            {"question_id": "7", "text": "E"},  # E parses but question 7 offers A-D: wrong
        ],
    )
    result = scienceqa.score_scienceqa_answers(answers, questions)
    assert (result["n"], result["correct"], result["accuracy"]) == (3, 2, pytest.approx(2 / 3))
    assert (result["img"]["n"], result["img"]["correct"], result["img"]["accuracy"]) == (2, 1, 0.5)
    assert [(row["parsed"], row["correct"]) for row in result["per_question"]] == [
        ("B", True),
        ("C", True),
        ("E", False),
    ]


@pytest.mark.skipif(not (LLAVA_EVAL / "llava_test_CQM-A.json").is_file(), reason=SHARED_ABSENT)
def test_llava_scienceqa_test_file_parses():
    everything = scienceqa.load_scienceqa(LLAVA_EVAL / "llava_test_CQM-A.json", images_only=False)
    images = [q for q in everything if q.image is not None]
    assert (len(everything), len(images)) == (4241, 2017)
    assert {len(q.options) for q in everything} == {2, 3, 4, 5} and all(q.answer in q.letters for q in everything)
    assert sum(q.context is not None for q in everything) == 2046


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
