"""The grounding task: IoU edge cases computed by hand, each family's box convention (prompt, parse, frame), the
refer-layout reader and its refusals, and a run end to end through the CLI on the bundled demo model over real
COCO images and masks (../shared/data; skipped when absent)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import refused, snapshot
from test_task_visualize import drawn_masks, drawn_panels, redraw  # noqa: F401 (drawn_masks, drawn_panels: fixtures)
from typer.testing import CliRunner

from prune_audit.analysis.overlay import (
    ANSWER_OUTLINE,
    MASK_OUTLINE,
    Panel,
    box_line_width,
    box_outline,
    compose,
    legend_entries,
)
from prune_audit.answer_modes import Generation
from prune_audit.cli.main import app
from prune_audit.data.boxes import BOX_CONVENTIONS, Box, box_iou
from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import clip_geometry, qwen_geometry
from prune_audit.data.refcoco import load_refcoco
from prune_audit.errors import PruneAuditError
from prune_audit.tasks import get_task

runner = CliRunner()
TASK = "refcoco"


# ----- IoU, by hand -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 0, 2, 2), (0, 0, 2, 2), 1.0),  # identical
        ((0, 0, 2, 2), (1, 1, 3, 3), 1 / 7),  # overlap 1, union 4 + 4 - 1
        ((0, 0, 2, 2), (2, 0, 4, 2), 0.0),  # touching along an edge: no area in common
        ((0, 0, 2, 2), (2, 2, 4, 4), 0.0),  # touching at a corner
        ((0, 0, 2, 2), (5, 5, 6, 6), 0.0),  # apart
        ((0, 0, 4, 4), (1, 1, 3, 3), 0.25),  # containment: inner 4 over outer 16
        ((0, 0, 2, 1), (0, 0, 1, 1), 0.5),  # exactly one half
        ((0, 0, 2, 2), (1, 1, 1, 1), 0.0),  # zero-area point inside
        ((0, 0, 2, 2), (0, 1, 2, 1), 0.0),  # zero-height line inside
        ((1, 1, 1, 1), (1, 1, 1, 1), 0.0),  # two equal points: no region, not 0/0
        ((2, 2, 0, 0), (0, 0, 2, 2), 0.0),  # inverted corners name no region
        ((0, 2, 2, 0), (0, 0, 2, 2), 0.0),  # inverted on one axis only
        ((0.5, 0.5, 1.5, 2.5), (0, 0, 1, 1), 0.25 / 2.75),  # fractional: overlap 0.5 x 0.5, union 2 + 1 - 0.25
    ],
)
def test_iou_edge_cases(a, b, expected):
    assert box_iou(Box(*a), Box(*b)) == pytest.approx(expected, abs=1e-12)
    assert box_iou(Box(*b), Box(*a)) == pytest.approx(expected, abs=1e-12)


def test_exactly_half_counts_as_correct(tmp_path):
    """Acc@0.5 is IoU >= 0.5: a box of exactly half the union is correct, a hair less is not."""
    task, question = _bound_task(_FakeModel("internvl"), Box(0, 0, 200, 100), (1000, 1000))
    assert task.score(question, _generation("[[0, 0, 100, 100]]")).correct  # IoU 0.5
    assert not task.score(question, _generation("[[0, 0, 99, 100]]")).correct  # IoU 0.495


def test_coco_bbox_is_width_and_height():
    assert Box.from_coco([10, 20, 30, 40]) == Box(10, 20, 40, 60)


# ----- box conventions ----------------------------------------------------------------------------------------------


def test_llava_box_is_normalised_on_the_padded_square():
    """640 x 427 pads to a 640 square with the image at y = (640 - 427) // 2 = 106."""
    convention, geometry = BOX_CONVENTIONS["llava-1.5"], clip_geometry((640, 427), mode="llava_pad")
    assert convention.to_image((0.5, 0.5, 1.0, 1.0), geometry) == Box(320, 214, 640, 534)
    assert convention.parse("The box is [0.12, 0.3, 0.5, 0.61].") == (0.12, 0.3, 0.5, 0.61)
    assert convention.parse("a man on the left") is None
    assert convention.prompt("man in red") == (
        "Please provide the bounding box coordinate of the region this sentence describes: man in red."
    )


def test_qwen_box_is_in_pixels_of_the_resized_input():
    """smart_resize(427, 640) is 420 x 644 (15 x 23 tokens of 28 pixels): x scales by 640/644, y by 427/420."""
    convention, geometry = BOX_CONVENTIONS["qwen2.5-vl"], qwen_geometry((640, 427))
    assert (geometry.processed_width, geometry.processed_height) == (644, 420)
    assert convention.to_image((322, 210, 644, 420), geometry) == Box(320, 213.5, 640, 427)
    answer = '```json\n[\n\t{"bbox_2d": [12, 34, 56, 78], "label": "man in red"}\n]\n```'
    assert convention.parse(answer) == (12, 34, 56, 78)
    assert convention.parse("[1, 2, 3, 4]") == (1, 2, 3, 4)
    assert convention.parse('{"label": "man"}') is None
    assert convention.prompt("man in red") == "Locate man in red, output its bbox coordinates using JSON format."


def test_internvl_box_is_on_a_thousand_grid_of_the_original():
    convention, geometry = BOX_CONVENTIONS["internvl"], clip_geometry((640, 427), mode="hf_pad")
    assert convention.to_image((500, 500, 1000, 1000), geometry) == Box(320, 213.5, 640, 427)
    assert convention.to_image((0.5, 0.5, 1, 1), geometry) == Box(320, 213.5, 640, 427)  # its 0-1 rule (sum < 4)
    assert convention.parse("<ref>man</ref><box>[[10, 20, 300, 400]]</box>") == (10, 20, 300, 400)
    assert convention.parse("man[[10, 20, 300, 400]]") == (10, 20, 300, 400)  # <box> skipped as a special token
    assert convention.parse("[[a, b, c, d]]") is None
    assert convention.prompt("man") == (
        "Please provide the bounding box coordinate of the region this sentence describes: <ref>man</ref>"
    )


@pytest.mark.parametrize("name", sorted(BOX_CONVENTIONS))
def test_every_convention_maps_back_what_it_writes(name):
    convention = BOX_CONVENTIONS[name]
    for geometry in (clip_geometry((640, 427), mode="llava_pad"), qwen_geometry((333, 500))):
        box = Box(12.5, 30.25, 200.0, 300.0)
        back = convention.to_image(convention.from_image(box, geometry), geometry)
        assert np.allclose(back.as_list(), box.as_list())


def test_families_declare_their_box_convention():
    from prune_audit.models.families import _ADAPTERS

    declared = {family: adapter.grounding for family, adapter in _ADAPTERS.items()}
    assert declared["llava"] == "llava-1.5"
    assert declared["qwen2_5_vl"] == "qwen2.5-vl"
    assert declared["internvl"] == "internvl"
    # subclasses of a family with a convention, whose own frame differs, declare none rather than inherit it
    assert declared["qwen2_vl"] is declared["qwen3_vl"] is declared["llava_next"] is declared["llava_onevision"] is None
    assert all(name is None or name in BOX_CONVENTIONS for name in declared.values())


# ----- scoring ------------------------------------------------------------------------------------------------------


class _FakeModel:
    """An ``AnsweringModel``: a family's declarations only."""

    def __init__(self, grounding, display_name="Fake"):
        self.grounding, self.display_name = grounding, display_name

    def token_geometry(self, image_size):
        return qwen_geometry(image_size) if self.grounding == "qwen2.5-vl" else clip_geometry(image_size, mode="hf_pad")


def _generation(text: str) -> Generation:
    return Generation.from_token_probs(text, (0.5, 0.8), True)


def _bound_task(model, box: Box, size: tuple[int, int]):
    from prune_audit.data.refcoco import RefQuestion

    task = get_task(TASK)
    task.use_model(model)
    return task, RefQuestion(7, "val", "a.jpg", "the cat", 1, 2, 3, "cat", box, size)


def test_an_answer_without_a_box_is_wrong_not_an_error():
    task, question = _bound_task(_FakeModel("llava-1.5"), Box(10, 10, 50, 50), (100, 100))
    scored = task.score(question, _generation("I cannot see it"))
    assert not scored.correct and scored.columns["iou"] == 0.0 and scored.columns["predicted_box"] is None
    assert scored.confidence == pytest.approx(0.4)  # sequence_prob: the answer's token probabilities' product
    assert scored.references == ("[10.0, 10.0, 50.0, 50.0]",)


@pytest.mark.parametrize("grounding", sorted(BOX_CONVENTIONS))
def test_the_target_written_in_the_family_convention_scores_one(grounding):
    model = _FakeModel(grounding)
    task, question = _bound_task(model, Box(64, 48, 320, 400), (640, 427))
    numbers = task.convention.from_image(question.box, model.token_geometry((640, 427)))
    answer = {
        "llava-1.5": "[{:.4f}, {:.4f}, {:.4f}, {:.4f}]",
        "qwen2.5-vl": '[{{"bbox_2d": [{:.3f}, {:.3f}, {:.3f}, {:.3f}], "label": "cat"}}]',
        "internvl": "<ref>the cat</ref><box>[[{:.3f}, {:.3f}, {:.3f}, {:.3f}]]</box>",
    }[grounding].format(*numbers)
    scored = task.score(question, _generation(answer))
    assert scored.correct and scored.columns["iou"] == pytest.approx(1.0, abs=1e-3)
    assert scored.columns["box_convention"] == grounding
    assert np.allclose(scored.columns["predicted_box"], question.box.as_list(), atol=0.5)


def test_a_family_without_a_box_convention_is_refused():
    with pytest.raises(PruneAuditError, match="Qwen2-VL declares no box convention.*LLaVA-1.5, Qwen2.5-VL, InternVL"):
        get_task(TASK).use_model(_FakeModel(None, "Qwen2-VL"))


# ----- the reader ---------------------------------------------------------------------------------------------------


def _instances() -> dict:
    polygon = [[10.0, 10.0, 50.0, 10.0, 50.0, 40.0, 10.0, 40.0]]
    return {
        "images": [{"id": 9, "file_name": "COCO_train2014_000000000009.jpg", "width": 64, "height": 48}],
        "annotations": [
            {"id": 5, "image_id": 9, "category_id": 1, "bbox": [10, 10, 40, 30], "segmentation": polygon},
            {"id": 6, "image_id": 9, "category_id": 2, "bbox": [0, 0, 8, 8], "segmentation": [[0, 0, 8, 0, 8, 8]]},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
    }


def _refs() -> list:
    sentences = [{"sent_id": 70, "sent": "the cat", "raw": "The cat", "tokens": ["the", "cat"]}]
    return [
        {"ref_id": 1, "ann_id": 5, "image_id": 9, "category_id": 1, "split": "testA", "sentences": sentences},
        {"ref_id": 2, "ann_id": 6, "image_id": 9, "category_id": 2, "split": "val", "sentences": [_sentence(71)]},
    ]


def _sentence(sent_id: int, text: str = "small dog left") -> dict:
    return {"sent_id": sent_id, "sent": text, "raw": text, "tokens": text.split()}


def _files(folder: Path, refs=None, instances=None, suffix=".p") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    refs_path, instances_path = folder / f"refs(unc){suffix}", folder / "instances.json"
    if suffix == ".p":
        refs_path.write_bytes(pickle.dumps(_refs() if refs is None else refs, protocol=2))
    else:
        refs_path.write_text(json.dumps(_refs() if refs is None else refs))
    instances_path.write_text(json.dumps(_instances() if instances is None else instances))
    return [refs_path, instances_path]


@pytest.mark.parametrize("suffix", [".p", ".json"])
def test_reader_reads_one_question_per_expression(tmp_path, suffix):
    questions = load_refcoco(list(reversed(_files(tmp_path, suffix=suffix))))  # either order
    assert [(q.question_id, q.split, q.ann_id, q.category) for q in questions] == [
        (70, "testA", 5, "cat"),
        (71, "val", 6, "dog"),
    ]
    first = questions[0]
    assert first.image == "COCO_train2014_000000000009.jpg" and first.image_size == (64, 48)
    assert first.box == Box(10, 10, 50, 40) and first.text == "the cat"


class _Planted:
    """A pickled object whose loading would call a function: the plain unpickler must never run it."""

    def __reduce__(self):
        return (print, ("planted code ran",))


def _bad(change) -> list:
    refs = _refs()
    change(refs)
    return refs


@pytest.mark.parametrize(
    ("refs", "needle"),
    [
        ([_Planted()], ".print, and a refs file holds plain lists"),
        ({"refs": []}, "not the list of refs"),
        (_bad(lambda r: r[0].pop("ann_id")), "refs[0] lacks ann_id"),
        (_bad(lambda r: r[0].update(split="dev")), "split 'dev' is not one of"),
        (_bad(lambda r: r[0].update(sentences=[])), "sentences must be a non-empty list"),
        (_bad(lambda r: r[0].update(ann_id=99)), "annotation 99 of image 9 is not in"),
        (_bad(lambda r: r[1].update(sentences=[_sentence(70)])), "sent_id 70 repeats ref 0"),
        (_bad(lambda r: r[1].update(sentences=[{"sent_id": 72, "sent": "  "}])), ".sent must be a non-empty"),
        (_bad(lambda r: r[1].update(ref_id="2")), "ref_id must be a whole number"),
    ],
)
def test_reader_refuses_malformed_refs_in_one_line(tmp_path, capsys, refs, needle):
    with pytest.raises(PruneAuditError, match=None) as caught:
        load_refcoco(_files(tmp_path, refs=refs))
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert "planted" not in capsys.readouterr().out


def test_reader_refuses_a_bad_box_and_a_missing_file(tmp_path):
    instances = _instances()
    instances["annotations"][0]["bbox"] = [10, 10, -4, 30]
    with pytest.raises(PruneAuditError, match=r"annotation 5: bbox must be \[x, y, width, height\]"):
        load_refcoco(_files(tmp_path / "box", instances=instances))
    with pytest.raises(PruneAuditError, match="one refs file .* and the dataset's instances.json"):
        load_refcoco(_files(tmp_path / "one")[:1])
    broken = tmp_path / "broken.p"
    broken.write_bytes(b"\x80\x02]q\x00")  # truncated pickle
    with pytest.raises(PruneAuditError, match="broken.p is not a plain refs pickle"):
        load_refcoco([broken, _files(tmp_path / "two")[1]])


def test_evidence_is_the_referred_annotation_alone(tmp_path):
    files = _files(tmp_path)
    task = get_task(TASK)
    questions = task.read_questions(files)
    evidence = task.load_evidence(files[1], questions)
    coco = CocoInstances.load(files[1])
    mask = evidence.record_mask({"ann_id": 5})
    assert np.array_equal(mask, coco.annotation_mask(coco.annotations_by_image[9][0]))
    assert not mask[0:8, 0:8].any()  # the dog (another object in the image) is not evidence
    geometry = clip_geometry((64, 48), mode="hf_pad", shortest_edge=56, crop_size=(56, 56))
    assert [name for name, _ in evidence.objects(questions[0], 9, geometry)] == ["cat"]
    moved = _instances()
    moved["annotations"][0]["bbox"] = [11, 10, 40, 30]
    other = tmp_path / "moved.json"
    other.write_text(json.dumps(moved))
    with pytest.raises(PruneAuditError, match="annotation 5 .* is not the one the questions refer to"):
        task.load_evidence(other, questions)


# ----- end to end through the CLI, on the bundled demo model over real COCO images ---------------------------------


@pytest.fixture(scope="module")
def coco_refs(shared_data, tmp_path_factory) -> dict[str, Path]:
    """A refs pickle of four expressions over three objects of two val2017 images (the format of RefCOCO's
    train2014 files), with the images' instances.json."""
    source = shared_data / "coco" / "tiny_coco_val2017"
    data = json.loads((source / "instances_val2017.json").read_text())
    images = data["images"][:2]
    ids = {image["id"] for image in images}
    anns = [ann for ann in data["annotations"] if ann["image_id"] in ids]
    folder = tmp_path_factory.mktemp("refcoco")
    instances = folder / "instances.json"
    instances.write_text(json.dumps({"images": images, "annotations": anns, "categories": data["categories"]}))
    objects = [ann for ann in anns if not ann["iscrowd"]][:3]
    refs = [
        {
            "ref_id": k,
            "ann_id": ann["id"],
            "image_id": ann["image_id"],
            "category_id": ann["category_id"],
            "split": "val" if k < 2 else "testA",
            "sentences": [_sentence(100 + 2 * k, "the one on the left"), _sentence(101 + 2 * k, "big thing")][
                : 2 - k // 2
            ],
        }
        for k, ann in enumerate(objects)
    ]
    refs_path = folder / "refs(unc).p"
    refs_path.write_bytes(pickle.dumps(refs, protocol=2))
    return {"refs": refs_path, "instances": instances, "images": source / "val2017"}


def _run_args(files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--task",
        TASK,
        "--questions",
        str(files["refs"]),
        "--questions",
        str(files["instances"]),
        "--annotations",
        str(files["instances"]),
        "--images",
        str(files["images"]),
        "--out",
        str(out),
        "--max-new-tokens",
        "8",
        *extra,
    ]


def test_run_records_the_box_its_iou_and_the_referred_object_retention(coco_refs, tmp_path, drawn_masks, drawn_panels):  # noqa: F811
    out = tmp_path / "run"
    result = runner.invoke(app, _run_args(coco_refs, out, "--selector", "random", "--budget", "16"))
    assert result.exit_code == 0, result.output
    assert "mean IoU" in result.output and "answers without a box" in result.output
    rows = pq.read_table(out / "records.parquet").to_pylist()
    assert [(row["split"], row["question_id"]) for row in rows] == [
        ("val", 100),
        ("val", 101),
        ("val", 102),
        ("val", 103),
        ("testA", 104),
    ]
    coco = CocoInstances.load(coco_refs["instances"])
    for row in rows:
        assert row["task"] == TASK and row["box_convention"] == "llava-1.5"  # the demo is a LLaVA
        assert 0.0 <= row["iou"] <= 1.0 and row["correct"] == (row["iou"] >= 0.5)
        assert row["predicted_box"] is not None or row["iou"] == 0.0  # the demo writes no box: wrong, not an error
        ann = next(a for anns in coco.annotations_by_image.values() for a in anns if a["id"] == row["ann_id"])
        assert row["target_box"] == pytest.approx(Box.from_coco(ann["bbox"]).as_list())
        assert row["evidence_objects"] == [coco.category_names[ann["category_id"]]]
        assert row["object_area"] == int(coco.annotation_mask(ann).sum()) > 0
        assert 0.0 <= row["retention"] <= 1.0 and row["lost"] in (True, False)
        assert len(row["kept"]) == 16 and 0 < row["sequence_prob"] <= 1 and row["confidence"] == row["sequence_prob"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "region this sentence describes: the one on the left." in manifest["prompt"]["first"]
    redraw(out, rows[0], tmp_path / "figure.png")
    expected = coco.annotation_mask(
        next(a for a in coco.annotations_by_image[rows[0]["image_id"]] if a["id"] == rows[0]["ann_id"])
    )
    assert np.array_equal(drawn_masks[0], expected)
    # the figure frames the target box, labelled with the object's category, in the task's legend words; the demo
    # writes no box, so no answer box is drawn and the title says why
    assert (tmp_path / "figure.png").is_file()
    [panel] = drawn_panels
    assert panel.evidence_boxes == [(rows[0]["evidence_objects"][0], Box(*rows[0]["target_box"]))]
    assert "referred object (cyan outline)" in [label for label, _ in legend_entries([panel])]
    assert rows[0]["predicted_box"] is None and panel.answer_boxes == [] and "no box parsed" in panel.title
    picture = compose(np.zeros((*expected.shape, 3), dtype=np.uint8), panel, 0)
    frame = box_outline(expected.shape, Box(*rows[0]["target_box"]), box_line_width(expected.shape))
    assert frame.any() and (picture[frame] == MASK_OUTLINE).all()


def test_run_split_picks_the_refs_split(coco_refs, tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, _run_args(coco_refs, out, "--split", "testA"))
    assert result.exit_code == 0, result.output
    assert [row["question_id"] for row in pq.read_table(out / "records.parquet").to_pylist()] == [104]


def test_run_refuses_a_code_pickle_and_writes_nothing(coco_refs, tmp_path):
    planted = tmp_path / "inputs" / "refs(unc).p"
    planted.parent.mkdir()
    planted.write_bytes(pickle.dumps([_Planted()]))
    out = tmp_path / "run"
    before = snapshot(tmp_path)
    result = runner.invoke(app, _run_args({**coco_refs, "refs": planted}, out))
    refused(result, str(planted), "asks for builtins.print")
    assert "planted code ran" not in result.output
    assert snapshot(tmp_path) == before and not out.exists()


@pytest.mark.parametrize(("family", "convention"), [("qwen2_5_vl", "qwen2.5-vl"), ("internvl", "internvl")])
def test_run_asks_and_reads_in_each_family_convention(coco_refs, tmp_path, family, convention):
    from prune_audit.models.families import adapter_for

    model = adapter_for(family, "test").build_tiny(tmp_path / "model", words=["the", "one", "on", "left"])
    out = tmp_path / "run"
    result = runner.invoke(app, _run_args(coco_refs, out, "--model", str(model), "--limit", "2"))
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "records.parquet").to_pylist()
    assert [row["box_convention"] for row in rows] == [convention] * 2
    prompt = BOX_CONVENTIONS[convention].prompt("the one on the left")
    assert prompt in json.loads((out / "manifest.json").read_text())["prompt"]["first"]


def test_run_refuses_a_family_without_a_box_convention_and_writes_nothing(coco_refs, tmp_path):
    from prune_audit.models.families import adapter_for

    model = adapter_for("qwen2_vl", "test").build_tiny(tmp_path / "model", words=["the"])
    out = tmp_path / "run"
    refused(runner.invoke(app, _run_args(coco_refs, out, "--model", str(model))), "Qwen2-VL declares no box convention")
    assert not out.exists()


def test_run_without_questions_grounds_the_demos_expressions(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "run"
    result = runner.invoke(app, ["run", "--task", TASK, "--limit", "2", "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output[-2000:]
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 2 and all(r["box_convention"] == "llava-1.5" and r["target_box"] for r in records)


def test_score_of_released_answers_is_refused_in_one_line(tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"question_id": 70, "text": "[0.1, 0.2, 0.3, 0.4]"}) + "\n")
    files = _files(tmp_path / "inputs")
    result = runner.invoke(
        app, ["score", str(answers), "--task", TASK, "--questions", str(files[0]), "--questions", str(files[1])]
    )
    refused(result, "is not offered", "box is in its model's frame")


def test_the_figure_draws_the_predicted_box_dashed_and_labelled_with_its_iou():
    task = get_task(TASK)
    record = {"evidence_objects": ["dog"], "target_box": [10.0, 10.0, 50.0, 40.0], "iou": 0.4242}
    boxes = task.figure_boxes({**record, "predicted_box": [20.0, 16.0, 60.0, 56.0]}, None)
    assert boxes.evidence == (("dog", Box(10.0, 10.0, 50.0, 40.0)),) and boxes.note == ""
    assert boxes.answer == ("IoU 0.42", Box(20.0, 16.0, 60.0, 56.0))
    unparsed = task.figure_boxes({**record, "predicted_box": None}, None)
    assert unparsed.answer is None and unparsed.note == "no box parsed"
    geometry = clip_geometry((70, 70), mode="hf_crop", shortest_edge=None, crop_size=None)
    panel = Panel("random", geometry, [[0]], evidence_boxes=list(boxes.evidence), answer_boxes=[boxes.answer])
    picture = compose(np.full((70, 70, 3), 120, dtype=np.uint8), panel, 0)
    assert (picture[10, 10:50] == MASK_OUTLINE).all() and (picture[10:40, 10] == MASK_OUTLINE).all()
    assert (picture[55, 20:24] == ANSWER_OUTLINE).all() and (picture[17:20, 59] == ANSWER_OUTLINE).all()
    assert not (picture[55, 24:28] == ANSWER_OUTLINE).all(axis=-1).any()  # dashed: a gap after each run
    labels = [label for label, _ in legend_entries([panel])]
    assert "the model's box (green, dashed)" in labels


# ----- box loyalty against the dense run, by hand -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("box", "reference", "agree"),
    [
        ([0, 0, 2, 1], [0, 0, 1, 1], True),  # IoU exactly 0.5
        ([0, 0, 2, 2], [1, 1, 3, 3], False),  # 1/7
        ([0.0, 0.0, 10.0, 10.0], [0.1, 0.0, 10.1, 10.0], True),  # one number moved: exact text would disagree
        (None, None, True),  # neither answer holds a box
        (None, [0, 0, 1, 1], False),
        ([0, 0, 1, 1], None, False),
    ],
)
def test_two_boxes_agree_from_iou_one_half(box, reference, agree):
    from prune_audit.tasks.refcoco import boxes_agree

    assert boxes_agree(box, reference) is agree


def test_the_comparison_with_the_reference_pairs_expressions_by_key():
    import pyarrow as pa

    def records(rows):
        names = ["split", "question_id", "predicted_box", "iou"]
        return pa.Table.from_pylist([dict(zip(names, row)) for row in rows])

    run = records([("val", 2, [0, 0, 2, 1], 0.6), ("val", 1, None, 0.0), ("val", 3, [5, 5, 6, 6], 0.0)])
    dense = records([("val", 1, [0, 0, 1, 1], 0.9), ("val", 2, [0, 0, 1, 1], 0.3), ("testA", 3, None, 0.0)])
    comparison = get_task(TASK).reference_comparison(run, dense)
    # shared keys (val, 1) and (val, 2): a lost box, then IoU 0.5; (val, 3) has no dense counterpart
    assert comparison == {"box_loyalty": 0.5, "mean_iou": 0.3, "mean_iou_reference": 0.6}
    assert set(comparison) == set(get_task(TASK).reference_comparison_meanings)
