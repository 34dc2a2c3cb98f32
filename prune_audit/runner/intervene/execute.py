"""``prune-audit intervene``, step 2: re-run each eligible question under its swapped kept sets."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import Record
from prune_audit.runner.answering import question_seed
from prune_audit.runner.build import QuestionEvidence, prepared_evidence
from prune_audit.runner.intervene.build import intervention_rows
from prune_audit.runner.intervene.plan import InterveneRequest, InterventionSource
from prune_audit.runner.intervene.swaps import NoSwap, Swap, plan_swaps, swap_stages
from prune_audit.runner.questions import prepare_task_question

if TYPE_CHECKING:
    from prune_audit.data.retention import ObjectArea
    from prune_audit.models import Answer, Prepared, VisionLanguageModel
    from prune_audit.models.answers import AnswerMode
    from prune_audit.tasks import Task, TaskQuestion


def answer_swaps(
    request: InterveneRequest,
    source: InterventionSource,
    eligible: Sequence[Record],
    on_progress: Callable[[int, int], None] | None,
) -> tuple[list[Record], Counter]:
    """Both conditions of every eligible question as records; reasons of the questions skipped."""
    from prune_audit.tasks import manifest_task

    manifest = source.manifest
    inputs = source.inputs
    task = manifest_task(manifest)
    vlm = load_model(manifest, inputs.model, request.device)
    task.use_model(vlm)
    forcing = Forcing(vlm, manifest)
    questions = load_questions(task, inputs.question_files)
    evidence = task.load_evidence(inputs.annotations, list(questions.values()))
    rows: list[Record] = []
    skipped: Counter = Counter()
    for done, record in enumerate(eligible, start=1):
        question = questions[(record["split"], record["question_id"])]
        # a clip is read from its frame folder as run reads it (runner.clips: the checkpoint's frame sizes)
        prepared = prepare_task_question(vlm, task, question, {question.image: inputs.images / record["image"]}, None)
        check_geometry(record, prepared)
        found = prepared_evidence(evidence, question, record["image_id"], prepared)
        area = swap_region(task, question, found)
        rng = np.random.default_rng(question_seed(request.seed, record["split"], record["question_id"]))
        stage = source.chosen(record)
        try:
            pair = plan_swaps(request.mode, record["kept_stages"][stage], area.area_per_token, request.max_cells, rng)
        except NoSwap as reason:
            skipped[str(reason)] += 1
        else:
            swaps = pair.by_condition()
            answers = forcing.answer(prepared, task.answer_mode(question), record, stage, list(swaps.values()))
            rows += intervention_rows(task, question, record, prepared, found, area, swaps, answers)
        if on_progress:
            on_progress(done, len(eligible))
    return rows, skipped


def swap_region(task: Task, question: TaskQuestion, found: QuestionEvidence) -> ObjectArea:
    """The region whose cells the swaps move: the evidence region, or on a clip the object in the question's window
    (``ClipArea.window_area``; the whole clip without a window): what the question asks the frames to show."""
    if found.clip is None:
        assert found.region is not None  # intervene runs on questions whose evidence has pixels
        return found.region
    return found.clip.window_area(task.clip_window(question))  # type: ignore[attr-defined]  # a clip: a ClipTask


def load_model(manifest: dict[str, Any], source: str, device: str) -> VisionLanguageModel:
    """The run's model (read from ``source``), dtype and prompt; refused when its config differs from the run's."""
    from prune_audit.models import load_vlm

    prompt = manifest.get("prompt") or {}
    vlm = load_vlm(
        source,
        device=device,
        dtype=manifest["dtype"],
        prompt_template=prompt.get("template"),
        system_prompt=prompt.get("system"),
    )
    if vlm.describe()["model"]["config_hash"] != manifest["model"]["config_hash"]:
        raise PruneAuditError(f"the model at {source} differs from the run's (config hash changed)")
    return vlm


def load_questions(task: Task, files: Sequence[Path]) -> dict[tuple[str, int], TaskQuestion]:
    """The run's questions by (split, question_id), read from its question files by its task (Parquet files too:
    their images are the run's own, in its images folder)."""
    return {(question.split, question.question_id): question for question in task.load_questions(files)[0]}


def check_geometry(record: Record, prepared: Prepared) -> None:
    """The image still has the token geometry recorded by the run."""
    recorded = json.loads(record["geometry"])
    if json.loads(json.dumps(prepared.geometry.to_dict())) != recorded:
        raise PruneAuditError(
            f"image {record['image']} now has another token geometry than in the run; check the images folder"
        )


class Forcing:
    """Answers one prepared question under several swaps of its recorded kept sets, in one batch.

    Input-level runs force the swapped set directly (no selector). In-LLM runs force the
    swapped stage sets at the record's ``stage_layers``, with the selector passed so the
    loop uses the run's position mode.
    """

    def __init__(self, vlm: VisionLanguageModel, manifest: dict[str, Any]) -> None:
        from prune_audit.pruners import get_selector

        description = manifest["selector"]
        self.vlm = vlm
        self.in_llm = description["stage"] == "llm"
        self.selector = get_selector(description["name"], **description["options"]) if self.in_llm else None

    def answer(
        self, prepared: Prepared, mode: AnswerMode, record: Record, stage: int, swaps: Sequence[Swap]
    ) -> list[Answer]:
        """The answers (in the question's answer ``mode``) under each swap, planned on the record's stage ``stage``."""
        forced = [swap_stages(record["kept_stages"], swap, stage) for swap in swaps]
        batch = [prepared] * len(swaps)
        if not self.in_llm:
            return self.vlm.answer(batch, mode=mode, forced_kept=[stages[0] for stages in forced])
        stages = [list(zip(record["stage_layers"], sets)) for sets in forced]
        return self.vlm.answer(batch, self.selector, mode=mode, forced_stages=stages)
