"""lmms-eval's Parquet layouts of POPE, GQA, ScienceQA-IMG, TextVQA and RefCOCO (``prune_audit/data/lmms_parquet.py``):
each reads as the JSON question files do, bad rows and other files are refused in one line. Its writers build the files that
tests/test_task_parquet.py and tests/test_safety_tasks.py run over."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import write_json
from test_scienceqa import SQA_ENTRIES

from prune_audit.data import gqa, lmms_parquet, scienceqa, textvqa
from prune_audit.data.boxes import Box
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


def textvqa_columns(entries: list[dict], images: dict[str, bytes]) -> dict[str, tuple[pa.DataType, list]]:
    """lmms-lab/textvqa's columns (its dataset card's features, in order) for TextVQA question JSON ``entries``, each
    row embedding ``images[image_id]``."""
    texts, many = pa.string(), pa.list_(pa.string())
    return {
        "image_id": (texts, [e["image_id"] for e in entries]),
        "question_id": (pa.int32(), [e["question_id"] for e in entries]),
        "question": (texts, [e["question"] for e in entries]),
        "question_tokens": (many, [e["question"].split() for e in entries]),
        "image": (IMAGE_STRUCT, [image(images[e["image_id"]]) for e in entries]),
        "image_width": (pa.int32(), [e.get("image_width") for e in entries]),
        "image_height": (pa.int32(), [e.get("image_height") for e in entries]),
        "flickr_original_url": (texts, [""] * len(entries)),
        "flickr_300k_url": (texts, [""] * len(entries)),
        "answers": (many, [e.get("answers") for e in entries]),
        "image_classes": (many, [["Sign"]] * len(entries)),
        "set_name": (texts, ["val"] * len(entries)),
        "ocr_tokens": (many, [e.get("ocr_tokens") for e in entries]),
    }


TEXTVQA_ENTRIES = [
    {
        "question_id": 7,
        "image_id": "0054c91397f2fe05",
        "question": "what does the sign say?",
        "answers": ["stop"] * 10,
        "image_width": 64,
        "image_height": 48,
        "ocr_tokens": ["STOP", "sign"],
    },
    {
        "question_id": 8,
        "image_id": "00685bc495504d61",
        "question": "what brand is this?",
        "answers": ["coke"] * 6 + ["coca cola"] * 4,
        "image_width": 40,
        "image_height": 40,
        "ocr_tokens": [],
    },
]


def test_lmms_textvqa_parquet_reads_as_the_question_json(tmp_path):
    images = {"0054c91397f2fe05": b"jpeg-a", "00685bc495504d61": b"jpeg-b"}
    path = write_parquet(tmp_path / "validation-00000-of-00001.parquet", textvqa_columns(TEXTVQA_ENTRIES, images))
    reference = write_json(tmp_path / "TextVQA_0.5.1_val.json", {"data": TEXTVQA_ENTRIES})
    for ocr in (False, True):
        result = lmms_parquet.read_textvqa_parquet(path, ocr_reference=ocr)
        assert result.questions == textvqa.read_textvqa_json(reference, ocr_reference=ocr)
    assert result.questions[0].text == "What does the sign say?\nReference OCR token: STOP, sign"
    assert result.images == {"0054c91397f2fe05.jpg": b"jpeg-a", "00685bc495504d61.jpg": b"jpeg-b"}
    assert lmms_parquet.read_textvqa_parquet(path, images=False).images == {}
    test_split = [{**entry, "answers": [""] * 10} for entry in TEXTVQA_ENTRIES]  # Hugging Face's test rows
    unanswered = write_parquet(tmp_path / "test-00000-of-00001.parquet", textvqa_columns(test_split, images))
    assert [q.answers for q in lmms_parquet.read_textvqa_parquet(unanswered).questions] == [None, None]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e[1].update(answers=["coke"] * 9), r"row 1: answers must be a list of 10 strings.*fix the row"),
        (lambda e: e[1].update(question_id=7), r"row 1: question_id 7 repeats row 0"),
        (lambda e: e[1].update(question=""), r"row 1: question must be non-empty text"),
        (lambda e: e[1].update(image_width=0), r"row 1: image_width and image_height must be positive"),
        (lambda e: e[1].update(ocr_tokens=None), r"row 1: ocr_tokens must be a list of strings"),
    ],
)
def test_lmms_textvqa_parquet_refuses_bad_rows(tmp_path, change, message):
    entries = [dict(entry) for entry in TEXTVQA_ENTRIES]
    change(entries)
    images = {"0054c91397f2fe05": b"a", "00685bc495504d61": b"b"}
    path = write_parquet(tmp_path / "validation.parquet", textvqa_columns(entries, images))
    with pytest.raises(PruneAuditError, match=message) as caught:
        lmms_parquet.read_textvqa_parquet(path, ocr_reference=True)
    assert "\n" not in str(caught.value)
    columns = textvqa_columns(TEXTVQA_ENTRIES, images)
    columns.pop("answers")
    with pytest.raises(PruneAuditError, match=r"no column answers; expected the lmms-lab/textvqa layout"):
        lmms_parquet.read_textvqa_parquet(write_parquet(tmp_path / "other.parquet", columns))


def png(size: tuple[int, int], shade: int = 0) -> bytes:
    """A blank PNG of ``size`` = (width, height)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (shade, shade, shade)).save(buffer, format="PNG")
    return buffer.getvalue()


def refcoco_columns(rows: list[dict]) -> dict[str, tuple[pa.DataType, list]]:
    """lmms-lab/RefCOCO's columns (its dataset card's features, in order) for ``rows`` of question_id, image
    (bytes), answer (expressions), segmentation (one flat polygon), bbox and file_name."""
    floats = pa.list_(pa.float32())
    return {
        "question_id": (pa.string(), [row["question_id"] for row in rows]),
        "image": (IMAGE_STRUCT, [image(row["image"]) for row in rows]),
        "question": (pa.string(), ["Provide a short description for this region."] * len(rows)),
        "answer": (pa.list_(pa.string()), [row["answer"] for row in rows]),
        "segmentation": (floats, [row["segmentation"] for row in rows]),
        "bbox": (floats, [row["bbox"] for row in rows]),
        "iscrowd": (pa.int8(), [0] * len(rows)),
        "file_name": (pa.string(), [row["file_name"] for row in rows]),
    }


def refcoco_rows() -> list[dict]:
    picture = png((64, 48))
    name = "COCO_train2014_000000000009.jpg"
    return [
        {
            "question_id": "5",
            "image": picture,
            "answer": ["the cat", "cat on the left"],
            "segmentation": [10.0, 10.0, 50.0, 10.0, 50.0, 40.0, 10.0, 40.0],
            "bbox": [10.0, 10.0, 40.0, 30.0],
            "file_name": name,
        },
        {
            "question_id": "6",
            "image": picture,
            "answer": ["small dog"],
            "segmentation": [0.0, 0.0, 8.0, 0.0, 8.0, 8.0],
            "bbox": [0.0, 0.0, 8.0, 8.0],
            "file_name": name,
        },
    ]


def test_lmms_refcoco_parquet_reads_one_question_per_expression(tmp_path):
    val = write_parquet(tmp_path / "val-00000-of-00002.parquet", refcoco_columns(refcoco_rows()[:1]))
    val_next = write_parquet(tmp_path / "val-00001-of-00002.parquet", refcoco_columns(refcoco_rows()[1:]))
    test_a = write_parquet(tmp_path / "testA-00000-of-00001.parquet", refcoco_columns(refcoco_rows()[1:]))
    result = lmms_parquet.read_refcoco_parquet([val, val_next, test_a])
    assert [(q.split, q.question_id, q.ref_id, q.ann_id, q.text) for q in result.questions] == [
        ("val", 0, 0, 5, "the cat"),
        ("val", 1, 0, 5, "cat on the left"),
        ("val", 2, 1, 6, "small dog"),
        ("testA", 0, 0, 6, "small dog"),
    ]
    first = result.questions[0]
    assert (first.image, first.image_id, first.image_size) == ("COCO_train2014_000000000009.jpg", 9, (64, 48))
    assert first.box == Box(10, 10, 50, 40) and first.category == "referred object"
    assert first.segmentation == (10.0, 10.0, 50.0, 10.0, 50.0, 40.0, 10.0, 40.0)
    assert result.images == {"COCO_train2014_000000000009.jpg": png((64, 48))}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r[1].update(question_id="ann-6"), r"row 1: question_id must be digits"),
        (lambda r: r[1].update(answer=[]), r"row 1: answer must be a non-empty list of referring expressions"),
        (lambda r: r[1].update(bbox=[0.0, 0.0, -8.0, 8.0]), r"row 1: bbox must be \[x, y, width, height\]"),
        (lambda r: r[1].update(segmentation=[0.0, 0.0, 8.0]), r"row 1: segmentation has a polygon of 3 coordinates"),
        (lambda r: r[1].update(question_id="5"), r"row 1: object 5 repeats row 0"),
        (lambda r: r[1].update(image=b"not an image", file_name="x.jpg"), r"row 1: the embedded image cannot be"),
        (lambda r: r[1].update(image=png((8, 8), 9)), r"row 1 and .* row 0 both name image COCO_train2014_"),
    ],
)
def test_lmms_refcoco_parquet_refuses_bad_rows(tmp_path, change, message):
    rows = refcoco_rows()
    change(rows)
    with pytest.raises(PruneAuditError, match=message) as caught:
        lmms_parquet.read_refcoco_parquet(write_parquet(tmp_path / "val-00000-of-00001.parquet", refcoco_columns(rows)))
    assert "\n" not in str(caught.value)


def test_lmms_refcoco_parquet_refuses_other_files(tmp_path):
    with pytest.raises(PruneAuditError, match=r"refcoco.parquet: the split is the file name's prefix"):
        lmms_parquet.read_refcoco_parquet(write_parquet(tmp_path / "refcoco.parquet", refcoco_columns(refcoco_rows())))
    columns = refcoco_columns(refcoco_rows())
    columns.pop("segmentation")
    with pytest.raises(PruneAuditError, match=r"no column segmentation; expected the lmms-lab/RefCOCO layout"):
        lmms_parquet.read_refcoco_parquet(write_parquet(tmp_path / "val-00000-of-00001.parquet", columns))
