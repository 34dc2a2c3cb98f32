"""The Parquet files of the lmms-eval datasets: questions plus embedded image bytes.

Layouts (Hugging Face ``datasets`` features, as the dataset cards declare them; an ``image`` column
is a struct ``{bytes: binary, path: string}``):

- ``lmms-lab/POPE`` (``data/test-*.parquet``): ``id``, ``question_id``, ``question``, ``answer``
  (yes/no), ``image_source`` (``COCO_val2014_...``), ``image``, ``category`` (the split).
- ``lmms-lab/GQA``: questions in ``testdev_balanced_instructions`` (``id``, ``imageId``,
  ``question``, ``answer``, ``fullAnswer``, ``isBalanced``, ... and, when present, ``annotations``)
  and images in ``testdev_balanced_images`` (``id`` = imageId, ``image``), joined on ``imageId`` as
  lmms-eval's ``gqa_doc_to_visual`` does.
- ``lmms-lab/ScienceQA`` (``ScienceQA-IMG/test-*.parquet``): ``image`` (null without one),
  ``question``, ``choices`` (list of text), ``answer`` (index, int8), ``hint``, ``task``, ``grade``,
  ``subject``, ``topic``, ``category``, ``skill``, ``lecture``, ``solution``. It has no problem id:
  a question's id is its row number (over the files in the order given). The prompt is built as
  lmms-eval's ``sqa_doc_to_text`` (= LLaVA's file): ``Context: <hint>\\n`` when there is a hint,
  the question, then ``X. choice`` lines.
- ``lmms-lab/textvqa`` (``data/{train,validation,test}-*.parquet``): ``image_id``, ``question_id`` (int32),
  ``question``, ``question_tokens``, ``image``, ``image_width``, ``image_height``, ``flickr_original_url``,
  ``flickr_300k_url``, ``answers`` (10 texts), ``image_classes``, ``set_name``, ``ocr_tokens`` (the Rosetta tokens'
  words, no boxes): the fields of TextVQA's question JSON, read as that file's entries are
  (``data.textvqa.question_entry``); the image is named ``<image_id>.jpg``.
- ``lmms-lab/RefCOCO``, ``RefCOCOplus``, ``RefCOCOg`` (``data/<split>-NNNNN-of-NNNNN.parquet``): one row per referred
  object: ``question_id`` (text: the object's COCO annotation id, which lmms-eval's ``refcoco_bbox_rec`` reports as
  ``ann_id``), ``image``, ``question`` (the captioning tasks' fixed prompt, unused here), ``answer`` (the object's
  referring expressions), ``segmentation`` (one polygon, flat x, y pairs), ``bbox`` (COCO ``[x, y, w, h]``, float32,
  in pixels of the row's image: lmms-eval's ``refcoco_bbox_rec_preprocess_dataset`` divides it by that image's
  size), ``iscrowd``, ``file_name`` (``COCO_train2014_<id>.jpg``). The split is the file name's prefix.

Every reader returns the same question dataclasses as the JSON readers, plus the image bytes by
image name; every check names the file, the row and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from prune_audit.data.coco import CocoImage, check_segmentation, image_id_from_file_name
from prune_audit.data.files import stable_image_id
from prune_audit.data.gqa import ANNOTATION_FIELDS, GqaQuestion, question_id_digits, reference_text
from prune_audit.data.pope import LABELS, PopeQuestion, parse_object
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.data.refcoco import SPLITS, RefQuestion, target_box
from prune_audit.data.scienceqa import LETTERS, ScienceQaQuestion, parse_prompt
from prune_audit.data.textvqa import TextVqaQuestion, question_entry
from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits
from prune_audit.safety.inputs import check_image_name, check_input_file, loads_json

Question = TypeVar("Question")
Paths = str | Path | Sequence[str | Path]
POPE_COLUMNS = ("question_id", "question", "answer", "image_source", "image", "category")
GQA_COLUMNS = ("id", "imageId", "question", "answer")
GQA_IMAGE_COLUMNS = ("id", "image")
SCIENCEQA_COLUMNS = ("image", "question", "choices", "answer", "hint")
TEXTVQA_COLUMNS = ("image_id", "question_id", "question", "answers", "image")
REFCOCO_COLUMNS = ("question_id", "image", "answer", "segmentation", "bbox", "file_name")
REFERRED_OBJECT = "referred object"
"""The name of a RefCOCO row's object: the layout carries no category."""


@dataclass(frozen=True)
class ParquetQuestions(Generic[Question]):
    """Questions read from Parquet and the embedded images they name (``question.image`` -> bytes)."""

    questions: list[Question]
    images: dict[str, bytes]


def _paths(paths: Paths) -> list[Path]:
    listed = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not listed:
        raise PruneAuditError("no Parquet files given")
    resolved = [path.resolve() for path in listed]
    repeated = next((path for n, path in enumerate(listed) if resolved[n] in resolved[:n]), None)
    if repeated is not None:  # lmms-lab/ScienceQA's ids are row numbers: its rows would be asked twice, unnoticed
        raise PruneAuditError(f"{repeated} is given twice; pass each Parquet file once")
    return listed


def column_names(path: Path, layout: str) -> list[str]:
    """The column names of the Parquet file ``path``; a file that is not Parquet is one line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_input_file(path, "Parquet file", f"pass the {layout} files")
    try:
        return list(pq.read_schema(path).names)
    except (OSError, pa.ArrowException) as error:
        raise PruneAuditError(f"{path}: not a readable Parquet file ({error}); pass the {layout} files") from None


def read_rows(path: Path, columns: Sequence[str], layout: str, skip: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The rows of ``path`` as dicts, without the columns ``skip`` (not read at all: scoring needs no image bytes);
    a file that is not Parquet or lacks a column of ``columns`` is one line naming it."""
    import pyarrow.parquet as pq

    names = column_names(path, layout)
    missing = [column for column in columns if column not in names]
    if missing:
        raise PruneAuditError(
            f"{path}: no column {', '.join(missing)}; expected the {layout} layout ({', '.join(columns)})"
        )
    return pq.read_table(path, columns=[name for name in names if name not in skip]).to_pylist()


def _text(row: dict[str, Any], column: str, where: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise PruneAuditError(f"{where}: {column} must be non-empty text, got {value!r}; fix the row")
    return value


def _image_bytes(value: Any, where: str) -> bytes:
    """The bytes of an ``{bytes, path}`` image struct; a path without bytes cannot be opened here."""
    data = value.get("bytes") if isinstance(value, dict) else None
    if not isinstance(data, bytes) or not data:
        raise PruneAuditError(
            f"{where}: image has no embedded bytes (got {type(value).__name__}); use the dataset's Parquet files, "
            f"which embed each image"
        )
    return data


def _read(
    paths: Paths,
    columns: Sequence[str],
    layout: str,
    convert: Callable[[dict[str, Any], str, int], tuple[Question, bytes | None]],
    skip: Sequence[str] = (),
    key: Callable[[Question], tuple[Hashable, str]] | None = None,
) -> ParquetQuestions[Question]:
    """The questions of the rows of ``paths`` (``convert``ed) and the images they embed; ``key`` gives a question's
    key and name where the layout has question ids (each may appear once over the files: ``note_question``)."""
    questions: list[Question] = []
    images: dict[str, bytes] = {}
    first_rows: dict[str, str] = {}
    seen: QuestionPlaces = {}
    for path in _paths(paths):
        for number, row in enumerate(read_rows(path, columns, layout, skip)):
            where = f"{path}: row {number}"
            question, data = convert(row, where, len(questions))
            if key is not None:
                question_key, name = key(question)
                note_question(question_key, QuestionPlace(path, "row", number, name), seen)
            questions.append(question)
            if data is not None:
                _add_image(images, first_rows, question.image, data, where)  # type: ignore[attr-defined]
    if not questions:
        raise PruneAuditError(f"no rows in {', '.join(str(p) for p in _paths(paths))}")
    return ParquetQuestions(questions, images)


def _add_image(images: dict[str, bytes], first_rows: dict[str, str], name: str, data: bytes, where: str) -> None:
    """Keep the bytes row ``where`` embeds for image ``name``; rows naming one image must embed the same bytes, since
    the run writes and pins one file per name (a second picture would be dropped without a word)."""
    if name not in images:
        images[name], first_rows[name] = data, where
    elif images[name] != data:
        raise PruneAuditError(
            f"{where} and {first_rows[name]} both name image {name} but embed different images; "
            f"give each image its own image name (image_source, file_name) or fix the rows"
        )


def _pope_row(row: dict[str, Any], where: str, _index: int) -> tuple[PopeQuestion, bytes | None]:
    question_id = row.get("question_id")
    text = str(question_id) if isinstance(question_id, (str, int)) and not isinstance(question_id, bool) else ""
    if not is_digits(text):
        raise PruneAuditError(f"{where}: question_id must be digits, got {question_id!r}; fix the row")
    answer = _text(row, "answer", where)
    if answer not in LABELS:
        raise PruneAuditError(f"{where}: answer must be 'yes' or 'no', got {answer!r}")
    question = _text(row, "question", where)
    try:
        obj = parse_object(question)
    except PruneAuditError as error:
        raise PruneAuditError(f"{where}: {error}") from None
    source = _text(row, "image_source", where)
    split = _text(row, "category", where)
    image = source if Path(source).suffix else f"{source}.jpg"
    pope = PopeQuestion(
        question_id=int(text), split=split, image=image, text=question, label=answer, object=obj, category=split
    )
    return pope, _image_bytes(row["image"], where) if "image" in row else None


def read_pope_parquet(paths: Paths, images: bool = True) -> ParquetQuestions[PopeQuestion]:
    """lmms-lab/POPE's Parquet files (one or several shards) as POPE questions with their images (none read when
    not ``images``: scoring released answers).

    The image is named ``<image_source>.jpg``; the split is ``category``; a (split, question_id)
    pair must be unique, as in the JSON files.
    """
    return _read(
        paths,
        POPE_COLUMNS,
        "lmms-lab/POPE",
        _pope_row,
        skip=() if images else ("image",),
        key=lambda q: ((q.split, q.question_id), f"question_id {q.question_id} of split {q.split}"),
    )


def _annotation_spans(value: Any) -> list[str]:
    """Object ids of one annotations field: a map (pairs), a struct (dict) or JSON text of span -> id."""
    if isinstance(value, str):
        value = loads_json(value, "annotations") if value.strip() else {}
    if isinstance(value, dict):
        return [v for v in value.values() if v is not None]
    if isinstance(value, list):
        return [pair[1] for pair in value]
    return []


def _gqa_evidence(row: dict[str, Any], where: str) -> tuple[str, ...]:
    annotations = row.get("annotations") or {}
    try:
        ids = [str(i) for field in ANNOTATION_FIELDS for i in _annotation_spans(annotations.get(field))]
    except (AttributeError, ValueError, IndexError, TypeError):
        raise PruneAuditError(f"{where}: annotations must map word spans to object ids; fix the row") from None
    return tuple(dict.fromkeys(ids))


def read_gqa_parquet(instructions: Paths, images: Paths) -> ParquetQuestions[GqaQuestion]:
    """lmms-lab/GQA's ``*_instructions`` and ``*_images`` Parquet files joined on ``imageId``.

    Each question's text is the row's question (the GQA task adds the short-answer instruction); each
    question's image must be among ``images``.
    """
    pictures: dict[str, bytes] = {}
    for path in _paths(images):
        for number, row in enumerate(read_rows(path, GQA_IMAGE_COLUMNS, "lmms-lab/GQA *_images")):
            where = f"{path}: row {number}"
            image_id = _text(row, "id", where)
            if image_id in pictures:
                raise PruneAuditError(f"{where}: image {image_id} repeats; pass each image file once")
            pictures[image_id] = _image_bytes(row.get("image"), where)

    def convert(row: dict[str, Any], where: str, _index: int) -> tuple[GqaQuestion, bytes]:
        question, image_id = _gqa_row(row, where)
        if image_id not in pictures:
            raise PruneAuditError(
                f"{where}: image {image_id} is not in the images files; pass the matching *_images split"
            )
        return question, pictures[image_id]

    return _read(instructions, GQA_COLUMNS, "lmms-lab/GQA *_instructions", convert, key=_gqa_key)


def _gqa_row(row: dict[str, Any], where: str) -> tuple[GqaQuestion, str]:
    """One ``*_instructions`` row as a question (its text the row's question) and its ``imageId``."""
    question_id, image_id = question_id_digits(_text(row, "id", where), where), _text(row, "imageId", where)
    text = _text(row, "question", where)
    question = GqaQuestion(
        question_id=question_id,
        image=f"{image_id}.jpg",
        text=text,
        question=text,
        answer=reference_text(row.get("answer"), where, "answer"),
        full_answer=reference_text(row.get("fullAnswer"), where, "fullAnswer"),
        evidence_object_ids=_gqa_evidence(row, where),
    )
    return question, image_id


def _gqa_key(question: GqaQuestion) -> tuple[str, str]:
    """A GQA question's key over the ``*_instructions`` files, and its name in messages."""
    return question.question_id, f"question {question.question_id}"


def _split_gqa_files(paths: Paths) -> tuple[list[Path], list[Path]]:
    """The ``*_instructions`` files among lmms-lab/GQA's files (those with an ``imageId`` column) and the
    ``*_images`` files (every other one)."""
    instructions, images = [], []
    for path in _paths(paths):
        (instructions if "imageId" in column_names(path, "lmms-lab/GQA") else images).append(path)
    return instructions, images


def read_gqa_parquet_questions(paths: Paths) -> list[GqaQuestion]:
    """The questions and answers of lmms-lab/GQA's ``*_instructions`` files among ``paths`` (``*_images`` files are
    not read: scoring released answers needs no image)."""
    instructions, _ = _split_gqa_files(paths)
    if not instructions:
        raise PruneAuditError(
            "no lmms-lab/GQA *_instructions (questions) Parquet file among the question files; "
            "pass the *_instructions file of the split"
        )

    def convert(row: dict[str, Any], where: str, _index: int) -> tuple[GqaQuestion, None]:
        return _gqa_row(row, where)[0], None

    return _read(instructions, GQA_COLUMNS, "lmms-lab/GQA *_instructions", convert, key=_gqa_key).questions


def read_gqa_parquet_files(paths: Paths) -> ParquetQuestions[GqaQuestion]:
    """lmms-lab/GQA's files given together, in any order: each file with an ``imageId`` column is an
    ``*_instructions`` file, every other one an ``*_images`` file (``read_gqa_parquet`` joins them)."""
    instructions, images = _split_gqa_files(paths)
    if not instructions or not images:
        missing = "*_instructions (questions)" if not instructions else "*_images"
        raise PruneAuditError(
            f"no lmms-lab/GQA {missing} Parquet file among the question files; pass both the "
            f"*_instructions and the *_images files of the split"
        )
    return read_gqa_parquet(instructions, images)


def _scienceqa_row(row: dict[str, Any], where: str, index: int) -> tuple[ScienceQaQuestion, bytes | None]:
    choices = row.get("choices")
    if (
        not isinstance(choices, list)
        or not 2 <= len(choices) <= len(LETTERS)
        or not all(isinstance(c, str) for c in choices)
    ):
        raise PruneAuditError(f"{where}: choices must be a list of 2 to {len(LETTERS)} texts, got {choices!r}")
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise PruneAuditError(f"{where}: answer must be a choice index from 0 to {len(choices) - 1}, got {answer!r}")
    hint = row.get("hint")
    if hint is not None and not isinstance(hint, str):
        raise PruneAuditError(f"{where}: hint must be text, got {hint!r}")
    question = _text(row, "question", where)
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices))
    value = f"{f'Context: {hint}' + chr(10) if hint else ''}{question}\n{options}"
    text, parsed_question, context, parsed_options = parse_prompt(value, where)
    data = None if row.get("image") is None else _image_bytes(row["image"], where)
    return ScienceQaQuestion(
        question_id=str(index),
        image=None if data is None else f"{index}.png",
        text=text,
        question=parsed_question,
        context=context,
        options=parsed_options,
        answer=LETTERS[answer],
    ), data


def read_scienceqa_parquet(paths: Paths, images_only: bool = True) -> ParquetQuestions[ScienceQaQuestion]:
    """lmms-lab/ScienceQA's Parquet files; ``images_only`` keeps the rows with an image (ScienceQA-IMG).

    Question ids are row numbers over the files in order (the layout has no problem id), so ids
    are stable only for the same files in the same order; images are named ``<id>.png``.
    """
    result = _read(paths, SCIENCEQA_COLUMNS, "lmms-lab/ScienceQA", _scienceqa_row)
    if images_only:
        kept = [question for question in result.questions if question.image is not None]
        if not kept:
            raise PruneAuditError("no ScienceQA rows with an image; pass ScienceQA-IMG files or keep every row")
        return ParquetQuestions(kept, result.images)
    return result


def read_textvqa_parquet(
    paths: Paths, ocr_reference: bool = False, images: bool = True
) -> ParquetQuestions[TextVqaQuestion]:
    """lmms-lab/textvqa's Parquet files as TextVQA questions with their images (none read when not ``images``:
    scoring released answers); ``ocr_reference`` asks each row's ``ocr_tokens`` line (lmms-eval's ``ocr: true``).

    A row is read as an entry of TextVQA's question JSON (``data.textvqa.question_entry``); ``question_id`` may
    appear once over the files. The rows carry the OCR tokens' words but not their boxes.
    """

    def convert(row: dict[str, Any], where: str, _index: int) -> tuple[TextVqaQuestion, bytes | None]:
        question = question_entry(row, where, ocr_reference, "fix the row")
        return question, _image_bytes(row["image"], where) if "image" in row else None

    return _read(
        paths,
        TEXTVQA_COLUMNS,
        "lmms-lab/textvqa",
        convert,
        skip=() if images else ("image",),
        key=lambda q: (q.question_id, f"question_id {q.question_id}"),
    )


def _refcoco_split(path: Path) -> str:
    """The split of one lmms-lab RefCOCO file: its name's prefix, as the dataset names them (``val-00000-of-...``)."""
    split = path.name.split("-", 1)[0]
    if split not in SPLITS:
        raise PruneAuditError(
            f"{path}: the split is the file name's prefix (<split>-00000-of-00001.parquet, split one of "
            f"{', '.join(SPLITS)}); keep lmms-lab's RefCOCO file names"
        )
    return split


def _image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) of embedded image bytes, read from their header."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise PruneAuditError(f"{where}: the embedded image cannot be decoded ({error}); fix the row") from None


def _expressions(row: dict[str, Any], where: str) -> list[str]:
    expressions = row.get("answer")
    if (
        not isinstance(expressions, list)
        or not expressions
        or not all(isinstance(text, str) and text.strip() for text in expressions)
    ):
        raise PruneAuditError(
            f"{where}: answer must be a non-empty list of referring expressions (texts), got {expressions!r}; "
            f"fix the row"
        )
    return [text.strip() for text in expressions]


def _polygon(row: dict[str, Any], image: CocoImage, where: str) -> tuple[float, ...] | None:
    """The row's polygon (flat x, y pixel pairs), checked as a COCO polygon on ``image``; None when empty."""
    segmentation = row.get("segmentation")
    if not segmentation:
        return None
    if not isinstance(segmentation, list):
        raise PruneAuditError(
            f"{where}: segmentation must be a list of x, y numbers, got {segmentation!r}; fix the row"
        )
    check_segmentation([segmentation], image, f"{where}: segmentation")
    return tuple(float(value) for value in segmentation)


@dataclass(frozen=True)
class _RefRow:
    """Where one lmms-lab RefCOCO row sits: its file's split, its number among the split's rows and the number of
    expressions the split's earlier rows hold (its first question id), and its image (name, bytes, size)."""

    split: str
    ref_number: int
    first_id: int
    image: CocoImage


def _refcoco_row(row: dict[str, Any], where: str, at: _RefRow) -> list[RefQuestion]:
    """One row as one question per referring expression (as lmms-eval explodes it)."""
    ann_id = row.get("question_id")
    text = str(ann_id) if isinstance(ann_id, (str, int)) and not isinstance(ann_id, bool) else ""
    if not is_digits(text):
        raise PruneAuditError(
            f"{where}: question_id must be digits (the referred object's COCO annotation id), got {ann_id!r}; "
            f"fix the row"
        )
    box = target_box(row, where, "fix the row")
    polygon = _polygon(row, at.image, where)
    return [
        RefQuestion(
            question_id=at.first_id + number,
            split=at.split,
            image=at.image.file_name,
            text=expression,
            ref_id=at.ref_number,
            ann_id=int(text),
            image_id=at.image.id,
            category=REFERRED_OBJECT,
            box=box,
            image_size=at.image.size,
            segmentation=polygon,
        )
        for number, expression in enumerate(_expressions(row, where))
    ]


def _refcoco_image(row: dict[str, Any], where: str, sizes: dict[str, tuple[int, int]]) -> tuple[CocoImage, bytes]:
    """The row's image: its ``file_name``, COCO id (from the name), embedded bytes and size (``sizes`` caches it)."""
    name = check_image_name(_text(row, "file_name", where), where)
    data = _image_bytes(row.get("image"), where)
    if name not in sizes:
        sizes[name] = _image_size(data, where)
    image_id = image_id_from_file_name(name)
    return CocoImage(stable_image_id(Path(name).stem) if image_id is None else image_id, name, *sizes[name]), data


def read_refcoco_parquet(paths: Paths) -> ParquetQuestions[RefQuestion]:
    """lmms-lab's RefCOCO / RefCOCO+ / RefCOCOg Parquet files as one question per referring expression, with the
    images they embed.

    A question's id is its number among its split's expressions over the files in the order given (lmms-eval's
    document index of the exploded split when its shards are given in order); ``ref_id`` is the row's number
    among its split's rows (the layout has no ref id); ``ann_id`` is the row's ``question_id``; the target box is
    the row's ``bbox`` and the evidence its ``segmentation``; the image size is the embedded image's own.
    """
    questions: list[RefQuestion] = []
    images: dict[str, bytes] = {}
    first_rows: dict[str, str] = {}
    sizes: dict[str, tuple[int, int]] = {}
    counts: dict[str, tuple[int, int]] = {}  # split -> (rows, expressions) read so far
    seen: QuestionPlaces = {}
    for path in _paths(paths):
        split = _refcoco_split(path)
        for number, row in enumerate(read_rows(path, REFCOCO_COLUMNS, "lmms-lab/RefCOCO")):
            where = f"{path}: row {number}"
            image, data = _refcoco_image(row, where, sizes)
            rows, asked = counts.get(split, (0, 0))
            found = _refcoco_row(row, where, _RefRow(split, rows, asked, image))
            note_question(
                (split, found[0].ann_id), QuestionPlace(path, "row", number, f"object {found[0].ann_id}"), seen
            )
            _add_image(images, first_rows, image.file_name, data, where)
            counts[split] = (rows + 1, asked + len(found))
            questions.extend(found)
    if not questions:
        raise PruneAuditError(f"no rows in {', '.join(str(p) for p in _paths(paths))}")
    return ParquetQuestions(questions, images)
