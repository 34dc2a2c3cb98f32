"""Offline lmms-eval tasks over the demo question set: a folder for lmms-eval's ``--include_path``.

lmms-eval's own tasks (``--tasks pope``) download their datasets from the hub; offline they fail. These
local tasks read Parquet files of demo questions and images written beside their YAML, so the plugin
(``prune_audit.api.lmms_eval``) runs without network, one task per request type it serves:

* ``localpope``: POPE questions, ``generate_until``, scored by whether the answer starts with the label;
* ``localpope_mc``: the same questions as ``multiple_choice`` over "yes" and "no" (loglikelihood requests);
* ``localpope_rounds``: ``generate_until_multi_round``, the question, then the same image asked again quoting the
  first answer;
* ``localcaption``: "Describe this image in detail.", ``generate_until``, scored by its word count.

``prune-audit demo lmms-tasks DIR`` writes them (``write_demo_tasks``); ``tests/test_lmms_eval_plugin.py`` and
``benchmarks/lmms_eval_compare.py`` write the same tasks from the questions and images of their own runs
(``write_tasks``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

from prune_audit.errors import PruneAuditError
from prune_audit.safety.atomic import write_bytes_atomic, write_text_atomic

TASK_UTILS = Path(__file__).resolve().parents[1] / "assets" / "lmms-eval-task" / "localpope_utils.py"
"""The tasks' Python functions (images from the Parquet rows, prompts, scores), copied beside the YAML."""

TASKS = ("localpope", "localpope_mc", "localpope_rounds", "localcaption")
MAX_NEW_TOKENS = 4
"""Tokens a POPE answer may generate (yes or no, and a little more)."""
CAPTION_TOKENS = 8
CAPTION_PROMPT = "Describe this image in detail."

GENERATION = """doc_to_text: !function localpope_utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {tokens}
  do_sample: false
process_results: !function localpope_utils.{process}
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
"""

MULTIPLE_CHOICE = """doc_to_text: !function localpope_utils.doc_to_text
doc_to_target: answer
doc_to_choice: ["yes", "no"]
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def task_yaml(task: str, parquet: Path, output_type: str, body: str) -> str:
    """One task's YAML: its Parquet test split, request type and images, then ``body`` (prompt, scoring)."""
    return f"""dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {parquet}
task: {task}
test_split: test
output_type: {output_type}
doc_to_visual: !function localpope_utils.doc_to_visual
{body}"""


def _parquet(columns: dict[str, list]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


def write_tasks(folder: Path, pope_rows: Sequence[dict], caption_images: Sequence[str], images_dir: Path) -> None:
    """The four tasks in ``folder`` (which exists): POPE rows (``question_id``, ``text``, ``label``, ``image`` as in
    the POPE files) and the caption images, both read from ``images_dir``; each file written atomically."""
    folder = folder.resolve()  # the YAML names its Parquet file by absolute path: lmms-eval runs from anywhere
    write_bytes_atomic(
        _parquet(
            {
                "question_id": [row["question_id"] for row in pope_rows],
                "question": [row["text"] for row in pope_rows],
                "answer": [row["label"] for row in pope_rows],
                "image": [
                    {"bytes": (images_dir / row["image"]).read_bytes(), "path": row["image"]} for row in pope_rows
                ],
            }
        ),
        folder / "pope.parquet",
    )
    write_bytes_atomic(
        _parquet(
            {
                "question": [CAPTION_PROMPT] * len(caption_images),
                "answer": [""] * len(caption_images),
                "image": [{"bytes": (images_dir / name).read_bytes(), "path": name} for name in caption_images],
            }
        ),
        folder / "caption.parquet",
    )
    write_bytes_atomic(TASK_UTILS.read_bytes(), folder / "localpope_utils.py")
    pope, caption = folder / "pope.parquet", folder / "caption.parquet"
    generation = GENERATION.format(tokens=MAX_NEW_TOKENS, process="process_results", metric="accuracy")
    rounds = generation.replace("localpope_utils.doc_to_text", "localpope_utils.doc_to_text_rounds").replace(
        "process_results\n", "process_results_rounds\n"
    )
    files = {
        "localpope": task_yaml("localpope", pope, "generate_until", generation),
        "localpope_rounds": task_yaml("localpope_rounds", pope, "generate_until_multi_round", rounds),
        "localpope_mc": task_yaml("localpope_mc", pope, "multiple_choice", MULTIPLE_CHOICE),
        "localcaption": task_yaml(
            "localcaption",
            caption,
            "generate_until",
            GENERATION.format(tokens=CAPTION_TOKENS, process="process_results_caption", metric="words"),
        ),
    }
    for task, text in files.items():
        write_text_atomic(text, folder / f"{task}.yaml")


def write_demo_tasks(folder: Path, questions: int, captions: int) -> None:
    """The four tasks over the first ``questions`` questions of the demo's first POPE file and the first
    ``captions`` images of its caption questions (the demo question set, generated on first use)."""
    from prune_audit.demo.assets import demo_assets
    from prune_audit.tasks import get_task

    demo = demo_assets()
    with open(demo.pope_files[0], encoding="utf-8") as handle:
        pope_rows = [json.loads(line) for line, _ in zip(handle, range(questions))]
    images = [question.image for question in get_task("caption").read_questions([demo.annotations])[:captions]]
    if len(pope_rows) < questions or len(images) < captions:
        raise PruneAuditError(
            f"the demo has {len(pope_rows)} questions in its first POPE file and {len(images)} images "
            f"to describe here; pass at most those (--questions, --captions)"
        )
    write_tasks(folder, pope_rows, images, demo.images_dir)


__all__ = ["CAPTION_PROMPT", "CAPTION_TOKENS", "MAX_NEW_TOKENS", "TASKS", "write_demo_tasks", "write_tasks"]
