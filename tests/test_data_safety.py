"""Issue 12 on the CLI: no command loses, overwrites or silently corrupts a run.

Every refusal is checked the same way (``refused``): the exit code, one line on stderr
naming the cause, no traceback, no crash signal, and (``records_kept``) the bytes of
every record file that existed before are unchanged. Runs are small (``--limit``) and
shared across cases by a module fixture; processes are real where the property is
about processes (lock, Ctrl-C, demo cache build).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import changed_annotations
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.records.schema import TIMING_COLUMNS

REPO_ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def refused(result, *needles: str, code: int = 2) -> str:
    """Exit ``code``, one ``error:`` line on stderr holding every needle, no traceback.

    A failure during the run may follow its progress lines (``questions: ...``); nothing else.
    """
    assert result.exit_code == code, result.output
    *progress, line = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(p.startswith("questions: ") for p in progress), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in line, line
    return line


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prune_audit.cli.main", *[str(a) for a in args]]


def process_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **extra}


def snapshot(*directories: Path) -> dict[str, bytes]:
    """Bytes of every file under ``directories`` except the lock files (their holder text changes)."""
    return {
        str(p): p.read_bytes()
        for d in directories
        for p in sorted(Path(d).rglob("*"))
        if p.is_file() and ".prune-audit.lock" not in p.name
    }


def record_count(run_dir: Path) -> int:
    parts = list((run_dir / "parts").glob("part-*.parquet")) if (run_dir / "parts").is_dir() else []
    files = [run_dir / "records.parquet"] if (run_dir / "records.parquet").is_file() else []
    return sum(pq.read_metadata(p).num_rows for p in files + parts)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    """A dense and a random@36 demo run (12 questions each) and their calibration audit."""
    from prune_audit.demo.assets import demo_assets

    root = tmp_path_factory.mktemp("safety")
    assets = demo_assets()
    runs = {"dense": root / "dense", "pruned": root / "pruned"}
    assert invoke("run", "--limit", "12", "--out", runs["dense"]).exit_code == 0
    pruned = invoke("run", "--selector", "random", "--budget", "36", "--limit", "12", "--out", runs["pruned"])
    assert pruned.exit_code == 0, pruned.output
    calibration = root / "calibration"
    done = invoke("calibrate", runs["pruned"], "--reference", runs["dense"], "--bootstrap", "20", "--out", calibration)
    assert done.exit_code == 0, done.output
    return {
        "root": root,
        **runs,
        "calibration": calibration,
        "model": assets.model_dir,
        "pope": assets.pope_files[0],
        "images": assets.images_dir,
        "annotations": assets.annotations,
    }


@pytest.fixture
def records_kept(demo):
    """Asserts after the test that no pre-existing output file changed."""
    before = snapshot(demo["dense"], demo["pruned"], demo["calibration"])
    yield
    assert snapshot(demo["dense"], demo["pruned"], demo["calibration"]) == before


def explicit_inputs(demo, images: Path | None = None, pope: Path | None = None, annotations: Path | None = None):
    """The demo inputs named explicitly (so tests can swap one of them)."""
    return [
        "--pope",
        pope or demo["pope"],
        "--images",
        images or demo["images"],
        "--annotations",
        annotations or demo["annotations"],
    ]


def used_images(pope: Path, limit: int) -> list[str]:
    lines = pope.read_text().splitlines()[:limit]
    return list(dict.fromkeys(json.loads(line)["image"] for line in lines))


# ----- 1. no command writes into another command's outputs ---------------------------------


def test_merge_into_a_run_of_another_configuration_is_refused(demo, records_kept):
    refused(invoke("merge", demo["pruned"], "--out", demo["dense"]), str(demo["dense"]), "another configuration")


def test_intervene_into_the_run_itself_is_refused(demo, records_kept):
    refused(
        invoke("intervene", demo["pruned"], "--mode", "remove", "--out", demo["pruned"]),
        str(demo["pruned"]),
        "holds the outputs of prune-audit run",
    )


@pytest.mark.parametrize(
    ("command", "target", "holder"),
    [
        (["calibrate", "{pruned}", "--bootstrap", "20"], "dense", "run"),
        (
            ["cascade", "{pruned}", "--reference", "{dense}", "--splits", "5", "--epsilon", "0.5"],
            "calibration",
            "calibrate",
        ),
        (["run", "--limit", "12"], "calibration", "calibrate"),
        (
            ["calibrate", "{pruned}", "--reference", "{dense}", "--bootstrap", "20", "--bins", "5"],
            "calibration",
            "other settings (bins)",
        ),
    ],
)
def test_commands_refuse_a_directory_holding_other_outputs(demo, records_kept, command, target, holder):
    args = [str(demo[a[1:-1]]) if a.startswith("{") else a for a in command]
    refused(invoke(*args, "--out", demo[target]), str(demo[target]), holder)


def test_out_naming_an_existing_file_is_refused(demo, records_kept, tmp_path):
    existing = tmp_path / "file.txt"
    existing.write_text("keep me")
    for args in (["run", "--limit", "2"], ["calibrate", demo["dense"]], ["merge", demo["dense"]]):
        refused(invoke(*args, "--out", existing), str(existing), "existing file")
    assert existing.read_text() == "keep me"


# ----- 3. budgets and batch sizes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--selector", "random", "--budget", "1000"], ["--budget 1000", "144 visual tokens", "--budget all"]),
        (["--budget", "64"], ["--budget", "--selector"]),
        (["--batch-size", "0"], ["--batch-size", "at least 1"]),
        (["--batch-size", "-2"], ["--batch-size", "at least 1"]),
        (["--selector", "random", "--budget", "lots"], ["--budget", "'lots'"]),
    ],
)
def test_run_budget_and_batch_size_are_validated(demo, tmp_path, extra, needles):
    out = tmp_path / "out"
    refused(invoke("run", "--limit", "2", *extra, "--out", out), *needles)
    assert not out.exists()


def test_budget_all_keeps_every_visual_token(demo, tmp_path):
    out = tmp_path / "all"
    result = invoke("run", "--selector", "random", "--budget", "all", "--limit", "2", "--out", out)
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pandas()
    assert (records["visual_tokens_avg"] == 144).all()
    assert json.loads((out / "manifest.json").read_text())["budget"] == 144


def test_visualize_budget_above_the_grid_is_refused(demo, tmp_path):
    image = demo["images"] / used_images(demo["pope"], 1)[0]
    out = tmp_path / "tokens.png"
    refused(
        invoke("visualize", image, "--selector", "random", "--budget", "5000", "--out", out),
        "--budget 5000",
        "144 visual tokens",
    )
    assert not out.exists()


def test_visualize_run_draws_next_to_the_run_never_into_it(demo, records_kept, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    question_id = int(pq.read_table(demo["pruned"] / "records.parquet")["question_id"][0].as_py())
    monkeypatch.chdir(tmp_path)
    drawn = invoke("visualize", "--run", demo["pruned"], "--question-id", question_id)
    assert drawn.exit_code == 0, drawn.output
    assert list((tmp_path / "figures" / demo["pruned"].name).glob("tokens-*.png"))
    refused(
        invoke("visualize", "--run", demo["pruned"], "--question-id", question_id, "--out", demo["pruned"]),
        str(demo["pruned"]),
        "prune-audit run",
    )


# ----- 4, 5. resume pinned by content, not paths ----------------------------------------------


def copy_inputs(demo, target: Path, limit: int) -> dict[str, Path]:
    """The demo question files, annotations and the images the first ``limit`` questions use, elsewhere."""
    from prune_audit.demo.assets import demo_assets

    target.mkdir()
    (target / "images").mkdir()
    pope = [shutil.copy(p, target / p.name) for p in demo_assets().pope_files]
    for name in used_images(demo["pope"], limit):
        shutil.copy(demo["images"] / name, target / "images" / name)
    return {
        "pope": [Path(p) for p in pope],
        "images": target / "images",
        "annotations": Path(shutil.copy(demo["annotations"], target / "instances.json")),
    }


def inputs_args(inputs: dict[str, Path]) -> list[str]:
    args = [a for p in inputs["pope"] for a in ("--pope", p)]
    return [*args, "--images", inputs["images"], "--annotations", inputs["annotations"]]


def test_resume_with_other_pixels_under_the_same_names_is_refused(demo, tmp_path):
    from PIL import Image

    inputs = copy_inputs(demo, tmp_path / "inputs", 12)
    out = tmp_path / "run"
    assert invoke("run", "--limit", "6", *inputs_args(inputs), "--out", out).exit_code == 0
    first, second = used_images(demo["pope"], 12)
    with Image.open(inputs["images"] / second) as image:
        image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(inputs["images"] / second)
    unused = invoke("run", "--limit", "6", *inputs_args(inputs), "--out", out)  # only used images are pinned
    assert unused.exit_code == 0, unused.output
    before = snapshot(out)
    with Image.open(inputs["images"] / first) as image:
        image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(inputs["images"] / first)
    refused(invoke("run", "--limit", "6", *inputs_args(inputs), "--out", out), str(out), first, "other content")
    assert snapshot(out) == before


def test_a_run_copied_elsewhere_with_inputs_and_model_elsewhere_resumes_and_analyses(demo, tmp_path):
    """Question files, annotations, images and the model all at other paths, same bytes."""
    copy = tmp_path / "copied-run"
    shutil.copytree(demo["dense"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shutil.rmtree(copy / "parts", ignore_errors=True)
    records = pq.read_table(copy / "records.parquet")
    pq.write_table(records.slice(0, 6), copy / "records.parquet")  # as if stopped after 6 questions
    inputs = copy_inputs(demo, tmp_path / "inputs", 12)
    model = Path(shutil.copytree(demo["model"], tmp_path / "elsewhere" / "demo-model"))
    result = invoke("run", "--model", model, "--limit", "12", *inputs_args(inputs), "--out", copy)
    assert result.exit_code == 0, result.output
    resumed = pq.read_table(copy / "records.parquet").to_pandas().drop(columns=list(TIMING_COLUMNS))
    original = records.to_pandas().drop(columns=list(TIMING_COLUMNS))
    # the resumed questions run in a smaller batch, padded to another length: answers and every other
    # column are identical, probabilities agree to float32 rounding (measured, batch 1 vs 16 at --threads 1:
    # p_yes within 4.8e-7, logit_diff within 3.2e-6; see --batch-size)
    floats = [c for c in original.columns if original[c].dtype.kind == "f"]
    assert resumed.drop(columns=floats).equals(original.drop(columns=floats))
    np.testing.assert_allclose(resumed[floats].to_numpy(float), original[floats].to_numpy(float), rtol=1e-5, atol=1e-6)
    assert manifest["images"]["sha256"] == json.loads((copy / "manifest.json").read_text())["images"]["sha256"]
    audit = invoke("calibrate", copy, "--reference", demo["dense"], "--bootstrap", "20", "--out", tmp_path / "cal")
    assert audit.exit_code == 0, audit.output


def moved_away(run_dir: Path, gone: Path) -> None:
    """Rewrite the manifest of a copied run as if made on a machine whose input paths are ``gone`` here."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for entry in [*manifest["question_files"], manifest["annotations"], manifest["images"]]:
        entry["path"] = str(gone / Path(entry["path"]).name)
    manifest["model"]["id"] = str(gone / "demo-model")
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def test_intervene_on_a_run_copied_elsewhere_takes_verified_input_overrides(demo, tmp_path):
    from PIL import Image

    copy = Path(shutil.copytree(demo["pruned"], tmp_path / "copied-run"))
    moved_away(copy, tmp_path / "gone")
    inputs = copy_inputs(demo, tmp_path / "inputs", 12)
    model = Path(shutil.copytree(demo["model"], tmp_path / "elsewhere" / "demo-model"))
    out = tmp_path / "intervened"
    command = ("intervene", copy, "--mode", "remove", "--bootstrap", "20", "--out", out)
    overrides = [*inputs_args(inputs), "--model", model]
    refused(invoke(*command), "not found", "--pope")
    refused(invoke(*command, *inputs_args(inputs)), "not found", "--model")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(inputs["annotations"].read_text() + " ")
    refused(invoke(*command, *overrides, "--annotations", wrong), str(wrong), "sha256 differs")
    first = used_images(demo["pope"], 12)[0]
    flipped = Path(shutil.copytree(inputs["images"], tmp_path / "flipped"))
    with Image.open(flipped / first) as image:
        image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(flipped / first)
    refused(invoke(*command, *overrides, "--images", flipped), first, "other content")
    assert not out.exists()
    done = invoke(*command, *overrides)
    assert done.exit_code == 0, done.output
    assert (out / "intervention.json").is_file()


# ----- 6. one writer per directory ---------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    from prune_audit.safety.lock import DirectoryLock
    with DirectoryLock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(600)
    """
)


def test_second_writer_is_refused_and_a_dead_writers_lock_is_taken_over(demo, tmp_path):
    out = tmp_path / "run"
    assert invoke("run", "--limit", "6", "--out", out).exit_code == 0
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=process_env()
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(out)
        refused(invoke("run", "--limit", "6", "--out", out), str(out), f"pid {holder.pid}", "being written")
        refused(invoke("merge", out), str(out), "being written")
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()
    resumed = invoke("run", "--limit", "6", "--out", out)
    assert resumed.exit_code == 0 and f"stale lock of {out}" in resumed.stderr


# ----- 7. demo cache built once, atomically ---------------------------------------------------------


def test_two_processes_build_one_demo_cache_through_the_cli(tmp_path):
    args = cli("demo", "questions", "--cache-dir", tmp_path / "cache", "--scenes", "60", "--pope-images", "8")
    processes = [
        subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=process_env(HOME=str(tmp_path / f"home{i}")),
        )
        for i in range(2)
    ]
    outputs = [p.communicate() for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]
    visible = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock"))
    # the question set and its task files (GQA, ScienceQA, caption, TextVQA, RefCOCO), each complete, no staging
    # folder left
    from prune_audit.demo.task_files import TASK_FILES_VERSION

    expected = f"{visible[0]}-tasks60-v{TASK_FILES_VERSION}"
    assert len(visible) == 2 and visible[1] == expected and not visible[0].startswith(".")


# ----- 8. analyses of incomplete runs say so ----------------------------------------------------------


def test_calibrate_and_cascade_warn_on_an_incomplete_run(demo, tmp_path):
    shard = tmp_path / "shard"
    assert invoke("run", "--limit", "36", "--shard", "0/2", "--out", shard).exit_code == 0
    calibration = invoke("calibrate", shard, "--bootstrap", "20", "--out", tmp_path / "cal", "--json")
    assert calibration.exit_code == 0, calibration.output
    assert f"warning: {shard} is incomplete (18 of 36 questions" in calibration.stderr
    entry = json.loads(calibration.stdout)["completeness"][0]
    assert (entry["done"], entry["total"], entry["complete"]) == (18, 36, False)
    written = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert written["completeness"][0]["done"] == 18
    pruned = tmp_path / "pruned-shard"
    args = ["--selector", "random", "--budget", "36", "--limit", "36", "--shard", "0/2", "--out", pruned]
    assert invoke("run", *args).exit_code == 0
    cascade = invoke(
        "cascade",
        pruned,
        "--reference",
        shard,
        "--epsilon",
        "0.5",
        "--splits",
        "5",
        "--out",
        tmp_path / "cascade",
        "--json",
    )
    assert cascade.exit_code == 0, cascade.output
    assert cascade.stderr.count("is incomplete (18 of 36 questions") == 2
    assert [e["complete"] for e in json.loads(cascade.stdout)["completeness"]] == [False, False]


# ----- 9, 10. one line instead of a traceback -------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        (lambda d: d["annotations"].append("oops"), ["annotations[", "not an object"]),
        (lambda d: d["images"][0].update(id="first"), ["images[0].id must be an integer"]),
        (lambda d: d["annotations"][0].update(image_id=1.5), ["image_id must be an integer, got 1.5"]),
        (lambda d: d["annotations"][0].update(segmentation=[[1e15, 0, 2e15, 5, 3, 1e15]]), ["far outside"]),
        (lambda d: d["annotations"][0].update(segmentation=[[1, 2, 3, 4, 5, 6, 7]]), ["polygon of 7 coordinates"]),
        (lambda d: d["annotations"][0].update(segmentation={"size": [5, 5], "counts": [25]}), ["RLE size [5, 5]"]),
    ],
)
def test_bad_annotations_are_refused_before_the_run_directory(demo, tmp_path, change, needles):
    annotations = changed_annotations(demo["annotations"], tmp_path, change)
    out = tmp_path / "out"
    refused(invoke("run", "--limit", "2", *explicit_inputs(demo, annotations=annotations), "--out", out), *needles)
    assert not out.exists()


def test_damaged_model_weights_are_one_line(demo, tmp_path):
    model = Path(shutil.copytree(demo["model"], tmp_path / "model"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    refused(
        invoke("run", "--model", model, "--limit", "2", *explicit_inputs(demo), "--out", out), "damaged or incomplete"
    )
    assert not out.exists()


def test_image_over_the_decompression_bomb_limit_names_limit_and_fix(demo, tmp_path):
    out = tmp_path / "out"
    result = invoke("run", "--limit", "2", "--out", out, env={"PRUNE_AUDIT_MAX_IMAGE_PIXELS": "1000"})
    refused(result, "decompression-bomb limit of 2000", "PRUNE_AUDIT_MAX_IMAGE_PIXELS=")
    assert not out.exists()


def test_disk_full_says_what_is_saved_and_the_rerun_resumes(demo, tmp_path, monkeypatch):
    from prune_audit.records.store import RecordStore

    append = RecordStore.append
    calls = []

    def full_after_first(self, rows):
        calls.append(len(rows))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.parts_dir / "part.parquet"))
        return append(self, rows)

    monkeypatch.setattr(RecordStore, "append", full_after_first)
    out = tmp_path / "out"
    line = refused(invoke("run", "--limit", "12", "--batch-size", "4", "--out", out), code=1)
    assert line.startswith("error: no space left on the device writing ")
    assert f"4 of 12 questions are saved in {out}; run the same command again to resume" in line
    assert record_count(out) == 4
    monkeypatch.setattr(RecordStore, "append", append)
    assert invoke("run", "--limit", "12", "--batch-size", "4", "--out", out).exit_code == 0
    assert record_count(out) == 12


def test_non_utf8_question_file_names_file_and_line(demo, tmp_path):
    pope = tmp_path / "demo_pope_random.json"
    lines = demo["pope"].read_bytes().splitlines(keepends=True)
    pope.write_bytes(b"".join(lines[:3]) + lines[3].replace(b"Is there", b"Is th\xe9re") + b"".join(lines[4:10]))
    out = tmp_path / "out"
    refused(invoke("run", *explicit_inputs(demo, pope=pope), "--out", out), f"{pope}:4", "not UTF-8")
    assert not out.exists()


def test_hub_id_while_offline_is_one_line(demo, tmp_path):
    out = tmp_path / "out"
    result = invoke(
        "run", "--model", "someorg/not-cached-model", *explicit_inputs(demo), "--out", out, env={"HF_HUB_OFFLINE": "1"}
    )
    refused(result, "someorg/not-cached-model", "hub is unreachable", "local checkpoint folder")
    assert not out.exists()


def test_already_refused_inputs_stay_refused(demo, tmp_path):
    out = tmp_path / "out"
    refused(invoke("run", "--selector", "nonsense", "--budget", "4", "--out", out), "unknown selector")
    refused(invoke("run", "--limit", "0", "--out", out), "--limit")
    refused(invoke("run", "--selector", "random", "--budget", "4", "--option", "x=1", "--out", out), "option 'x'")
    refused(invoke("run", *explicit_inputs(demo, images=tmp_path), "--out", out), "image not found")
    refused(invoke("calibrate", tmp_path / "nope", "--out", tmp_path / "cal"), "nope")
    assert not out.exists() and not (tmp_path / "cal").exists()


# ----- 11. pope build stays inside --out -----------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["../..", "../escape", "a/b", ".."])
def test_pope_build_refuses_path_like_prefixes(demo, tmp_path, prefix):
    out = tmp_path / "deep" / "out"
    result = invoke(
        "pope", "build", "--annotations", demo["annotations"], "--out", out, "--images", "5", "--prefix", prefix
    )
    refused(result, "--prefix", "plain name")
    assert list(tmp_path.rglob("*")) == []


# ----- 12. Ctrl-C ---------------------------------------------------------------------------------------------


def test_ctrl_c_says_what_is_saved_exits_130_and_the_same_command_resumes(demo, tmp_path):
    out = tmp_path / "run"
    # long enough (hundreds of batches) that the interrupt lands mid-run however fast the machine is
    args = cli("run", "--limit", "600", "--batch-size", "2", "--out", out)
    # a test session started in the background of a non-interactive shell ignores SIGINT, and children
    # inherit that (Python then installs no KeyboardInterrupt handler): restore the default, as a terminal has
    process = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=process_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    while (
        process.poll() is None
        and len(list((out / "parts").glob("part-*.parquet")) if (out / "parts").is_dir() else []) < 2
    ):
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate()
    assert process.returncode == 130, stderr
    line = stderr.strip().splitlines()[-1]
    assert "Traceback" not in stderr
    saved = record_count(out)
    assert (
        line == f"error: interrupted: {saved} of 600 questions are saved in {out}; run the same command again to resume"
    )
    leftover = out / "parts" / f".part-0-dead.parquet.{'0123' * 8}.tmp"  # as a killed write leaves it
    leftover.write_bytes(b"half a parquet file")
    resumed = subprocess.run(args, capture_output=True, text=True, env=process_env())
    assert resumed.returncode == 0, resumed.stderr
    assert not leftover.exists() and record_count(out) == 600


# ----- the same guarantees on real COCO (../shared/data) ---------------------------------------------------


@pytest.fixture(scope="module")
def coco(shared_data, tmp_path_factory) -> dict[str, Path]:
    """POPE questions built from the real tiny COCO val2017 and a 6-question demo-model run over them."""
    tiny = shared_data / "coco" / "tiny_coco_val2017"
    root = tmp_path_factory.mktemp("coco")
    built = invoke(
        "pope",
        "build",
        "--annotations",
        tiny / "instances_val2017.json",
        "--out",
        root / "pope",
        "--images",
        "4",
        "--split",
        "random",
    )
    assert built.exit_code == 0, built.output
    inputs = {
        "pope": root / "pope" / "coco_pope_random.json",
        "images": tiny / "val2017",
        "annotations": tiny / "instances_val2017.json",
    }
    run = root / "run"
    result = invoke("run", "--limit", "6", *explicit_inputs(inputs), "--out", run)
    assert result.exit_code == 0, result.output
    return {**inputs, "root": root, "run": run}


def test_coco_absurd_polygon_is_refused_before_pycocotools_and_the_run_directory(coco, tmp_path):
    data = json.loads(coco["annotations"].read_text())
    polygon = next(a for a in data["annotations"] if isinstance(a["segmentation"], list))
    polygon["segmentation"] = [[0, 0, 1e300, 0, 1e300, 1e300]]
    annotations = tmp_path / "instances.json"
    annotations.write_text(json.dumps(data))
    out = tmp_path / "out"
    result = invoke("run", "--limit", "6", *explicit_inputs(coco, annotations=annotations), "--out", out)
    refused(result, f"annotation {polygon['id']}", "far outside")
    assert not out.exists()


def test_coco_resume_with_other_pixels_is_refused_and_records_kept(coco, tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    used = used_images(coco["pope"], 6)
    for name in used:
        shutil.copy(coco["images"] / name, images / name)
    assert invoke("run", "--limit", "6", *explicit_inputs(coco, images=images), "--out", coco["run"]).exit_code == 0
    with Image.open(images / used[0]) as image:
        image.transpose(Image.Transpose.FLIP_TOP_BOTTOM).save(images / used[0])  # same size, other pixels
    before = snapshot(coco["run"])
    refused(
        invoke("run", "--limit", "6", *explicit_inputs(coco, images=images), "--out", coco["run"]),
        str(coco["run"]),
        used[0],
        "other content",
    )
    refused(
        invoke("pope", "build", "--annotations", coco["annotations"], "--out", coco["run"], "--images", "4"),
        str(coco["run"]),
        "holds the outputs of prune-audit run",
    )
    assert snapshot(coco["run"]) == before
