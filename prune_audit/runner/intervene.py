"""``prune-audit intervene``: does the evidence a pruner removed cause the errors?

The run's recorded kept sets are edited by swapping cells and the model is re-run
with the edited sets forced (``VisionLanguageModel.answer(forced_kept=...)`` for
input-level selectors, ``forced_stages=...`` for in-LLM ones). Every swap removes as
many kept cells as it adds, so the budget stays fixed, and every intervention has a
control that differs from it only in which cells are swapped:

- restore (questions whose object lost every token): the same ``m`` kept cells, drawn
  at random, are replaced by the ``m`` object cells holding the most object area
  (ties to the lower index) in the intervention and by ``m`` random cells that are
  neither kept nor object cells in the control; ``m = min(max_cells, object cells,
  kept cells, free cells)``.
- remove (questions whose object kept 1..32 cells): the same ``k`` random cells that
  are neither kept nor object cells are added; the intervention removes the ``k``
  kept object cells, the control ``k`` random kept non-object cells.

"Kept" is the record's ``kept`` column, the last non-empty kept set (the one retention
is computed on). In-LLM stage sets are nested (S_1 ⊇ S_2 ⊇ ...); a swap (removed R,
added A) is applied to every non-empty stage as S_i' = (S_i \\ R_i) ∪ A, where R_i is
the first |A \\ S_i| cells of R in the swap's (random) order. Each stage keeps its size,
A reaches the deepest visible stage, R_i grows with depth, so every later stage stays a
subset of the earlier one; stages that were empty (a schedule ending at 0) stay empty.

All draws come from one generator per question, seeded like ``prune-audit run``
(``question_seed``), so the result does not depend on the order of questions.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.errors import PruneAuditError

MODES = ("restore", "remove")
CONTROLS = ("random",)
REMOVE_MAX_OBJECT_CELLS = 32
"""Remove mode takes questions whose object kept 1..32 cells (the issue's range)."""

CONDITIONS = ("intervention", "control")
RECORDS_FILE = "records.parquet"
REPORT_FILE = "intervention.json"

CONVENTIONS = {
    "restore": "lost objects: m random kept cells replaced by the m object cells with the most object area "
    "(intervention) or by m random cells neither kept nor object (control); m = min(max_cells, object cells, "
    "kept cells, free cells)",
    "remove": "objects with 1..32 kept cells: the same k random cells neither kept nor object are added; the "
    "intervention removes the k kept object cells, the control k random kept non-object cells",
    "stages": "in-LLM stages: S_i' = (S_i minus the first |A minus S_i| removed cells) plus A; sizes fixed, "
    "stages stay nested, empty stages stay empty",
    "object_area_changed": "object pixels of the added cells minus those of the removed cells",
    "intervals": "95% percentile intervals from an image-clustered bootstrap; differences are paired "
    "(intervention minus control on the same resampled images)",
}


class NoSwap(Exception):
    """A question on which the requested swap is impossible; the message says why."""


@dataclass(frozen=True)
class Swap:
    """Cells taken out of and put into one kept set; ``removed`` in the order stages drop them."""

    removed: tuple[int, ...]
    added: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.added)

    def object_area_changed(self, area_per_token: np.ndarray) -> int:
        """Object pixels gained (positive) or lost (negative) by the swap."""
        return int(area_per_token[list(self.added)].sum() - area_per_token[list(self.removed)].sum())


@dataclass(frozen=True)
class SwapPair:
    intervention: Swap
    control: Swap

    def by_condition(self) -> dict[str, Swap]:
        return {"intervention": self.intervention, "control": self.control}


# ----- swaps (pure) --------------------------------------------------------------------


def _cells(kept: Sequence[int], area_per_token: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept, object cells, free cells): ascending int64; free = neither kept nor object."""
    kept_cells = np.unique(np.asarray(kept, dtype=np.int64))
    object_cells = np.flatnonzero(area_per_token > 0)
    free = np.setdiff1d(np.arange(len(area_per_token)), np.union1d(kept_cells, object_cells))
    return kept_cells, object_cells, free


def _draw(cells: np.ndarray, count: int, rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(i) for i in rng.choice(cells, size=count, replace=False))


def restore_swaps(
    kept: Sequence[int], area_per_token: np.ndarray, max_cells: int, rng: np.random.Generator
) -> SwapPair:
    """Put the lost object's largest cells back in place of random kept cells.

    Args:
        kept: the kept grid indices (no object cell among them).
        area_per_token: (N,) object pixels per grid cell.
        max_cells: most cells to swap.
        rng: draws the replaced kept cells, then the control's cells.
    """
    kept_cells, object_cells, free = _cells(kept, area_per_token)
    if np.intersect1d(kept_cells, object_cells).size:
        raise NoSwap("object still holds kept cells")
    if not object_cells.size:
        raise NoSwap("object covers no grid cell")
    count = min(max_cells, object_cells.size, kept_cells.size, free.size)
    if count == 0:
        raise NoSwap("no kept cell or no free non-object cell for the control")
    removed = _draw(kept_cells, count, rng)
    by_area = object_cells[np.lexsort((object_cells, -area_per_token[object_cells]))]
    added = tuple(sorted(int(i) for i in by_area[:count]))
    control = tuple(sorted(_draw(free, count, rng)))
    return SwapPair(Swap(removed, added), Swap(removed, control))


def remove_swaps(kept: Sequence[int], area_per_token: np.ndarray, rng: np.random.Generator) -> SwapPair:
    """Take the object's kept cells out (control: as many kept non-object cells) for the same free cells.

    Args:
        kept: the kept grid indices (1..32 of them hold object pixels).
        area_per_token: (N,) object pixels per grid cell.
        rng: draws the added cells, the intervention's removal order, then the control's cells.
    """
    kept_cells, _, free = _cells(kept, area_per_token)
    on_object = area_per_token[kept_cells] > 0
    kept_object, kept_other = kept_cells[on_object], kept_cells[~on_object]
    count = kept_object.size
    if not 1 <= count <= REMOVE_MAX_OBJECT_CELLS:
        raise NoSwap(f"object holds {count} kept cells, not 1..{REMOVE_MAX_OBJECT_CELLS}")
    if kept_other.size < count:
        raise NoSwap("fewer kept non-object cells than kept object cells for the control")
    if free.size < count:
        raise NoSwap("fewer free non-object cells than kept object cells")
    added = tuple(sorted(_draw(free, count, rng)))
    removed = tuple(int(i) for i in rng.permutation(kept_object))
    control = _draw(kept_other, count, rng)
    return SwapPair(Swap(removed, added), Swap(control, added))


def swap_stages(kept_stages: Sequence[Sequence[int]], swap: Swap) -> list[list[int]]:
    """Apply ``swap`` to nested stage sets; the result is nested with the same sizes.

    The removed cells must lie in the last non-empty stage and the added cells outside it.
    Stage i drops the first |added \\ S_i| removed cells (module docstring).
    """
    removed, added = list(swap.removed), set(swap.added)
    if len(removed) != len(added):
        raise ValueError(f"a swap removes as many cells as it adds, got {len(removed)} and {len(added)}")
    swapped = []
    for stage in kept_stages:
        cells = set(stage)
        if not cells:
            swapped.append([])
            continue
        if not set(removed) <= cells:
            raise ValueError("removed cells must be kept at every non-empty stage")
        dropped = set(removed[: len(added - cells)])
        swapped.append(sorted((cells - dropped) | added))
    return swapped


def plan_swaps(mode: str, kept: Sequence[int], area_per_token: np.ndarray, max_cells: int,
               rng: np.random.Generator) -> SwapPair:
    """The intervention and control swaps of one question under ``mode``."""
    if mode == "restore":
        return restore_swaps(kept, area_per_token, max_cells, rng)
    return remove_swaps(kept, area_per_token, rng)


# ----- the command ---------------------------------------------------------------------


@dataclass
class InterveneRequest:
    """What the user asked for, as given on the command line."""

    run_dir: Path
    mode: str | None
    max_cells: int = 8
    controls: str = "random"
    bootstrap: int = 2000
    seed: int = 0
    out: Path | None = None
    device: str = "auto"


@dataclass
class InterventionResult:
    out: Path
    report: dict[str, Any]
    records: Any  # pyarrow.Table with intervention_schema()


def intervention_schema() -> Any:
    """The run-record schema plus ``condition``, ``cells_changed`` and ``object_area_changed``."""
    import pyarrow as pa

    from prune_audit.runner.records import SCHEMA

    return (
        SCHEMA.append(pa.field("condition", pa.string()))
        .append(pa.field("cells_changed", pa.int64()))
        .append(pa.field("object_area_changed", pa.int64()))
    )


@dataclass
class _Source:
    """The pruned run being intervened on."""

    run: Any  # prune_audit.analysis.runs.Run
    records: list[dict[str, Any]]

    @property
    def manifest(self) -> dict[str, Any]:
        return self.run.manifest


def intervene(request: InterveneRequest, on_progress: Callable[[int, int], None] | None = None) -> InterventionResult:
    """Re-run the eligible questions of a run under intervention and control swaps; write OUT.

    ``on_progress(done, total)`` is called after each question. Nothing is written unless
    every question was answered.
    """
    from prune_audit.analysis.outputs import to_json, write_files
    from prune_audit.runner.audit import check_writable

    _check_request(request)
    source = _load_source(request.run_dir)
    _check_swappable(source)
    eligible = _eligible(source.records, request.mode)
    out = Path(request.out) if request.out is not None else Path(request.run_dir) / f"intervene-{request.mode}"
    check_writable(out)
    rows, skipped = _answer_swaps(request, source, eligible, on_progress)
    if not rows:
        reasons = "; ".join(f"{reason} ({count})" for reason, count in skipped.items())
        raise PruneAuditError(f"none of the {len(eligible)} eligible questions allows a {request.mode} swap: {reasons}")
    table = _records_table(rows)
    report = intervention_report(request, source, table, len(eligible), skipped)
    write_files(out, {RECORDS_FILE: _parquet_bytes(table), REPORT_FILE: to_json(report)})
    return InterventionResult(out, report, table)


def _check_request(request: InterveneRequest) -> None:
    if request.mode not in MODES:
        given = "" if request.mode is None else f", got {request.mode!r}"
        raise PruneAuditError(f"--mode must be restore or remove{given}")
    if request.controls not in CONTROLS:
        raise PruneAuditError(f"--controls must be {' or '.join(CONTROLS)}, got {request.controls!r}")
    if request.max_cells < 1:
        raise PruneAuditError(f"--max-cells must be at least 1, got {request.max_cells}")
    if request.bootstrap < 1:
        raise PruneAuditError(f"--bootstrap must be at least 1, got {request.bootstrap}")


def _load_source(run_dir: Path) -> _Source:
    from prune_audit.analysis.runs import load_run
    from prune_audit.runner.records import RecordStore

    run = load_run(run_dir)
    manifest = run.manifest
    if run.selector == "dense":
        raise PruneAuditError(f"{run_dir} is an unpruned run; intervene swaps the kept tokens of a pruned run")
    if not manifest.get("annotations"):
        raise PruneAuditError(
            f"{run_dir} was run without annotations; intervene needs the object masks: re-run with --annotations FILE"
        )
    _check_inputs_unchanged(manifest)
    return _Source(run, RecordStore(run_dir).read().to_pylist())


def _check_inputs_unchanged(manifest: dict[str, Any]) -> None:
    """The annotations and question files still exist and hash as when the run was made."""
    from prune_audit.data.pope import file_sha256

    for entry in [manifest["annotations"], *manifest.get("question_files", [])]:
        path = Path(entry["path"])
        if not path.is_file():
            raise PruneAuditError(
                f"{path}, named in the run's manifest, is not found; run from the folder the run was made in"
            )
        if file_sha256(path) != entry["sha256"]:
            raise PruneAuditError(
                f"{path} changed since the run (sha256 differs); intervene needs the run's own inputs"
            )


def _eligible(records: Sequence[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    if mode == "restore":
        eligible = [row for row in records if row["lost"] is True]
        what = "whose object lost all tokens"
    else:
        eligible = [row for row in records if 1 <= row["object_tokens_kept"] <= REMOVE_MAX_OBJECT_CELLS]
        what = f"whose object kept 1..{REMOVE_MAX_OBJECT_CELLS} tokens"
    if not eligible:
        raise PruneAuditError(f"no eligible questions for --mode {mode}: the run has no question {what}")
    return eligible


def _check_swappable(source: _Source) -> None:
    """Input-level kept cells must be exactly the visual tokens the model saw.

    A merging selector (VisionZip) feeds merged tokens beside its kept cells; forcing
    only the cells would change the budget, so such runs are refused.
    """
    if source.manifest["selector"]["stage"] == "llm":
        return
    for record in source.records:
        if round(record["visual_tokens_avg"]) != len(record["kept"]):
            raise PruneAuditError(
                f"selector {source.run.selector!r} feeds {record['visual_tokens_avg']:g} visual tokens for "
                f"{len(record['kept'])} kept cells (merged tokens); intervene needs a selector that keeps grid cells"
            )


def _answer_swaps(
    request: InterveneRequest,
    source: _Source,
    eligible: Sequence[dict[str, Any]],
    on_progress: Callable[[int, int], None] | None,
) -> tuple[list[dict[str, Any]], Counter]:
    """Both conditions of every eligible question as records; reasons of the questions skipped."""
    from prune_audit.data.coco import CocoInstances
    from prune_audit.runner.audit import AreaLookup, build_record, prepare_question, question_seed

    manifest = source.manifest
    vlm = _load_model(manifest, request.device)
    forcing = _Forcing(vlm, manifest)
    questions = _questions(manifest)
    areas = AreaLookup(CocoInstances.load(manifest["annotations"]["path"]))
    rows: list[dict[str, Any]] = []
    skipped: Counter = Counter()
    for done, record in enumerate(eligible, start=1):
        question = questions[(record["split"], record["question_id"])]
        prepared = prepare_question(vlm, Path(manifest["images"]) / record["image"], question.text)
        _check_geometry(record, prepared)
        area = areas.get(record["image_id"], record["object"], prepared.geometry)
        rng = np.random.default_rng(question_seed(request.seed, record["split"], record["question_id"]))
        try:
            pair = plan_swaps(request.mode, record["kept"], area.area_per_token, request.max_cells, rng)
        except NoSwap as reason:
            skipped[str(reason)] += 1
        else:
            swaps = pair.by_condition()
            answers = forcing.answer(prepared, record["kept_stages"], list(swaps.values()))
            for (condition, swap), answer in zip(swaps.items(), answers):
                row = build_record(question, answer, prepared, record["image_id"], area, record["order"])
                row.update(condition=condition, cells_changed=swap.size,
                           object_area_changed=swap.object_area_changed(area.area_per_token))
                rows.append(row)
        if on_progress:
            on_progress(done, len(eligible))
    return rows, skipped


def _load_model(manifest: dict[str, Any], device: str) -> Any:
    """The run's model, dtype and prompt; refused when the checkpoint's config changed since the run."""
    from prune_audit.models import load_vlm

    prompt = manifest.get("prompt") or {}
    vlm = load_vlm(manifest["model"]["id"], device=device, dtype=manifest["dtype"],
                   prompt_template=prompt.get("template"), system_prompt=prompt.get("system"))
    if vlm.describe()["model"]["config_hash"] != manifest["model"]["config_hash"]:
        raise PruneAuditError(f"the model at {manifest['model']['id']} differs from the run's (config hash changed)")
    return vlm


def _questions(manifest: dict[str, Any]) -> dict[tuple[str, int], Any]:
    from prune_audit.data.pope import load_pope

    return {
        (question.split, question.question_id): question
        for entry in manifest["question_files"]
        for question in load_pope(entry["path"])
    }


def _check_geometry(record: dict[str, Any], prepared: Any) -> None:
    recorded = json.loads(record["geometry"])
    if json.loads(json.dumps(prepared.geometry.to_dict())) != recorded:
        raise PruneAuditError(
            f"image {record['image']} now has another token geometry than in the run; check the images folder"
        )


class _Forcing:
    """Answers one prepared question under several swaps of its recorded kept sets, in one batch.

    Input-level runs force the swapped set directly (no selector). In-LLM runs force the
    swapped stage sets at the stage layers of the run's selector schedule for this token
    count (the manifest's ``schedule`` for the first image's count), with the selector
    passed so the loop uses the run's position mode.
    """

    def __init__(self, vlm: Any, manifest: dict[str, Any]) -> None:
        from prune_audit.pruners import get_selector

        description = manifest["selector"]
        self.vlm = vlm
        self.budget = manifest["budget"]
        self.in_llm = description["stage"] == "llm"
        self.selector = get_selector(description["name"], **description["options"]) if self.in_llm else None

    def answer(self, prepared: Any, kept_stages: Sequence[Sequence[int]], swaps: Sequence[Swap]) -> list[Any]:
        forced = [swap_stages(kept_stages, swap) for swap in swaps]
        batch = [prepared] * len(swaps)
        if not self.in_llm:
            return self.vlm.answer(batch, forced_kept=[stages[0] for stages in forced])
        schedule = self.selector.schedule(self.vlm.num_layers, prepared.num_visual, self.budget)
        layers = [stage.layer for stage in schedule]
        if len(layers) != len(kept_stages):
            raise PruneAuditError(
                f"the record holds {len(kept_stages)} stages but the selector's schedule has {len(layers)}; "
                "the run was made with another selector version"
            )
        stages = [list(zip(layers, sets)) for sets in forced]
        return self.vlm.answer(batch, self.selector, forced_stages=stages)


def _records_table(rows: Sequence[dict[str, Any]]) -> Any:
    import pyarrow as pa

    return pa.Table.from_pylist(list(rows), schema=intervention_schema())


def _parquet_bytes(table: Any) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


# ----- the report ----------------------------------------------------------------------


def intervention_report(
    request: InterveneRequest, source: _Source, table: Any, eligible: int, skipped: Counter
) -> dict[str, Any]:
    """intervention.json: per condition accuracy and mean confidence with 95% image-bootstrap intervals,
    the paired difference intervention - control, the run's own answers on the same questions, and the
    object area and cells changed."""
    from prune_audit.analysis.bootstrap import image_counts
    from prune_audit.analysis.calibration import survival_measures
    from prune_audit.analysis.reports import run_identity
    from prune_audit.analysis.runs import question_table

    conditions = table["condition"].to_numpy(zero_copy_only=False)
    tables = {name: question_table(table.filter(conditions == name), REPORT_FILE) for name in CONDITIONS}
    position = {key: index for index, key in enumerate(source.run.questions.keys())}
    intervened = [position[key] for key in tables["intervention"].keys()]
    tables["recorded"] = source.run.questions.take(np.array(intervened, dtype=np.int64))
    images = np.unique(tables["intervention"].image_id)
    counts = image_counts(len(images), request.bootstrap, request.seed)
    measured = {
        name: survival_measures(
            questions, {"all": np.ones(len(questions), dtype=bool)}, questions.image_index(images), counts
        )["all"]
        for name, questions in tables.items()
    }
    report: dict[str, Any] = {
        **run_identity(source.run, source.run.label),
        "mode": request.mode,
        "settings": {"max_cells": request.max_cells, "controls": request.controls, "bootstrap": request.bootstrap,
                     "seed": request.seed},
        "conventions": CONVENTIONS,
        "questions": {"eligible": eligible, "intervened": len(tables["intervention"]), "images": len(images),
                      "skipped": dict(sorted(skipped.items()))},
    }
    for name, measure in measured.items():
        report[name] = {**_scores(measure.summary()), "mean_retention": float(np.mean(tables[name].retention))}
        if name in CONDITIONS:
            rows = table.filter(conditions == name)
            report[name]["mean_cells_changed"] = float(np.mean(rows["cells_changed"].to_numpy()))
            report[name]["mean_object_area_changed"] = float(np.mean(rows["object_area_changed"].to_numpy()))
    report["difference"] = _scores(measured["intervention"].minus(measured["control"]))
    return report


def _scores(estimates: dict[str, dict]) -> dict[str, dict]:
    return {"accuracy": estimates["accuracy"], "mean_confidence": estimates["confidence"]}
