"""`prune-audit run` end to end on a tiny offline LLaVA and a synthetic COCO question set.

Covers the records and manifest, summary numbers recomputed from the records,
resume after SIGKILL at random points, sharding (``--shard`` + ``merge`` and a
2-process gloo launch) equal to one process, and every bad input the issue lists.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import TokenGeometry
from prune_audit.data.retention import object_area, retention
from prune_audit.records.manifest import MANIFEST_KEYS
from prune_audit.records.schema import TIMING_COLUMNS
from prune_audit.records.store import read_run

runner = CliRunner()


def base_args(ws: dict[str, Path], out: Path, *extra: str) -> list[str]:
    args = [
        "run",
        "--model",
        str(ws["model"]),
        "--images",
        str(ws["images"]),
        "--annotations",
        str(ws["instances"]),
        "--out",
        str(out),
    ]
    for path in ws["pope"]:
        args += ["--pope", str(path)]
    return args + list(extra)


def invoke(args: list[str]):
    result = runner.invoke(app, args)
    return result


def read_records(run_dir: Path):
    return pq.read_table(run_dir / "records.parquet").to_pandas()


def comparable(frame):
    return frame.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)


def assert_same_records(actual, expected):
    """Equal records, floats to 1e-6: processes with another thread count sum matmuls in another order."""
    actual, expected = comparable(actual), comparable(expected)
    assert list(actual.columns) == list(expected.columns)
    floats = [c for c in expected.columns if expected[c].dtype.kind == "f"]
    assert actual.drop(columns=floats).equals(expected.drop(columns=floats))
    np.testing.assert_allclose(actual[floats].to_numpy(float), expected[floats].to_numpy(float), rtol=1e-6, atol=1e-6)


def test_run_writes_records_and_manifest(workspace, tmp_path):
    out = tmp_path / "run"
    result = invoke(
        base_args(
            workspace, out, "--selector", "random", "--budget", "6", "--limit", "30", "--batch-size", "4", "--seed", "3"
        )
    )
    assert result.exit_code == 0, result.output
    records = read_records(out)
    assert len(records) == 30
    expected_columns = {
        "question_id",
        "split",
        "image",
        "image_id",
        "object",
        "label",
        "answer",
        "p_yes",
        "p_no",
        "confidence",
        "correct",
        "kept",
        "kept_stages",
        "visual_tokens_avg",
        "prefill_tokens",
        "retention",
        "visible_fraction",
        "object_tokens_kept",
        "lost",
        "latency_ms",
    }
    assert expected_columns <= set(records.columns)
    assert all(len(k) == 6 for k in records["kept"])
    assert (
        records["cost_tokens"] == records["prefill_tokens"]
    ).all()  # input-level: the sequence is short from the start
    assert (records["correct"] == (records["answer"] == records["label"])).all()
    np.testing.assert_allclose(records["confidence"], np.maximum(records["p_yes_2way"], 1 - records["p_yes_2way"]))

    # retention recomputed independently from the masks, the recorded geometry and the kept sets
    coco = CocoInstances.load(workspace["instances"])
    for row in records.itertuples():
        if row.label != "yes":
            assert math.isnan(row.retention) and row.lost is None
            continue
        geometry = TokenGeometry(**json.loads(row.geometry))
        area = object_area(coco.category_mask(row.image_id, row.object), geometry)
        retained, tokens, lost = retention(area.area_per_token, area.total_area, list(row.kept))
        assert row.retention == pytest.approx(retained)
        assert (row.object_tokens_kept, row.lost) == (tokens, lost)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["selector"]["name"] == "random" and manifest["budget"] == 6
    assert manifest["seed"] == 3 and manifest["num_questions"] == 30
    assert {f["sha256"] for f in manifest["question_files"]} and manifest["annotations"]["sha256"]
    assert manifest["versions"]["torch"] and manifest["model"]["config_hash"]
    assert manifest["realised_visual_tokens_avg"] == pytest.approx(records["visual_tokens_avg"].mean())
    assert "--selector random" in manifest["command"]
    assert set(manifest) <= {key for key, _ in MANIFEST_KEYS}  # every key is documented in docs/records.md
    assert manifest["threads"]["inter_op"] == 1 and manifest["threads"]["intra_op"] >= 1

    # the printed summary is the records' own numbers
    assert f"{records['correct'].mean():.4f}" in result.output
    assert f"{records['confidence'].mean():.4f}" in result.output
    lost = records["lost"].dropna()
    assert f"{int(lost.sum())} of {len(lost)}" in result.output


def test_in_llm_selector_records_stages(workspace, tmp_path):
    out = tmp_path / "fastv"
    result = invoke(base_args(workspace, out, "--selector", "e2s", "--budget", "8", "--limit", "6"))
    assert result.exit_code == 0, result.output
    records = read_records(out)
    manifest = json.loads((out / "manifest.json").read_text())
    stages = manifest["selector"]["schedule"]
    assert stages and all(len(k) == len(stages) for k in records["kept_stages"])
    assert records["visual_tokens_avg"].iloc[0] == pytest.approx(manifest["realised_visual_tokens_avg"])
    # in-LLM pruning: the prefill enters with all 16 visual tokens, the layer average is lower
    expected_cost = records["prefill_tokens"] - 16 + records["visual_tokens_avg"]
    np.testing.assert_allclose(records["cost_tokens"], expected_cost)
    assert (records["cost_tokens"] < records["prefill_tokens"]).all()


IN_LLM_SELECTORS = (
    "dart",
    "dycoke_kv",
    "e2s",
    "fastv",
    "fitprune",
    "holitom_llm",
    "mustdrop",
    "pdrop",
    "sparsevlm",
    "sparsevlm2",
    "v2drop",
    "vscan",
)
# VScan's vision stage (decoder layer 0) and HoliTom's inner merge merge by default; without merging their stages nest
# like the others'
IN_LLM_OPTIONS = {"holitom_llm": ("--option", "merge_pruned=false"), "vscan": ("--option", "merge_pruned=false")}
#: in-LLM selectors of video clips: refused on the still images of these runs
IN_LLM_VIDEO_SELECTORS = ("framefusion", "prunevid_llm")
#: in-LLM selectors whose tower stage holds the budget on the demo's one-crop LLaVA, so no in-LLM stage runs there
#: (FlowCut cuts in the decoder on anyres images only): their demo records, tests/pruners/test_flowcut.py
IN_LLM_ANYRES_ONLY = ("flowcut",)


def test_every_in_llm_selector_is_listed():
    from prune_audit.pruners import list_selectors, selector_class

    listed = set(IN_LLM_SELECTORS) | set(IN_LLM_VIDEO_SELECTORS) | set(IN_LLM_ANYRES_ONLY)
    assert listed == {name for name in list_selectors() if selector_class(name).stage == "llm"}


@pytest.mark.parametrize("selector", IN_LLM_VIDEO_SELECTORS)
def test_in_llm_video_selectors_are_refused_on_still_images_in_one_line(workspace, tmp_path, selector):
    out = tmp_path / selector
    result = invoke(base_args(workspace, out, "--selector", selector, "--budget", "6", "--limit", "2"))
    assert result.exit_code != 0 and "still image" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (out / "manifest.json").exists()


@pytest.mark.parametrize("selector", IN_LLM_SELECTORS)
def test_in_llm_stages_are_nested_and_retention_never_grows(workspace, tmp_path, selector):
    out = tmp_path / selector
    options = IN_LLM_OPTIONS.get(selector, ())
    result = invoke(base_args(workspace, out, "--selector", selector, "--budget", "6", "--limit", "24", *options))
    assert result.exit_code == 0, result.output
    records = read_records(out)
    planned = json.loads((out / "manifest.json").read_text())["selector"]["schedule"]
    from prune_audit.pruners import get_selector

    # a schedule solved on what the selector's own tower stage feeds each image is not planned (MustDrop's merge)
    assert (planned is None) == get_selector(selector).schedule_follows_tower
    layers = None if planned is None else [layer for layer, _ in planned]
    # a selector's own tower stage (MustDrop's merge) records the input (stage 0) first
    opening = 1 if get_selector(selector).tower_stage() is not None else 0
    masked = 0
    for row in records.itertuples():
        stages = [set(kept) for kept in row.kept_stages]
        recorded = list(row.stage_layers)
        assert recorded[:opening] == [0] * opening
        assert layers is None or recorded[opening:] == layers
        assert all(a >= b for a, b in zip(stages, stages[1:]))
        for column in ("retention_stages", "object_tokens_kept_stages", "lost_stages", "diluted_stages"):
            assert len(getattr(row, column)) == len(stages)
        assert (row.object_tokens_kept, row.lost) == (row.object_tokens_kept_stages[0], row.lost_stages[0])
        # no merged tokens: no object is diluted (null without a mask, as lost)
        assert [d is None for d in row.diluted_stages] == [lost is None for lost in row.lost_stages]
        assert not any(row.diluted_stages)
        if row.lost is None:
            assert np.isnan(row.retention_stages).all()
            continue
        masked += 1
        assert row.retention == row.retention_stages[0]
        assert np.all(np.diff(row.retention_stages) <= 1e-12), row.retention_stages
        assert np.all(np.diff(row.object_tokens_kept_stages) <= 0)
        assert all(not earlier or later for earlier, later in zip(row.lost_stages, row.lost_stages[1:]))
    assert masked
    first = int(records["lost"].dropna().sum())
    if not opening and layers[0] > 0:  # in-LLM: the first stage is deeper, except VScan's vision stage
        assert "lost objects, stage first (decoder layer 0)" not in result.output
    first_layer = 0 if opening else layers[0]
    assert f"lost objects, stage first (decoder layer {first_layer})" in " ".join(result.output.split())
    assert f"{first} of {masked}" in result.output


def test_a_run_of_an_older_version_is_refused_by_every_reader(workspace, tmp_path):
    out = tmp_path / "old"
    args = base_args(workspace, out, "--selector", "random", "--budget", "4", "--limit", "6")
    assert invoke(args).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["records_schema"]  # as written before per-stage records
    (out / "manifest.json").write_text(json.dumps(manifest))
    commands = [
        args,  # resume
        ["calibrate", str(out), "--bootstrap", "10", "--out", str(tmp_path / "calibration")],
        ["cascade", str(out), "--reference", str(out), "--out", str(tmp_path / "cascade")],
        ["intervene", str(out), "--mode", "restore", "--out", str(tmp_path / "intervene")],
        ["visualize", "--run", str(out), "--question-id", "1", "--out", str(tmp_path / "tokens.png")],
        ["merge", str(out), "--out", str(tmp_path / "merged")],
    ]
    for command in commands:
        result = runner.invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
        assert "written by an older prune-audit" in result.stderr and "re-run with this version" in result.stderr
    assert not any(
        (tmp_path / name).exists() for name in ("calibration", "cascade", "intervene", "tokens.png", "merged")
    )


def test_rerun_resumes_without_duplicates(workspace, tmp_path):
    out = tmp_path / "resume"
    args = base_args(workspace, out, "--selector", "uniform", "--budget", "4", "--limit", "12")
    assert invoke(args).exit_code == 0
    first = read_records(out)
    again = invoke(args)
    assert again.exit_code == 0, again.output
    assert comparable(read_records(out)).equals(comparable(first))


def test_changed_configuration_is_refused(workspace, tmp_path):
    out = tmp_path / "changed"
    assert invoke(base_args(workspace, out, "--selector", "random", "--budget", "4", "--limit", "6")).exit_code == 0
    result = invoke(base_args(workspace, out, "--selector", "random", "--budget", "5", "--limit", "6"))
    assert result.exit_code == 2
    assert "budget" in result.stderr and "--out" in result.stderr


def test_default_run_directory_names_options_that_differ_from_their_defaults():
    from prune_audit.pruners import get_selector
    from prune_audit.runner.request import RunRequest
    from prune_audit.runner.run_dir import run_dir_of

    request = RunRequest(model="/models/demo/", selector="fastv", budget=64)
    assert run_dir_of(request, get_selector("fastv")) == Path("runs/demo-fastv-64")
    assert run_dir_of(request, get_selector("fastv", budget_rule="paper")) == Path("runs/demo-fastv-64-paper")
    assert run_dir_of(RunRequest(model="/models/demo"), None) == Path("runs/demo-dense")


def test_progress_lines_when_output_is_not_a_terminal_and_quiet_silences_them(workspace, tmp_path):
    args = base_args(
        workspace, tmp_path / "logged", "--selector", "random", "--budget", "5", "--limit", "12", "--batch-size", "4"
    )[1:]
    logged = subprocess.run(_cli("run", *args), capture_output=True, text=True)  # pipes: not a terminal
    assert logged.returncode == 0, logged.stderr
    lines = [line for line in logged.stderr.splitlines() if line.startswith("questions: ")]
    pattern = r"questions: \d+/12 \(\d+%\) \| ([0-9.]+|-) q/s \| ETA (\d+:\d\d:\d\d|\?)"
    assert lines and all(re.fullmatch(pattern, line) for line in lines), logged.stderr
    assert lines[-1].startswith("questions: 12/12 (100%)") and "\x1b[" not in logged.stderr  # no live-bar escapes
    quiet_args = [a if a != str(tmp_path / "logged") else str(tmp_path / "quiet") for a in args]
    quiet = subprocess.run(_cli("run", *quiet_args, "--quiet"), capture_output=True, text=True)
    assert quiet.returncode == 0 and "questions: " not in quiet.stderr and "accuracy" in quiet.stdout


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prune_audit.cli.main", *args]


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_uninterrupted(workspace, tmp_path):
    args = base_args(workspace, tmp_path / "reference", "--selector", "random", "--budget", "5", "--limit", "24")[1:]
    reference_dir = tmp_path / "reference"
    subprocess.run(_cli("run", *args), check=True, capture_output=True)
    reference = comparable(read_records(reference_dir))
    rng = random.Random(0)
    for trial in range(3):
        out = tmp_path / f"killed{trial}"
        trial_args = [a if a != str(reference_dir) else str(out) for a in args]
        process = subprocess.Popen(
            _cli("run", *trial_args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        # kill while it is writing parts: wait for the first part (or a random moment before)
        deadline = time.monotonic() + 60
        wait_for_parts = rng.random() < 0.7
        delay = rng.uniform(0.0, 2.0)
        start = time.monotonic()
        while time.monotonic() < deadline and process.poll() is None:
            parts = list((out / "parts").glob("part-*.parquet")) if (out / "parts").is_dir() else []
            if (wait_for_parts and len(parts) >= rng.randint(1, 4)) or (
                not wait_for_parts and time.monotonic() - start > delay
            ):
                break
            time.sleep(0.02)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it finished first: the resume below must then change nothing
            pass
        process.wait()
        resumed = subprocess.run(_cli("run", *trial_args), capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr
        assert comparable(read_records(out)).equals(reference)


def test_shards_and_merge_equal_one_process(workspace, tmp_path):
    whole = tmp_path / "whole"
    common = ("--selector", "random", "--budget", "5", "--limit", "24")
    assert invoke(base_args(workspace, whole, *common)).exit_code == 0
    for index in range(3):
        result = invoke(base_args(workspace, tmp_path / f"shard{index}", *common, "--shard", f"{index}/3"))
        assert result.exit_code == 0, result.output
    # sharding is by image: no image appears in two shards
    images = [set(read_run(tmp_path / f"shard{i}")[1]["image"].to_pylist()) for i in range(3)]
    assert not (images[0] & images[1] or images[0] & images[2] or images[1] & images[2])
    merged = tmp_path / "merged"
    result = invoke(["merge", *(str(tmp_path / f"shard{i}") for i in range(3)), "--out", str(merged)])
    assert result.exit_code == 0, result.output
    assert comparable(read_records(merged)).equals(comparable(read_records(whole)))
    # an incomplete set of shards is refused
    result = invoke(["merge", str(tmp_path / "shard0"), "--out", str(tmp_path / "partial")])
    assert result.exit_code == 2 and "missing shards" in result.stderr
    assert not (tmp_path / "partial" / "records.parquet").exists()


def free_port() -> int:
    """A port nobody listens on now: parallel test sessions on one machine must not share a rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


LAUNCHERS = {
    "torchrun": ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "{port}"],
    # --multi_gpu is accelerate's torchrun-based multi-process launch (RANK/WORLD_SIZE; the run uses gloo, so
    # it works without a GPU); --cpu with 2 processes would need mpirun and otherwise starts ONE process
    "accelerate": [
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "{port}",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_process_gloo_launch_equals_one_process(workspace, tmp_path, launcher):
    if launcher == "accelerate":
        pytest.importorskip("accelerate")
    common = ("--selector", "random", "--budget", "5", "--limit", "18")
    whole = tmp_path / "whole"
    assert invoke(base_args(workspace, whole, *common)).exit_code == 0
    launched = tmp_path / "launched"
    args = base_args(workspace, launched, *common)
    # no user accelerate config may change the launch: point its cache at the test's folder
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    port = free_port()
    completed = subprocess.run(
        [
            sys.executable,
            *(part.format(port=port) for part in LAUNCHERS[launcher]),
            "-m",
            "prune_audit.cli.main",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    # a failing rank's one-line error comes first: the launcher's and the other rank's tracebacks follow it
    errors = [line for line in completed.stderr.splitlines() if line.lower().startswith("error")]
    assert completed.returncode == 0, "\n".join([*errors, completed.stderr[-3000:]])
    assert_same_records(read_records(launched), read_records(whole))
    assert not (launched / "parts").exists()


# ----- bad inputs: one line, exit code 2, no run directory --------------------------------


def _copy_pope_with(ws, tmp_path, mutate) -> Path:
    lines = ws["pope"][0].read_text().splitlines()
    path = tmp_path / "scenes_pope_random.json"
    path.write_text("\n".join(mutate(lines)) + "\n")
    return path


def _assert_one_line_failure(result, out: Path, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists()


def _single_file_args(ws, out, pope: Path, images: Path | None = None, *extra: str) -> list[str]:
    return [
        "run",
        "--model",
        str(ws["model"]),
        "--pope",
        str(pope),
        "--images",
        str(images or ws["images"]),
        "--annotations",
        str(ws["instances"]),
        "--out",
        str(out),
        "--limit",
        "4",
        *extra,
    ]


def test_missing_image(workspace, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(workspace["images"], images)
    first = json.loads(workspace["pope"][0].read_text().splitlines()[0])["image"]
    (images / first).unlink()
    out = tmp_path / "out"
    result = invoke(_single_file_args(workspace, out, workspace["pope"][0], images))
    _assert_one_line_failure(result, out, "image not found", first)


def test_corrupt_image(workspace, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(workspace["images"], images)
    first = json.loads(workspace["pope"][0].read_text().splitlines()[0])["image"]
    (images / first).write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    out = tmp_path / "out"
    result = invoke(_single_file_args(workspace, out, workspace["pope"][0], images))
    _assert_one_line_failure(result, out, "cannot be decoded")


def test_malformed_question_line(workspace, tmp_path):
    pope = _copy_pope_with(workspace, tmp_path, lambda lines: lines[:2] + ["{not json"] + lines[2:])
    out = tmp_path / "out"
    result = invoke(_single_file_args(workspace, out, pope))
    _assert_one_line_failure(result, out, "scenes_pope_random.json:3", "malformed")


def test_unknown_object(workspace, tmp_path):
    def swap(lines):
        record = json.loads(lines[0])
        record["text"] = "Is there a unicorn in the image?"
        return [json.dumps(record)] + lines[1:]

    out = tmp_path / "out"
    result = invoke(_single_file_args(workspace, out, _copy_pope_with(workspace, tmp_path, swap)))
    _assert_one_line_failure(result, out, "unicorn")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (("--selector", "random", "--budget", "0"), ("budget",)),
        (("--selector", "random", "--budget", "-3"), ("budget",)),
        (("--selector", "nonsense", "--budget", "4"), ("unknown selector", "divprune")),
        (("--selector", "scope", "--budget", "4", "--option", "beta=2"), ("beta", "alpha")),
        (("--selector", "scope", "--budget", "4", "--option", "alpha=high"), ("alpha",)),
        (("--device", "cuda"), ("CUDA",)),
    ],
)
def test_bad_options(workspace, tmp_path, extra, needles):
    if "cuda" in extra:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    out = tmp_path / "out"
    result = invoke(_single_file_args(workspace, out, workspace["pope"][0], None, *extra))
    _assert_one_line_failure(result, out, *needles)


def test_missing_model_path(workspace, tmp_path):
    out = tmp_path / "out"
    args = _single_file_args(workspace, out, workspace["pope"][0])
    args[args.index("--model") + 1] = str(tmp_path / "no-such-model")
    result = invoke(args)
    _assert_one_line_failure(result, out, "no-such-model")


def test_out_dir_not_writable(workspace, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "run"
    result = invoke(_single_file_args(workspace, out, workspace["pope"][0]))
    _assert_one_line_failure(result, out, "not writable")
