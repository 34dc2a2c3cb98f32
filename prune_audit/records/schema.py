"""Every record column, defined once: name, Arrow type, nullability, meaning, and who writes it.

The run writer (``runner.build``), the record store, the analysis readers, the intervene
rows and docs/records.md (``records_markdown``) all come from ``RUN_COLUMNS`` and
``INTERVENE_COLUMNS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 5
"""Version of the record columns, written to every manifest as ``records_schema``.

2: per-stage columns (``stage_layers``, ``*_stages``); ``retention``, ``object_tokens_kept``
and ``lost`` are the first stage's values (1 computed them on the last non-empty stage).
3: ``merged_stages`` (in-LLM merged tokens and their sources); retention counts their footprint.
4: ``merged_stages`` also holds input-level merged tokens (VisionZip's contextual tokens), so their
footprint counts towards that stage's retention, ``object_tokens_kept`` and ``lost`` (3 left them out).
5: every records file carries its run's ``run_id`` (Parquet metadata ``RUN_ID_METADATA``, also in the manifest),
so records are read and resumed only by the run they belong to (4's records cannot be told apart).
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
    """

    name: str
    type: pa.DataType
    nullable: bool
    meaning: str
    written_by: tuple[str, ...] = RUN_COMMANDS

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)


def _run(name: str, type_: pa.DataType, meaning: str, nullable: bool = False) -> Column:
    return Column(name, type_, nullable, meaning)


INT_LIST = pa.list_(pa.int64())

RUN_COLUMNS: tuple[Column, ...] = (
    _run("question_id", pa.int64(), "id from the question file"),
    _run("split", pa.string(), "random / popular / adversarial (or the file's category)"),
    _run("image", pa.string(), "image file name as in the question file"),
    _run("image_id", pa.int64(), "COCO image id (the exchangeable unit for bootstrap and CRC)"),
    _run("object", pa.string(), "queried object parsed from the question"),
    _run("label", pa.string(), 'ground truth "yes" / "no"'),
    _run("answer", pa.string(), 'model\'s prediction "yes" / "no" (argmax of the two-way probabilities)'),
    _run("p_yes", pa.float64(), "first-token probability of yes over the full vocabulary, case/space variants summed"),
    _run("p_no", pa.float64(), "first-token probability of no, likewise"),
    _run("p_yes_2way", pa.float64(), "p_yes / (p_yes + p_no)"),
    _run("logit_diff", pa.float64(), "log p_yes - log p_no (the two-way logit d; p_yes_2way = sigmoid(d))"),
    _run("confidence", pa.float64(), "max(p_yes_2way, 1 - p_yes_2way)"),
    _run("correct", pa.bool_(), "answer == label"),
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
        "object-area retention of the FIRST stage's kept set, the earliest point at which tokens leave the model "
        "(NaN for \"no\" questions and unknown masks); = retention_stages[0]. A stage's kept set here and in "
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
    _run("object_area", pa.int64(), "mask pixels of the queried object in the image (0 for \"no\" questions)"),
    _run("latency_ms", pa.float64(), "wall time of the prefill (batch prefill time / batch size)"),
    _run("geometry", pa.string(), "JSON of the image's `TokenGeometry` (lets `visualize --run` redraw without the model)"),
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

NON_NULL_COLUMNS = tuple(column.name for column in RUN_COLUMNS if not column.nullable)
"""Run columns that hold a value in every row."""
