"""Issues 44 (items 4 and 9) and 47 (item 6), the read side: what a command may read and what it refuses
before parsing (``prune_audit.safety.inputs``).

Every input path that is not a regular file (a FIFO, a link to ``/dev/zero``, a folder) is refused by kind in
one line naming the file, the cause and the fix, by every reader and command; JSON nested 100,000 deep is
refused before Python's parser recurses; a file over the size limit is refused before it is read; an image
name from an input file cannot leave the images folder.

No test can hang on a FIFO: the ``special`` fixture keeps a writer thread knocking on the FIFO, so a reader
that wrongly opened it would get end-of-file (and fail its test) instead of blocking for ever.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_checks import refused, snapshot
from test_gqa import gqa_args, gqa_inputs
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError

runner = CliRunner()
DEEP = 100_000
KINDS = {"fifo": "is a FIFO", "zero": "is a character device", "folder": "is a folder"}


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


class FifoWriter:
    """Opens the FIFO for writing and closes it again, over and over: a reader that opened the FIFO would
    see end-of-file instead of waiting for a writer."""

    def __init__(self, path: Path) -> None:
        self.path, self.stopped = path, False
        self.thread = threading.Thread(target=self._knock, daemon=True)
        self.thread.start()

    def _knock(self) -> None:
        while not self.stopped:
            with open(self.path, "wb"):
                pass

    def stop(self) -> None:
        self.stopped = True
        descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # lets a waiting open() return
        self.thread.join()
        os.close(descriptor)


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """``{kind: (folder, name)}``: a FIFO, a link to /dev/zero and a folder, each named NAME in its own folder.

    ``path(kind, name)`` gives FOLDER/NAME for any name (a reader's expected suffix: ``kept.jsonl``).
    """
    root = tmp_path_factory.mktemp("special")
    writers = []

    def path(kind: str, name: str = "input.json") -> Path:
        target = root / kind / name
        if not target.exists() and not target.is_symlink():
            target.parent.mkdir(exist_ok=True)
            if kind == "fifo":
                os.mkfifo(target)
                writers.append(FifoWriter(target))
            elif kind == "zero":
                target.symlink_to("/dev/zero")
            else:
                target.mkdir()
        return target

    yield path
    for writer in writers:
        writer.stop()


def deep_json(inner: str = "0") -> str:
    return "[" * DEEP + inner + "]" * DEEP


# ----- the rule itself ----------------------------------------------------------------------------------------


def test_json_depth_is_counted_without_recursion_and_ignores_brackets_in_strings():
    from prune_audit.safety.inputs import MAX_JSON_DEPTH, json_depth, loads_json

    assert json_depth(deep_json()) == MAX_JSON_DEPTH + 1
    assert json_depth('{"a": [1, {"b": "[[[[}}"}], "c": "\\"]"}') == 3
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_json(nested, "x") == json.loads(nested)
    with pytest.raises(PruneAuditError, match=rf"^f.json:3: JSON nested more than {MAX_JSON_DEPTH} levels deep"):
        loads_json("[" + nested + "]", "f.json:3")


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(workspace, monkeypatch):
    from prune_audit.data.pope import load_pope

    path = workspace["pope"][0]
    monkeypatch.setenv("PRUNE_AUDIT_MAX_INPUT_BYTES", "100")
    with pytest.raises(
        PruneAuditError,
        match=rf"question file {path} holds {path.stat().st_size} bytes, more than "
        r"the input limit of 100; .*PRUNE_AUDIT_MAX_INPUT_BYTES=<bytes>",
    ):
        load_pope(path)
    monkeypatch.setenv("PRUNE_AUDIT_MAX_INPUT_BYTES", "lots")
    with pytest.raises(PruneAuditError, match="PRUNE_AUDIT_MAX_INPUT_BYTES must be a positive whole number"):
        load_pope(path)


@pytest.mark.parametrize("name", ["../../../x/victim.png", "/abs/victim.png", "C:\\victim.png", "a/../../b.png"])
def test_path_under_refuses_a_name_that_leaves_its_folder(tmp_path, name):
    from prune_audit.safety.inputs import path_under

    assert path_under(tmp_path, "sub/a.png", "q.jsonl:1") == tmp_path / "sub" / "a.png"
    with pytest.raises(PruneAuditError, match="q.jsonl:1: image .* leads outside the images folder"):
        path_under(tmp_path, name, "q.jsonl:1")


# ----- every reader refuses special files by kind -------------------------------------------------------------


def _readers():
    from prune_audit.data import answers, captions, coco, gqa, images, lmms_parquet, pope, pope_score, scienceqa
    from prune_audit.records import interchange

    return {
        "pope questions": (pope.load_pope, "questions.jsonl", "question file"),
        "llava gqa questions": (gqa.load_llava_gqa, "questions.jsonl", "question file"),
        "gqa question json": (gqa.read_gqa_questions, "questions.json", "JSON file"),
        "gqa scene graphs": (gqa.load_scene_graphs, "graphs.json", "scene-graph file"),
        "scienceqa questions": (scienceqa.load_scienceqa, "questions.json", "JSON file"),
        "coco instances": (coco.CocoInstances.load, "instances.json", "annotations file"),
        "coco captions": (captions.read_coco_captions, "captions.json", "JSON file"),
        "llava answers": (answers.load_llava_answers, "answers.jsonl", "answers file"),
        "pope answers": (pope_score.load_answers, "answers.jsonl", "answers file"),
        "kept sets (jsonl)": (interchange.read_kept_sets, "kept.jsonl", "kept-set file"),
        "kept sets (parquet)": (interchange.read_kept_sets, "kept.parquet", "kept-set file"),
        "lmms-eval parquet": (lmms_parquet.read_pope_parquet, "pope.parquet", "Parquet file"),
        "image": (images.open_rgb, "image.png", "image"),
    }


READERS = list(_readers())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_special_file_by_kind(special, reader, kind):
    read, name, role = _readers()[reader]
    path = special(kind, name)
    with pytest.raises(PruneAuditError) as refusal:
        read(path)
    message = str(refusal.value)
    assert message.startswith(f"{role} {path}") and KINDS[kind] in message and "not a regular file" in message
    assert "; " in message and "not found" not in message
    if kind == "zero":
        assert "(a link to /dev/zero)" in message


# ----- deep JSON, on every JSON reader ------------------------------------------------------------------------


def _deep_files(folder: Path, workspace) -> dict[str, tuple]:
    from prune_audit.data import answers, coco, gqa, pope

    first = json.loads(workspace["pope"][0].read_text().splitlines()[0])
    line = json.dumps(first)[:-1] + f', "extra": {deep_json()}}}\n'
    folder.mkdir(exist_ok=True)
    files = {
        "pope line": (pope.load_pope, line),
        "gqa line": (gqa.load_llava_gqa, line),
        "answers line": (answers.load_llava_answers, '{"question_id": 1, "text": "yes", "x": ' + deep_json() + "}\n"),
        "instances": (coco.CocoInstances.load, '{"images": ' + deep_json() + "}"),
    }
    return {
        name: (read, _write(folder / f"{index}.jsonl", text))
        for index, (name, (read, text)) in enumerate(files.items())
    }


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_json_nested_100000_deep_is_refused_by_every_json_reader(workspace, tmp_path):
    for read, path in _deep_files(tmp_path, workspace).values():
        with pytest.raises(PruneAuditError, match=rf"^{path}(:1)?: JSON nested more than 64 levels deep"):
            read(path)


# ----- the commands: one line naming the file, the cause and the fix; nothing written --------------------------


def _pope_args(ws, *, pope=None, images=None, annotations=None) -> list:
    return [
        "--model",
        ws["model"],
        "--pope",
        pope or ws["pope"][0],
        "--images",
        images or ws["images"],
        "--annotations",
        annotations or ws["instances"],
    ]


def _answers(tmp_path: Path, ws) -> Path:
    lines = [json.loads(line) for line in ws["pope"][0].read_text().splitlines()]
    return _write(
        tmp_path / "answers.jsonl",
        "".join(json.dumps({"question_id": q["question_id"], "text": "yes"}) + "\n" for q in lines),
    )


def _commands(ws, tmp_path: Path, path, out: Path) -> dict[str, tuple[list, str]]:
    """Each command with one input replaced by ``path(name)``: (arguments, the role the refusal names)."""
    image = min(Path(ws["images"]).glob("*.png"))
    first_image = json.loads(ws["pope"][0].read_text().splitlines()[0])["image"]
    return {
        "run image": (["run", *_pope_args(ws, images=path(first_image).parent), "--limit", "1", "--out", out], "image"),
        "run --pope": (["run", *_pope_args(ws, pope=path("q.json")), "--limit", "2", "--out", out], "question file"),
        "run --annotations": (
            ["run", *_pope_args(ws, annotations=path("a.json")), "--limit", "2", "--out", out],
            "annotations file",
        ),
        "run --task gqa --questions": (
            [
                "run",
                "--task",
                "gqa",
                "--model",
                ws["model"],
                "--questions",
                path("q.jsonl"),
                "--images",
                ws["images"],
                "--out",
                out,
            ],
            "question file",
        ),
        "run --task gqa scene graphs": (
            gqa_args(ws, {**gqa_inputs(ws, tmp_path / "gqa"), "graphs": path("g.json")}, out),
            "scene-graph file",
        ),
        "study --annotations": (
            [
                "study",
                *_pope_args(ws, annotations=path("a.json")),
                "--limit",
                "2",
                "--selectors",
                "random",
                "--budgets",
                "4",
                "--out",
                out,
            ],
            "annotations file",
        ),
        "score answers": (["score", path("answers.jsonl"), "--questions", ws["pope"][0]], "answers file"),
        "score --questions": (["score", _answers(tmp_path, ws), "--questions", path("q.json")], "question file"),
        "import": (
            [
                "import",
                path("kept.jsonl"),
                "--geometry",
                ws["model"],
                "--pope",
                ws["pope"][0],
                "--images",
                ws["images"],
                "--annotations",
                ws["instances"],
                "--out",
                out,
            ],
            "kept-set file",
        ),
        "import --pope": (
            [
                "import",
                _kept_set(tmp_path, ws),
                "--geometry",
                ws["model"],
                "--pope",
                path("q.json"),
                "--images",
                ws["images"],
                "--annotations",
                ws["instances"],
                "--out",
                out,
            ],
            "question file",
        ),
        "visualize image": (["visualize", path("image.png"), "--model", ws["model"], "--out", out], "image"),
        "visualize --annotations": (
            ["visualize", image, "--model", ws["model"], "--annotations", path("a.json"), "--out", out],
            "annotations file",
        ),
    }


def _kept_set(tmp_path: Path, ws) -> Path:
    first = json.loads(ws["pope"][0].read_text().splitlines()[0])
    header = {"format": "prune-audit-kept-sets", "version": 1, "task": "pope", "selector": "mine", "budget": 4}
    line = {
        "question_id": first["question_id"],
        "split": "random",
        "image": first["image"],
        "stages": [{"layer": 0, "kept": [1, 2, 3, 4]}],
        "answer": {"text": "yes", "probability": 0.8},
    }
    return _write(tmp_path / "kept.jsonl", json.dumps(header) + "\n" + json.dumps(line) + "\n")


COMMANDS = [
    "run image",
    "run --pope",
    "run --annotations",
    "run --task gqa --questions",
    "run --task gqa scene graphs",
    "study --annotations",
    "score answers",
    "score --questions",
    "import",
    "import --pope",
    "visualize image",
    "visualize --annotations",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_a_special_input_naming_its_kind(workspace, special, tmp_path, command, kind):
    out = tmp_path / "out"
    args, role = _commands(workspace, tmp_path, lambda name: special(kind, name), out)[command]
    before = snapshot(tmp_path)
    line = refused(invoke(*args), f"{role} ", KINDS[kind], "not a regular file to read; ")
    assert "not found" not in line
    assert not out.exists() and snapshot(tmp_path) == before


def test_deep_json_in_an_import_line_and_a_score_answers_line_is_one_line(workspace, tmp_path):
    kept = _kept_set(tmp_path, workspace)
    kept.write_text(kept.read_text().rstrip("\n")[:-1] + f', "extra": {deep_json()}}}\n')
    refused(
        invoke(
            "import",
            kept,
            "--geometry",
            workspace["model"],
            "--pope",
            workspace["pope"][0],
            "--images",
            workspace["images"],
            "--out",
            tmp_path / "out",
        ),
        f"{kept} line 2: JSON nested more than 64 levels",
    )
    answers = _write(tmp_path / "deep.jsonl", '{"question_id": 1, "text": "yes", "x": ' + deep_json() + "}\n")
    refused(invoke("score", answers, "--questions", workspace["pope"][0]), f"{answers}:1: JSON nested more than 64")
    assert not (tmp_path / "out").exists()


# ----- item 9: an instances file_name cannot leave --images ----------------------------------------------------


@pytest.mark.parametrize("escape", ["../victim/victim.png", "absolute"])
def test_a_caption_run_never_reads_an_image_outside_images(workspace, tmp_path, escape):
    victim = tmp_path / "victim" / "victim.png"
    victim.parent.mkdir()
    images = tmp_path / "images"
    images.mkdir()
    data = json.loads(Path(workspace["instances"]).read_text())
    first = data["images"][0]
    shutil.copy(Path(workspace["images"]) / first["file_name"], victim)
    first["file_name"] = str(victim) if escape == "absolute" else escape
    instances = _write(tmp_path / "instances.json", json.dumps(data))
    out = tmp_path / "out"
    refused(
        invoke(
            "run",
            "--task",
            "caption",
            "--model",
            workspace["model"],
            "--questions",
            instances,
            "--images",
            images,
            "--limit",
            "1",
            "--out",
            out,
        ),
        f"{instances}: image {first['image_id'] if 'image_id' in first else first['id']}",
        "leads outside the images folder",
        "name image files relative to --images",
    )
    assert not out.exists()


# ----- issue 47 item 6: messages that name the right cause ----------------------------------------------------


def test_a_binary_jsonl_import_names_the_file_and_line(workspace, tmp_path):
    kept = _write(tmp_path / "kept.jsonl", "")
    kept.write_bytes(b'{"format": "prune-audit-kept-sets"}\n\xff\xfe\x00binary\n')
    refused(
        invoke(
            "import",
            kept,
            "--geometry",
            workspace["model"],
            "--pope",
            workspace["pope"][0],
            "--images",
            workspace["images"],
            "--out",
            tmp_path / "out",
        ),
        f"{kept} line 2: not UTF-8 text (byte 0xff)",
        "prune-audit export",
    )


def test_a_parquet_kept_set_with_a_bad_header_names_the_header(workspace, tmp_path):
    kept = tmp_path / "kept.parquet"
    table = pa.table({"question_id": [1]}).replace_schema_metadata({b"prune_audit.interchange": b"{not json"})
    pq.write_table(table, kept)
    line = refused(
        invoke(
            "import",
            kept,
            "--geometry",
            workspace["model"],
            "--pope",
            workspace["pope"][0],
            "--images",
            workspace["images"],
            "--out",
            tmp_path / "out",
        ),
        f"{kept}: the interchange header",
        "is not JSON",
        "docs/interchange.md",
    )
    assert "Expecting property name" not in line.split("(")[0]


def test_a_non_digit_gqa_parquet_id_is_one_line(tmp_path):
    from prune_audit.data.lmms_parquet import read_gqa_parquet_questions

    path = tmp_path / "testdev_balanced_instructions.parquet"
    pq.write_table(pa.table({"id": ["12a"], "imageId": ["n1"], "question": ["What?"], "answer": ["cup"]}), path)
    with pytest.raises(PruneAuditError, match=rf"{path}: row 0: question_id must be digits .* got '12a'"):
        read_gqa_parquet_questions([path])


def test_image_token_in_a_question_is_refused_before_the_run(workspace, tmp_path):
    first = json.loads(workspace["pope"][0].read_text().splitlines()[0])
    pope = _write(tmp_path / "pope_random.json", json.dumps({**first, "text": first["text"] + "\n<image>"}) + "\n")
    out = tmp_path / "out"
    refused(
        invoke("run", *_pope_args(workspace, pope=pope), "--out", out),
        "holds '<image>', a special token",
        "remove it from the question",
    )
    assert not out.exists()


def test_the_api_refuses_an_image_token_and_an_image_without_pixels(workspace):
    from PIL import Image

    from prune_audit import load, pruned

    vlm = load(str(workspace["model"]), device="cpu", threads=1)
    image = min(Path(workspace["images"]).glob("*.png"))
    with pruned(vlm, "random", budget=4) as model:
        with pytest.raises(PruneAuditError, match="holds '<image>', a special token .* remove it from the question"):
            model.answer(image, "Is there a <image> in the image?")
        for size in [(0, 0), (5, 0)]:
            with pytest.raises(PruneAuditError, match=rf"is {size[0]}x{size[1]} pixels.*pass an image with pixels"):
                model.answer(Image.new("RGB", size), "Is there a circle in the image?")
