"""Every record column, defined once: name, Arrow type, nullability, meaning, and who writes it.

The run writer (``runner.build``), the record store, the analysis readers, the intervene
rows and docs/records.md (``records_markdown``) all come from ``RUN_COLUMNS`` and
``INTERVENE_COLUMNS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prune_audit.compute.cost import SIGNAL_SOURCES

SCHEMA_VERSION = 8
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
Readers and resume refuse any other version.
"""

RECORDS_FILE = "records.parquet"
RUN_ID_METADATA = b"prune_audit.run_id"
"""Parquet key-value metadata of every records file: the ``run_id`` of the manifest it belongs to."""
KEY_COLUMNS = ("split", "question_id")
"""Rows are keyed by (split, question_id): POPE question ids repeat across splits."""

Record = dict[str, Any]
"""One record as a Python dict, column name -> value (``RUN_SCHEMA`` or ``INTERVENE_SCHEMA``)."""

RUN_COMMANDS = ("run", "intervene")
INTERVENE_COMMANDS = ("intervene",)


@dataclass(frozen=True)
class Column:
    """One record column.

    Attributes:
        name: the Parquet column name.
        type: its Arrow type.
        nullable: whether a row may hold null (NaN in a float column is a value, not null).
        meaning: what the value is, for docs/records.md.
        written_by: the commands whose records carry the column.
        tasks: the tasks whose rows hold it (``prune_audit.tasks``); empty for the task-agnostic core. A task's
            own column is null in the rows of every other task, so its Arrow field is nullable; ``nullable``
            says whether it may be null in its own tasks' rows.
    """

    name: str
    type: pa.DataType
    nullable: bool
    meaning: str
    written_by: tuple[str, ...] = RUN_COMMANDS
    tasks: tuple[str, ...] = ()

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable or bool(self.tasks))


def _run(name: str, type_: pa.DataType, meaning: str, nullable: bool = False) -> Column:
    return Column(name, type_, nullable, meaning)


def _task(tasks: str | tuple[str, ...], name: str, type_: pa.DataType, meaning: str, nullable: bool = False) -> Column:
    """A column only the rows of ``tasks`` (one name, or several) hold."""
    return Column(name, type_, nullable, meaning, tasks=(tasks,) if isinstance(tasks, str) else tasks)


INT_LIST = pa.list_(pa.int64())
GENERATING = ("gqa", "caption")
"""The tasks that answer by greedy decoding and share its columns."""

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
        "probe, per-layer attention probes, ToMe's tower rerun, CDPruner's CLIP text tower, re-projection of merged "
        "tokens)",
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
    _run("kv_bytes", pa.int64(), "KV-cache bytes after the prefill: sum over layers of 2 x length x KV heads x head dim x dtype bytes"),
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
    "latency_ms", "latency_vision_ms", "latency_selection_ms", "latency_prefill_ms", "latency_decode_ms",
)
"""Measured wall times: the run columns that differ between two runs of the same command."""

RUN_COLUMNS: tuple[Column, ...] = (
    _run("question_id", pa.int64(), "id from the question file"),
    _run("split", pa.string(), "POPE: random / popular / adversarial (or the file's category); other tasks: see "
                               "docs/tasks.md"),
    _run("task", pa.string(), "the run's task (`run --task`, docs/tasks.md): pope, ..."),
    _run("image", pa.string(), "image file name as in the question file"),
    _run("image_id", pa.int64(), "image id (COCO's for POPE): the exchangeable unit for bootstrap and CRC"),
    _run("answer_text", pa.string(), "the model's answer as text (POPE: yes / no)"),
    _run("references", pa.list_(pa.string()), "the reference answers it is scored against (POPE: [label])"),
    _run("confidence", pa.float64(), "the task's confidence in its answer (docs/tasks.md; POPE: "
                                     "max(p_yes_2way, 1 - p_yes_2way))"),
    _run("correct", pa.bool_(), "the task's correctness rule (docs/tasks.md; POPE: answer == label)"),
    _task("pope", "object", pa.string(), "queried object parsed from the question"),
    _task("pope", "label", pa.string(), 'ground truth "yes" / "no"'),
    _task("pope", "answer", pa.string(), 'model\'s prediction "yes" / "no" (argmax of the two-way probabilities)'),
    _task("pope", "p_yes", pa.float64(), "first-token probability of yes over the full vocabulary, case/space "
                                         "variants summed"),
    _task("pope", "p_no", pa.float64(), "first-token probability of no, likewise"),
    _task("pope", "p_yes_2way", pa.float64(), "p_yes / (p_yes + p_no)"),
    _task("pope", "logit_diff", pa.float64(), "log p_yes - log p_no (the two-way logit d; p_yes_2way = sigmoid(d))"),
    _task(GENERATING, "sequence_prob", pa.float64(), "probability of the whole generated answer: the product of its "
                                                "tokens' full-vocabulary probabilities"),
    _task(GENERATING, "mean_token_prob", pa.float64(), "the length-normalised form: geometric mean of the generated "
                                                  "tokens' probabilities (1.0 for an empty answer)"),
    _task(GENERATING, "answer_tokens", pa.int64(), "tokens generated, the end-of-sequence token excluded"),
    _task(GENERATING, "stopped", pa.bool_(), "generation ended with an end-of-sequence token (false: cut at "
                                        "max_new_tokens)"),
    _task("caption", "mentioned", pa.list_(pa.string()), "COCO categories the caption mentions (CHAIR's synonym "
                                                         "list), each once, in order of first mention"),
    _task("caption", "hallucinated", pa.list_(pa.string()), "mentioned categories absent from the image (neither "
                                                            "annotated nor in its reference captions)"),
    _task("caption", "omitted", pa.list_(pa.string()), "annotated categories the caption never mentions, in "
                                                       "evidence_objects order (evidence_objects_lost says which "
                                                       "the first stage lost)"),
    _task("caption", "chair_i", pa.float64(), "hallucinated mentions / mentions (0 without mentions)"),
    _task("caption", "recall", pa.float64(), "share of annotated categories mentioned (NaN when none is annotated)"),
    _task("gqa", "evidence_object_ids", pa.list_(pa.string()), "scene-graph ids of the objects the question's "
                                                               "annotations name (its evidence region's boxes)"),
    _task("scienceqa", "letter_probs", pa.list_(pa.float64()), "first-token probability of each offered option "
                                                               "letter over the full vocabulary, spellings summed, "
                                                               "in letter order"),
    _task("scienceqa", "options_offered", pa.int64(), "number of options the question offers (2 to 5)"),
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
        "kept grid indices after each stage, nested (one entry for input-level selectors, all tokens unpruned)",
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
        "for each stage, the decoder layer whose input its kept set is ([0] for input-level selectors and unpruned)",
    ),
    _run("visual_tokens_avg", pa.float64(), "realised average number of visual tokens over decoder layers"),
    _run("prefill_tokens", pa.int64(), "tokens in the prefill sequence entering the first decoder layer (text + visual)"),
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
        "\"no\" questions, unknown masks); = retention_stages[0]. A stage's kept set here and in "
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
    _run("object_tokens_kept_stages", INT_LIST, "object_tokens_kept of each stage's kept set (-1 entries without a mask)"),
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
    _run("object_area", pa.int64(), "pixels of the evidence region in the image (0 without evidence: POPE's \"no\" "
                                    "questions)"),
    _run("evidence_objects", pa.list_(pa.string()), "the objects of the evidence region, each on its own (POPE: the "
                                                    "queried object of a yes question; empty without annotations)"),
    _run(
        "evidence_objects_lost",
        pa.list_(pa.bool_()),
        "for each of evidence_objects, lost at the FIRST stage: pixels, none in the kept cells or the cells "
        "merged tokens carry (null entries for an object without pixels)",
    ),
    _run("latency_ms", pa.float64(), "wall time of the question: the sum of its latency parts (vision, selection, "
                                     "prefill; tasks that generate: and decoding), each batch time / batch size"),
    *COST_COLUMNS,
    _run("geometry", pa.string(), "JSON of the image's `TokenGeometry` (several grids: `data.multigrid`; lets `visualize --run` redraw without the model)"),
    _run("order", pa.int64(), "position of the question in the run's question list (sorts the rows)"),
)

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

RUN_SCHEMA = pa.schema([column.field() for column in RUN_COLUMNS])
"""The schema of a run's ``records.parquet`` and of its part files."""

INTERVENE_SCHEMA = pa.schema([column.field() for column in (*RUN_COLUMNS, *INTERVENE_COLUMNS)])
"""The schema of ``intervene``'s ``records.parquet``: the run columns plus the swap columns."""

NON_NULL_COLUMNS = tuple(column.name for column in RUN_COLUMNS if not column.nullable and not column.tasks)
"""Core run columns that hold a value in every row."""


def task_columns(task: str) -> tuple[Column, ...]:
    """The run columns only ``task``'s rows hold."""
    return tuple(column for column in RUN_COLUMNS if task in column.tasks)
