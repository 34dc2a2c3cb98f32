"""``prune-audit intervene``, step 1: validate the request and the source run; nothing is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prune_audit.analysis.runs import Run, completeness, load_run
from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import Record
from prune_audit.records.stages import FIRST, StageChoice, record_stage
from prune_audit.records.store import RecordStore
from prune_audit.runner.intervene.inputs import RunInputs, locate_inputs
from prune_audit.runner.intervene.swaps import MODES, REMOVE_MAX_OBJECT_CELLS
from prune_audit.tasks import manifest_task

CONTROLS = ("random",)


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
    stage: StageChoice = FIRST
    threads: dict | None = None  # the torch threads chosen (prune_audit.threads.configure_threads), for the report
    inputs: RunInputs = field(default_factory=RunInputs)  # --pope/--images/--annotations/--model overrides


@dataclass
class InterventionSource:
    """The pruned run being intervened on: its analysis view and its records as rows."""

    run: Run
    records: list[Record]
    inputs: RunInputs
    stage: StageChoice = FIRST
    stage_index: dict[tuple[str, int], int] = field(default_factory=dict)
    """The chosen stage of every record, by (split, question_id)."""

    def chosen(self, record: Record) -> int:
        return self.stage_index[(record["split"], record["question_id"])]

    @property
    def manifest(self) -> dict[str, Any]:
        return self.run.manifest


def check_request(request: InterveneRequest) -> None:
    if request.mode not in MODES:
        given = "" if request.mode is None else f", got {request.mode!r}"
        raise PruneAuditError(f"--mode must be restore or remove{given}")
    if request.controls not in CONTROLS:
        raise PruneAuditError(f"--controls must be {' or '.join(CONTROLS)}, got {request.controls!r}")
    if request.max_cells < 1:
        raise PruneAuditError(f"--max-cells must be at least 1, got {request.max_cells}")
    if request.bootstrap < 1:
        raise PruneAuditError(f"--bootstrap must be at least 1, got {request.bootstrap}")


def load_source(run_dir: Path, stage: StageChoice = FIRST, overrides: RunInputs = RunInputs()) -> InterventionSource:
    """The run read at ``stage``, refused when unpruned, without annotations, or when its inputs (recorded
    or ``overrides``) differ from its pins."""
    run = load_run(run_dir, stage)
    completeness([run], [run.label])  # warns when the run is a shard or was stopped midway, as calibrate does
    manifest = run.manifest
    if run.selector == "dense":
        raise PruneAuditError(f"{run_dir} is an unpruned run; intervene swaps the kept tokens of a pruned run")
    check_evidence(run_dir, manifest, stage)
    inputs = locate_inputs(manifest, overrides)
    records = RecordStore(run_dir, manifest).read().to_pylist()
    chosen = {
        (r["split"], r["question_id"]): record_stage(r["kept_stages"], stage, str(run_dir), r["merged_stages"])
        for r in records
    }
    return InterventionSource(run, records, inputs, stage, chosen)


def check_evidence(run_dir: Path, manifest: dict[str, Any], stage: StageChoice) -> None:
    """The run's task names objects and the run has their masks; on clips, the stage is the first (a clip's swaps
    move the object in the asked window, ``execute.swap_region``, whose fate the records hold at the first stage)."""
    task = manifest_task(manifest)
    if not task.names_evidence:
        raise PruneAuditError(
            f"task {task.name} names no objects in its images, so intervene has no evidence tokens to swap; intervene "
            "on a run of a task whose questions name objects"
        )
    if not manifest.get("annotations"):
        raise PruneAuditError(
            f"{run_dir} was run without annotations; intervene needs the object masks: re-run with --annotations FILE"
        )
    if task.reads_clips and stage.index != 0:
        raise PruneAuditError(
            f"--stage {stage.name}: on clips the asked window's evidence (lost_in_window) is recorded at the first "
            "stage only; intervene on a clip run with --stage first"
        )


def eligible_records(source: InterventionSource, mode: str) -> list[Record]:
    """The records the mode applies to at the chosen stage (restore: lost objects; remove: 1..32
    kept object cells); on clips, the object in the question's window at the first stage (restore:
    ``lost_in_window``; remove: some of it kept, the cell count checked when the swaps are planned)."""
    records = source.records
    if manifest_task(source.manifest).reads_clips:
        if mode == "restore":
            eligible = [row for row in records if row["lost_in_window"] is True]
            what = "whose object lost all tokens in the asked window"
        else:
            eligible = [row for row in records if row["window_retention"] > 0]
            what = "whose object kept tokens in the asked window"
    elif mode == "restore":
        eligible = [row for row in records if row["lost_stages"][source.chosen(row)] is True]
        what = "whose object lost all tokens"
    else:
        eligible = [
            row
            for row in records
            if 1 <= row["object_tokens_kept_stages"][source.chosen(row)] <= REMOVE_MAX_OBJECT_CELLS
        ]
        what = f"whose object kept 1..{REMOVE_MAX_OBJECT_CELLS} tokens"
    if not eligible:
        raise PruneAuditError(
            f"no eligible questions for --mode {mode}: the run has no question {what} at stage {source.stage.name}"
        )
    return eligible


def check_swappable(source: InterventionSource) -> None:
    """The forced kept cells must be exactly the visual tokens the model saw.

    A merging selector (VisionZip's contextual tokens, SparseVLM with recycle=true) feeds
    merged tokens beside its kept cells (the records' ``merged_stages``); forcing only the
    cells would drop them, so such runs are refused, as are input-level runs that feed
    tokens without a grid cell (VisionZip's CLS).
    """
    selector = source.run.selector
    if any(merged for record in source.records for stage in record["merged_stages"] for merged in stage):
        raise PruneAuditError(
            f"selector {selector!r} fed merged tokens (the records' merged_stages); forced kept cells cannot "
            f"reproduce them, so intervene needs a selector that keeps grid cells only (sparsevlm: recycle=false, "
            f"vscan: merge_pruned=false)"
        )
    if source.manifest["selector"]["stage"] == "llm":
        return
    for record in source.records:
        if round(record["visual_tokens_avg"]) != len(record["kept"]):
            raise PruneAuditError(
                f"selector {selector!r} feeds {record['visual_tokens_avg']:g} visual tokens for "
                f"{len(record['kept'])} kept cells; intervene needs a selector that keeps grid cells only"
            )
