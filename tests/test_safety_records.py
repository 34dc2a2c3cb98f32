"""Issue 23 (items 3, 5, 13): records belong to their manifest; the manifest follows one declared schema.

Every case is refused the data safety way (``refused``: exit 2, one ``error:`` line naming the
cause and the fix, no traceback) and leaves every pre-existing file's bytes unchanged
(``snapshot``). The demo runs are tiny (``--limit``) and shared by a module fixture; each case
works on its own copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_safety import invoke, refused, snapshot

from prune_audit.records.manifest import MANIFEST_KEYS, MANIFEST_SCHEMA, run_id_of
from prune_audit.records.store import stamped

LIMIT = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Demo runs: dense and fastv@36 of ``LIMIT`` questions, dense of 4 questions."""
    root = tmp_path_factory.mktemp("records")
    made = {
        "dense": ["--limit", LIMIT],
        "fastv": ["--selector", "fastv", "--budget", "36", "--limit", LIMIT],
        "dense4": ["--limit", 4],
    }
    for name, args in made.items():
        result = invoke("run", *args, "--out", root / name)
        assert result.exit_code == 0, result.output
    return {"root": root, **{name: root / name for name in made}}


RUN_ARGS = {
    "dense": ["--limit", LIMIT],
    "fastv": ["--selector", "fastv", "--budget", "36", "--limit", LIMIT],
    "dense4": ["--limit", 4],
}
"""The command line of each fixture run (repeated to resume a copy)."""


def copy_run(runs, name: str, target: Path) -> Path:
    shutil.copytree(runs[name], target)
    return target


def readers(run_dir: Path, out: Path) -> list[list]:
    """Every command that reads a run directory, writing (if at all) under ``out``."""
    return [
        ["calibrate", run_dir, "--bootstrap", "10", "--out", out / "calibrate"],
        ["cascade", run_dir, "--reference", run_dir, "--epsilon", "0.5", "--out", out / "cascade"],
        ["visualize", "--run", run_dir, "--question-id", "1", "--out", out / "figure.png"],
        ["intervene", run_dir, "--mode", "remove", "--out", out / "intervene"],
        ["merge", run_dir, "--out", out / "merged"],
    ]


def all_refused(run_dir: Path, runs, tmp_path: Path, *needles: str, resume: list | None = None) -> None:
    """Every reader (and the resume ``resume``, when given) refuses ``run_dir``; no file changes, none is written."""
    before = snapshot(runs["root"], run_dir)
    commands = readers(run_dir, tmp_path / "out") + ([["run", *resume, "--out", run_dir]] if resume else [])
    for command in commands:
        refused(invoke(*command), *needles)
    assert snapshot(runs["root"], run_dir) == before
    assert not (tmp_path / "out").exists()


def rewrite_records(run_dir: Path, change) -> None:
    """Replace the run's records by ``change(table)``, stamped with the run's own id (a forged file)."""
    path = run_dir / "records.parquet"
    table = change(pq.read_table(path))
    run_id = json.loads((run_dir / "manifest.json").read_text())["run_id"]
    pq.write_table(stamped(table, run_id), path)


def edit_manifest(run_dir: Path, **fields) -> None:
    path = run_dir / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# ----- 3. records that are not the run's own are never adopted -------------------------------


def test_records_of_another_selector_copied_into_a_run_are_refused(runs, tmp_path):
    run_dir = copy_run(runs, "dense", tmp_path / "dense")
    shutil.copy(runs["fastv"] / "records.parquet", run_dir / "records.parquet")
    all_refused(
        run_dir,
        runs,
        tmp_path,
        "records.parquet belongs to another run",
        "never adopted",
        "remove it",
        resume=RUN_ARGS["dense"],
    )


def test_records_without_a_manifest_are_refused_never_adopted(runs, tmp_path):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")
    (run_dir / "manifest.json").unlink()
    before = snapshot(run_dir)
    for args in (RUN_ARGS["dense"], RUN_ARGS["fastv"]):
        refused(
            invoke("run", *args, "--out", run_dir), str(run_dir), "records but no manifest.json", "remove the folder"
        )
    refused(
        invoke("calibrate", run_dir, "--bootstrap", "10", "--out", tmp_path / "cal"), "records but no manifest.json"
    )
    refused(invoke("merge", runs["fastv"], "--out", run_dir), "records but no manifest.json")
    assert snapshot(run_dir) == before and not (run_dir / "manifest.json").exists()


def test_records_of_a_larger_limit_are_refused(runs, tmp_path):
    run_dir = copy_run(runs, "dense4", tmp_path / "dense4")
    shutil.copy(runs["dense"] / "records.parquet", run_dir / "records.parquet")  # 6 records in a run of 4
    all_refused(run_dir, runs, tmp_path, "belongs to another run", resume=RUN_ARGS["dense4"])


def test_more_records_than_planned_questions_are_refused_even_with_the_run_id(runs, tmp_path):
    run_dir = copy_run(runs, "dense4", tmp_path / "dense4")
    rewrite_records(run_dir, lambda _: pq.read_table(runs["dense"] / "records.parquet"))
    all_refused(
        run_dir,
        runs,
        tmp_path,
        "holds 6 records for its 4 planned questions",
        "remove the folder",
        resume=RUN_ARGS["dense4"],
    )


def test_records_outside_the_planned_positions_are_refused(runs, tmp_path):
    run_dir = copy_run(runs, "dense4", tmp_path / "dense4")
    order = lambda t: t.schema.get_field_index("order")  # noqa: E731
    # two of four questions, so a resume that missed the check would answer (and write) the other two
    rewrite_records(
        run_dir,
        lambda t: t.slice(0, 2).set_column(
            order(t), t.schema.field("order"), pa.array([o + 100 for o in t["order"][:2].to_pylist()])
        ),
    )
    all_refused(
        run_dir,
        runs,
        tmp_path,
        "holds records outside the positions of its 4 planned questions",
        resume=RUN_ARGS["dense4"],
    )


def test_repeated_keys_with_flipped_answers_are_refused(runs, tmp_path):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")

    def repeat_flipped(table: pa.Table) -> pa.Table:
        repeated = table.slice(0, 3)
        flipped = pa.array(["no" if a == "yes" else "yes" for a in repeated["answer"].to_pylist()], pa.string())
        repeated = repeated.set_column(repeated.schema.get_field_index("answer"), table.schema.field("answer"), flipped)
        return pa.concat_tables([table, repeated])

    rewrite_records(run_dir, repeat_flipped)
    all_refused(
        run_dir, runs, tmp_path, "records.parquet holds 3 questions twice", "remove it", resume=RUN_ARGS["fastv"]
    )


def test_a_part_repeating_a_record_with_other_values_is_refused(runs, tmp_path):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")
    table = pq.read_table(run_dir / "records.parquet").slice(0, 1)
    flipped = table.set_column(
        table.schema.get_field_index("correct"),
        table.schema.field("correct"),
        pa.array([not table["correct"][0].as_py()]),
    )
    (run_dir / "parts").mkdir()
    pq.write_table(flipped, run_dir / "parts" / "part-0-copied.parquet")  # the metadata (run id) travels along
    all_refused(run_dir, runs, tmp_path, "holds two different records of question", resume=RUN_ARGS["fastv"])


def test_resume_refuses_records_of_questions_outside_the_plan(runs, tmp_path):
    run_dir = copy_run(runs, "dense4", tmp_path / "dense4")
    rewrite_records(
        run_dir,
        lambda t: t.set_column(
            0, t.schema.field("question_id"), pa.array([q + 10_000 for q in t["question_id"].to_pylist()])
        ),
    )
    before = snapshot(run_dir)
    refused(
        invoke("run", *RUN_ARGS["dense4"], "--out", run_dir),
        "4 questions outside this run's question list",
        "remove the folder",
    )
    assert snapshot(run_dir) == before


def test_merge_writes_its_manifest_before_the_records(runs, tmp_path, monkeypatch):
    """An interrupted merge leaves a manifest without records (resumable), never records without a manifest."""
    import prune_audit.runner.merge as merge

    def interrupted(table, path):
        raise KeyboardInterrupt

    target = tmp_path / "merged"
    monkeypatch.setattr(merge, "write_table_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge.merge_runs([runs["fastv"]], target)
    assert (target / "manifest.json").is_file() and not (target / "records.parquet").exists()
    monkeypatch.undo()
    assert invoke("merge", runs["fastv"], "--out", target).exit_code == 0
    merged, source = (repr(pq.read_table(d / "records.parquet").to_pylist()) for d in (target, runs["fastv"]))
    assert merged == source  # repr: NaN retention of "no" questions compares equal


def test_every_records_file_carries_the_manifest_run_id(runs):
    for name in ("dense", "fastv", "dense4"):
        manifest = json.loads((runs[name] / "manifest.json").read_text())
        metadata = pq.read_schema(runs[name] / "records.parquet").metadata
        assert manifest["run_id"] == run_id_of(manifest) == metadata[b"prune_audit.run_id"].decode()
    ids = {json.loads((runs[name] / "manifest.json").read_text())["run_id"] for name in ("dense", "fastv", "dense4")}
    assert len(ids) == 3


# ----- 5. question ids and the manifest's declared schema -----------------------------------


@pytest.mark.parametrize("question_id", [2**63, -1, "1e3", True, 1.5])
def test_question_ids_outside_int64_are_refused_before_the_run_directory(runs, tmp_path, question_id):
    from prune_audit.demo.assets import demo_assets

    assets = demo_assets()
    lines = assets.pope_files[0].read_text().splitlines()
    row = json.loads(lines[0])
    pope = tmp_path / "coco_pope_random.json"
    pope.write_text("\n".join([json.dumps({**row, "question_id": question_id}), *lines[1:4]]) + "\n")
    out = tmp_path / "run"
    refused(
        invoke("run", "--pope", pope, "--images", assets.images_dir, "--annotations", assets.annotations, "--out", out),
        f"{pope}:1: question_id must be an integer from 0 to 2**63-1",
        "fix the question file",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"selector": "fastv"}, ["field 'selector' must be an object", 'got string "fastv"']),
        ({"selector": None}, ["field 'selector' must be an object", "got null"]),
        ({"model": "demo"}, ["field 'model' must be an object with id, config_hash"]),
        ({"question_files": "coco_pope_random.json"}, ["field 'question_files' must be a non-empty list"]),
        ({"images": "images"}, ["field 'images' must be an object with path, sha256, files"]),
        (
            {"annotations": {"path": "a.json"}},
            ["field 'annotations' must be null or an object with path, sha256 (it lacks sha256)"],
        ),
        ({"budget": "abc"}, ["field 'budget' must be null or a positive number of visual tokens"]),
        ({"budget": None}, ["field 'budget' must be null exactly for the unpruned run"]),
        ({"num_questions": -1}, ["field 'num_questions' must be a positive integer, got integer -1"]),
        ({"limit": 3.5}, ["field 'limit' must be null or a positive integer"]),
        ({"realised_visual_tokens_avg": "32"}, ["field 'realised_visual_tokens_avg' must be null or a finite"]),
        ({"limit": 5}, ["field 'run_id' does not match the configuration fields (the manifest was edited)"]),
    ],
)
def test_manifest_fields_of_the_wrong_type_or_domain_are_refused_by_every_reader(runs, tmp_path, fields, needles):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")
    edit_manifest(run_dir, **fields)
    all_refused(
        run_dir,
        runs,
        tmp_path,
        "manifest.json: ",
        *needles,
        "re-run with this version into a new --out",
        resume=RUN_ARGS["fastv"],
    )


def test_the_declared_schema_covers_every_documented_manifest_key(runs):
    assert set(MANIFEST_SCHEMA) == {key for key, _ in MANIFEST_KEYS}
    for name in ("dense", "fastv", "dense4"):
        assert set(json.loads((runs[name] / "manifest.json").read_text())) <= set(MANIFEST_SCHEMA)


@pytest.mark.parametrize("text", ["[1, 2]", '"manifest"', "null", "7"])
def test_a_manifest_that_is_no_json_object_names_its_type(runs, tmp_path, text):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")
    (run_dir / "manifest.json").write_text(text)
    all_refused(
        run_dir,
        runs,
        tmp_path,
        "manifest.json holds a JSON",
        "not a run manifest (an object)",
        "remove the folder",
        resume=RUN_ARGS["fastv"],
    )


# ----- 13. damaged files are named; folders where files belong are found before the model --------


@pytest.mark.parametrize(
    ("content", "reason"), [(b"", "file size is 0 bytes"), (b"not parquet\n", "magic bytes not found")]
)
def test_damaged_records_files_are_named(runs, tmp_path, content, reason):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")
    (run_dir / "records.parquet").write_bytes(content)
    all_refused(
        run_dir,
        runs,
        tmp_path,
        f"{run_dir / 'records.parquet'} is not a readable Parquet file",
        reason,
        "remove it",
        resume=RUN_ARGS["fastv"],
    )


def test_a_damaged_part_file_is_named(runs, tmp_path):
    run_dir = copy_run(runs, "fastv", tmp_path / "fastv")
    (run_dir / "parts").mkdir()
    part = run_dir / "parts" / "part-0-damaged.parquet"
    part.write_bytes(b"PAR1 truncated")
    all_refused(run_dir, runs, tmp_path, f"{part} is not a readable Parquet file", resume=RUN_ARGS["fastv"])


@pytest.mark.parametrize("name", ["records.parquet", "manifest.json"])
def test_a_folder_where_a_run_file_belongs_is_refused_before_answering(runs, tmp_path, name, monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / name).mkdir(parents=True)
    (run_dir / name / "keep.txt").write_text("keep me")
    if name == "records.parquet":
        shutil.copy(runs["dense"] / "manifest.json", run_dir / "manifest.json")
    before = snapshot(run_dir)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("prune_audit.models.load_vlm", no_model)
    refused(invoke("run", *RUN_ARGS["dense"], "--out", run_dir), f"{run_dir / name} is not a file", "remove it")
    monkeypatch.undo()
    refused(invoke("calibrate", run_dir, "--bootstrap", "10", "--out", tmp_path / "cal"), f"{run_dir / name}")
    assert snapshot(run_dir) == before


def test_a_parts_file_where_the_parts_folder_belongs_is_refused(runs, tmp_path):
    run_dir = copy_run(runs, "dense", tmp_path / "dense")
    (run_dir / "parts").write_text("not a folder")
    all_refused(run_dir, runs, tmp_path, f"{run_dir / 'parts'} is not a folder", resume=RUN_ARGS["dense"])
