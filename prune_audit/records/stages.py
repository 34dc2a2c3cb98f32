"""Which stage of the per-stage record columns an analysis reads: ``--stage first|last|INDEX``.

``first`` (the default) is stage 0, the earliest point at which tokens leave the model
(the only stage of input-level selectors); ``last`` is each record's deepest stage that
still feeds visual tokens, kept cells or merged tokens (a schedule ending at 0 tokens
reports the stage before); an integer is that stage index in every record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits


@dataclass(frozen=True)
class StageChoice:
    """A parsed ``--stage``: ``index`` is the stage index, None for ``last``."""

    name: str
    index: int | None

    def describe(self, layers: np.ndarray) -> str:
        """E.g. ``first (decoder layer 3)``, ``first (stage layer -22)`` for a cut in the vision tower; ``layers``
        the chosen stage's layer per record."""
        unique = sorted({int(layer) for layer in layers})
        if not unique:
            return self.name
        word = "layer" if len(unique) == 1 else "layers"
        place = "decoder" if unique[0] >= 0 else "stage"
        return f"{self.name} ({place} {word} {', '.join(str(layer) for layer in unique)})"


FIRST = StageChoice("first", 0)
LAST = StageChoice("last", None)


def parse_stage(text: str | int) -> StageChoice:
    """``first``, ``last`` or a non-negative stage index; anything else is a one-line error."""
    value = str(text).strip().lower()
    if value == "first":
        return FIRST
    if value == "last":
        return LAST
    if is_digits(value):
        return StageChoice(value, int(value))
    raise PruneAuditError(f"--stage must be first, last or a stage index 0, 1, ..., got {text!r}")


@dataclass(frozen=True)
class StageValues:
    """One stage per record; all arrays have shape (n,).

    Attributes:
        retention: float64, NaN without a mask.
        lost: float64 1.0 / 0.0, NaN without a mask.
        diluted: float64 1.0 / 0.0, NaN without a mask (the object only in merged tokens' cells).
        object_tokens_kept: int64, -1 without a mask.
        layer: int64, the decoder layer whose input the chosen kept set is.
        index: int64, the chosen stage index of each record.
    """

    retention: np.ndarray
    lost: np.ndarray
    diluted: np.ndarray
    object_tokens_kept: np.ndarray
    layer: np.ndarray
    index: np.ndarray


def _lists(column: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(values of every row's list, (n + 1,) offsets into them starting at 0)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    return array.flatten(), offsets - offsets[0]


def _last_non_empty(records: pa.Table, offsets: np.ndarray) -> np.ndarray:
    """(n,) flat position of each record's last stage that feeds any visual token, kept or merged
    (its last stage when none does)."""
    stages, _ = _lists(records["kept_stages"])
    merged, _ = _lists(records["merged_stages"])
    sizes = pc.list_value_length(stages).to_numpy() + pc.list_value_length(merged).to_numpy()
    positions = np.where(sizes > 0, np.arange(len(sizes)), -1)
    last = np.maximum.reduceat(positions, offsets[:-1]) if len(positions) else np.zeros(0, np.int64)
    return np.where(last >= 0, last, offsets[1:] - 1)


def stage_values(records: pa.Table, choice: StageChoice, source: str) -> StageValues:
    """The chosen stage's retention, lost, diluted and layer for every record of ``records`` (``RUN_SCHEMA``)."""
    layers, offsets = _lists(records["stage_layers"])
    counts = np.diff(offsets)
    if records.num_rows and counts.min() < 1:
        raise PruneAuditError(f"records of {source} have rows without stages; re-run with this version")
    if choice.index is None:
        position = _last_non_empty(records, offsets)
    else:
        if records.num_rows and choice.index >= counts.min():
            raise PruneAuditError(
                f"--stage {choice.index}: records of {source} have {counts.min()} stage(s) in some rows; "
                f"pass first, last or an index below {counts.min()}"
            )
        position = offsets[:-1] + choice.index
    retention, _ = _lists(records["retention_stages"])
    lost, _ = _lists(records["lost_stages"])
    diluted, _ = _lists(records["diluted_stages"])
    tokens, _ = _lists(records["object_tokens_kept_stages"])
    return StageValues(
        retention=retention.to_numpy(zero_copy_only=False).astype(np.float64)[position],
        lost=_as_float(lost)[position],
        diluted=_as_float(diluted)[position],
        object_tokens_kept=tokens.to_numpy().astype(np.int64)[position],
        layer=layers.to_numpy().astype(np.int64)[position],
        index=position - offsets[:-1],
    )


def _as_float(flags: pa.Array) -> np.ndarray:
    """(m,) float64 1.0 / 0.0 of a bool array, NaN for nulls."""
    return pc.cast(flags, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)


def record_stage(
    kept_stages: list[list[int]], choice: StageChoice, source: str, merged_stages: list[list] | None = None
) -> int:
    """The stage index ``choice`` picks in one record with these kept sets and merged tokens (see ``stage_values``)."""
    if choice.index is None:
        merged_stages = merged_stages or [[] for _ in kept_stages]
        fed = [bool(kept) or bool(merged) for kept, merged in zip(kept_stages, merged_stages)]
        return max((i for i, feeds in enumerate(fed) if feeds), default=len(kept_stages) - 1)
    if choice.index >= len(kept_stages):
        raise PruneAuditError(
            f"--stage {choice.index}: a record of {source} has {len(kept_stages)} stage(s); "
            f"pass first, last or an index below {len(kept_stages)}"
        )
    return choice.index


def budget_words(budget: object, layers: list[int], averaged: bool = True) -> str:
    """``budget 64``, or ``budget 64 (layer average)`` for stages inside the LLM (a layer above 0), whose stages
    keep more tokens before and fewer after so that the average over the decoder layers is the budget (cuts in
    the vision tower, negative layers, reach the budget at the input); a composed selector's budgets (a list, one
    per part) are spelled as ``--budget`` takes them, ``budget 128,64``. ``averaged``: the selector's
    ``averages_budget`` (False: its option keeps exactly the budget after a cut, or ignores it; no average named).
    """
    if isinstance(budget, (list, tuple)):
        place = "in-LLM layer average" if averaged else "in-LLM"  # a composed selector's: its in-LLM part's
        return f"budget {','.join(str(part) for part in budget)} (input, then {place})"
    return f"budget {budget}" + (" (layer average)" if averaged and any(layer > 0 for layer in layers) else "")


def stage_place(layer: int) -> str:
    """Where a stage's kept set enters: ``from layer 2``, ``at the input`` (layer 0: an input-level stage), or a
    cut in the vision tower (a negative layer)."""
    if layer < 0:
        return f"in the vision tower (stage layer {layer})"
    return "at the input" if layer == 0 else f"from layer {layer}"


def mean_stage_tokens(records: pa.Table) -> tuple[list[int], list[float]]:
    """The stage layers of the records' schedule and the mean realised tokens of each stage (one decimal); stages
    at other layers in some records (a share budget) are averaged by stage index, named by the first record."""
    kept, merged = records["kept_stages"].to_pylist(), records["merged_stages"].to_pylist()
    counts = [[len(cells) + len(tokens) for cells, tokens in zip(k, m)] for k, m in zip(kept, merged)]  # merged count
    depth = max(len(row) for row in counts)
    means = [round(float(np.mean([row[i] for row in counts if i < len(row)])), 1) for i in range(depth)]
    return records["stage_layers"][0].as_py()[:depth], means
