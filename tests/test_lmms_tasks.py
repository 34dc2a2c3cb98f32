"""Issue 46, item 5: ``prune-audit demo lmms-tasks DIR`` writes the offline lmms-eval tasks outside the test.

lmms-eval itself is not needed here: the written files are checked as lmms-eval reads them (YAML with
``!function`` tags, Parquet rows, the copied task functions); ``tests/test_lmms_eval_plugin.py`` runs lmms-eval on
the same tasks where it is installed.
"""

from __future__ import annotations

import importlib.util
import json

import pyarrow.parquet as pq
import pytest
import yaml
from cli_checks import refused, snapshot
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.demo.assets import demo_assets
from prune_audit.demo.lmms_tasks import CAPTION_PROMPT, CAPTION_TOKENS, MAX_NEW_TOKENS, TASKS

runner = CliRunner()


class TaskLoader(yaml.SafeLoader):
    """lmms-eval's YAML: ``!function module.name`` names a function of the task folder's module."""


TaskLoader.add_constructor("!function", lambda loader, node: ("function", loader.construct_scalar(node)))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lmms") / "tasks"
    result = runner.invoke(app, ["demo", "lmms-tasks", str(folder), "--questions", "6", "--captions", "3"])
    assert result.exit_code == 0, result.output
    assert f"to {folder}" in result.stdout and "--include_path" in result.stdout
    return folder


def task_functions(folder):
    spec = importlib.util.spec_from_file_location("localpope_utils", folder / "localpope_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_writes_four_tasks_over_the_demo_questions(tasks):
    visible = {path.name for path in tasks.iterdir() if not path.name.startswith(".")}
    assert visible == {"pope.parquet", "caption.parquet", "localpope_utils.py", *(f"{task}.yaml" for task in TASKS)}
    demo = demo_assets()
    rows = [json.loads(line) for line in demo.pope_files[0].read_text().splitlines()[:6]]
    pope = pq.read_table(tasks / "pope.parquet").to_pylist()
    assert [(r["question_id"], r["question"], r["answer"]) for r in pope] == [
        (r["question_id"], r["text"], r["label"]) for r in rows
    ]
    assert all(r["image"]["bytes"] == (demo.images_dir / q["image"]).read_bytes() for r, q in zip(pope, rows))
    captions = pq.read_table(tasks / "caption.parquet").to_pylist()
    assert len(captions) == 3 and {r["question"] for r in captions} == {CAPTION_PROMPT}

    functions = task_functions(tasks)
    for task in TASKS:
        spec = yaml.load((tasks / f"{task}.yaml").read_text(), Loader=TaskLoader)
        assert spec["task"] == task and spec["test_split"] == "test"
        parquet = spec["dataset_kwargs"]["data_files"]["test"]
        assert parquet == str(tasks.resolve() / ("caption.parquet" if task == "localcaption" else "pope.parquet"))
        named = [value[1] for value in spec.values() if isinstance(value, tuple)]
        assert named and all(hasattr(functions, name.split(".")[1]) for name in named), named
        if "generation_kwargs" in spec:
            tokens = CAPTION_TOKENS if task == "localcaption" else MAX_NEW_TOKENS
            assert spec["generation_kwargs"] == {"max_new_tokens": tokens, "do_sample": False}
    assert yaml.load((tasks / "localpope_mc.yaml").read_text(), Loader=TaskLoader)["doc_to_choice"] == ["yes", "no"]
    [image] = functions.doc_to_visual(pope[0])
    assert image.mode == "RGB" and image.size[0] > 0
    assert functions.process_results(pope[0], [pope[0]["answer"].capitalize() + "."]) == {"accuracy": 1.0}


def test_caption_images_are_the_ones_run_describes(tasks, tmp_path):
    demo = demo_assets()
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "run",
            "--model",
            "demo",
            "--task",
            "caption",
            "--questions",
            str(demo.annotations),
            "--annotations",
            str(demo.annotations),
            "--images",
            str(demo.images_dir),
            "--limit",
            "3",
            "--max-new-tokens",
            "2",
            "--out",
            str(out),
            "--quiet",
            "--threads",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    recorded = [row["image"] for row in pq.read_table(out / "records.parquet").to_pylist()]
    assert [row["image"]["path"] for row in pq.read_table(tasks / "caption.parquet").to_pylist()] == recorded


def test_other_settings_or_too_many_questions_are_refused_in_one_line(tasks, tmp_path):
    before = snapshot(tasks)
    refused(
        runner.invoke(app, ["demo", "lmms-tasks", str(tasks), "--questions", "7", "--captions", "3"]),
        "other settings",
        "DIR",
    )
    assert snapshot(tasks) == before
    again = runner.invoke(app, ["demo", "lmms-tasks", str(tasks), "--questions", "6", "--captions", "3"])
    assert again.exit_code == 0, again.output  # the same settings rewrite the same files
    assert snapshot(tasks) == before
    refused(
        runner.invoke(app, ["demo", "lmms-tasks", str(tmp_path / "many"), "--questions", "100000"]),
        "the demo has 3000 questions",
        "--questions",
    )
    assert not (tmp_path / "many").exists()
