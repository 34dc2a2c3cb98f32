"""``run --questions FILE.parquet``: every task's lmms-eval Parquet layout, images embedded, no ``--images`` folder.

The files are built offline in the datasets' exact schema (``test_lmms_parquet``'s writers) over the
workspace's synthetic scenes; each run must record what the same questions from JSON files and an
images folder record.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import refused
from test_gqa import gqa_inputs
from test_lmms_parquet import (
    IMAGE_STRUCT,
    gqa_instruction_columns,
    image,
    refcoco_columns,
    textvqa_columns,
    write_parquet,
)
from test_scienceqa import scienceqa_file
from test_textvqa import textvqa_files
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()
COMPARED = ("question_id", "split", "image", "image_id", "answer_text", "confidence", "correct", "retention", "lost")


def rows(run: Path) -> list[dict]:
    """The compared columns of each record, NaN (no evidence) as None so that rows compare equal."""

    def value(item: object) -> object:
        return None if isinstance(item, float) and math.isnan(item) else item

    return [{key: value(row[key]) for key in COMPARED} for row in pq.read_table(run / "records.parquet").to_pylist()]


def pope_parquet(ws: dict[str, Path], path: Path) -> Path:
    """lmms-lab/POPE's columns for the workspace's three POPE files (the split is ``category``)."""
    entries = [
        (json.loads(line), split.stem.rsplit("_", 1)[-1])
        for split in ws["pope"]
        for line in split.read_text().splitlines()
        if line.strip()
    ]
    return write_parquet(
        path,
        {
            "id": (pa.string(), [str(n) for n in range(len(entries))]),
            "question_id": (pa.string(), [str(e["question_id"]) for e, _ in entries]),
            "question": (pa.string(), [e["text"] for e, _ in entries]),
            "answer": (pa.string(), [e["label"] for e, _ in entries]),
            "image_source": (pa.string(), [e["image"] for e, _ in entries]),
            "image": (IMAGE_STRUCT, [image((Path(ws["images"]) / e["image"]).read_bytes()) for e, _ in entries]),
            "category": (pa.string(), [split for _, split in entries]),
        },
    )


def test_pope_parquet_runs_without_an_images_folder_as_the_json_files_do(workspace, tmp_path):
    parquet = pope_parquet(workspace, tmp_path / "test-00000-of-00001.parquet")
    common = [
        "run",
        "--model",
        str(workspace["model"]),
        "--annotations",
        str(workspace["instances"]),
        "--selector",
        "random",
        "--budget",
        "6",
        "--limit",
        "10",
    ]
    from_parquet, from_json = tmp_path / "parquet", tmp_path / "json"
    result = runner.invoke(app, [*common, "--questions", str(parquet), "--out", str(from_parquet)])
    assert result.exit_code == 0, result.output
    json_args = [arg for path in workspace["pope"] for arg in ("--pope", str(path))]
    result = runner.invoke(app, [*common, *json_args, "--images", str(workspace["images"]), "--out", str(from_json)])
    assert result.exit_code == 0, result.output
    assert rows(from_parquet) == rows(from_json)
    manifest = json.loads((from_parquet / "manifest.json").read_text())
    reference = json.loads((from_json / "manifest.json").read_text())
    assert manifest["images"]["files"] == reference["images"]["files"]  # pinned by the embedded bytes
    assert Path(manifest["images"]["path"]) == from_parquet / "images"
    for name in manifest["images"]["files"]:
        assert (from_parquet / "images" / name).read_bytes() == (Path(workspace["images"]) / name).read_bytes()
    # resuming finds the written images with the pinned bytes
    again = runner.invoke(app, [*common, "--questions", str(parquet), "--out", str(from_parquet)])
    assert again.exit_code == 0, again.output
    # the run's own images folder serves the commands that read a finished run
    row = pq.read_table(from_parquet / "records.parquet").to_pylist()[0]
    drawn = runner.invoke(
        app,
        [
            "visualize",
            "--run",
            str(from_parquet),
            "--question-id",
            str(row["question_id"]),
            "--split",
            row["split"],
            "--out",
            str(tmp_path / "figure.png"),
        ],
    )
    assert drawn.exit_code == 0, drawn.output
    treated = runner.invoke(
        app,
        [
            "intervene",
            str(from_parquet),
            "--mode",
            "remove",
            "--max-cells",
            "1",
            "--bootstrap",
            "10",
            "--out",
            str(tmp_path / "intervene"),
        ],
    )
    assert treated.exit_code == 0, treated.output


def gqa_parquet(ws: dict[str, Path], folder: Path) -> tuple[Path, Path, dict[str, Path], dict]:
    """lmms-lab/GQA's instructions and images files for the workspace's GQA questions (``gqa_inputs``), those
    inputs and their questions (GQA's question JSON)."""
    inputs = gqa_inputs(ws, folder / "gqa")
    questions = json.loads(inputs["questions"].read_text())
    annotations = [
        {
            "question": list(q["annotations"]["question"].items()),
            "answer": list(q["annotations"]["answer"].items()),
            "fullAnswer": list(q["annotations"]["fullAnswer"].items()),
        }
        for q in questions.values()
    ]
    columns = gqa_instruction_columns(annotations)
    count = len(questions)
    columns.update(
        {
            "id": (pa.string(), list(questions)),
            "imageId": (pa.string(), [q["imageId"] for q in questions.values()]),
            "question": (pa.string(), [q["question"] for q in questions.values()]),
            "answer": (pa.string(), [q["answer"] for q in questions.values()]),
            "fullAnswer": (pa.string(), [q["answer"] for q in questions.values()]),
            "isBalanced": (pa.bool_(), [True] * count),
            "types": (columns["types"][0], columns["types"][1][:1] * count),
        }
    )
    instructions = write_parquet(folder / "testdev_balanced_instructions.parquet", columns)
    stems = list(dict.fromkeys(q["imageId"] for q in questions.values()))
    pictures = write_parquet(
        folder / "testdev_balanced_images.parquet",
        {
            "id": (pa.string(), stems),
            "image": (IMAGE_STRUCT, [image((Path(ws["images"]) / f"{stem}.png").read_bytes()) for stem in stems]),
        },
    )
    return instructions, pictures, inputs, questions


def test_gqa_parquet_files_join_instructions_and_images(workspace, tmp_path):
    instructions, pictures, inputs, questions = gqa_parquet(workspace, tmp_path)
    stems = list(dict.fromkeys(q["imageId"] for q in questions.values()))
    from_parquet = tmp_path / "parquet"
    result = runner.invoke(
        app,
        [
            "run",
            "--task",
            "gqa",
            "--model",
            str(workspace["model"]),
            "--questions",
            str(pictures),
            "--questions",
            str(instructions),
            "--max-new-tokens",
            "2",
            "--out",
            str(from_parquet),
        ],
    )
    assert result.exit_code == 0, result.output
    records = pq.read_table(from_parquet / "records.parquet").to_pylist()
    assert [str(r["question_id"]) for r in records] == list(questions)
    assert [r["references"] for r in records] == [[q["answer"]] for q in questions.values()]
    assert all(r["evidence_object_ids"] for r in records)  # read from the instructions' annotations
    # the images are named <imageId>.jpg in lmms-eval's layout, so the JSON run reads the same bytes from a copy
    folder = tmp_path / "jpg-names"
    folder.mkdir()
    for stem in stems:
        (folder / f"{stem}.jpg").write_bytes((Path(workspace["images"]) / f"{stem}.png").read_bytes())
    (inputs["questions"]).write_text(json.dumps(questions))
    from_json = tmp_path / "json"
    result = runner.invoke(
        app,
        [
            "run",
            "--task",
            "gqa",
            "--model",
            str(workspace["model"]),
            "--questions",
            str(inputs["questions"]),
            "--images",
            str(folder),
            "--max-new-tokens",
            "2",
            "--out",
            str(from_json),
        ],
    )
    assert result.exit_code == 0, result.output
    assert [(r["answer_text"], r["confidence"]) for r in records] == [
        (r["answer_text"], r["confidence"]) for r in pq.read_table(from_json / "records.parquet").to_pylist()
    ]
    refused(
        runner.invoke(
            app,
            [
                "run",
                "--task",
                "gqa",
                "--model",
                str(workspace["model"]),
                "--questions",
                str(instructions),
                "--out",
                str(tmp_path / "alone"),
            ],
        ),
        "no lmms-lab/GQA *_images",
    )
    assert not (tmp_path / "alone").exists()


def test_scienceqa_parquet_answers_as_llavas_file(workspace, letters_model, tmp_path):  # noqa: F811
    llava_file = scienceqa_file(workspace, tmp_path / "sqa")
    entries = [e for e in json.loads(llava_file.read_text()) if "image" in e]
    prompts = [e["conversations"][0]["value"].split("\n") for e in entries]
    choices = [[line.split(". ", 1)[1] for line in lines[3:]] for lines in prompts]
    parquet = write_parquet(
        tmp_path / "test-00000-of-00001.parquet",
        {
            "image": (IMAGE_STRUCT, [image((Path(workspace["images"]) / e["image"]).read_bytes()) for e in entries]),
            "question": (pa.string(), [lines[2] for lines in prompts]),
            "choices": (pa.list_(pa.string()), choices),
            "answer": (pa.int8(), ["ABCD".index(e["conversations"][1]["value"]) for e in entries]),
            "hint": (pa.string(), [lines[1].removeprefix("Context: ") for lines in prompts]),
            **{
                name: (pa.string(), [""] * len(entries))
                for name in ("task", "grade", "subject", "topic", "category", "skill", "lecture", "solution")
            },
        },
    )
    runs = {"parquet": tmp_path / "parquet", "json": tmp_path / "json"}
    common = ["run", "--task", "scienceqa", "--model", str(letters_model)]  # dense: random keeps depend on the ids
    result = runner.invoke(app, [*common, "--questions", str(parquet), "--out", str(runs["parquet"])])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, [*common, "--questions", str(llava_file), "--images", str(workspace["images"]), "--out", str(runs["json"])]
    )
    assert result.exit_code == 0, result.output
    by_parquet, by_json = (pq.read_table(run / "records.parquet").to_pylist() for run in runs.values())
    assert [r["question_id"] for r in by_parquet] == list(range(len(entries)))  # row numbers: the layout has no id
    assert [(r["answer_text"], r["references"], r["letter_probs"]) for r in by_parquet] == [
        (r["answer_text"], r["references"], r["letter_probs"]) for r in by_json
    ]


def score_json(*args: str) -> dict:
    result = runner.invoke(app, ["score", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_score_reads_pope_parquet_as_the_json_files(workspace, tmp_path):
    parquet = pope_parquet(workspace, tmp_path / "test-00000-of-00001.parquet")
    entries = [
        (json.loads(line), path.stem.rsplit("_", 1)[-1])
        for path in workspace["pope"]
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    answers = tmp_path / "answers.jsonl"  # every third answer wrong, matched by (split, question_id)
    answers.write_text(
        "".join(
            json.dumps(
                {
                    "question_id": e["question_id"],
                    "category": split,
                    "text": e["label"] if n % 3 else {"yes": "No", "no": "Yes"}[e["label"]],
                }
            )
            + "\n"
            for n, (e, split) in enumerate(entries)
        )
    )
    by_parquet = score_json(str(answers), "--questions", str(parquet))
    by_json = score_json(str(answers), *[arg for path in workspace["pope"] for arg in ("--questions", str(path))])
    assert by_parquet["matched_by"] == by_json["matched_by"] == "id"
    assert json.dumps(by_parquet["splits"]) == json.dumps(by_json["splits"])  # NaN-safe equality
    per_split = [split for name, split in by_parquet["splits"].items() if name != "average"]
    assert sum(split["tp"] + split["tn"] for split in per_split) == sum(n % 3 != 0 for n in range(len(entries)))


def test_score_reads_gqa_instructions_parquet_without_its_images(workspace, tmp_path):
    instructions, pictures, _, questions = gqa_parquet(workspace, tmp_path)
    ids = list(questions)
    rows = [
        (ids[0], questions[ids[0]]["answer"].capitalize() + "."),
        (ids[1], "no idea"),
        *((qid, questions[qid]["answer"]) for qid in ids[2:]),
    ]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"question_id": qid, "text": text}) + "\n" for qid, text in rows))
    # "Circle." -> "circle" under LLaVA's rule; "no idea" is wrong: 5 of 6, with or without the images file
    for files in ([instructions], [pictures, instructions]):
        report = score_json(
            str(answers), "--task", "gqa", *[arg for path in files for arg in ("--questions", str(path))]
        )
        assert (report["n"], report["correct"]) == (6, 5)
    refused(
        runner.invoke(app, ["score", str(answers), "--task", "gqa", "--questions", str(pictures)]),
        "no lmms-lab/GQA *_instructions",
    )


@pytest.mark.parametrize(("task", "reason"), [("scienceqa", "no problem id"), ("caption", "reads no Parquet")])
def test_score_refuses_parquet_it_cannot_match_in_one_line(workspace, tmp_path, task, reason):
    parquet = pope_parquet(workspace, tmp_path / "test-00000-of-00001.parquet")
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"question_id": 1, "text": "A"}) + "\n")
    refused(runner.invoke(app, ["score", str(answers), "--task", task, "--questions", str(parquet)]), reason)


@pytest.mark.parametrize("case", ["images option", "mixed files", "missing column", "caption", "bad image"])
def test_parquet_inputs_are_refused_in_one_line_before_anything_is_written(workspace, tmp_path, case):
    parquet = pope_parquet(workspace, tmp_path / "pope.parquet")
    args = ["run", "--model", str(workspace["model"]), "--questions", str(parquet), "--out", str(tmp_path / "run")]
    if case == "images option":
        refused(
            runner.invoke(app, [*args, "--images", str(workspace["images"])]), "embed their images", "drop --images"
        )
    elif case == "mixed files":
        refused(runner.invoke(app, [*args, "--questions", str(workspace["pope"][0])]), "not both")
    elif case == "missing column":
        table = pq.read_table(parquet).drop_columns(["image_source"])
        pq.write_table(table, parquet)
        refused(runner.invoke(app, args), "no column image_source", "lmms-lab/POPE layout")
    elif case == "caption":
        refused(runner.invoke(app, [*args, "--task", "caption"]), "caption reads no Parquet question files")
    else:
        table = pq.read_table(parquet)
        broken = [{"bytes": b"not an image", "path": None}] * table.num_rows
        pq.write_table(
            table.set_column(table.schema.get_field_index("image"), "image", pa.array(broken, type=IMAGE_STRUCT)),
            parquet,
        )
        refused(runner.invoke(app, args), "embedded in the question files", "cannot be decoded")
    assert not (tmp_path / "run").exists()


def scene_images(ws: dict[str, Path], count: int) -> list[Path]:
    return sorted(Path(ws["images"]).glob("*.png"))[:count]


def textvqa_parquet(ws: dict[str, Path], folder: Path) -> tuple[Path, dict[str, Path]]:
    """lmms-lab/textvqa's layout for ``test_textvqa``'s question JSON over two scenes, and those files with a folder
    of the scenes named ``<image_id>.jpg`` as TextVQA names its images (the bytes stay PNG)."""
    scenes = scene_images(ws, 2)
    paths = textvqa_files(folder, [(scene.stem, (64, 64)) for scene in scenes])
    entries = json.loads(paths["json"].read_text())["data"]
    parquet = write_parquet(
        folder / "validation-00000-of-00001.parquet",
        textvqa_columns(entries, {scene.stem: scene.read_bytes() for scene in scenes}),
    )
    named = folder / "images"
    named.mkdir()
    for scene in scenes:
        (named / f"{scene.stem}.jpg").write_bytes(scene.read_bytes())
    return parquet, {**paths, "images": named}


def test_textvqa_parquet_runs_and_scores_as_the_question_json(workspace, tmp_path):
    parquet, files = textvqa_parquet(workspace, tmp_path / "tvqa")
    common = ["run", "--task", "textvqa", "--model", str(workspace["model"]), "--annotations", str(files["ocr"])]
    common += ["--selector", "random", "--budget", "6", "--max-new-tokens", "2"]
    runs = {"parquet": tmp_path / "parquet", "json": tmp_path / "json"}
    result = runner.invoke(app, [*common, "--questions", str(parquet), "--out", str(runs["parquet"])])
    assert result.exit_code == 0, result.output
    json_args = ["--questions", str(files["json"]), "--images", str(files["images"])]
    result = runner.invoke(app, [*common, *json_args, "--out", str(runs["json"])])
    assert result.exit_code == 0, result.output
    assert rows(runs["parquet"]) == rows(runs["json"])
    by_parquet = {r["question_id"]: r for r in pq.read_table(runs["parquet"] / "records.parquet").to_pylist()}
    assert by_parquet[101]["evidence_objects"] == ["STOP", "sign"]  # the Rosetta file's boxes, as from the JSON
    assert by_parquet[101]["references"] == ["stop"] * 4 + ["stop sign"] * 3 + ["go"] * 3
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        "".join(json.dumps({"question_id": q, "text": t}) + "\n" for q, t in [(101, "stop"), (103, "x")])
    )
    answers.write_text(answers.read_text() + json.dumps({"question_id": 102, "text": "red"}) + "\n")
    reports = [
        score_json(str(answers), "--task", "textvqa", "--questions", str(path)) for path in (parquet, files["json"])
    ]
    assert reports[0]["accuracy"] == reports[1]["accuracy"] == pytest.approx(2 / 3)


def refcoco_inputs(ws: dict[str, Path], folder: Path) -> tuple[Path, dict[str, Path]]:
    """Three referred rectangles on two scenes, in lmms-lab's RefCOCO layout (``val-*.parquet``) and in the refer
    layout (refs pickle + instances.json whose sent_ids are the Parquet reader's numbers, so both runs key and seed
    each expression alike)."""
    scenes = scene_images(ws, 2)
    instances = json.loads(Path(ws["instances"]).read_text())
    images = [entry for entry in instances["images"] if entry["file_name"] in {s.name for s in scenes}]
    boxes = [(images[0], [8, 8, 24, 16]), (images[0], [30, 20, 20, 30]), (images[1], [4, 30, 40, 20])]
    expressions = [["the left one", "small box"], ["right thing"], ["bottom"]]
    anns, refs, parquet_rows, sent_id = [], [], [], 0
    for number, ((entry, (x, y, w, h)), texts) in enumerate(zip(boxes, expressions)):
        polygon = [x, y, x + w, y, x + w, y + h, x, y + h]
        ann = {"id": 40 + number, "image_id": entry["id"], "category_id": 1, "bbox": [x, y, w, h], "iscrowd": 0}
        anns.append({**ann, "segmentation": [polygon], "area": w * h})
        sentences = [{"sent_id": sent_id + k, "sent": text} for k, text in enumerate(texts)]
        sent_id += len(texts)
        refs.append({"ref_id": number, "ann_id": ann["id"], "image_id": entry["id"], "split": "val"})
        refs[-1].update(category_id=1, sentences=sentences)
        picture = (Path(ws["images"]) / entry["file_name"]).read_bytes()
        parquet_rows.append(
            {
                "question_id": str(ann["id"]),
                "image": picture,
                "answer": texts,
                "segmentation": [float(v) for v in polygon],
            }
        )
        parquet_rows[-1].update(bbox=[float(v) for v in (x, y, w, h)], file_name=entry["file_name"])
    folder.mkdir(parents=True)
    files = {"refs": folder / "refs(unc).p", "instances": folder / "instances.json", "images": Path(ws["images"])}
    files["refs"].write_bytes(pickle.dumps(refs, protocol=2))
    files["instances"].write_text(
        json.dumps({"images": images, "annotations": anns, "categories": [{"id": 1, "name": "box"}]})
    )
    return write_parquet(folder / "val-00000-of-00001.parquet", refcoco_columns(parquet_rows)), files


def test_refcoco_parquet_runs_as_the_refs_files_with_the_rows_polygons_as_evidence(workspace, tmp_path):
    parquet, files = refcoco_inputs(workspace, tmp_path / "refcoco")
    common = ["run", "--task", "refcoco", "--model", str(workspace["model"]), "--max-new-tokens", "4"]
    common += ["--selector", "random", "--budget", "6"]
    runs = {"parquet": tmp_path / "parquet", "refs": tmp_path / "refs"}
    result = runner.invoke(
        app, [*common, "--questions", str(parquet), "--out", str(runs["parquet"])]
    )  # no --annotations
    assert result.exit_code == 0, result.output
    refs_args = ["--questions", str(files["refs"]), "--questions", str(files["instances"])]
    refs_args += ["--annotations", str(files["instances"]), "--images", str(files["images"])]
    result = runner.invoke(app, [*common, *refs_args, "--out", str(runs["refs"])])
    assert result.exit_code == 0, result.output
    assert rows(runs["parquet"]) == rows(runs["refs"])
    by_parquet, by_refs = (pq.read_table(run / "records.parquet").to_pylist() for run in runs.values())
    assert [r["question_id"] for r in by_parquet] == [0, 1, 2, 3]
    for row, reference in zip(by_parquet, by_refs):
        assert (row["ann_id"], row["target_box"], row["iou"]) == (
            reference["ann_id"],
            reference["target_box"],
            reference["iou"],
        )
        assert row["object_area"] == reference["object_area"] > 0  # the row's polygon is the annotation's mask
        assert row["evidence_objects"] == ["referred object"] and reference["evidence_objects"] == ["box"]
    drawn = runner.invoke(
        app,
        [
            "visualize",
            "--run",
            str(runs["parquet"]),
            "--question-id",
            "0",
            "--split",
            "val",
            "--out",
            str(tmp_path / "f.png"),
        ],
    )
    assert drawn.exit_code == 0, drawn.output
    # the dataset's instances.json as --annotations: its masks are the evidence, its ids and boxes match the rows'
    annotated = tmp_path / "annotated"
    result = runner.invoke(
        app, [*common, "--questions", str(parquet), "--annotations", str(files["instances"]), "--out", str(annotated)]
    )
    assert result.exit_code == 0, result.output
    assert rows(annotated) == rows(runs["parquet"])
    renamed = parquet.rename(parquet.with_name("refcoco.parquet"))
    refused(
        runner.invoke(app, [*common, "--questions", str(renamed), "--out", str(tmp_path / "bad")]),
        "the split is the file name's prefix",
    )
    assert not (tmp_path / "bad").exists()
