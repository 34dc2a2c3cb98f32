"""lmms-eval's Parquet layouts of POPE, GQA and ScienceQA-IMG (``prune_audit/data/lmms_parquet.py``): each reads as
the JSON question files do, bad rows and other files are refused in one line. Its writers build the files that
tests/test_task_parquet.py and tests/test_safety_tasks.py run over."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import write_json
from test_scienceqa import SQA_ENTRIES

from prune_audit.data import gqa, lmms_parquet, scienceqa
from prune_audit.data.pope import PopeQuestion
from prune_audit.errors import PruneAuditError

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def write_parquet(path: Path, columns: dict[str, tuple[pa.DataType, list]]) -> Path:
    """A Parquet file with the given (type, values) columns, as ``datasets`` writes them."""
    pq.write_table(pa.table({name: pa.array(values, type=kind) for name, (kind, values) in columns.items()}), path)
    return path


def image(data: bytes, path: str | None = None) -> dict:
    return {"bytes": data, "path": path}


def pope_columns(**changes: list) -> dict[str, tuple[pa.DataType, list]]:
    columns = {
        "id": (pa.string(), ["0", "1", "2"]),
        "question_id": (pa.string(), ["1", "2", "1"]),
        "question": (
            pa.string(),
            ["Is there a snowboard in the image?", "Is there an apple in the imange?", "Is there a dog in the image?"],
        ),
        "answer": (pa.string(), ["yes", "no", "no"]),
        "image_source": (
            pa.string(),
            ["COCO_val2014_000000310196", "COCO_val2014_000000310196", "COCO_val2014_000000000042"],
        ),
        "image": (IMAGE_STRUCT, [image(b"jpeg-a"), image(b"jpeg-a"), image(b"jpeg-b", "x.jpg")]),
        "category": (pa.string(), ["adversarial", "adversarial", "random"]),
    }
    for name, values in changes.items():
        columns[name] = (columns[name][0], values)
    return columns


def test_lmms_pope_parquet_reads_as_pope_questions(tmp_path):
    result = lmms_parquet.read_pope_parquet([write_parquet(tmp_path / "test-00000-of-00001.parquet", pope_columns())])
    first = result.questions[0]
    assert isinstance(first, PopeQuestion) and (first.question_id, first.split, first.label) == (
        1,
        "adversarial",
        "yes",
    )
    assert (first.image, first.object, first.image_id) == ("COCO_val2014_000000310196.jpg", "snowboard", 310196)
    assert result.questions[1].object == "apple" and result.questions[2].split == "random"
    assert result.images == {"COCO_val2014_000000310196.jpg": b"jpeg-a", "COCO_val2014_000000000042.jpg": b"jpeg-b"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"answer": ["yes", "maybe", "no"]}, r"row 1: answer must be 'yes' or 'no', got 'maybe'"),
        ({"question_id": ["1", "x", "1"]}, r"row 1: question_id must be digits"),
        (
            {"question": ["Is there a dog in the image?", "What is it?", "Is there a dog in the image?"]},
            r"row 1: not a POPE question: 'What is it\?'",
        ),
        ({"image": [image(b"a"), image(None, "a.jpg"), image(b"b")]}, r"row 1: image has no embedded bytes"),
        ({"question_id": ["1", "1", "1"], "category": ["random"] * 3}, r"question_id 1 of split random repeats"),
    ],
)
def test_lmms_pope_parquet_refuses_bad_rows(tmp_path, changes, message):
    path = write_parquet(tmp_path / "pope.parquet", pope_columns(**changes))
    with pytest.raises(PruneAuditError, match=message) as caught:
        lmms_parquet.read_pope_parquet(path)
    assert "\n" not in str(caught.value)


def test_lmms_parquet_refuses_other_files(tmp_path):
    columns = pope_columns()
    columns.pop("image_source")
    with pytest.raises(
        PruneAuditError, match=r"pope.parquet: no column image_source; expected the lmms-lab/POPE layout"
    ):
        lmms_parquet.read_pope_parquet(write_parquet(tmp_path / "pope.parquet", columns))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(PruneAuditError, match=r"text.parquet: not a readable Parquet file"):
        lmms_parquet.read_pope_parquet(tmp_path / "text.parquet")


GQA_TYPES = pa.struct([("structural", pa.string()), ("semantic", pa.string()), ("detailed", pa.string())])


def gqa_instruction_columns(annotations: list | None = None) -> dict[str, tuple[pa.DataType, list]]:
    columns = {
        "id": (pa.string(), ["201", "203"]),
        "imageId": (pa.string(), ["n1", "n2"]),
        "question": (pa.string(), ["What is on the table?", "What color is the car?"]),
        "answer": (pa.string(), ["laptop", "white"]),
        "fullAnswer": (pa.string(), ["The laptop is on the table.", "The car is white."]),
        "isBalanced": (pa.bool_(), [True, True]),
        "types": (GQA_TYPES, [{"structural": "query", "semantic": "rel", "detailed": "relS"}] * 2),
    }
    if annotations is not None:
        kind = pa.struct([(field, pa.map_(pa.string(), pa.string())) for field in gqa.ANNOTATION_FIELDS])
        columns["annotations"] = (kind, annotations)
    return columns


def test_lmms_gqa_parquet_joins_instructions_and_images(tmp_path):
    annotations = [
        {"question": [("4", "10")], "answer": [("0", "11")], "fullAnswer": [("1", "11")]},
        {"question": [], "answer": [], "fullAnswer": []},
    ]
    instructions = write_parquet(tmp_path / "testdev-instructions.parquet", gqa_instruction_columns(annotations))
    images = write_parquet(
        tmp_path / "testdev-images.parquet",
        {"id": (pa.string(), ["n1", "n2", "n3"]), "image": (IMAGE_STRUCT, [image(b"1"), image(b"2"), image(b"3")])},
    )
    result = lmms_parquet.read_gqa_parquet(instructions, images)
    first, second = result.questions
    assert (first.question_id, first.image, first.answer) == ("201", "n1.jpg", "laptop")
    assert first.evidence_object_ids == ("10", "11")
    assert first.text == "What is on the table?" and second.evidence_object_ids == ()  # the task adds the instruction
    assert result.images == {"n1.jpg": b"1", "n2.jpg": b"2"}
    plain = write_parquet(tmp_path / "plain.parquet", gqa_instruction_columns())  # no annotations column
    assert lmms_parquet.read_gqa_parquet(plain, images).questions[0].evidence_object_ids == ()
    only_n1 = write_parquet(
        tmp_path / "n1.parquet", {"id": (pa.string(), ["n1"]), "image": (IMAGE_STRUCT, [image(b"1")])}
    )
    with pytest.raises(PruneAuditError, match=r"plain.parquet: row 1: image n2 is not in the images files"):
        lmms_parquet.read_gqa_parquet(plain, only_n1)


def scienceqa_columns(**changes: list) -> dict[str, tuple[pa.DataType, list]]:
    columns = {
        "image": (IMAGE_STRUCT, [image(b"png-0", "0.png"), None, image(b"png-2")]),
        "question": (pa.string(), ["Which eats grass?", "Which word fits?", "What is shown?"]),
        "choices": (pa.list_(pa.string()), [["fox", "rabbit"], ["hi", "bye", "ok"], ["a map", "a cell"]]),
        "answer": (pa.int8(), [1, 2, 0]),
        "hint": (pa.string(), ["A food web.\nArrows show matter.", "", ""]),
        "task": (pa.string(), ["closed choice"] * 3),
        "grade": (pa.string(), ["grade4"] * 3),
        "subject": (pa.string(), ["natural science"] * 3),
        "topic": (pa.string(), ["biology"] * 3),
        "category": (pa.string(), ["Ecosystems"] * 3),
        "skill": (pa.string(), ["food webs"] * 3),
        "lecture": (pa.string(), [""] * 3),
        "solution": (pa.string(), [""] * 3),
    }
    for name, values in changes.items():
        columns[name] = (columns[name][0], values)
    return columns


def test_lmms_scienceqa_parquet_reads_like_llavas_file(tmp_path):
    path = write_parquet(tmp_path / "test-00000-of-00001.parquet", scienceqa_columns())
    result = lmms_parquet.read_scienceqa_parquet(path)
    assert [q.question_id for q in result.questions] == ["0", "2"] and set(result.images) == {"0.png", "2.png"}
    first = result.questions[0]
    llava = scienceqa.load_scienceqa(write_json(tmp_path / "sqa.json", SQA_ENTRIES[:1]))[0]
    assert (first.text, first.question, first.context, first.options, first.answer) == (
        llava.text,
        llava.question,
        llava.context,
        llava.options,
        llava.answer,
    )
    every = lmms_parquet.read_scienceqa_parquet(path, images_only=False).questions
    assert every[1].image is None and every[1].context is None and every[1].answer == "C"
    assert every[1].text == "Which word fits?\nA. hi\nB. bye\nC. ok"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"answer": [1, 3, 0]}, r"row 1: answer must be a choice index from 0 to 2, got 3"),
        ({"choices": [["fox", "rabbit"], ["only"], ["a", "b"]]}, r"row 1: choices must be a list of 2 to 5 texts"),
        ({"question": ["Which eats grass?", None, "What?"]}, r"row 1: question must be non-empty text"),
        ({"image": [image(b"x"), image(None, "1.png"), None]}, r"row 1: image has no embedded bytes"),
    ],
)
def test_lmms_scienceqa_parquet_refuses_bad_rows(tmp_path, changes, message):
    with pytest.raises(PruneAuditError, match=message):
        lmms_parquet.read_scienceqa_parquet(write_parquet(tmp_path / "sqa.parquet", scienceqa_columns(**changes)))
