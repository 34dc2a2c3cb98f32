"""TextVQA questions, Rosetta OCR boxes and the official VQA accuracy.

Formats (checked against the public files):

- TextVQA's question JSON (``TextVQA_0.5.1_val.json``, dl.fbaipublicfiles.com/textvqa): ``{"data": [{question_id
  (int), image_id (hex string; the image is ``<image_id>.jpg``), question (lower case), answers (10 strings; absent
  in the test split), image_width, image_height, ...}]}``; lmms-eval's rows (lmms-lab/textvqa) add ``ocr_tokens``.
- LLaVA-1.5's ``llava_textvqa_val_v051_ocr.jsonl`` (haotian-liu/LLaVA commit 32cebc3, playground/data/eval/textvqa):
  ``question_id`` is the *image* id (two questions on one image share it), ``image``, ``text`` = the question
  (capitalised), ``"\\nReference OCR token: "`` + the image's OCR tokens joined by ``", "``, then
  ``"\\nAnswer the question using a single word or phrase."``. It carries no answers: LLaVA's
  ``llava/eval/eval_textvqa.py`` finds each line's annotation by (image id, question in lower case), as
  :func:`load_textvqa` does.
- Rosetta OCR (``TextVQA_Rosetta_OCR_v0.2_val.json``): ``{"data": [{image_id, ocr_tokens, ocr_info: [{word,
  bounding_box: {top_left_x, top_left_y, width, height, rotation, ...}}]}]}``, boxes as fractions of the image's
  width and height (MMF's TextVQA readers scale them so); a few boxes reach past the image edge and are clipped.

Scoring re-implements the official VQA accuracy as LLaVA's ``llava/eval/m4c_evaluator.py`` (copied there from MMF
commit c46b3b3, ``EvalAIAnswerProcessor`` and ``TextVQAAccuracyEvaluator``) and lmms-eval's
``textvqa_process_results`` (EvolvingLMMs-Lab/lmms-eval commit 03b2f7c) compute it: prediction and the 10 human
answers are normalised (:func:`normalize_answer`, the reference's quirks kept: the punctuation test reads the text
before any replacement, at most 32 periods go, "somebody'd" maps to "somebodyd"), and the score is
``min(#matching annotators / 3, 1)`` averaged over the 10 leave-one-out subsets of 9 annotators
(:func:`vqa_accuracy`). Checked against that evaluator: equal normalisations of 20,000 random strings, equal
scores of 3,000 random answer sets.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.data.answers import load_llava_answers, match_answers
from prune_audit.data.coco import read_json
from prune_audit.data.files import file_sha256, read_json_lines
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import check_image_name

ANNOTATORS = 10
"""Human answers per TextVQA question; the official evaluator refuses any other count."""
OCR_REFERENCE = "Reference OCR token: "
"""The line LLaVA-1.5's question file (and lmms-eval's ``ocr: true``) puts between question and instruction."""
QUESTIONS_FIX = "pass TextVQA's question JSON (TextVQA_0.5.1_val.json) with --questions"
OCR_FIX = "pass TextVQA's Rosetta OCR file (TextVQA_Rosetta_OCR_v0.2_val.json) with --annotations"

# ----- the official answer normalisation (EvalAI / VQA eval), re-implemented --------------------------------------

_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6"}
_NUMBERS |= {"seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = frozenset({"a", "an", "the"})
_PUNCTUATION = ';/[]"{}()=+\\_-><@`,?!'
"""The characters the official processor removes or turns into spaces ('.' and "'" are handled apart)."""
_PERIOD = re.compile(r"\.(?!\d)")
_PERIOD_LIMIT = 32
"""The official ``PERIOD_STRIP.sub("", text, re.UNICODE)`` passes re.UNICODE (32) as the count: at most 32 periods go."""
_CONTRACTED = (
    "ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't haven't he'd "
    "he'd've he's how'd how'll how's isn't it'd it'd've it'll ma'am mightn't mightn't've might've mustn't must've "
    "needn't not've o'clock oughtn't 'ow's'at shan't she'd've should've shouldn't shouldn't've somebody'd've "
    "somebody'll somebody's someone'd someone'd've someone'll someone's something'd something'd've something'll "
    "that's there'd there'd've there're there's they'd they'd've they'll they're they've 'twas wasn't we'd've we've "
    "weren't what'll what're what's what've when's where'd where's where've who'd who'd've who'll who's who've why'll "
    "why're why's won't would've wouldn't wouldn't've y'all y'all'll y'all'd've you'd you'd've you'll you're you've"
).split()
"""The contracted forms the official table restores. Its keys are each form with exactly one apostrophe dropped
("couldnt've" and "couldn'tve", never "couldntve"); its entries that can never fire (capitalised keys after lower
casing, identities) are left out."""


def _contraction_table() -> dict[str, str]:
    table = {"somebody'd": "somebodyd"}  # the official table maps this one backwards; kept for equal scores
    for form in _CONTRACTED:
        for place in (i for i, char in enumerate(form) if char == "'"):
            table[form[:place] + form[place + 1 :]] = form
    return table


_CONTRACTIONS = _contraction_table()


def _punctuation(text: str) -> str:
    """Each listed character is dropped where it touches a space in ``text`` and becomes a space elsewhere (the test
    reads the text as it came in); then every period not followed by a digit goes."""
    out = text
    for char in _PUNCTUATION:
        out = out.replace(char, "" if f"{char} " in text or f" {char}" in text else " ")
    return _PERIOD.sub("", out, count=_PERIOD_LIMIT)


def normalize_answer(text: str) -> str:
    """An answer as the official VQA accuracy compares it: lower case, ',' and '?' dropped, "'s" split off,
    punctuation removed (:func:`_punctuation`), number words as digits, articles dropped, contractions restored."""
    text = text.lower().replace(",", "").replace("?", "").replace("'s", " 's").strip()
    text = _punctuation(text.replace("\n", " ").replace("\t", " ").strip())
    words = [_NUMBERS.get(word, word) for word in text.lower().split()]
    return " ".join(_CONTRACTIONS.get(word, word) for word in words if word not in _ARTICLES)


def annotator_matches(prediction: str, answers: Sequence[str]) -> int:
    """How many of the human ``answers`` equal ``prediction``, both normalised."""
    predicted = normalize_answer(prediction)
    return sum(normalize_answer(answer) == predicted for answer in answers)


def vqa_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """The official VQA accuracy of ``prediction``: over each of the 10 subsets of 9 annotators (one left out),
    ``min(#annotators in it who gave the prediction / 3, 1)``, averaged. Needs exactly :data:`ANNOTATORS` answers."""
    if len(answers) != ANNOTATORS:
        raise PruneAuditError(f"VQA accuracy needs {ANNOTATORS} human answers, got {len(answers)}")
    predicted = normalize_answer(prediction)
    given = [normalize_answer(answer) == predicted for answer in answers]
    matching = sum(given)
    return sum(min(1.0, (matching - left_out) / 3) for left_out in given) / ANNOTATORS


# ----- questions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextVqaQuestion:
    """One TextVQA question.

    Attributes:
        question_id: TextVQA's integer id (the records' key).
        image_id: TextVQA's image id (the image file's stem, the key of the OCR file).
        image: image file name under ``--images``.
        text: the question as asked before the instruction (LLaVA's line with its OCR tokens, else the question
            capitalised as lmms-eval asks it, with the OCR line when ``ocr_reference``).
        question: the question alone, as the JSON gives it.
        answers: the 10 human answers; None in the test split.
        image_size: (width, height) the JSON gives; None when absent.
    """

    question_id: int
    image_id: str
    image: str
    text: str
    question: str
    answers: tuple[str, ...] | None
    image_size: tuple[int, int] | None


def _text(value: Any, where: str, key: str, fix: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PruneAuditError(f"{where}: {key} must be non-empty text, got {value!r}; {fix}")
    return value


def _answers(entry: dict[str, Any], where: str, fix: str) -> tuple[str, ...] | None:
    """The 10 human answers; None in the test split (the JSON has no ``answers``; lmms-lab/textvqa's rows hold null
    or, as Hugging Face's TextVQA loader writes the test split, 10 empty strings)."""
    answers = entry.get("answers")
    if answers is None:
        return None
    if not isinstance(answers, list) or len(answers) != ANNOTATORS or not all(isinstance(a, str) for a in answers):
        raise PruneAuditError(
            f"{where}: answers must be a list of {ANNOTATORS} strings (one per annotator; VQA accuracy is defined "
            f"over 10), got {answers!r}; {fix}"
        )
    return None if not any(answers) else tuple(answers)


def _size(entry: dict[str, Any], where: str, fix: str) -> tuple[int, int] | None:
    values = (entry.get("image_width"), entry.get("image_height"))
    if values == (None, None):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise PruneAuditError(
            f"{where}: image_width and image_height must be positive whole numbers of pixels, got {values}; {fix}"
        )
    return values  # type: ignore[return-value]  # two ints, checked above


def _ocr_tokens(entry: dict[str, Any], where: str, fix: str) -> list[str]:
    tokens = entry.get("ocr_tokens")
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise PruneAuditError(
            f"{where}: ocr_tokens must be a list of strings to ask the OCR line (lmms-eval's rows carry it), got "
            f"{tokens!r}; {fix} (LLaVA's llava_textvqa_val_v051_ocr.jsonl carries the OCR line too)"
        )
    return tokens


def question_entry(entry: dict[str, Any], where: str, ocr: bool, fix: str = QUESTIONS_FIX) -> TextVqaQuestion:
    """One question of TextVQA's JSON or one lmms-lab/textvqa Parquet row (the same fields), every field checked
    (``fix`` ends each refusal); ``ocr``: ask its ``ocr_tokens`` line too."""
    question_id = entry.get("question_id")
    if isinstance(question_id, bool) or not isinstance(question_id, int) or not 0 <= question_id < 2**63:
        raise PruneAuditError(
            f"{where}: question_id must be a non-negative integer below 2**63, got {question_id!r}; {fix}"
        )
    image_id = _text(entry.get("image_id"), where, "image_id", fix)
    question = _text(entry.get("question"), where, "question", fix)
    text = question.capitalize()  # lmms-eval's textvqa_doc_to_text
    if ocr:
        text += f"\n{OCR_REFERENCE}{', '.join(_ocr_tokens(entry, where, fix))}"
    return TextVqaQuestion(
        question_id=question_id,
        image_id=image_id,
        image=check_image_name(f"{image_id}.jpg", where),
        text=text,
        question=question,
        answers=_answers(entry, where, fix),
        image_size=_size(entry, where, fix),
    )


def _question(entry: Any, path: Path, number: int, seen: QuestionPlaces, ocr: bool) -> TextVqaQuestion:
    """Entry ``number`` of the question JSON at ``path``, every field checked; ``ocr``: ask its ``ocr_tokens`` line
    too."""
    where = f"{path}: entry {number}"
    if not isinstance(entry, dict):
        raise PruneAuditError(f"{where} is a JSON {type(entry).__name__}, not an object; {QUESTIONS_FIX}")
    question = question_entry(entry, where, ocr)
    note_question(
        question.question_id, QuestionPlace(path, "entry", number, f"question_id {question.question_id}"), seen
    )
    return question


def read_textvqa_json(path: str | Path, ocr_reference: bool = False) -> list[TextVqaQuestion]:
    """Every question of TextVQA's question JSON, in file order, validated; ``ocr_reference`` asks each with its
    ``ocr_tokens`` line (lmms-eval's ``ocr: true``). A malformed entry is refused naming file and entry."""
    data = read_json(path, "question file", QUESTIONS_FIX)
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise PruneAuditError(f"{path}: expected TextVQA's question JSON, an object whose 'data' lists the questions")
    seen: QuestionPlaces = {}
    return [_question(entry, Path(path), number, seen, ocr_reference) for number, entry in enumerate(entries)]


def _llava_line(path: str | Path, number: int, row: dict[str, Any]) -> tuple[str, str, str]:
    """(image id, image, text) of one line of LLaVA's question file, checked."""
    where = f"{path}:{number}"
    missing = [key for key in ("question_id", "image", "text") if key not in row]
    if missing:
        raise PruneAuditError(
            f"{where}: missing {', '.join(missing)}; LLaVA's TextVQA lines have question_id, image, text"
        )
    fix = "fix the line or pass LLaVA's llava_textvqa_val_v051_ocr.jsonl"
    image_id = _text(row["question_id"], where, "question_id (LLaVA's TextVQA lines carry the image id)", fix)
    text = _text(row["text"], where, "text", fix)
    image = check_image_name(row["image"], where)
    if Path(image).stem != image_id:
        raise PruneAuditError(
            f"{where}: image {image!r} is not the image question_id {image_id!r} names (LLaVA's lines name "
            f"<image id>.jpg); {fix}"
        )
    return image_id, image, text


def _by_key(questions: Sequence[TextVqaQuestion]) -> dict[tuple[str, str], list[TextVqaQuestion]]:
    """The JSON's questions by (image id, question in lower case), LLaVA's evaluation key, in file order."""
    keyed: dict[tuple[str, str], list[TextVqaQuestion]] = defaultdict(list)
    for question in questions:
        keyed[(question.image_id, question.question.lower())].append(question)
    return keyed


def load_textvqa(
    questions_json: str | Path, llava_file: str | Path | None = None, ocr_reference: bool = False
) -> list[TextVqaQuestion]:
    """TextVQA questions with their answers.

    Args:
        questions_json: TextVQA's question JSON (ids, answers, image sizes).
        llava_file: LLaVA's question file; its questions, order and prompt text (question, OCR line, instruction)
            are used, each matched to the JSON's entry of the same image and question (lower case), as LLaVA's
            ``eval_textvqa.py`` matches them; a key asked twice takes the JSON's entries in order. Without it every
            question of the JSON is used, asked as lmms-eval asks it.
        ocr_reference: without ``llava_file``, ask the JSON's ``ocr_tokens`` line too.
    """
    questions = read_textvqa_json(questions_json, ocr_reference and llava_file is None)
    if llava_file is None:
        return questions
    keyed = _by_key(questions)
    asked = []
    for number, row in read_json_lines(llava_file):
        image_id, image, text = _llava_line(llava_file, number, row)
        first_line = text.split("\n", 1)[0].strip()
        candidates = keyed.get((image_id, first_line.lower()))
        if not candidates:
            raise PruneAuditError(
                f"{llava_file}:{number}: no question {first_line!r} on image {image_id} in {questions_json}; pass "
                f"TextVQA's question JSON of the same split (val for llava_textvqa_val_v051_ocr.jsonl)"
            )
        entry = candidates.pop(0)
        asked.append(
            TextVqaQuestion(entry.question_id, image_id, image, text, entry.question, entry.answers, entry.image_size)
        )
    if not asked:
        raise PruneAuditError(f"{llava_file}: no questions")
    return asked


# ----- OCR boxes -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OcrBox:
    """One OCR token: its text and box, as fractions of the image's width and height (top-left corner, size)."""

    word: str
    x: float
    y: float
    width: float
    height: float


def _fraction(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PruneAuditError(f"{where}: bounding_box.{key} must be a finite number, got {value!r}; {OCR_FIX}")
    if key in ("width", "height") and value < 0:
        raise PruneAuditError(f"{where}: bounding_box.{key} must not be negative, got {value!r}; {OCR_FIX}")
    return float(value)


def _ocr_box(token: Any, where: str) -> OcrBox:
    box = token.get("bounding_box") if isinstance(token, dict) else None
    if not isinstance(box, dict) or not isinstance(token.get("word"), str):
        raise PruneAuditError(f"{where}: an OCR token needs a word (text) and a bounding_box object; {OCR_FIX}")
    keys = ("top_left_x", "top_left_y", "width", "height")
    return OcrBox(token["word"], *(_fraction(box.get(key), where, key) for key in keys))


def load_rosetta_ocr(path: str | Path) -> dict[str, tuple[OcrBox, ...]]:
    """TextVQA's Rosetta OCR file: each image's OCR tokens (``ocr_info``) by image id, every box checked; a malformed
    entry is refused naming file, image and token."""
    data = read_json(path, "OCR file", OCR_FIX)
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise PruneAuditError(f"{path}: expected an object whose 'data' lists each image's ocr_info; {OCR_FIX}")
    images: dict[str, tuple[OcrBox, ...]] = {}
    for number, entry in enumerate(entries):
        where = f"{path}: entry {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("ocr_info"), list):
            raise PruneAuditError(f"{where} needs an image_id and an ocr_info list; {OCR_FIX}")
        image_id = _text(entry.get("image_id"), where, "image_id", OCR_FIX)
        if image_id in images:
            raise PruneAuditError(f"{where}: image {image_id} is listed twice; {OCR_FIX}")
        images[image_id] = tuple(
            _ocr_box(token, f"{where} (image {image_id}) token {index}")
            for index, token in enumerate(entry["ocr_info"])
        )
    return images


def answer_boxes(answers: Sequence[str], boxes: Sequence[OcrBox]) -> list[int]:
    """Indices of the OCR tokens that spell a human answer: every run of consecutive tokens (in the file's reading
    order) whose normalised words, joined by spaces, equal a normalised answer (an empty answer spells nothing)."""
    wanted = {normalize_answer(answer) for answer in answers} - {""}
    words = [normalize_answer(box.word) for box in boxes]
    longest = max((len(answer.split()) for answer in wanted), default=0)
    matched: set[int] = set()
    for start in (i for i, word in enumerate(words) if word):  # a token normalised away (punctuation) spells nothing
        for stop in range(start + 1, min(start + longest, len(words)) + 1):
            if words[stop - 1] and " ".join(word for word in words[start:stop] if word) in wanted:
                matched.update(range(start, stop))
    return sorted(matched)


def box_mask(box: OcrBox, width: int, height: int) -> np.ndarray:
    """(height, width) bool: the pixels whose centre lies in ``box`` (fractions scaled by the image size), clipped
    to the image; the token geometry counts a pixel by its centre too (``data.geometry``)."""
    mask = np.zeros((height, width), dtype=bool)
    columns = [min(max(math.ceil(edge * width - 0.5), 0), width) for edge in (box.x, box.x + box.width)]
    rows = [min(max(math.ceil(edge * height - 0.5), 0), height) for edge in (box.y, box.y + box.height)]
    mask[rows[0] : rows[1], columns[0] : columns[1]] = True
    return mask


# ----- released answers -------------------------------------------------------------------------------------------


def score_textvqa_answers(answers: str | Path, questions: Sequence[TextVqaQuestion]) -> dict[str, Any]:
    """Score an answers file (``question_id`` = TextVQA's question id, ``text``) by the official VQA accuracy.

    Returns ``answers`` (path, sha256), ``n``, ``accuracy`` (the mean VQA accuracy, the published number),
    ``exact`` (share with at least 3 matching annotators) and ``per_question`` (question_id, prediction, references,
    vqa_accuracy) in question order.
    """
    unanswerable = [question.question_id for question in questions if question.answers is None]
    if unanswerable:
        raise PruneAuditError(
            f"{len(unanswerable)} questions have no human answers (first: {unanswerable[0]}); pass TextVQA's "
            f"question JSON with answers (train or val, not test)"
        )
    texts = match_answers([str(q.question_id) for q in questions], load_llava_answers(answers), answers)
    rows = [
        {
            "question_id": q.question_id,
            "prediction": text,
            "references": list(q.answers or ()),
            "vqa_accuracy": vqa_accuracy(text, q.answers or ()),
        }
        for q, text in zip(questions, texts, strict=True)
    ]
    return {
        "answers": {"path": str(answers), "sha256": file_sha256(answers)},
        "n": len(rows),
        "accuracy": sum(row["vqa_accuracy"] for row in rows) / len(rows),
        "exact": sum(annotator_matches(text, q.answers or ()) >= 3 for q, text in zip(questions, texts)) / len(rows),
        "per_question": rows,
    }
