"""Issue 44 items 1-3, issue 47 items 3 and 6 (`--out` a dangling link): what a command may write.

A command writes only into its own folder, and never through a symbolic link it did not make (no command
makes one): a link anywhere inside its folder is refused, a file written beside the user's files (``export``)
never lands in another command's folder, a refusal leaves every pre-existing byte as it was, names that
cannot be written are refused before the first byte, and a failure after the first byte leaves nothing
that blocks the corrected retry.

Every refusal: exit code 2, one ``error:`` line naming cause and fix, no traceback, bytes unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import refused, snapshot
from test_interchange import question_args
from test_run_cli import base_args
from test_task_parquet import pope_parquet
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError
from prune_audit.safety.names import check_file_names
from prune_audit.safety.ownership import check_owned_paths

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def stats(folder: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time (ns) of everything under ``folder``, hidden files and the lock included."""
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def made(workspace, tmp_path_factory) -> dict[str, Path]:
    """A dense and a random@6 run of the workspace (24 questions), their calibration, a Parquet-input run."""
    root = tmp_path_factory.mktemp("writes")
    dense, pruned, calibration = root / "dense", root / "pruned", root / "calibration"
    for out, extra in ((dense, ()), (pruned, ("--selector", "random", "--budget", "6"))):
        result = invoke(*base_args(workspace, out, *extra, "--limit", "24", "--quiet"))
        assert result.exit_code == 0, result.output
    result = invoke("calibrate", pruned, "--reference", dense, "--bootstrap", "20", "--out", calibration)
    assert result.exit_code == 0, result.output
    return {"root": root, "dense": dense, "pruned": pruned, "calibration": calibration}


def parquet_run_args(workspace, parquet: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--model",
        workspace["model"],
        "--annotations",
        workspace["instances"],
        "--questions",
        parquet,
        "--limit",
        "6",
        "--quiet",
        "--out",
        out,
        *extra,
    ]


# ----- 44.1: never through a link the command did not make ---------------------------------------------------


def test_a_linked_images_folder_of_a_parquet_run_is_refused_and_the_users_file_kept(workspace, tmp_path):
    parquet = pope_parquet(workspace, tmp_path / "pope.parquet")
    out = tmp_path / "out"
    assert invoke(*parquet_run_args(workspace, parquet, out)).exit_code == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    for image in (out / "images").iterdir():  # the user's files under the names the run writes
        (victim / image.name).write_bytes(b"the user's own file")
    (out / "images").rename(tmp_path / "moved-away")
    (out / "images").symlink_to(victim)
    before, kept = snapshot(victim), snapshot(out)
    refused(
        invoke(*parquet_run_args(workspace, parquet, out)),
        f"{out / 'images'} is a symbolic link",
        "did not make",
        "remove the link",
    )
    assert snapshot(victim) == before and snapshot(out) == kept


@pytest.mark.parametrize("where", ["parts", "figures/sub"])
def test_a_link_anywhere_inside_a_commands_folder_is_refused_before_writing(workspace, tmp_path, where):
    out = tmp_path / "run"
    args = base_args(workspace, out, "--limit", "4", "--quiet")
    assert invoke(*args).exit_code == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("notes")
    link = out / where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    before = snapshot(out, victim)
    refused(invoke(*args), str(link), "symbolic link", "remove the link")
    assert snapshot(out, victim) == before and sorted(p.name for p in victim.iterdir()) == ["notes.txt"]


def test_a_lock_file_linked_to_a_users_file_is_never_written_through(workspace, tmp_path):
    users = tmp_path / "diary.txt"
    users.write_text("the user's own file")
    out = tmp_path / "empty"
    out.mkdir()
    (out / ".prune-audit.lock").symlink_to(users)
    refused(
        invoke(*base_args(workspace, out, "--limit", "2", "--quiet")),
        ".prune-audit.lock is a symbolic link",
        "remove the link",
    )
    assert users.read_text() == "the user's own file" and os.listdir(out) == [".prune-audit.lock"]


def test_visualize_never_draws_through_a_linked_figures_folder(made, tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.mkdir()
    monkeypatch.chdir(tmp_path)
    Path("figures").symlink_to(victim)
    row = pq.read_table(made["dense"] / "records.parquet").to_pylist()[0]
    args = ["visualize", "--run", made["dense"], "--question-id", row["question_id"], "--split", row["split"]]
    refused(invoke(*args), "figures is a symbolic link", "remove the link")
    assert list(victim.iterdir()) == []
    Path("figures").unlink()
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert len(list(Path("figures").rglob("*.png"))) == 1


def test_owned_paths_are_checked_part_by_part(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "images")
    check_owned_paths(tmp_path, [tmp_path / "images" / "new.png", tmp_path / "new" / "deep.png"])
    for path, needle in (
        (tmp_path / "images" / "a.png", "is a folder, where a file is written"),
        (tmp_path / "file" / "b.png", "is a file, where a folder is written"),
        (tmp_path / "link" / "c.png", "symbolic link"),
    ):
        with pytest.raises(PruneAuditError, match=needle):
            check_owned_paths(tmp_path, [path])


# ----- 44.2: export follows the ownership rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("dense/kept.jsonl", "holds the outputs of prune-audit run"),
        ("pruned/kept.parquet", "holds the outputs of prune-audit run"),
        ("calibration/kept.jsonl", "holds the outputs of prune-audit calibrate"),
        ("dense/parts/kept.jsonl", "lies inside"),
    ],
)
def test_export_never_writes_into_a_commands_folder(made, target, needle):
    before = snapshot(made["dense"], made["pruned"], made["calibration"])
    out = made["root"] / target
    refused(invoke("export", made["dense"], "--out", out), needle, "export never writes there", "another --out")
    assert snapshot(made["dense"], made["pruned"], made["calibration"]) == before and not out.exists()
    assert not (made["dense"] / "parts").exists()


def test_export_beside_the_users_files_writes_its_file(made, tmp_path):
    out = tmp_path / "exports" / "kept.jsonl"
    (tmp_path / "notes.txt").write_text("notes")
    result = invoke("export", made["dense"], "--out", out)
    assert result.exit_code == 0, result.output
    assert out.is_file() and (tmp_path / "notes.txt").read_text() == "notes"


# ----- 44.3: a refused command leaves every pre-existing byte ------------------------------------------------


def test_a_refused_import_into_its_earlier_folder_changes_nothing(made, workspace, tmp_path):
    kept = tmp_path / "kept.jsonl"
    assert invoke("export", made["pruned"], "--out", kept).exit_code == 0
    out = tmp_path / "imported"
    args = ["import", kept, "--geometry", workspace["model"], *question_args(workspace), "--out", out, "--quiet"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    lines = kept.read_text().splitlines()
    line = json.loads(lines[1])
    line["answer"]["p_yes"], line["answer"]["p_no"] = line["answer"]["p_yes"] / 2, line["answer"]["p_no"] / 2
    kept.write_text("\n".join([lines[0], json.dumps(line), *lines[2:]]) + "\n")
    before, times = snapshot(out), stats(out)
    refused(invoke(*args), str(out), "different configuration", "another --out")
    assert snapshot(out) == before and stats(out) == times


# ----- 47.3: check before the first byte; a failure after it leaves nothing that blocks the retry -------------


def renamed_image(parquet: Path, names: dict[int, str]) -> None:
    """Give rows of ``parquet`` other ``image_source`` names (row index -> name)."""
    table = pq.read_table(parquet)
    sources = table.column("image_source").to_pylist()
    for row, name in names.items():
        sources[row] = name
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("image_source"), "image_source", pa.array(sources, type=pa.string())
        ),
        parquet,
    )


@pytest.mark.parametrize(
    ("names", "needle"),
    [
        ({0: "scene\x00.png"}, "NUL byte"),
        ({0: "s" * 300 + ".png"}, "over the 255 a file system allows"),
        ({0: "a.png", 1: "a.png/b.png"}, "names both a file and the folder of"),
    ],
)
def test_parquet_image_names_that_cannot_be_written_are_refused_before_the_folder(workspace, tmp_path, names, needle):
    parquet = pope_parquet(workspace, tmp_path / "pope.parquet")
    renamed_image(parquet, names)
    out = tmp_path / "out"
    refused(invoke(*parquet_run_args(workspace, parquet, out)), "image_source", needle)
    assert not out.exists()


def test_a_failure_after_the_first_write_leaves_nothing_that_blocks_the_retry(workspace, tmp_path, monkeypatch):
    from prune_audit.records.store import RecordStore

    parquet = pope_parquet(workspace, tmp_path / "pope.parquet")
    out = tmp_path / "runs" / "out"
    append = RecordStore.append

    def fails(self, rows):
        assert (out / "manifest.json").is_file() and any((out / "images").iterdir())  # written before it fails
        raise PruneAuditError("a record cannot be stored; fix the input")

    monkeypatch.setattr(RecordStore, "append", fails)
    refused(invoke(*parquet_run_args(workspace, parquet, out)), "cannot be stored")
    assert not (tmp_path / "runs").exists()
    monkeypatch.setattr(RecordStore, "append", append)
    # the corrected command (other settings) runs into the same --out
    result = invoke(*parquet_run_args(workspace, parquet, out, "--selector", "random", "--budget", "6"))
    assert result.exit_code == 0, result.output


def test_a_failure_in_an_existing_empty_folder_gives_it_back_empty(made, workspace, tmp_path, monkeypatch):
    from prune_audit.records.store import RecordStore

    out = tmp_path / "empty"
    out.mkdir()
    monkeypatch.setattr(RecordStore, "append", lambda self, rows: (_ for _ in ()).throw(OSError(5, "I/O error")))
    result = invoke(*base_args(workspace, out, "--limit", "4", "--quiet"))
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert out.is_dir() and [p.name for p in out.iterdir() if not p.name.startswith(".prune-audit.lock")] == []


def test_a_resumed_runs_files_are_kept_when_it_fails(made, workspace, tmp_path, monkeypatch):
    from prune_audit.records.store import RecordStore

    out = tmp_path / "run"
    assert invoke(*base_args(workspace, out, "--limit", "4", "--quiet")).exit_code == 0
    before = snapshot(out)
    monkeypatch.setattr(RecordStore, "append", lambda self, rows: (_ for _ in ()).throw(OSError(5, "I/O error")))
    assert invoke(*base_args(workspace, out, "--limit", "8", "--quiet")).exit_code != 0
    assert all(snapshot(out).get(name) == content for name, content in before.items())


def test_file_names_are_checked_before_writing():
    check_file_names(["a.png", "b/a.png", "é" * 125 + ".png"], "names")
    for names, needle in (
        (["x\0.png"], "NUL"),
        (["d/" + "x" * 256], "256 bytes"),
        (["a", "a/b/c.png"], "folder of"),
        (["a.png", "./a.png"], "name the same file"),
        (["x/.."], "leads outside"),
        ([""], "names a folder"),
        (["\ud800.png"], "not valid UTF-8"),
    ):
        with pytest.raises(PruneAuditError, match=needle):
            check_file_names(names, "names")


# ----- 47.6: --out a dangling link ---------------------------------------------------------------------------


@pytest.mark.parametrize("below", [False, True])
def test_out_a_dangling_link_names_cause_and_fix(made, workspace, tmp_path, below):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    out = link / "run" if below else link
    refused(
        invoke(*base_args(workspace, out, "--limit", "2")),
        f"{link} is a symbolic link to {tmp_path / 'gone'}",
        "does not exist",
        "create that folder",
    )
    refused(invoke("calibrate", made["pruned"], "--reference", made["dense"], "--out", out), "does not exist")
    assert os.listdir(tmp_path) == ["link"]


def test_an_import_that_fails_while_storing_leaves_nothing_that_blocks_the_corrected_import(made, workspace, tmp_path):
    kept = tmp_path / "kept.jsonl"
    assert invoke("export", made["pruned"], "--out", kept).exit_code == 0
    lines = kept.read_text().splitlines()
    line = json.loads(lines[1])
    line["cost"] = {**(line["cost"] or {}), "flop_equivalent_tokens": 10**15, "flops": 10**30}
    huge = tmp_path / "huge.jsonl"
    huge.write_text("\n".join([lines[0], json.dumps(line), *lines[2:]]) + "\n")
    out = tmp_path / "imported"
    common = ["--geometry", workspace["model"], *question_args(workspace), "--out", out, "--quiet"]
    assert invoke("import", huge, *common).exit_code != 0  # refused, by its checks or when stored
    assert not out.exists()
    result = invoke("import", kept, *common)
    assert result.exit_code == 0, result.output
