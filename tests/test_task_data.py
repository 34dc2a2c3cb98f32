"""Data layer of the GQA, ScienceQA-IMG and caption tasks: readers, answer rules, scoring, Parquet layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA

from prune_audit.data import captions, chair, gqa, lmms_parquet, scienceqa
from prune_audit.data.coco import CocoInstances
from prune_audit.data.pope import PopeQuestion, file_sha256
from prune_audit.errors import PruneAuditError

LLAVA_EVAL = SHARED_DATA / "llava_eval"
SHARED_ABSENT = "needs ../shared/data/llava_eval (LLaVA's question files), absent here"


def write_lines(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


# --- GQA ---------------------------------------------------------------------------------------------------------

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


# --- ScienceQA-IMG -------------------------------------------------------------------------------------------------


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


# --- CHAIR and captions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("caption", "expected"),
    [
        ("Two dogs and three horses.", [("dog", "dog"), ("horse", "horse")]),  # plurals
        (
            "Men, women and children feed the mice.",
            [("man", "person"), ("woman", "person"), ("children", "person"), ("mouse", "mouse")],
        ),  # irregular plurals
        (
            "A puppy chases a kitten past the motorbike.",
            [("puppy", "dog"), ("kitten", "cat"), ("motorbike", "motorcycle")],
        ),  # synonyms
        (
            "A hot dog, teddy bears and a traffic light.",
            [("hot dog", "hot dog"), ("teddy bear", "teddy bear"), ("traffic light", "traffic light")],
        ),  # multi-word names
        ("Plates on the dining table.", [("table", "dining table")]),  # not a pair: "table" is a synonym of its own
        ("A dog sits by another dog.", [("dog", "dog"), ("dog", "dog")]),  # named twice
        ("A baby elephant and an adult giraffe.", [("elephant", "elephant"), ("giraffe", "giraffe")]),  # no person
        ("The seat of the toilet.", [("toilet", "toilet")]),  # a toilet's seat is no chair
        ("A passenger jet.", [("jet", "airplane")]),  # no person
        ("He wears a bow tie; ties hang.", [("tie", "tie"), ("tie", "tie")]),
        ("Wine glasses under blue skies, reading glasses.", [("wine glass", "wine glass")]),  # skies is no ski
        ("Buses and skis.", [("bus", "bus"), ("skis", "skis")]),
        ("A motor bike and a cheesecake.", []),  # CHAIR's list has " motor bike" and " cheesecake": never matched
        ("A cake and a cupcake.", [("cake", "cake"), ("cupcake", "cake")]),
    ],
)
def test_chair_mentions(caption, expected):
    assert [(m.word, m.category) for m in chair.mentions(caption)] == expected


def test_chair_vocabulary_is_cocos_eighty_categories():
    vocabulary = chair.default_vocabulary()
    assert len(vocabulary.categories) == 80 and vocabulary.categories[:3] == ("person", "bicycle", "car")
    assert vocabulary.synonyms["bow"] == "tie" and vocabulary.pairs["toilet seat"] == "toilet"


def test_chair_scores_a_caption_by_hand():
    score = chair.score_caption("A dog and a cat. The dog sits near a car.", ["dog", "person", "car", "dog"])
    assert score.mentioned == ("dog", "cat", "car") and score.hallucinated == ("cat",)
    assert (score.hallucinated_mentions, len(score.mentions), score.chair_i, score.chair_s) == (1, 4, 0.25, True)
    assert score.omitted == ("person",) and score.recall == pytest.approx(2 / 3)
    also = chair.score_caption("A dog and a cat.", ["dog"], also_present={"cat"})  # a reference caption names the cat
    assert (also.hallucinated, also.chair_s, also.omitted) == ((), False, ())
    empty = chair.score_caption("Nothing to see.", [])
    assert (empty.chair_i, empty.chair_s, np.isnan(empty.recall)) == (0.0, False, True)
    metrics = chair.chair_metrics([score, also, empty])
    assert metrics["chair_s"] == pytest.approx(1 / 3) and metrics["chair_i"] == pytest.approx(1 / 6)
    assert metrics["recall"] == pytest.approx(3 / 4) and metrics["omitted"] == 1 and metrics["n"] == 3


def polygon(x: float, y: float) -> list[list[float]]:
    return [[x, y, x + 4, y, x + 4, y + 4, x, y + 4]]


def tiny_instances() -> dict:
    return {
        "images": [
            {"id": 1, "file_name": "000000000001.jpg", "width": 20, "height": 20},
            {"id": 2, "file_name": "000000000002.jpg", "width": 20, "height": 20},
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}, {"id": 3, "name": "car"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 18, "segmentation": polygon(1, 1)},
            {"id": 2, "image_id": 1, "category_id": 1, "segmentation": polygon(8, 8)},
            {"id": 3, "image_id": 1, "category_id": 18, "segmentation": polygon(12, 1)},
            {"id": 4, "image_id": 2, "category_id": 3, "segmentation": polygon(2, 2)},
        ],
    }


def test_captions_score_an_answers_file_by_hand(tmp_path):
    coco = CocoInstances(tiny_instances(), source="instances.json")
    references = captions.read_coco_captions(
        write_json(
            tmp_path / "captions.json",
            {
                "annotations": [
                    {"image_id": 1, "id": 10, "caption": "A man walks two dogs."},
                    {"image_id": 2, "id": 11, "caption": "A car next to a bicycle."},
                ]
            },
        )
    )
    questions = captions.caption_questions(coco, references)
    assert [(q.question_id, q.image, q.objects, q.caption_objects) for q in questions] == [
        (1, "000000000001.jpg", ("dog", "person"), ("dog", "person")),
        (2, "000000000002.jpg", ("car",), ("bicycle", "car")),
    ]
    answers = write_lines(
        tmp_path / "answers.jsonl",
        [
            {"question_id": 2, "text": "A bicycle and a truck."},  # bicycle: a reference caption names it
            {"question_id": "1", "text": "Two dogs play with a cat and a dog."},
        ],
    )
    result = captions.score_caption_answers(answers, questions)
    first, second = result["per_question"]
    assert (first["mentioned"], first["hallucinated"], first["omitted"]) == (["dog", "cat"], ["cat"], ["person"])
    assert (first["chair_i"], first["chair_s"], first["recall"]) == (pytest.approx(1 / 3), True, 0.5)
    assert (second["hallucinated"], second["omitted"], second["recall"]) == (["truck"], ["car"], 0.0)
    metrics = result["metrics"]
    assert (metrics["chair_s"], metrics["chair_i"], metrics["recall"]) == (
        1.0,
        pytest.approx(2 / 5),
        pytest.approx(1 / 3),
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], r"captions.json: expected a COCO captions file"),
        (
            {"annotations": [{"image_id": "1", "caption": "x"}]},
            r"annotations\[0\]: image_id must be a non-negative integer",
        ),
        ({"annotations": [{"image_id": 1, "caption": None}]}, r"annotations\[0\]: caption must be text"),
        ({"annotations": [{"image_id": 1, "caption": "x"}]}, r"image 2 has no reference caption"),
    ],
)
def test_caption_inputs_are_refused_in_one_line(tmp_path, data, message):
    coco = CocoInstances(tiny_instances(), source="instances.json")
    with pytest.raises(PruneAuditError, match=message):
        captions.caption_questions(coco, captions.read_coco_captions(write_json(tmp_path / "captions.json", data)))


def test_caption_questions_refuse_unknown_and_repeated_images():
    coco = CocoInstances(tiny_instances(), source="instances.json")
    with pytest.raises(PruneAuditError, match="image 7 is not in instances.json"):
        captions.caption_questions(coco, image_ids=[1, 7])
    with pytest.raises(PruneAuditError, match="image 1 is listed twice"):
        captions.caption_questions(coco, image_ids=[1, 2, 1])


def test_caption_questions_on_the_shared_coco_images(shared_data):
    instances = shared_data / "coco" / "tiny_coco_val2017" / "instances_val2017.json"
    if not instances.is_file():
        pytest.skip(f"needs {instances}")
    questions = captions.caption_questions(CocoInstances.load(instances))
    assert len(questions) == 50 and sum(not q.objects for q in questions) == 2
    assert all(set(q.objects) <= set(chair.default_vocabulary().categories) for q in questions)


# --- lmms-eval Parquet layouts ---------------------------------------------------------------------------------------

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


def test_chair_synonyms_are_the_bundled_upstream_file():
    """``assets/chair/synonyms.txt`` is LisaAnne/Hallucination's ``data/synonyms.txt`` byte for byte (NOTICE.md)."""
    assert file_sha256(chair.SYNONYMS_FILE) == "b685537b36fe21b791c87151b96a991ceb582edff19f3da204dcc7a7905502f2"
    assert (chair.SYNONYMS_FILE.parent / "NOTICE.md").is_file()
