"""The lmms-eval model plugin (``prune_audit.api.lmms_eval``) through lmms-eval's own command line.

Runs only where the optional extra is installed (``pip install "prune-audit[lmms-eval]"``) with this checkout
registered for the ``lmms_eval.models`` entry point; elsewhere it is skipped. A local POPE-like generation task
(a Parquet file of demo questions and images, the task YAML through ``--include_path``) is evaluated dense and
under FastV; lmms-eval's score and the plugin's records must match the Python API's answers on the same inputs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmms_eval")
TASK_UTILS = Path(__file__).resolve().parent / "lmms_eval_task" / "localpope_utils.py"
QUESTIONS = 8
MAX_NEW_TOKENS = 4


def lmms_eval_command() -> Path:
    command = Path(sys.executable).parent / "lmms-eval"
    if not command.is_file():
        pytest.skip("the lmms-eval command is not installed beside this Python")
    from importlib.metadata import entry_points

    if not any(entry.name == "prune_audit" for entry in entry_points(group="lmms_eval.models")):
        pytest.skip("prune-audit is not registered for lmms_eval.models here (pip install -e '.[lmms-eval]')")
    return command


def write_task(folder: Path) -> list[dict]:
    """The task folder: the Parquet file of the first demo questions, its YAML and its functions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prune_audit.demo.assets import demo_assets

    demo = demo_assets()
    rows = [json.loads(line) for line in demo.pope_files[0].read_text().splitlines()[:QUESTIONS]]
    images = [{"bytes": (demo.images_dir / row["image"]).read_bytes(), "path": row["image"]} for row in rows]
    folder.mkdir()
    pq.write_table(pa.table({"question_id": [row["question_id"] for row in rows],
                             "question": [row["text"] for row in rows], "answer": [row["label"] for row in rows],
                             "image": images}), folder / "test.parquet")
    shutil.copy(TASK_UTILS, folder / "localpope_utils.py")
    (folder / "localpope.yaml").write_text(f"""dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {folder / 'test.parquet'}
task: localpope
test_split: test
output_type: generate_until
doc_to_visual: !function localpope_utils.doc_to_visual
doc_to_text: !function localpope_utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {MAX_NEW_TOKENS}
  do_sample: false
process_results: !function localpope_utils.process_results
metric_list:
  - metric: accuracy
    aggregation: mean
    higher_is_better: true
""")
    return rows


@pytest.mark.parametrize("selector, budget, batch_size", [("none", None, 1), ("fastv", 16, 3)])
def test_lmms_eval_runs_the_pruned_model(tmp_path, selector, budget, batch_size):
    command = lmms_eval_command()
    rows = write_task(tmp_path / "task")
    records = tmp_path / "records"
    model_args = f"pretrained=demo,selector={selector},records={records},device=cpu"
    model_args += "" if budget is None else f",budget={budget}"
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    completed = subprocess.run(
        [str(command), "eval", "--model", "prune_audit", "--model_args", model_args, "--tasks", "localpope",
         "--include_path", str(tmp_path / "task"), "--output_path", str(tmp_path / "out"),
         "--batch_size", str(batch_size)],
        capture_output=True, text=True, env=environment, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    [results_file] = (tmp_path / "out").rglob("*_results.json")
    accuracy = json.loads(results_file.read_text())["results"]["localpope"]["accuracy,none"]
    lines = [json.loads(line) for line in (records / "localpope.jsonl").read_text().splitlines()]
    assert [line["doc_id"] for line in lines] == list(range(QUESTIONS))

    from prune_audit import load, pruned
    from prune_audit.demo.assets import demo_assets

    images = [demo_assets().images_dir / row["image"] for row in rows]
    with pruned(load("demo", device="cpu"), selector, budget) as model:
        expected = model.generate(images, [row["text"] for row in rows], max_new_tokens=MAX_NEW_TOKENS)
    assert [line["text"] for line in lines] == [result.text for result in expected]
    assert [line["kept_stages"] for line in lines] == [result.kept_stages for result in expected]
    assert [line["sequence_probability"] for line in lines] == pytest.approx(
        [result.sequence_probability for result in expected], abs=1e-6)
    scored = [result.text.lower().startswith(row["label"]) for result, row in zip(expected, rows)]
    assert accuracy == pytest.approx(sum(scored) / QUESTIONS)


def test_dense_answers_equal_lmms_evals_own_llava_class(tmp_path):
    """selector=none gives lmms-eval's llava_hf answers on the same inputs (the demo is a LLaVA checkpoint)."""
    command = lmms_eval_command()
    pytest.importorskip("decord")  # lmms-eval's llava_hf module imports it
    from prune_audit.demo import DEMO_MODEL_DIR

    write_task(tmp_path / "task")
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    answers = {}
    for model, model_args in [("prune_audit", "pretrained=demo,selector=none,device=cpu"),
                              ("llava_hf", f"pretrained={DEMO_MODEL_DIR},device=cpu,device_map=cpu,dtype=float32")]:
        out = tmp_path / model
        completed = subprocess.run(
            [str(command), "eval", "--model", model, "--model_args", model_args, "--tasks", "localpope",
             "--include_path", str(tmp_path / "task"), "--output_path", str(out), "--log_samples"],
            capture_output=True, text=True, env=environment, check=False,
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        [samples] = out.rglob("*samples*.jsonl")
        answers[model] = [json.loads(line)["filtered_resps"] for line in samples.read_text().splitlines()]
    assert len(answers["prune_audit"]) == QUESTIONS
    assert answers["prune_audit"] == answers["llava_hf"]
