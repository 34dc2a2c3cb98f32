"""Issue 23, inputs: images, annotations and content pins are validated before anything is written.

Each refusal is checked as in ``test_data_safety``: exit code 2, one ``error:`` line naming the
cause and the fix, no traceback, no crash signal, no output folder, and every pre-existing file
(inputs and an earlier run) byte for byte unchanged. The inputs are a tiny copy of the demo
question set (two images, twelve questions) with a two-question run over it, shared by the module.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_checks import changed_annotations
from PIL import Image
from test_data_safety import invoke, refused, snapshot

from prune_audit.errors import PruneAuditError

QUESTIONS = 12  # the first two images of the demo's random split


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Question file, images and reduced annotations of two demo images, and a 2-question run over them."""
    from prune_audit.demo.assets import demo_assets

    assets = demo_assets()
    root = tmp_path_factory.mktemp("inputs")
    lines = assets.pope_files[0].read_text().splitlines(keepends=True)[:QUESTIONS]
    pope = root / "demo_pope_random.json"
    pope.write_text("".join(lines))
    names = list(dict.fromkeys(json.loads(line)["image"] for line in lines))
    images = root / "images"
    images.mkdir()
    for name in names:
        shutil.copy(assets.images_dir / name, images / name)
    data = json.loads(assets.annotations.read_text())
    kept = {entry["id"] for entry in data["images"] if entry["file_name"] in names}
    data["images"] = [entry for entry in data["images"] if entry["id"] in kept]
    data["annotations"] = [ann for ann in data["annotations"] if ann["image_id"] in kept]
    annotations = root / "instances.json"
    annotations.write_text(json.dumps(data))
    run = root / "run"
    done = invoke("run", "--pope", pope, "--images", images, "--annotations", annotations, "--limit", "2", "--out", run)
    assert done.exit_code == 0, done.output
    return {"root": root, "pope": pope, "images": images, "annotations": annotations, "run": run, "names": names}


@pytest.fixture
def kept(inputs):
    """Asserts after the test that no file of the shared inputs or run changed."""
    before = snapshot(inputs["root"])
    yield
    assert snapshot(inputs["root"]) == before


def run_args(inputs, pope: Path | None = None, images: Path | None = None, annotations: Path | None = None) -> list:
    return [
        "run",
        "--pope",
        pope or inputs["pope"],
        "--images",
        images or inputs["images"],
        "--annotations",
        annotations or inputs["annotations"],
        "--limit",
        "2",
    ]


def copied_images(inputs, target: Path) -> Path:
    return Path(shutil.copytree(inputs["images"], target))


# ----- 6. 16-bit and floating-point images ---------------------------------------------------------------------


def test_16_bit_greyscale_is_converted_by_its_bit_depth_not_clipped_white(tmp_path):
    from prune_audit.data.images import open_rgb

    values = np.array([[0, 257, 128 * 257, 65535], [1000, 30000, 50000, 65000]], dtype=np.uint16)
    for suffix in (".png", ".tiff"):
        path = tmp_path / f"grey16{suffix}"
        Image.fromarray(values).save(path)
        with Image.open(path) as image:
            assert image.mode.startswith("I;16")
        rgb = np.asarray(open_rgb(path))
        expected = np.rint(values / 257).astype(np.uint8)  # 0..65535 onto 0..255, fixed by the bit depth
        assert rgb.shape == (2, 4, 3) and (rgb == expected[..., None]).all()


@pytest.mark.parametrize(
    ("pixels", "mode", "kind"),
    [
        (np.random.default_rng(0).random((96, 96), dtype=np.float32), "F", "floating-point"),
        (np.arange(96 * 96, dtype=np.int32).reshape(96, 96), "I", "32-bit integer"),
    ],
)
def test_image_of_unknown_range_is_refused_naming_file_and_mode(inputs, kept, tmp_path, pixels, mode, kind):
    images = copied_images(inputs, tmp_path / "images")
    image = images / inputs["names"][0]
    Image.fromarray(pixels).save(image, format="TIFF")  # same name, now a float / int32 TIFF
    out = tmp_path / "out"
    refused(invoke(*run_args(inputs, images=images), "--out", out), str(image), f"PIL mode {mode}", kind, "8-bit")
    assert not out.exists()


# ----- 7. ambiguous annotations ------------------------------------------------------------------------------------


def _file_name_twice(data):
    data["images"].append({**data["images"][0], "id": 999_999})


def _category_name_twice(data):
    data["categories"].append({"id": 999, "name": data["categories"][0]["name"]})


def _category_id_twice(data):
    data["categories"].append({"id": data["categories"][0]["id"], "name": "other shape"})


def _image_id_twice(data):
    data["images"].append({**data["images"][0], "file_name": "another.png"})


AMBIGUITIES = [
    (_file_name_twice, ["images[0] and images[2]", "same file_name", "list each image file under one id"]),
    (_category_name_twice, ["categories[0] and categories[", "same name", "give each category its own name"]),
    (_category_id_twice, ["categories[0] and categories[", "same id", "give each category its own id"]),
    (_image_id_twice, ["images[0] and images[2]", "same id", "list each image once"]),
]


@pytest.mark.parametrize(("change", "needles"), AMBIGUITIES)
def test_ambiguous_annotations_are_refused_by_run_pope_build_and_pope_info(inputs, kept, tmp_path, change, needles):
    annotations = changed_annotations(inputs["annotations"], tmp_path, change)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    refused(invoke(*run_args(inputs, annotations=annotations), "--out", out), str(annotations), *needles)
    refused(
        invoke("pope", "build", "--annotations", annotations, "--out", out, "--images", "1"), str(annotations), *needles
    )
    refused(invoke("pope", "info", inputs["pope"], "--annotations", annotations), str(annotations), *needles)
    assert not out.exists() and snapshot(tmp_path) == before


# ----- 8, 13. an image of another size than annotated: refused in planning, naming both sizes ------------------------


def test_image_of_another_size_is_refused_before_the_model_and_the_corrected_rerun_works(
    inputs, kept, tmp_path, monkeypatch
):
    import prune_audit.models

    images = copied_images(inputs, tmp_path / "images")
    image = images / inputs["names"][0]
    original = image.read_bytes()
    with Image.open(image) as pixels:
        pixels.resize((120, 80)).save(image)
    out = tmp_path / "out"
    args = [*run_args(inputs, images=images), "--out", out]

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the image sizes were checked")

    with monkeypatch.context() as patch:
        patch.setattr(prune_audit.models, "load_vlm", no_model)
        refused(invoke(*args), str(image), "120x80 pixels", "annotates it as 96x96", str(inputs["annotations"]))
    assert not out.exists()
    image.write_bytes(original)
    assert invoke(*args).exit_code == 0


def test_visualize_of_an_image_of_another_size_names_both_sizes(inputs, kept, tmp_path):
    image = tmp_path / inputs["names"][0]
    with Image.open(inputs["images"] / inputs["names"][0]) as pixels:
        pixels.resize((64, 48)).save(image)
    out = tmp_path / "figure.png"
    refused(
        invoke("visualize", image, "--annotations", inputs["annotations"], "--object", "circle", "--out", out),
        str(image),
        "64x48 pixels",
        "annotates it as 96x96",
    )
    assert not out.exists()


# ----- 9. content pins ------------------------------------------------------------------------------------------


def first_recorded_image(run: Path) -> tuple[str, int]:
    import pyarrow.parquet as pq

    row = pq.read_table(run / "records.parquet").to_pylist()[0]
    return row["image"], row["question_id"]


def test_visualize_run_refuses_a_replaced_image_of_the_same_size(inputs, tmp_path):
    run = Path(shutil.copytree(inputs["run"], tmp_path / "run"))
    images = copied_images(inputs, tmp_path / "images")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["images"]["path"] = str(images)
    (run / "manifest.json").write_text(json.dumps(manifest))
    name, question_id = first_recorded_image(run)
    figure = tmp_path / "figure.png"
    assert invoke("visualize", "--run", run, "--question-id", question_id, "--out", figure).exit_code == 0
    figure.unlink()
    with Image.open(images / name) as pixels:
        pixels.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(images / name)  # same size, other picture
    before = snapshot(run, images)
    refused(
        invoke("visualize", "--run", run, "--question-id", question_id, "--out", figure),
        str(images / name),
        "other content",
        "sha256",
        "restore the run's file",
    )
    assert not figure.exists() and snapshot(run, images) == before


def test_intervene_refuses_a_replaced_image_in_the_recorded_folder(inputs, tmp_path):
    """Without --images, intervene reads the recorded folder: its images are checked against the pins too."""
    images, run = copied_images(inputs, tmp_path / "images"), tmp_path / "run"
    pruned = invoke(*run_args(inputs, images=images), "--selector", "random", "--budget", "36", "--out", run)
    assert pruned.exit_code == 0, pruned.output
    name, _ = first_recorded_image(run)
    with Image.open(images / name) as pixels:
        pixels.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(images / name)  # same size, other picture
    before = snapshot(run, images)
    out = tmp_path / "intervention"
    refused(
        invoke("intervene", run, "--mode", "restore", "--out", out),
        "the run's images folder",
        name,
        "sha256 differs",
        "pass --images DIR",
    )
    assert not out.exists() and snapshot(run, images) == before


def test_visualize_run_refuses_a_manifest_without_image_pins(inputs, tmp_path):
    run = Path(shutil.copytree(inputs["run"], tmp_path / "run"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["images"] = None
    (run / "manifest.json").write_text(json.dumps(manifest))
    _, question_id = first_recorded_image(run)
    before = snapshot(run)
    figure = tmp_path / "figure.png"
    line = refused(
        invoke("visualize", "--run", run, "--question-id", question_id, "--out", figure),
        "manifest.json",
        "field 'images'",
        "got null",
        "re-run with this version into a new --out",
    )
    assert "None/" not in line
    assert not figure.exists() and snapshot(run) == before


@pytest.mark.parametrize("images", [None, {"files": {}}, {"path": None}, 3])
def test_a_manifest_without_an_images_folder_is_one_line_for_every_reader(images):
    from prune_audit.records.manifest import images_folder

    with pytest.raises(PruneAuditError, match=r"manifest names no images folder .*re-run into a new --out"):
        images_folder({"images": images})


def test_visualize_run_refuses_an_image_the_manifest_does_not_pin(inputs, tmp_path):
    run = Path(shutil.copytree(inputs["run"], tmp_path / "run"))
    manifest = json.loads((run / "manifest.json").read_text())
    name, question_id = first_recorded_image(run)
    del manifest["images"]["files"][name]
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(run)
    figure = tmp_path / "figure.png"
    refused(
        invoke("visualize", "--run", run, "--question-id", question_id, "--out", figure),
        str(run),
        "run_id",
        "the manifest was edited",
        "re-run with this version into a new --out",
    )
    assert not figure.exists() and snapshot(run) == before


def edit_in_place(path: Path) -> None:
    """Other bytes of the same length, written into the same inode, mtime set back: only ctime tells."""
    state = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with path.open("r+b") as handle:
        handle.write(data)
    os.utime(path, ns=(state.st_atime_ns, state.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (state.st_size, state.st_mtime_ns, state.st_ino)


def test_hash_cache_sees_an_in_place_edit_that_keeps_size_mtime_and_inode(tmp_path, monkeypatch):
    from prune_audit.safety import fingerprint

    monkeypatch.setattr(fingerprint, "SETTLE_NS", -(10**18))  # trust every entry at once: only the key can tell
    path = tmp_path / "image.png"
    path.write_bytes(b"pixels" * 100)
    cache_file = tmp_path / "hashes.json"
    first = fingerprint.images_fingerprint({"image.png": path}, cache_file)
    edit_in_place(path)
    again = fingerprint.images_fingerprint({"image.png": path}, cache_file)
    assert again["files"]["image.png"] == fingerprint.file_sha256(path) != first["files"]["image.png"]


def test_hash_cache_rereads_a_file_hashed_before_it_settled(tmp_path, monkeypatch):
    from prune_audit.safety import fingerprint

    path = tmp_path / "image.png"
    path.write_bytes(b"pixels")
    reads = []
    monkeypatch.setattr(fingerprint, "file_sha256", lambda p: reads.append(p) or "digest")
    cache = fingerprint.HashCache(None)
    cache.sha256(path)
    cache.sha256(path)
    assert len(reads) == 2  # hashed within SETTLE_NS of its last change: a same-tick edit could hide
    cache.entries[os.path.realpath(path)][-2] += 2 * fingerprint.SETTLE_NS  # as if hashed later
    cache.sha256(path)
    assert len(reads) == 2


def test_resume_after_an_in_place_edit_keeping_size_mtime_and_inode_is_refused(inputs, tmp_path):
    images = copied_images(inputs, tmp_path / "images")
    name = inputs["names"][0]
    with Image.open(images / name) as pixels:
        pixels.load()
    pixels.save(images / name, compress_level=0)  # stored, not deflated: a flipped image has the same length
    out = tmp_path / "run"
    args = [*run_args(inputs, images=images), "--out", out]
    assert invoke(*args).exit_code == 0
    flipped = tmp_path / "flipped.png"
    pixels.transpose(Image.Transpose.FLIP_TOP_BOTTOM).save(flipped, compress_level=0)
    state = (images / name).stat()
    assert flipped.stat().st_size == state.st_size
    with (images / name).open("r+b") as handle:  # same inode
        handle.write(flipped.read_bytes())
    os.utime(images / name, ns=(state.st_atime_ns, state.st_mtime_ns))
    after = (images / name).stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (state.st_size, state.st_mtime_ns, state.st_ino)
    before = snapshot(out)
    refused(invoke(*args), str(out), name, "other content")
    assert snapshot(out) == before


# ----- 11. POPE image names stay inside --images ------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry", ["{images}/{name}", "../images/{name}", "sub/../../{name}", "C:\\images\\{name}", None, ""]
)
def test_pope_image_outside_images_or_not_a_name_is_refused(inputs, kept, tmp_path, entry):
    lines = inputs["pope"].read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    value = None if entry is None else entry.format(images=inputs["images"], name=first["image"])
    first["image"] = value
    pope = tmp_path / "demo_pope_random.json"
    pope.write_text(json.dumps(first) + "\n" + "".join(lines[1:]))
    out = tmp_path / "out"
    needles = ["outside the images folder", "relative to --images"] if value else ["image must be a file name"]
    refused(invoke(*run_args(inputs, pope=pope), "--out", out), f"{pope}:1", repr(value), *needles)
    refused(invoke("pope", "info", pope), f"{pope}:1", repr(value), *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    ("file_name", "needles"),
    [
        ("/elsewhere/image.png", ["'/elsewhere/image.png' leads outside the images folder", "relative to --images"]),
        ("../image.png", ["'../image.png' leads outside the images folder"]),
        (None, ["images[0].file_name must be a file name, got None"]),
    ],
)
def test_pope_build_refuses_annotated_file_names_a_run_would_refuse(inputs, kept, tmp_path, file_name, needles):
    data = json.loads(inputs["annotations"].read_text())
    for entry in data["images"]:
        entry["file_name"] = file_name if entry is data["images"][0] else entry["file_name"]
    annotations = tmp_path / "instances.json"
    annotations.write_text(json.dumps(data))
    out = tmp_path / "out"
    refused(
        invoke("pope", "build", "--annotations", annotations, "--out", out, "--images", "2"), str(annotations), *needles
    )
    assert not out.exists()


# ----- 13. environment variables -----------------------------------------------------------------------------


def test_cache_variable_naming_a_file_is_refused(inputs, kept, tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    out = tmp_path / "out"
    refused(
        invoke(*run_args(inputs), "--out", out, env={"PRUNE_AUDIT_CACHE": str(cache)}),
        "PRUNE_AUDIT_CACHE",
        str(cache),
        "is a file, not a folder",
        "point PRUNE_AUDIT_CACHE to a folder",
    )
    assert not out.exists() and cache.read_text() == "not a folder"


def test_cache_dir_option_naming_a_file_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    refused(
        invoke("demo", "questions", "--cache-dir", cache / "sub"),
        "--cache-dir",
        str(cache),
        "is a file",
        "point --cache-dir to a folder",
    )
    assert cache.read_text() == "not a folder"


@pytest.mark.parametrize("value", ["-1", "0", "many", "1e9"])
def test_pixel_limit_must_be_a_positive_whole_number(inputs, kept, tmp_path, value):
    out = tmp_path / "out"
    line = refused(
        invoke(*run_args(inputs), "--out", out, env={"PRUNE_AUDIT_MAX_IMAGE_PIXELS": value}),
        "PRUNE_AUDIT_MAX_IMAGE_PIXELS must be a positive whole number",
        repr(value),
        "unset it",
    )
    assert "limit of" not in line
    assert not out.exists()


def test_pixel_limit_accepts_a_positive_number(tmp_path, monkeypatch):
    from prune_audit.data.images import MAX_PIXELS_VARIABLE, open_rgb

    path = tmp_path / "small.png"
    Image.new("RGB", (8, 8)).save(path)
    monkeypatch.setenv(MAX_PIXELS_VARIABLE, "64")
    assert open_rgb(path).size == (8, 8)
    monkeypatch.setenv(MAX_PIXELS_VARIABLE, "-1")
    with pytest.raises(PruneAuditError, match="positive whole number"):
        open_rgb(path)
