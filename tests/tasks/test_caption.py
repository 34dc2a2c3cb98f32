"""The caption task: CHAIR's mentions, vocabulary and scores by hand (the bundled upstream synonyms), COCO caption
questions and their refusals, scoring an answers file, omission by the objects' fate, and a run scoring the
mentions and measuring each object on a tiny offline LLaVA."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import answers_file, refused, score_json, write_json, write_lines
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data import captions, chair
from prune_audit.data.coco import CocoInstances
from prune_audit.data.pope import file_sha256
from prune_audit.errors import PruneAuditError

runner = CliRunner()


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


def test_chair_synonyms_are_the_bundled_upstream_file():
    """``assets/chair/synonyms.txt`` is LisaAnne/Hallucination's ``data/synonyms.txt`` byte for byte (NOTICE.md)."""
    assert file_sha256(chair.SYNONYMS_FILE) == "b685537b36fe21b791c87151b96a991ceb582edff19f3da204dcc7a7905502f2"
    assert (chair.SYNONYMS_FILE.parent / "NOTICE.md").is_file()


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


def test_caption_run_scores_mentions_and_measures_each_object(workspace, tmp_path):
    from prune_audit.data.chair import default_vocabulary, score_caption, with_categories

    out = tmp_path / "run"
    instances = str(workspace["instances"])
    args = [
        "run",
        "--task",
        "caption",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--questions",
        instances,
        "--annotations",
        instances,
        "--out",
        str(out),
        "--limit",
        "4",
        "--max-new-tokens",
        "4",
        "--selector",
        "random",
        "--budget",
        "4",
    ]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "omitted among objects lost at the first stage" in result.stdout and "CHAIR-s" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task"] == "caption" and manifest["max_new_tokens"] == 4
    coco = json.loads(Path(instances).read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    for row in pq.read_table(out / "records.parquet").to_pylist():
        annotated = list(
            dict.fromkeys(names[a["category_id"]] for a in coco["annotations"] if a["image_id"] == row["question_id"])
        )
        # the shapes are no COCO objects: CHAIR's list plus the file's category names
        score = score_caption(
            row["answer_text"], annotated, vocabulary=with_categories(default_vocabulary(), names.values())
        )
        assert row["evidence_objects"] == annotated == row["references"]
        assert len(row["evidence_objects_lost"]) == len(annotated)
        assert row["omitted"] == list(score.omitted) and row["hallucinated"] == list(score.hallucinated)
        assert row["correct"] == (not score.chair_s) and row["recall"] == pytest.approx(score.recall)
        assert row["confidence"] == row["mean_token_prob"] and row["answer_tokens"] <= 4
        # the union region is lost exactly when every object is
        assert row["lost"] == all(row["evidence_objects_lost"])


def test_omission_by_fate_counts_objects_by_hand():
    from prune_audit.tasks.caption import omission_by_fate

    rows = [
        {"evidence_objects": ["dog", "cat", "car"], "evidence_objects_lost": [True, False, None], "omitted": ["dog"]},
        {"evidence_objects": ["dog", "cup"], "evidence_objects_lost": [True, True], "omitted": ["dog", "cup"]},
        {"evidence_objects": ["cat"], "evidence_objects_lost": [False], "omitted": []},
    ]
    # lost: dog, dog, cup (all 3 omitted); kept: cat, cat (none omitted); car has no pixels
    assert omission_by_fate(rows) == {"lost": (3, 3), "kept": (2, 0)}


def test_caption_questions_need_one_instances_file(workspace, tmp_path):
    out = tmp_path / "run"
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "A red circle."}]}))
    refused(
        runner.invoke(
            app,
            [
                "run",
                "--task",
                "caption",
                "--model",
                str(workspace["model"]),
                "--images",
                str(workspace["images"]),
                "--questions",
                str(captions),
                "--out",
                str(out),
            ],
        ),
        "one COCO instances file",
    )
    assert not out.exists()


def test_score_caption_answers_by_hand(workspace, tmp_path):
    coco = json.loads(Path(workspace["instances"]).read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    image = coco["images"][0]
    annotated = list(
        dict.fromkeys(names[a["category_id"]] for a in coco["annotations"] if a["image_id"] == image["id"])
    )
    absent = next(name for name in ("dog", "car", "person", "cat") if name not in annotated)
    one_image = {
        **coco,
        "images": [image],
        "annotations": [a for a in coco["annotations"] if a["image_id"] == image["id"]],
    }
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps(one_image))
    caption = f"There is a {absent} and two {absent}s next to something."
    report = score_json(
        str(answers_file(tmp_path / "a.jsonl", [(image["id"], caption)])),
        "--task",
        "caption",
        "--questions",
        str(instances),
    )
    metrics = report["metrics"]
    assert metrics["chair_s"] == 1.0 and metrics["chair_i"] == 1.0  # both mentions name an absent object
    assert metrics["recall"] == 0.0 and metrics["omitted"] == len(annotated)
