"""``prune-audit run``: plan (validate everything, touch nothing), then execute with resume.

Planning loads and checks every input before anything is written, so a bad input
ends the command with one line and no run directory. Execution writes the manifest
first, then one atomic part file per batch, and compacts the parts into
``records.parquet`` once every question of the run is done.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.runner.manifest import base_manifest, differing_fields, read_manifest, write_manifest
from prune_audit.runner.records import RecordStore
from prune_audit.runner.sharding import ProcessGroup, Shard, launcher_shard, shard_questions

SPLITS = ("random", "popular", "adversarial")


@dataclass
class RunRequest:
    """What the user asked for, as given on the command line."""

    model: str | None = None
    selector: str = "none"
    budget: int | None = None
    options: list[str] = field(default_factory=list)  # KEY=VALUE strings
    pope: list[Path] = field(default_factory=list)
    split: str | None = None
    images: Path | None = None
    annotations: Path | None = None
    out: Path | None = None
    limit: int | None = None
    batch_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    shard: Shard | None = None
    prompt_template: str | None = None
    clip_text: Path | None = None
    command: str = ""


@dataclass
class RunPlan:
    """A validated run: questions, images, selector, model, output directory and manifest."""

    request: RunRequest
    questions: list[Any]
    image_paths: dict[str, Path]
    image_ids: dict[str, int]
    selector: Any
    budget: int | None
    vlm: Any
    coco: Any
    run_dir: Path
    manifest: dict[str, Any]
    shard: Shard | None
    launched: bool = False


@dataclass
class RunResult:
    run_dir: Path
    records: Any  # pyarrow.Table of every record present (all shards, when complete)
    complete: bool
    summary: dict[str, Any]


# ----- planning ------------------------------------------------------------------------


def plan_run(request: RunRequest) -> RunPlan:
    """Validate every input of the run; nothing is written."""
    _resolve_demo_defaults(request)
    selector, budget = _make_selector(request)
    questions = _load_questions(request)
    image_paths = _check_images(request, questions)
    coco = _load_annotations(request, questions)
    image_ids = _image_ids(questions, coco)
    run_dir = _run_dir(request)
    check_writable(run_dir)
    _check_device(request.device)
    from prune_audit.models import load_vlm

    vlm = load_vlm(
        request.model,
        device=request.device,
        dtype=request.dtype,
        prompt_template=request.prompt_template,
        clip_text=request.clip_text,
    )
    if selector is not None:
        vlm.check_selector(selector)
    launched = launcher_shard()
    if launched is not None and request.shard is not None:
        raise PruneAuditError("--shard cannot be combined with torchrun/accelerate launch; use one or the other")
    first = _prepare_first(vlm, questions[0], image_paths)
    manifest = _manifest(request, vlm, selector, budget, questions, first)
    shard = request.shard or launched
    return RunPlan(request, questions, image_paths, image_ids, selector, budget, vlm, coco, run_dir, manifest, shard,
                   launched is not None)


def _prepare_first(vlm: Any, question: Any, image_paths: dict[str, Path]) -> Any:
    """The first question prepared: its token grid and geometry describe the run in the manifest."""
    return prepare_question(vlm, image_paths[question.image], question.text)


def prepare_question(vlm: Any, image_path: Path, text: str) -> Any:
    """The model's ``Prepared`` prompt for one image file (as RGB) and question text."""
    from PIL import Image

    with Image.open(image_path) as image:
        return vlm.prepare(image.convert("RGB"), text)


def _resolve_demo_defaults(request: RunRequest) -> None:
    if request.model is not None and request.pope:
        return
    if request.model is not None and not request.pope:
        raise PruneAuditError("--model needs questions: pass --pope FILE... with --images DIR (and --annotations FILE for retention)")
    from prune_audit.demo.assets import demo_assets

    demo = demo_assets()
    request.model = str(demo.model_dir)
    if not request.pope:
        request.pope = list(demo.pope_files)
        request.images = request.images or demo.images_dir
        request.annotations = request.annotations or demo.annotations


def _make_selector(request: RunRequest) -> tuple[Any, int | None]:
    if request.selector == "none":
        if request.options:
            raise PruneAuditError("--option needs a selector; the unpruned run (--selector none) has no options")
        return None, None
    from prune_audit.pruners.registry import selector_from_strings

    selector = selector_from_strings(request.selector, request.options)  # every option checked against its domain
    if request.budget is None:
        raise PruneAuditError(f"selector {request.selector!r} needs --budget N (visual tokens to keep)")
    if request.budget <= 0:
        raise PruneAuditError(f"--budget must be a positive number of visual tokens, got {request.budget}")
    return selector, request.budget


def _load_questions(request: RunRequest) -> list[Any]:
    from prune_audit.data.pope import load_pope

    if request.split not in (None, "all", *SPLITS):
        raise PruneAuditError(f"--split must be one of {', '.join(SPLITS)} or all, got {request.split!r}")
    questions = []
    for path in request.pope:
        if not Path(path).is_file():
            raise PruneAuditError(f"question file not found: {path}; pass an existing POPE file with --pope")
        questions.extend(load_pope(path))
    if request.split not in (None, "all"):
        questions = [q for q in questions if q.split == request.split]
    keys = [(q.split, q.question_id) for q in questions]
    if len(set(keys)) != len(keys):
        raise PruneAuditError("the question files repeat a (split, question_id); pass each split's file once")
    unlabelled = [q for q in questions if q.label is None]
    if unlabelled:
        raise PruneAuditError(f"{len(unlabelled)} questions have no label; pass the POPE label files with --pope")
    if request.limit is not None:
        if request.limit <= 0:
            raise PruneAuditError(f"--limit must be positive, got {request.limit}")
        questions = questions[: request.limit]
    if not questions:
        raise PruneAuditError("no questions to run; check --pope and --split")
    return questions


def _check_images(request: RunRequest, questions: Sequence[Any]) -> dict[str, Path]:
    """Every image exists and decodes (a corrupt file fails here, before any output)."""
    from PIL import Image, UnidentifiedImageError

    if request.images is None:
        raise PruneAuditError("pass --images DIR, the folder holding the question files' images")
    paths: dict[str, Path] = {}
    for name in dict.fromkeys(q.image for q in questions):
        path = Path(request.images) / name
        if not path.is_file():
            raise PruneAuditError(f"image not found: {path}; check --images")
        try:
            with Image.open(path) as image:
                image.load()
        except (UnidentifiedImageError, OSError) as error:
            raise PruneAuditError(f"image {path} cannot be decoded ({error}); replace or remove the file") from None
        paths[name] = path
    return paths


def _load_annotations(request: RunRequest, questions: Sequence[Any]) -> Any:
    if request.annotations is None:
        return None
    from prune_audit.data.coco import CocoInstances

    coco = CocoInstances.load(request.annotations)
    for question in questions:
        try:
            coco.category_id(question.object)
        except (KeyError, PruneAuditError):
            raise PruneAuditError(
                f"question {question.split}/{question.question_id} asks about {question.object!r}, "
                f"which is no category of {request.annotations}; pass the matching --annotations file"
            ) from None
    return coco


def _image_ids(questions: Sequence[Any], coco: Any) -> dict[str, int]:
    ids: dict[str, int] = {}
    for question in questions:
        if question.image in ids:
            continue
        image_id = coco.image_id(question.image) if coco is not None else question.image_id
        if image_id is None:
            raise PruneAuditError(f"cannot tell the image id of {question.image!r}; pass --annotations")
        ids[question.image] = int(image_id)
    return ids


def _run_dir(request: RunRequest) -> Path:
    if request.out is not None:
        return Path(request.out)
    model_name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(request.model).rstrip("/")).name) or "model"
    suffix = "dense" if request.selector == "none" else f"{request.selector}-{request.budget}"
    return Path("runs") / f"{model_name}-{suffix}"


def check_writable(run_dir: Path) -> None:
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PruneAuditError(f"cannot write the run directory {run_dir} ({existing} is not writable); pass a writable --out")


def _check_device(device: str) -> None:
    if device not in {"auto", "cpu", "cuda"} and not device.startswith("cuda:"):
        raise PruneAuditError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise PruneAuditError("--device cuda was requested but CUDA is not available; use --device cpu or auto")


def _manifest(
    request: RunRequest, vlm: Any, selector: Any, budget: int | None, questions: Sequence[Any], first: Any
) -> dict[str, Any]:
    from prune_audit.data.pope import file_sha256

    description = vlm.describe()
    manifest = base_manifest()
    manifest.update(description)
    manifest["processor"] = {**manifest.get("processor", {}), "first_image": first.geometry.to_dict()}
    manifest["selector"] = _selector_description(selector, budget, vlm, first.num_visual)
    manifest["budget"] = budget
    manifest["question_files"] = [{"path": str(p), "sha256": file_sha256(p)} for p in request.pope]
    manifest["annotations"] = (
        {"path": str(request.annotations), "sha256": file_sha256(request.annotations)} if request.annotations else None
    )
    manifest["images"] = str(request.images)
    manifest["split"] = request.split or "all"
    manifest["limit"] = request.limit
    manifest["num_questions"] = len(questions)
    manifest["seed"] = request.seed
    manifest["command"] = request.command
    return manifest


def _selector_description(selector: Any, budget: int | None, vlm: Any, num_visual: int) -> dict[str, Any]:
    """Name, options, position mode and (in-LLM) schedule for the first question's token count."""
    if selector is None:
        return {"name": "none", "stage": None, "options": {}, "positions": None, "schedule": None}
    llm = selector.stage == "llm"
    schedule = selector.schedule(vlm.num_layers, num_visual, budget) if llm else None
    return {
        "name": selector.name,
        "stage": selector.stage,
        "options": selector.options(),
        "positions": vlm.positions_for(selector),
        "schedule": [[stage.layer, stage.keep] for stage in schedule] if schedule is not None else None,
        "schedule_num_visual": num_visual,
    }


# ----- execution -----------------------------------------------------------------------


def question_seed(seed: int, split: str, question_id: int) -> int:
    """A per-question seed, so results do not depend on batching, sharding or resuming."""
    digest = hashlib.sha256(f"{seed}:{split}:{question_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def execute(
    plan: RunPlan,
    on_start: Callable[[int, int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Answer the plan's questions not yet recorded; compact once the whole run is done.

    Under torchrun / accelerate every rank answers its shard, rank 0 writes the
    manifest first and compacts last. With ``--shard I/N`` each process works alone
    and whichever finds the run complete compacts it (compaction is idempotent).
    """
    group = ProcessGroup(plan.shard if plan.launched else None)
    leader = not plan.launched or plan.shard.index == 0
    try:
        if leader:
            _prepare_run_dir(plan)
        group.barrier()
        if not leader:
            _check_resume(plan)
        store = RecordStore(plan.run_dir, writer=plan.shard.writer if plan.shard else "0")
        mine = shard_questions(plan.questions, plan.shard) if plan.shard else list(plan.questions)
        done = store.done_keys()
        todo = [q for q in mine if (q.split, q.question_id) not in done]
        if on_start:
            on_start(len(mine) - len(todo), len(mine))
        _answer_questions(plan, todo, store, on_progress)
        group.barrier()
        complete = len(store.done_keys()) == len(plan.questions)
        if complete and leader:
            records = store.compact()
            _finish_manifest(plan, records)
        group.barrier()
        records = store.read()
    finally:
        group.close()
    return RunResult(plan.run_dir, records, complete, summarize(records))


def _finish_manifest(plan: RunPlan, records: Any) -> None:
    import numpy as np

    manifest = dict(plan.manifest)
    manifest["realised_visual_tokens_avg"] = float(np.mean(records["visual_tokens_avg"].to_numpy()))
    write_manifest(plan.run_dir, manifest)


def _prepare_run_dir(plan: RunPlan) -> None:
    if (plan.run_dir / "manifest.json").is_file():
        _check_resume(plan)
        return
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(plan.run_dir, plan.manifest)


def _check_resume(plan: RunPlan) -> None:
    previous = read_manifest(plan.run_dir)
    differences = differing_fields(previous, plan.manifest)
    if differences:
        raise PruneAuditError(
            f"{plan.run_dir} holds a run with a different configuration ({', '.join(differences)}); "
            f"pass another --out or repeat the original command"
        )


def _answer_questions(plan: RunPlan, todo: Sequence[Any], store: RecordStore, on_progress: Callable[[int], None] | None) -> None:
    order = {(q.split, q.question_id): index for index, q in enumerate(plan.questions)}
    areas = AreaLookup(plan.coco)
    batch_size = max(1, plan.request.batch_size)
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        prepared = [prepare_question(plan.vlm, plan.image_paths[q.image], q.text) for q in batch]
        generators = [_generator(plan.request.seed, q) for q in batch]
        answers = plan.vlm.answer(prepared, plan.selector, plan.budget, generator=generators)
        rows = []
        for q, a, p in zip(batch, answers, prepared):
            image_id = plan.image_ids[q.image]
            area = areas.get(image_id, q.object, p.geometry) if q.label == "yes" else None
            rows.append(build_record(q, a, p, image_id, area, order[(q.split, q.question_id)]))
        store.append(rows)
        if on_progress:
            on_progress(len(batch))


def _generator(seed: int, question: Any) -> Any:
    import torch

    return torch.Generator().manual_seed(question_seed(seed, question.split, question.question_id))


class AreaLookup:
    """Object area per token for (image, object) under the prepared geometry; masks decoded once.

    ``coco`` is the run's ``CocoInstances``; without one (no --annotations) every lookup is None.
    """

    def __init__(self, coco: Any) -> None:
        self.coco = coco
        self.cache: dict[tuple[int, str, Any], Any] = {}

    def get(self, image_id: int, object_name: str, geometry: Any) -> Any:
        if self.coco is None:
            return None
        key = (image_id, object_name, geometry)
        if key not in self.cache:
            from prune_audit.data.retention import object_area

            mask = self.coco.category_mask(image_id, object_name)
            self.cache[key] = object_area(mask, geometry)
        return self.cache[key]


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


def build_record(question: Any, answer: Any, prepared: Any, image_id: int, area: Any, order: int) -> dict[str, Any]:
    """One row of docs/records.md; ``area`` is the object's ``ObjectArea`` (None for "no" questions
    and runs without annotations)."""
    from prune_audit.data.retention import retention

    kept = last_visible_kept(answer.kept_stages, prepared.num_visual)
    if area is not None and area.has_mask:
        retained, object_tokens, lost = retention(area.area_per_token, area.total_area, kept)
        visible, object_area_px = area.visible_fraction, area.total_area
    else:
        retained, object_tokens, lost, visible, object_area_px = math.nan, -1, None, math.nan, 0
    return {
        "question_id": question.question_id,
        "split": question.split,
        "image": question.image,
        "image_id": image_id,
        "object": question.object,
        "label": question.label,
        "answer": answer.answer,
        "p_yes": answer.p_yes,
        "p_no": answer.p_no,
        "p_yes_2way": answer.p_yes_2way,
        "logit_diff": answer.logit_diff,
        "confidence": answer.confidence,
        "correct": answer.answer == question.label,
        "kept": kept,
        "kept_stages": [list(k) for k in answer.kept_stages] or [list(range(prepared.num_visual))],
        "visual_tokens_avg": answer.visual_tokens_avg,
        "prefill_tokens": answer.prefill_tokens,
        # in-LLM pruning shortens the sequence only from its first stage on
        "cost_tokens": answer.prefill_tokens - answer.tokens_per_layer[0] + answer.visual_tokens_avg,
        "retention": retained,
        "visible_fraction": visible,
        "object_tokens_kept": object_tokens,
        "lost": lost,
        "object_area": object_area_px,
        "latency_ms": answer.latency_ms,
        "geometry": json.dumps(prepared.geometry.to_dict()),
        "order": order,
    }


def summarize(records: Any) -> dict[str, Any]:
    """One-screen summary numbers, computed from the records table."""
    import numpy as np

    n = records.num_rows
    if n == 0:
        return {"questions": 0}
    column = lambda name: np.asarray(records[name].to_pylist(), dtype=float)  # noqa: E731
    lost = [v for v in records["lost"].to_pylist() if v is not None]
    retention_values = column("retention")
    return {
        "questions": n,
        "accuracy": float(np.mean(column("correct"))),
        "mean_confidence": float(np.mean(column("confidence"))),
        "visual_tokens_avg": float(np.mean(column("visual_tokens_avg"))),
        "mean_retention": float(np.nanmean(retention_values)) if np.isfinite(retention_values).any() else math.nan,
        "lost_objects": int(sum(lost)),
        "questions_with_mask": len(lost),
        "mean_latency_ms": float(np.mean(column("latency_ms"))),
    }

