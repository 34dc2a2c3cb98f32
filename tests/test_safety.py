"""The shared safety mechanisms (prune_audit.safety) and the data-layer validation, as units.

Real processes where the property is about processes: a live lock holder, a killed
one (stale lock), and two builders of one demo cache.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prune_audit.errors import PruneAuditError
from prune_audit.safety import progress
from prune_audit.safety.atomic import remove_partial_files, write_atomic, write_text_atomic
from prune_audit.safety.fingerprint import first_differing_image, images_fingerprint
from prune_audit.safety.lock import DirectoryLock
from prune_audit.safety.names import check_plain_name
from prune_audit.safety.ownership import OWNER_FILE, check_output_dir, hold_output_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


# ----- ownership -----------------------------------------------------------------------


def test_new_and_empty_directories_are_accepted_a_users_folder_is_not(tmp_path):
    assert check_output_dir(tmp_path / "new", "calibrate") == tmp_path / "new"
    (tmp_path / "mine").mkdir()
    check_output_dir(tmp_path / "mine", "calibrate")
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(PruneAuditError, match=r"already holds files that no prune-audit calibrate wrote \(notes.txt\)"):
        check_output_dir(tmp_path / "mine", "calibrate")
    check_output_dir(tmp_path / "mine", "visualize", shared=True)


def test_existing_file_and_file_parent_are_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PruneAuditError, match="is an existing file"):
        check_output_dir(tmp_path / "f", "run")
    with pytest.raises(PruneAuditError, match="is a file, not a folder"):
        check_output_dir(tmp_path / "f" / "sub", "run")


def test_another_commands_directory_is_refused_by_marker_and_by_files(tmp_path):
    with hold_output_dir(tmp_path / "cal", "calibrate", {"bins": 15}):
        (tmp_path / "cal" / "calibration.json").write_text("{}")
    with pytest.raises(PruneAuditError, match=r"holds the outputs of prune-audit calibrate"):
        check_output_dir(tmp_path / "cal", "cascade")
    legacy = tmp_path / "legacy-run"
    legacy.mkdir()
    (legacy / "manifest.json").write_text("{}")
    with pytest.raises(PruneAuditError, match=r"legacy-run holds the outputs of prune-audit run \(manifest.json\)"):
        check_output_dir(legacy, "intervene")


def test_same_command_other_settings_is_refused(tmp_path):
    with hold_output_dir(tmp_path / "cal", "calibrate", {"bins": 15, "seed": 0}):
        (tmp_path / "cal" / "calibration.json").write_text("{}")
    check_output_dir(tmp_path / "cal", "calibrate", {"bins": 15, "seed": 0})
    with pytest.raises(PruneAuditError, match=r"other settings \(bins\)"):
        check_output_dir(tmp_path / "cal", "calibrate", {"bins": 10, "seed": 0})
    assert json.loads((tmp_path / "cal" / OWNER_FILE).read_text())["command"] == "calibrate"


# ----- locks ---------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    from prune_audit.safety.lock import DirectoryLock
    with DirectoryLock(sys.argv[1], shard=None if sys.argv[2] == "-" else sys.argv[2]):
        print("locked", flush=True)
        time.sleep(600)
    """
)


def _hold(directory: Path, shard: str = "-") -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), shard], stdout=subprocess.PIPE, env=_env(), text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_second_live_writer_is_refused_then_stale_lock_taken_over(tmp_path, capsys):
    holder = _hold(tmp_path)
    try:
        with pytest.raises(PruneAuditError, match=rf"being written by pid {holder.pid} on "):
            DirectoryLock(tmp_path).__enter__()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with DirectoryLock(tmp_path):
        assert f"stale lock of {tmp_path} left by pid {holder.pid}" in capsys.readouterr().err
    with DirectoryLock(tmp_path):  # released cleanly: no notice
        assert "stale" not in capsys.readouterr().err


def test_shards_share_a_directory_but_not_a_shard(tmp_path):
    holder = _hold(tmp_path, "0000of0002")
    try:
        with DirectoryLock(tmp_path, shard="0001of0002"):
            pass
        with pytest.raises(PruneAuditError, match="this shard of"):
            DirectoryLock(tmp_path, shard="0000of0002").__enter__()
        with pytest.raises(PruneAuditError, match="being written by"):
            DirectoryLock(tmp_path).__enter__()
    finally:
        holder.kill()
        holder.wait()


# ----- atomic writes, progress lines -----------------------------------------------------


def test_interrupted_write_leaves_no_file_and_partial_files_are_removed(tmp_path):
    def interrupted(handle):
        handle.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "records.parquet", interrupted)
    assert list(tmp_path.iterdir()) == []
    write_text_atomic("ok", tmp_path / "a.json")
    (tmp_path / "parts").mkdir()
    left = tmp_path / "parts" / f".part-0-x.parquet.{'ab' * 16}.tmp"  # as a SIGKILLed writer leaves it
    left.write_bytes(b"half")
    users = [tmp_path / "parts" / ".part-0-y.parquet.abc.tmp", tmp_path / "parts" / ".notes.tmp"]
    for path in users:
        path.write_bytes(b"not ours")
    assert remove_partial_files(tmp_path / "parts", ["records.parquet"]) == []
    assert remove_partial_files(tmp_path / "parts", ["part-0-*.parquet"]) == [left]
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".notes.tmp", ".part-0-y.parquet.abc.tmp", "a.json", "parts"]


def test_interrupt_and_disk_full_lines_name_saved_questions(tmp_path):
    progress.forget_saved()
    assert progress.interrupted_message() == "interrupted: nothing was written"
    progress.report_saved(tmp_path, 12, 30)
    assert progress.interrupted_message() == (
        f"interrupted: 12 of 30 questions are saved in {tmp_path}; run the same command again to resume"
    )
    error = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    assert progress.is_disk_full(error)
    assert progress.disk_full_message(error).startswith(
        f"no space left on the device writing {tmp_path / 'x'}: 12 of 30"
    )
    progress.forget_saved()


# ----- fingerprints, names -----------------------------------------------------------------


def test_image_fingerprint_pins_content_and_names_first_difference(tmp_path):
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(name.encode())
    cache = tmp_path / "cache" / "hashes.json"
    paths = {"b.png": tmp_path / "b.png", "a.png": tmp_path / "a.png"}
    first = images_fingerprint(paths, cache)
    assert cache.is_file() and first["count"] == 2
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("a.png", "b.png"):
        (copy / name).write_bytes(name.encode())
    moved = images_fingerprint({name: copy / name for name in ("b.png", "a.png")}, cache)
    assert moved["sha256"] == first["sha256"] and first_differing_image(first, moved) is None
    (copy / "a.png").write_bytes(b"other pixels")
    changed = images_fingerprint({name: copy / name for name in ("b.png", "a.png")}, cache)
    assert changed["sha256"] != first["sha256"]
    assert first_differing_image(first, changed) == "a.png"


@pytest.mark.parametrize("value", ["../..", "a/b", "..", "", "x\\y"])
def test_path_like_names_are_refused(value):
    with pytest.raises(PruneAuditError, match="--prefix .* must be a plain name"):
        check_plain_name(value, "--prefix")


def test_plain_names_pass():
    assert check_plain_name("coco.v2_a-b", "--prefix") == "coco.v2_a-b"


# ----- data layer ----------------------------------------------------------------------------


def _coco(images=None, annotations=None) -> dict:
    return {
        "images": images if images is not None else [{"id": 1, "file_name": "a.jpg", "width": 8, "height": 6}],
        "annotations": annotations if annotations is not None else [],
        "categories": [{"id": 3, "name": "car"}],
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_coco(annotations=["not an object"]), r"annotations\[0\] is a JSON str, not an object"),
        (
            _coco(images=[{"id": "x1", "file_name": "a.jpg", "width": 8, "height": 6}]),
            r"images\[0\].id must be an integer",
        ),
        (
            _coco(annotations=[{"id": 5, "image_id": 1.5, "category_id": 3, "segmentation": []}]),
            r"annotation 5: image_id must be an integer, got 1.5",
        ),
        (_coco(images=[{"id": 1, "file_name": "a.jpg", "width": 0, "height": 6}]), "must be positive"),
    ],
)
def test_malformed_coco_entries_are_one_line_errors(tmp_path, data, message):
    from prune_audit.data.coco import CocoInstances

    path = tmp_path / "instances.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PruneAuditError, match=message):
        CocoInstances.load(path)


def test_non_utf8_files_name_file_and_line(tmp_path):
    from prune_audit.data.coco import read_json
    from prune_audit.data.pope import load_pope

    questions = tmp_path / "coco_pope_random.json"
    good = json.dumps({"question_id": 1, "image": "a.jpg", "text": "Is there a car in the image?", "label": "yes"})
    questions.write_bytes(good.encode() + b"\n" + b'{"question_id": 2, "text": "caf\xe9"}\n')
    with pytest.raises(PruneAuditError, match=rf"{questions}:2: not UTF-8 text \(byte 0xe9\)"):
        load_pope(questions)
    instances = tmp_path / "instances.json"
    instances.write_bytes(b'{\n"images": [],\n "x": "\xff"}')
    with pytest.raises(PruneAuditError, match=rf"{instances}:3: not UTF-8"):
        read_json(instances)


def test_decompression_bomb_names_the_limit_and_how_to_raise_it(tmp_path, monkeypatch):
    from PIL import Image

    from prune_audit.data.images import MAX_PIXELS_VARIABLE, open_rgb

    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    monkeypatch.setenv(MAX_PIXELS_VARIABLE, "1000")
    with pytest.raises(PruneAuditError, match=rf"decompression-bomb limit of 2000 .*{MAX_PIXELS_VARIABLE}=<pixels>"):
        open_rgb(path)
    monkeypatch.setenv(MAX_PIXELS_VARIABLE, "10000")
    assert open_rgb(path).size == (64, 64)


def test_offline_hub_id_is_one_fast_line(monkeypatch):
    from prune_audit.models.hub import resolve_model_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PruneAuditError, match="not a local folder nor in the hub cache, and the hub is unreachable"):
        resolve_model_source("someorg/no-such-model")
    with pytest.raises(PruneAuditError, match="model folder not found: ./no/such"):
        resolve_model_source("./no/such")


def test_damaged_weights_are_one_line(tmp_path):
    import shutil

    from prune_audit.demo import DEMO_MODEL_DIR
    from prune_audit.models import load_vlm

    copy = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL_DIR, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(PruneAuditError, match="weights in .* are damaged or incomplete"):
        load_vlm(copy, device="cpu")


BUILDER = textwrap.dedent(
    """
    import sys
    from prune_audit.demo.questions import demo_question_set
    question_set = demo_question_set(sys.argv[1], scenes=60, pope_images=8)
    print(question_set.root)
    """
)


def test_two_processes_build_one_demo_cache(tmp_path):
    """Both get the same complete set; no staging folder or half-built set stays behind."""
    builders = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(),
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [builder.communicate() for builder in builders]
    assert [builder.returncode for builder in builders] == [0, 0], outputs
    roots = {out.strip() for out, _ in outputs}
    assert len(roots) == 1
    root = Path(roots.pop())
    assert (root / ".complete").is_file() and len(list((root / "images").iterdir())) == 60
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [root.name]
