"""video_mc: MVBench and Video-MME readers on small files of each layout (JSON, and Video-MME's Parquet), the prompts
equal to lmms-eval's ``doc_to_text`` (75571cfe; written out here by hand from its code), letter scoring computed by
hand, and one-line refusals of malformed entries."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prune_audit.answer_modes import LetterChoice, OptionLetters
from prune_audit.errors import PruneAuditError
from prune_audit.tasks import get_task

MVBENCH = [
    {"video": "166583.webm", "question": "What is the action performed by the person in the video?",
     "candidates": ["Not sure", "Scattering something down", "Piling something up"],
     "answer": "Piling something up"},
    {"video": "clip_2.mp4", "question": "How many times?", "candidates": ["3", "5"], "answer": "3", "fps": 3},
]  # fmt: skip
VIDEOMME = [
    {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
     "videoID": "fFjv93ACGo8", "question_id": "001-1",
     "task_type": "Counting Problem", "question": "When demonstrating the Germany modern Christmas tree is "
     "initially decorated with apples, candles and berries, which kind of the decoration has the largest number?",
     "options": ["A. Apples.", "B. Candles.", "C. Berries.", "D. The three kinds are of the same number."],
     "answer": "C"},
    {"videoID": "abc", "question_id": "002-3", "question": "Who?", "options": ["A. Me.", "B. You."], "answer": "B"},
]  # fmt: skip


def _write(path, rows):
    path.write_text(json.dumps(rows))
    return path


def test_mvbench_reader_and_prompt_are_lmms_evals(tmp_path):
    task = get_task("video_mc")
    questions = task.read_questions([_write(tmp_path / "action_antonym.json", MVBENCH)])
    first, second = questions
    assert (first.split, first.question_id, first.image, first.answer, first.fps) == (
        "action_antonym", 0, "166583", "C", None,
    )  # fmt: skip
    assert (second.question_id, second.image, second.letters, second.fps) == (1, "clip_2", ("A", "B"), 3.0)
    nested = task.read_questions(
        [_write(tmp_path / "nested.json", [{**MVBENCH[0], "video": "star/Charades/6H78U.mp4"}])]
    )
    assert nested[0].image == "star/Charades/6H78U"  # the frame folder keeps the video's folders
    # mvbench_doc_to_text: "Question:" + question + "\nOption:\n" + "(X) option\n"... + post_prompt
    expected = (
        "Question:What is the action performed by the person in the video?\nOption:\n(A) Not sure\n"
        "(B) Scattering something down\n(C) Piling something up\nOnly give the best option.\n"
    )
    assert task.prompt_text(first) == expected
    assert task.answer_mode(first) == OptionLetters(("A", "B", "C"))
    assert task.clip_fps(first) == 2.0 and task.clip_fps(second) == 3.0  # the documented default, the entry's own


def test_videomme_reader_and_prompt_are_lmms_evals(tmp_path):
    task = get_task("video_mc")
    json_questions = task.read_questions([_write(tmp_path / "videomme.json", VIDEOMME)])
    parquet = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "duration": row.get("duration", "")} for row in VIDEOMME]), parquet)
    parquet_questions, embedded = task.load_questions([parquet])
    assert embedded is None and [q.question_id for q in parquet_questions] == [q.question_id for q in json_questions]
    first, second = json_questions
    assert (first.split, first.image, first.answer, first.letters) == ("short", "fFjv93ACGo8", "C", tuple("ABCD"))
    assert (second.split, second.image) == ("videomme", "abc")  # no duration: the layout's name
    # videomme_doc_to_text (default kwargs): option_prompt + "\n" + question + "\n" + options + "\n" + post_prompt
    expected = (
        "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
        "Respond with only the letter (A, B, C, or D) of the correct option.\n"
        "When demonstrating the Germany modern Christmas tree is initially decorated with apples, candles and "
        "berries, which kind of the decoration has the largest number?\n"
        "A. Apples.\nB. Candles.\nC. Berries.\nD. The three kinds are of the same number.\n"
        "\nAnswer with the option's letter from the given choices directly."
    )
    assert task.prompt_text(first) == expected
    assert task.prompt_text(first, {"video_mc": "Answer:"}).endswith("same number.\nAnswer:")  # a declared post_prompt


def test_scoring_is_the_letter_and_its_renormalised_probability(tmp_path):
    task = get_task("video_mc")
    question = task.read_questions([_write(tmp_path / "x.json", MVBENCH)])[0]
    choice = LetterChoice.from_probabilities((0.1, 0.2, 0.5), ("A", "B", "C"))
    scored = task.score(question, choice)
    assert scored.answer_text == "C" and scored.correct and scored.references == ("C",)
    assert scored.confidence == pytest.approx(0.5 / 0.8)
    assert scored.columns == {"letter_probs": [0.1, 0.2, 0.5], "options_offered": 3}
    wrong = task.score(question, LetterChoice.from_probabilities((0.3, 0.3, 0.1), ("A", "B", "C")))
    assert wrong.answer_text == "A" and not wrong.correct and wrong.confidence == pytest.approx(0.3 / 0.7)


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([{**MVBENCH[0], "answer": "Juggling"}], "none of the candidates"),
        ([{**MVBENCH[0], "candidates": ["one"], "answer": "one"}], "2 to 26 strings"),
        ([{**MVBENCH[0], "fps": -1}], "'fps' must be a positive number"),
        ([{**VIDEOMME[1], "answer": "C"}], "not one of the letters A, B"),
        ([{**VIDEOMME[1], "options": ["B. You.", "A. Me."]}], "'A. ...', 'B. ...' in order"),
        ([{"video": "x.mp4", "question": "q"}], "neither MVBench's 'candidates' nor Video-MME's 'options'"),
        ([VIDEOMME[1], VIDEOMME[1]], "repeats"),
        ({"not": "a list"}, "expected a JSON list"),
    ],
)
def test_malformed_files_are_refused_in_one_line(tmp_path, rows, needle):
    with pytest.raises(PruneAuditError, match=needle) as refusal:
        get_task("video_mc").read_questions([_write(tmp_path / "bad.json", rows)])
    assert "\n" not in str(refusal.value)


def test_video_mc_has_no_evidence_and_shares_scienceqas_columns(tmp_path):
    from prune_audit.records.schema import task_columns

    task = get_task("video_mc")
    with pytest.raises(PruneAuditError, match="drop --annotations"):
        task.load_evidence(tmp_path / "a.json", [])
    names = [column.name for column in task_columns("video_mc")]
    assert names[:2] == ["letter_probs", "options_offered"]
    assert "window" in names and "lost_in_window" in names and task.reads_clips
