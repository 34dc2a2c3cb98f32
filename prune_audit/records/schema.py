"""Every record column, defined once: the task-agnostic core here, each task's own on its task class.

The run writer (``runner.build``), the record store, the analysis readers, the intervene
rows and docs/records.md (``records_markdown``) all come from ``run_columns()`` and
``INTERVENE_COLUMNS``.

A task owns its record columns: each task class declares them (``Task.record_columns``, plus the shared
``tasks.base.GENERATED_COLUMNS`` when it generates), and ``run_columns`` assembles the run schema from the task
registry at every call: the core head, each registered task's columns in registration order (the built-ins in the
fixed order of ``prune_audit.tasks``, so every existing run's columns keep their order and types; plug-ins after
them), then the core tail. No module here knows a task by name.

Layering: ``tasks`` imports nothing from ``records`` (the column type lives below both, in
``prune_audit.record_columns``), so ``records`` sits above ``tasks`` and reads the registry with a plain downward
import: no registration hook, no import cycle, and the schema is complete in any process that imports this module
(``python -m prune_audit.records.docs`` included), with no task import to remember. ``RUN_COLUMNS``,
``RUN_SCHEMA``, ``INTERVENE_SCHEMA`` and ``NON_NULL_COLUMNS`` are computed on access, so they include a plug-in
registered after this module was imported.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa

from prune_audit.compute.cost import SIGNAL_SOURCES
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import INT_LIST, INTERVENE_COMMANDS, Column
from prune_audit.record_columns import column as _run
from prune_audit.tasks.base import GENERATED_COLUMNS
from prune_audit.tasks.clips import CLIP_COLUMNS
from prune_audit.tasks.registry import task_classes

SCHEMA_VERSION = 9
"""Version of the record columns, written to every manifest as ``records_schema``.

2: per-stage columns (``stage_layers``, ``*_stages``); ``retention``, ``object_tokens_kept``
and ``lost`` are the first stage's values (1 computed them on the last non-empty stage).
3: ``merged_stages`` (in-LLM merged tokens and their sources); retention counts their footprint.
4: ``merged_stages`` also holds input-level merged tokens (VisionZip's contextual tokens), so their
footprint counts towards that stage's retention, ``object_tokens_kept`` and ``lost`` (3 left them out).
5: every records file carries its run's ``run_id`` (Parquet metadata ``RUN_ID_METADATA``, also in the manifest),
so records are read and resumed only by the run they belong to (4's records cannot be told apart).
6: the task seam: task-agnostic core columns (``task``, ``answer_text``, ``references``; ``confidence``,
``correct`` and the retention columns now read each task's own definition and evidence region) and each
task's own columns (POPE's ``object``, ``label``, ``answer``, ``p_*``, ``logit_diff``: null in other tasks'
rows); the manifest records the ``task``.
7: the cost columns (``COST_COLUMNS``: analytic FLOPs per part, KV-cache bytes, FLOP-equivalent tokens,
measured latency parts, decoding included where the task generates; docs/compute.md).
8: ``signal_sources``: where the selector's signals came from (CLS-row or decoder-row probes, a tower rerun, ...).
9: the clip columns of the video tasks (``tasks.clips.CLIP_COLUMNS``: sampled frames, per-frame retention at each
stage, the asked window and what it keeps), null in still-image rows.
Readers and resume refuse any other version.
"""

RECORDS_FILE = "records.parquet"
RUN_ID_METADATA = b"prune_audit.run_id"
"""Parquet key-value metadata of every records file: the ``run_id`` of the manifest it belongs to."""
KEY_COLUMNS = ("split", "question_id")
"""Rows are keyed by (split, question_id): POPE question ids repeat across splits."""

Record = dict[str, Any]
"""One record as a Python dict, column name -> value (``RUN_SCHEMA`` or ``INTERVENE_SCHEMA``)."""

COST_COLUMNS: tuple[Column, ...] = (
    _run(
        "flops",
        pa.int64(),
        "analytic FLOPs of the prefill: flops_vision + flops_selector + flops_llm (docs/compute.md; a product "
        "(m,k)@(k,n) counts 2mkn, norms and softmax 0)",
    ),
    _run(
        "flops_vision",
        pa.int64(),
        "vision tower up to the feature layer, projector, and the vision-side signals the selector needs (CLS-row "
        "probe, per-layer attention probes, CDPruner's CLIP text tower, re-projection of merged tokens); a tower run "
        "with merges or cuts (ToMe location=tower, FlowCut) in place of the plain tower and projector",
    ),
    _run(
        "flops_selector",
        pa.int64(),
        "the selector's own arithmetic (similarity matrices, greedy steps, DPP updates); nominal for greedy "
        "selectors (docs/compute.md lists which)",
    ),
    _run(
        "flops_llm",
        pa.int64(),
        "decoder layers at their realised sequence lengths (attention over every key of the layer), the "
        "in-LLM probes, and the LM head at the last position",
    ),
    _run("flops_dense", pa.int64(), "flops of the same question unpruned (the run's reference point)"),
    _run(
        "flops_decode_token",
        pa.int64(),
        "FLOPs of one generated token after this prefill (each layer attends over its pruned KV cache + itself)",
    ),
    _run(
        "kv_bytes",
        pa.int64(),
        "KV-cache bytes after the prefill: sum over layers of 2 x length x KV heads x head dim x dtype bytes",
    ),
    _run(
        "flop_equivalent_tokens",
        pa.float64(),
        "the dense sequence length whose decoder prefill (+ LM head) costs flops - the dense vision tower and projector",
    ),
    _run(
        "signal_sources",
        pa.list_(pa.string()),
        "where the selector's signals came from beyond the prefill, in this order (empty: nothing, e.g. unpruned, "
        "random, or features only; null: not known, a cost imported with the kept sets): "
        + "; ".join(f"`{name}`: {meaning}" for name, meaning in SIGNAL_SOURCES.items())
        + ". Attention rows and keys are recomputed from the layer's weights (probes), never by switching a layer "
        "to eager attention: every layer of every record runs the manifest's `attn_implementation`",
        nullable=True,
    ),
    _run("latency_vision_ms", pa.float64(), "wall time of the vision tower and projector (batch time / batch size)"),
    _run(
        "latency_selection_ms",
        pa.float64(),
        "wall time of input-level signals and selection and building the LLM inputs (in-LLM selectors score "
        "inside latency_prefill_ms)",
    ),
    _run("latency_prefill_ms", pa.float64(), "wall time of the decoder layers (with in-LLM pruning) and the LM head"),
    _run(
        "latency_decode_ms",
        pa.float64(),
        "wall time of greedy decoding after the prefill, over the pruned KV cache (null when the task answers "
        "from the first token)",
        nullable=True,
    ),
)
"""The cost block of the run columns (issue 26); written by ``runner.build.cost_values``."""

TIMING_COLUMNS = (
    "latency_ms",
    "latency_vision_ms",
    "latency_selection_ms",
    "latency_prefill_ms",
    "latency_decode_ms",
)
"""Measured wall times: the run columns that differ between two runs of the same command."""

HEAD_COLUMNS: tuple[Column, ...] = (
    _run("question_id", pa.int64(), "id from the question file"),
    _run(
        "split",
        pa.string(),
        "POPE: random / popular / adversarial (or the file's category); other tasks: see docs/tasks.md",
    ),
    _run("task", pa.string(), "the run's task (`run --task`, docs/tasks.md): pope, ..."),
    _run("image", pa.string(), "image file name as in the question file"),
    _run("image_id", pa.int64(), "image id (COCO's for POPE): the exchangeable unit for bootstrap and CRC"),
    _run("answer_text", pa.string(), "the model's answer as text (POPE: yes / no)"),
    _run("references", pa.list_(pa.string()), "the reference answers it is scored against (POPE: [label])"),
    _run(
        "confidence",
        pa.float64(),
        "the task's confidence in its answer (docs/tasks.md; POPE: max(p_yes_2way, 1 - p_yes_2way))",
    ),
    _run("correct", pa.bool_(), "the task's correctness rule (docs/tasks.md; POPE: answer == label)"),
)
"""The core columns before the tasks' own (``run_columns``)."""

TAIL_COLUMNS: tuple[Column, ...] = (
    _run(
        "kept",
        INT_LIST,
        "the last non-empty kept set: the visual tokens of the deepest decoder layers that still see any "
        "(all tokens unpruned; for a schedule ending at 0 tokens, those alive before its last stage); "
        "the stage `--stage last` reads",
    ),
    _run(
        "kept_stages",
        pa.list_(INT_LIST),
        "kept grid indices after each stage, nested (one entry for input-level selectors, all tokens unpruned; a "
        "selector that cuts inside the vision tower records each cut before it)",
    ),
    _run(
        "merged_stages",
        pa.list_(pa.list_(INT_LIST)),
        "for each stage, the merged tokens alive after it, each as the ascending grid indices it carries, in "
        "feed order: an input-level merge's tokens at its single stage (VisionZip's contextual tokens) and an "
        "in-LLM merge's tokens (SparseVLM's inserted ones with recycle=true, VScan's in its kept tokens' places); "
        "empty lists without merging",
    ),
    _run(
        "stage_layers",
        INT_LIST,
        "for each stage, the decoder layer whose input its kept set is ([0] for input-level selectors and unpruned); "
        "a cut inside the vision tower before it is negative, l - Lv for the cut after tower layer l of the Lv run",
    ),
    _run("visual_tokens_avg", pa.float64(), "realised average number of visual tokens over decoder layers"),
    _run(
        "prefill_tokens", pa.int64(), "tokens in the prefill sequence entering the first decoder layer (text + visual)"
    ),
    _run(
        "cost_tokens",
        pa.float64(),
        "the prefill sequence length averaged over decoder layers (= prefill_tokens for input-level selectors; "
        "less for in-LLM pruning); the cascade's cost unit",
    ),
    _run(
        "retention",
        pa.float64(),
        "area retention of the question's evidence region (docs/tasks.md; POPE: the queried object's mask) by the "
        "FIRST stage's kept set, the earliest point at which tokens leave the model (NaN without evidence: POPE's "
        '"no" questions, unknown masks); = retention_stages[0]. A stage\'s kept set here and in '
        "the columns below is its kept grid indices plus every grid index its merged tokens carry "
        "(merged_stages)",
    ),
    _run(
        "retention_stages",
        pa.list_(pa.float64()),
        "retention of each stage's kept set; non-increasing, since the sets are nested (NaN entries without a mask)",
    ),
    _run("visible_fraction", pa.float64(), "mask fraction inside any token footprint (NaN when no mask)"),
    _run(
        "object_tokens_kept",
        pa.int64(),
        "number of the first stage's kept tokens holding object pixels (-1 when no mask); "
        "= object_tokens_kept_stages[0]",
    ),
    _run(
        "object_tokens_kept_stages", INT_LIST, "object_tokens_kept of each stage's kept set (-1 entries without a mask)"
    ),
    _run(
        "lost",
        pa.bool_(),
        "object had pixels but none in the first stage's kept cells or the cells its merged tokens carry (null "
        "when no mask); = lost_stages[0]",
        nullable=True,
    ),
    _run(
        "lost_stages",
        pa.list_(pa.bool_()),
        "lost at each stage (null entries without a mask); an empty stage (a schedule ending at 0 tokens) loses "
        "every object",
    ),
    _run(
        "diluted",
        pa.bool_(),
        "object had pixels, none in the first stage's own kept cells, some only in cells a merged token carries "
        "(it reaches the model averaged with other cells, so lost is false); false without merged tokens, null "
        "when no mask; = diluted_stages[0]",
        nullable=True,
    ),
    _run("diluted_stages", pa.list_(pa.bool_()), "diluted at each stage (null entries without a mask)"),
    _run(
        "object_area",
        pa.int64(),
        'pixels of the evidence region in the image (0 without evidence: POPE\'s "no" questions)',
    ),
    _run(
        "evidence_objects",
        pa.list_(pa.string()),
        "the objects of the evidence region, each on its own (POPE: the "
        "queried object of a yes question; empty without annotations)",
    ),
    _run(
        "evidence_objects_lost",
        pa.list_(pa.bool_()),
        "for each of evidence_objects, lost at the FIRST stage: pixels, none in the kept cells or the cells "
        "merged tokens carry (null entries for an object without pixels)",
    ),
    _run(
        "latency_ms",
        pa.float64(),
        "wall time of the question: the sum of its latency parts (vision, selection, "
        "prefill; tasks that generate: and decoding), each batch time / batch size",
    ),
    *COST_COLUMNS,
    _run(
        "geometry",
        pa.string(),
        "JSON of the image's `TokenGeometry` (several grids: `data.multigrid`; lets `visualize --run` redraw without the model)",
    ),
    _run("order", pa.int64(), "position of the question in the run's question list (sorts the rows)"),
)
"""The core columns after the tasks' own (``run_columns``)."""

INTERVENE_COLUMNS: tuple[Column, ...] = (
    Column("condition", pa.string(), False, '"intervention" or "control"', INTERVENE_COMMANDS),
    Column("cells_changed", pa.int64(), False, "grid cells swapped into (and out of) the kept set", INTERVENE_COMMANDS),
    Column(
        "object_area_changed",
        pa.int64(),
        False,
        "object pixels of the added cells minus those of the removed cells",
        INTERVENE_COMMANDS,
    ),
)


def tasks_columns() -> tuple[Column, ...]:
    """Every registered task's own columns, each naming its tasks: in registration order, the shared
    ``GENERATED_COLUMNS`` just before the first generating task's own and ``CLIP_COLUMNS`` just before the first clip
    task's own. A task may declare another task's column as it is (the video tasks' answer columns are POPE's and
    ScienceQA's): the column is listed once, at its first place, naming both tasks."""
    classes = task_classes()
    shared = {
        classes_of[0]: [replace(column, tasks=classes_of) for column in block]
        for block, classes_of in (
            (GENERATED_COLUMNS, tuple(task.name for task in classes if task.generates())),
            (CLIP_COLUMNS, tuple(task.name for task in classes if task.reads_clips)),
        )
        if classes_of
    }
    columns: dict[str, Column] = {}
    repeated: list[Column] = []
    for task in classes:
        for column in (*shared.get(task.name, ()), *task.record_columns):
            first = columns.get(column.name)
            if first is not None and replace(first, tasks=()) == replace(column, tasks=()):
                if task.name not in first.tasks:
                    columns[column.name] = replace(first, tasks=(*first.tasks, task.name))
            elif first is not None:
                repeated.append(replace(column, tasks=(task.name,)))  # refused by _check_declared_once
            else:
                columns[column.name] = column if column.tasks else replace(column, tasks=(task.name,))
    return (*columns.values(), *repeated)


def run_columns() -> tuple[Column, ...]:
    """The run columns: the core head, every registered task's own (``tasks_columns``), the core tail."""
    columns = (*HEAD_COLUMNS, *tasks_columns(), *TAIL_COLUMNS)
    _check_declared_once((*columns, *INTERVENE_COLUMNS))
    return columns


def _check_declared_once(columns: tuple[Column, ...]) -> None:
    """Refuse a column name declared twice (a plug-in task's column named as another's) in one line."""
    seen: dict[str, Column] = {}
    for column in columns:
        if column.name in seen:
            first = ", ".join(seen[column.name].tasks) or "the core columns"
            raise PruneAuditError(
                f"record column {column.name!r} is declared by {first} and again by task "
                f"{', '.join(column.tasks)}; rename the task's column (Task.record_columns)"
            )
        seen[column.name] = column


def run_schema() -> pa.Schema:
    """The schema of a run's ``records.parquet`` and of its part files."""
    return pa.schema([column.field() for column in run_columns()])


def intervene_schema() -> pa.Schema:
    """The schema of ``intervene``'s ``records.parquet``: the run columns plus the swap columns."""
    return pa.schema([column.field() for column in (*run_columns(), *INTERVENE_COLUMNS)])


def non_null_columns() -> tuple[str, ...]:
    """Core run columns that hold a value in every row."""
    return tuple(column.name for column in run_columns() if not column.nullable and not column.tasks)


def task_columns(task: str) -> tuple[Column, ...]:
    """The run columns only ``task``'s rows hold."""
    return tuple(column for column in run_columns() if task in column.tasks)


_COMPUTED = {
    "RUN_COLUMNS": run_columns,
    "RUN_SCHEMA": run_schema,
    "INTERVENE_SCHEMA": intervene_schema,
    "NON_NULL_COLUMNS": non_null_columns,
}
"""The schema's former constants, served on access (PEP 562) from the registry as it stands then."""


def __getattr__(name: str) -> Any:
    if name in _COMPUTED:
        return _COMPUTED[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
