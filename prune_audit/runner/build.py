"""``prune-audit run``, step 3: answers + token geometry + evidence regions -> one record per question.

The run's task scores each answer (its core columns and its own, ``tasks.base.Scored``) and
names each question's evidence region. Retention of that region is computed at every stage, on the kept grid indices and those the stage's merged
tokens carry, for a whole batch at once through ``ObjectAreaCache`` and
``retention_by_stage`` (the path ``benchmarks/retention.py`` times). The columns are
those of ``prune_audit.records.schema.RUN_COLUMNS``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from prune_audit.data.retention import ObjectArea, StageRetention, retention_by_stage
from prune_audit.records.schema import Record, task_columns

if TYPE_CHECKING:
    from prune_audit.data.clip_retention import ClipArea
    from prune_audit.models import Answer, Prepared
    from prune_audit.tasks import Evidence, Task, TaskQuestion
    from prune_audit.tasks.clips import ClipEvidence


@dataclass(frozen=True)
class AnsweredQuestion:
    """One question with the model's answer and everything its record needs."""

    question: TaskQuestion
    answer: Answer
    prepared: Prepared
    image_id: int
    order: int


@dataclass(frozen=True)
class QuestionEvidence:
    """One question's evidence under its prepared geometry: the whole region (None without one: POPE's "no"
    questions, a run without annotations), each of its objects on its own, (name, area), and on a clip the object
    over its sampled frames (``tasks.clips.ClipEvidence``; None on still images and without evidence)."""

    region: ObjectArea | None
    objects: list[tuple[str, ObjectArea]]
    clip: ClipArea | None = None


NO_EVIDENCE = QuestionEvidence(None, [])


def question_evidence(evidence: Evidence | None, answered: AnsweredQuestion) -> QuestionEvidence:
    """The question's evidence region and objects, as its task's evidence names them."""
    return prepared_evidence(evidence, answered.question, answered.image_id, answered.prepared)


def prepared_evidence(
    evidence: Evidence | None, question: TaskQuestion, image_id: int, prepared: Prepared
) -> QuestionEvidence:
    """:func:`question_evidence` of a question prepared and not yet answered (``intervene`` plans its swaps on it)."""
    if evidence is None:
        return NO_EVIDENCE
    geometry = prepared.geometry
    clip = None
    if prepared.video_grid is not None:  # a clip task's evidence reads clips (``tasks.clips.ClipTask``)
        clip = cast("ClipEvidence", evidence).clip_area(question, image_id, geometry)
    return QuestionEvidence(
        evidence.area(question, image_id, geometry), evidence.objects(question, image_id, geometry), clip
    )


def clip_values(task: Task, item: AnsweredQuestion, evidence: QuestionEvidence, covered: list[list[int]]) -> Record:
    """A clip task's ``CLIP_COLUMNS`` (``tasks.clips``) from each stage's ``covered`` token indices (the unsuffixed
    columns the first stage's); none for other tasks."""
    if not task.reads_clips:
        return {}
    window = task.clip_window(item.question)  # type: ignore[attr-defined]  # reads_clips: a ClipTask
    clip = evidence.clip
    frames = None if clip is None else [clip.frame_retention(cells) for cells in covered]
    lost = None if clip is None else [clip.lost_in_window(cells, window) for cells in covered]
    return {
        "sampled_frames": list(item.prepared.geometry.frames),
        "frame_retention": None if frames is None else frames[0],
        "frame_retention_stages": frames,
        "window": None if window is None else list(window),
        "window_retention": math.nan if clip is None else clip.window_retention(covered[0], window),
        "lost_in_window": None if lost is None else lost[0],
        "lost_in_window_stages": lost,
    }


def last_visible_kept(kept_stages: Sequence[Sequence[int]], num_visual: int) -> list[int]:
    """The visual tokens of the deepest layers that still see any: the last non-empty kept set.

    Unpruned (no stages) that is every token; a schedule that ends at 0 tokens (E2S at
    64) reports the tokens alive before its last stage.
    """
    if not kept_stages:
        return list(range(num_visual))
    for kept in reversed(kept_stages):
        if kept:
            return list(kept)
    return []


class StagedAnswer(Protocol):
    """What ``recorded_stages`` reads of an answer: the model's ``Answer`` or the Python API's ``PrunedResult``."""

    kept_stages: list[list[int]]
    stage_layers: list[int]
    merged_stages: list[list[list[int]]]


def recorded_stages(answer: StagedAnswer, num_visual: int) -> tuple[list[list[int]], list[int], list[list[list[int]]]]:
    """(kept set of each stage, decoder layer whose input it is, sources of its merged tokens): one
    stage at layer 0 for input-level selectors, and for the unpruned model (every token)."""
    if not answer.kept_stages:
        return [list(range(num_visual))], [0], [[]]
    kept_stages = [list(kept) for kept in answer.kept_stages]
    layers = list(answer.stage_layers) or [0]
    merged = [[list(s) for s in stage] for stage in answer.merged_stages] or [[] for _ in kept_stages]
    if not len(layers) == len(kept_stages) == len(merged):
        raise ValueError(f"{len(kept_stages)} kept sets for {len(layers)} stage layers and {len(merged)} merged sets")
    return kept_stages, layers, merged


def covered_stages(kept_stages: list[list[int]], merged_stages: list[list[list[int]]]) -> list[list[int]]:
    """Each stage's grid indices seen by a kept token or carried by a merged one (retention reads these)."""
    return [sorted(set(kept).union(*merged)) if merged else kept for kept, merged in zip(kept_stages, merged_stages)]


def build_records(
    task: Task, answered: Sequence[AnsweredQuestion], evidence: Sequence[QuestionEvidence]
) -> list[Record]:
    """One record per answered question, scored by ``task``; ``evidence[i]`` is question i's.

    Retention of the evidence region is computed at every stage; ``retention``, ``object_tokens_kept``,
    ``lost`` and ``diluted`` are the first stage's values, as is each evidence object's own lost.
    """
    areas = [item.region for item in evidence]
    stages = [recorded_stages(item.answer, item.prepared.num_visual) for item in answered]
    covered = [covered_stages(kept, merged) for kept, _, merged in stages]
    retained = retention_by_stage(areas, covered)
    diluted = _diluted_stages(areas, stages, retained)
    objects_lost = _objects_lost(evidence, [cells[0] for cells in covered])
    return [
        _record(
            task,
            item,
            area,
            kept_stages,
            layers,
            merged,
            by_stage,
            dilution,
            named,
            lost,
            clip_values(task, item, named, cells),
        )
        for item, area, (kept_stages, layers, merged), by_stage, dilution, named, lost, cells in zip(
            answered, areas, stages, retained, diluted, evidence, objects_lost, covered
        )
    ]


def _objects_lost(evidence: Sequence[QuestionEvidence], first_cells: Sequence[list[int]]) -> list[list[bool | None]]:
    """Per question, each evidence object lost at the first stage (None for an object without pixels), in one
    ``retention_by_stage`` call over every object."""
    flat = [(q, area) for q, item in enumerate(evidence) for _, area in item.objects]
    measured = retention_by_stage([area for _, area in flat], [[first_cells[q]] for q, _ in flat])
    lost: list[list[bool | None]] = [[] for _ in evidence]
    for (q, _), by_stage in zip(flat, measured):
        lost[q].append(by_stage.lost[0])
    return lost


def _diluted_stages(
    areas: Sequence[ObjectArea | None],
    stages: list[tuple[list[list[int]], list[int], list[list[list[int]]]]],
    retained: list[StageRetention],
) -> list[list[bool | None]]:
    """Per question and stage: the kept cells alone lose the object but a merged token carries it.

    Only questions with merged tokens need their kept cells' own retention; the others are
    never diluted (None without a mask, as ``lost``).
    """
    merging = [q for q, (_, _, merged) in enumerate(stages) if any(merged)]
    own = dict(zip(merging, retention_by_stage([areas[q] for q in merging], [stages[q][0] for q in merging])))
    return [
        [None if lost is None else bool(q in own and own[q].lost[s] and not lost) for s, lost in enumerate(by.lost)]
        for q, by in enumerate(retained)
    ]


def _own_columns(task: str) -> set[str]:
    return {column.name for column in task_columns(task)}


def _record(
    task: Task,
    item: AnsweredQuestion,
    area: ObjectArea | None,
    kept_stages: list[list[int]],
    stage_layers: list[int],
    merged_stages: list[list[list[int]]],
    by_stage: StageRetention,
    diluted: list[bool | None],
    evidence: QuestionEvidence,
    objects_lost: list[bool | None],
    clip: Record,
) -> Record:
    question, answer, prepared = item.question, item.answer, item.prepared
    has_mask = area is not None and area.has_mask
    scored = task.score(question, answer.reduced)
    if set(scored.columns) | set(clip) != _own_columns(task.name):  # pyarrow would drop an unknown key silently
        raise ValueError(
            f"task {task.name!r} scored columns {sorted(scored.columns)}, but it declares "
            f"{sorted(_own_columns(task.name))} (Task.record_columns)"
        )
    return {
        "question_id": question.question_id,
        "split": question.split,
        "task": task.name,
        "image": question.image,
        "image_id": item.image_id,
        "answer_text": scored.answer_text,
        "references": list(scored.references),
        "confidence": scored.confidence,
        "correct": scored.correct,
        **scored.columns,
        **clip,
        "kept": last_visible_kept(answer.kept_stages, prepared.num_visual),
        "kept_stages": kept_stages,
        "merged_stages": merged_stages,
        "stage_layers": stage_layers,
        "visual_tokens_avg": answer.visual_tokens_avg,
        "prefill_tokens": answer.prefill_tokens,
        # in-LLM pruning shortens the sequence only from its first stage on
        "cost_tokens": answer.prefill_tokens - answer.tokens_per_layer[0] + answer.visual_tokens_avg,
        "retention": by_stage.retention[0],
        "retention_stages": by_stage.retention,
        "visible_fraction": area.visible_fraction if has_mask else math.nan,
        "object_tokens_kept": by_stage.object_tokens_kept[0],
        "object_tokens_kept_stages": by_stage.object_tokens_kept,
        "lost": by_stage.lost[0],
        "lost_stages": by_stage.lost,
        "diluted": diluted[0],
        "diluted_stages": diluted,
        "object_area": area.total_area if has_mask else 0,
        "evidence_objects": [name for name, _ in evidence.objects],
        "evidence_objects_lost": objects_lost,
        "latency_ms": answer.latency_ms,
        **cost_values(answer),
        "geometry": json.dumps(prepared.geometry.to_dict()),
        "order": item.order,
    }


def cost_values(answer: Answer) -> Record:
    """The cost columns (``COST_COLUMNS``) of one answer."""
    cost, parts = answer.cost, answer.latency_parts
    return {
        "flops": cost.flops,
        "flops_vision": cost.flops_vision,
        "flops_selector": cost.flops_selector,
        "flops_llm": cost.flops_llm,
        "flops_dense": cost.flops_dense,
        "flops_decode_token": cost.flops_decode_token,
        "kv_bytes": cost.kv_bytes,
        "flop_equivalent_tokens": cost.flop_equivalent_tokens,
        "signal_sources": None if cost.signal_sources is None else list(cost.signal_sources),
        "latency_vision_ms": parts["vision"],
        "latency_selection_ms": parts["selection"],
        "latency_prefill_ms": parts["prefill"],
        "latency_decode_ms": parts.get("decode"),
    }
