"""``prune-audit run``, step 2: execute a RunPlan with resume, batch by batch.

Execution writes the manifest first, then one atomic part file per batch of answered
questions (records built by ``runner.build``), and compacts the parts into
``records.parquet`` once every question of the run is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from prune_audit.records.manifest import MANIFEST_FILE, read_manifest, write_manifest
from prune_audit.records.store import RecordStore, check_run_layout
from prune_audit.runner.answering import answer_grouped, question_generator
from prune_audit.runner.build import AnsweredQuestion, build_records, question_evidence
from prune_audit.runner.embedded import write_embedded_images
from prune_audit.runner.plan import RunPlan
from prune_audit.runner.questions import prepare_task_question
from prune_audit.runner.safeguards import check_same_run, hold_run_dir, undo_first_writes
from prune_audit.runner.sharding import ProcessGroup, shard_questions
from prune_audit.runner.summary import summarize
from prune_audit.safety.progress import report_saved, saving

if TYPE_CHECKING:
    import torch

    from prune_audit.models import Answer, Prepared
    from prune_audit.tasks import TaskQuestion


@dataclass
class RunResult:
    """Where the run went, every record present (all shards, when complete) and the summary."""

    run_dir: Path
    records: pa.Table
    complete: bool
    summary: dict[str, float | int]


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
    leader = not plan.launched or plan.shard is None or plan.shard.index == 0
    lock = hold_run_dir(plan.run_dir, plan.shard.writer if plan.shard else None)
    written: list[Path] = []  # what this attempt wrote before its first record, undone if it fails
    try:
        if leader:
            _prepare_run_dir(plan, written)
        group.barrier()
        if not leader:
            check_resume(plan)
        store = RecordStore(plan.run_dir, plan.manifest, writer=plan.shard.writer if plan.shard else "0")
        mine = shard_questions(plan.questions, plan.shard) if plan.shard else list(plan.questions)
        done = store.done_keys()
        todo = [q for q in mine if (q.split, q.question_id) not in done]
        saved = len(mine) - len(todo)
        report_saved(plan.run_dir, saved, len(mine))
        if on_start:
            on_start(saved, len(mine))

        def answered(count: int) -> None:  # after each durable batch: what Ctrl-C or a full disk would keep
            nonlocal saved
            saved += count
            report_saved(plan.run_dir, saved, len(mine))
            if on_progress:
                on_progress(count)

        answer_batches(plan, todo, store, answered)
        group.barrier()
        complete = len(store.done_keys()) == len(plan.questions)
        group.barrier()  # every rank has counted before the leader compacts the parts away
        if complete and leader:
            records = store.compact()
            _finish_manifest(plan, records)
        group.barrier()
        records = store.read()
    except BaseException as error:
        if plan.shard is None:  # shards share the folder: another may be writing its first records
            undo_first_writes(plan.run_dir, written)
        lock.__exit__(type(error), error, error.__traceback__)  # told the error, the hold gives back an emptied folder
        raise
    finally:
        lock.close()  # no-op once exited above
        group.close()
    return RunResult(plan.run_dir, records, complete, summarize(records, plan.task))


def _finish_manifest(plan: RunPlan, records: pa.Table) -> None:
    manifest = dict(plan.manifest)
    manifest["realised_visual_tokens_avg"] = float(np.mean(records["visual_tokens_avg"].to_numpy()))
    write_manifest(plan.run_dir, manifest)


def _prepare_run_dir(plan: RunPlan, written: list[Path]) -> None:
    """Check the manifest of a resumed run, else write it before the first record (under the lock); then the
    images embedded in Parquet question files (``runner.embedded``), which the run reads from its folder. A new
    run's files are appended to ``written`` as they are written (``undo_first_writes``)."""
    check_run_layout(plan.run_dir)
    resumed = (plan.run_dir / MANIFEST_FILE).is_file()
    if resumed:
        check_resume(plan)
    else:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(plan.run_dir, plan.manifest)
        written.append(plan.run_dir / MANIFEST_FILE)
    if plan.embedded_images is not None:  # a resumed run's images are kept whatever happens next
        write_embedded_images(plan.embedded_images, plan.image_paths, plan.run_dir, [] if resumed else written)


def check_resume(plan: RunPlan) -> None:
    """Refuse to resume into a run directory whose manifest has another configuration or inputs."""
    check_same_run(plan.run_dir, read_manifest(plan.run_dir), plan.manifest)


def answer_batches(
    plan: RunPlan, todo: Sequence[TaskQuestion], store: RecordStore, on_progress: Callable[[int], None] | None
) -> None:
    """Answer ``todo`` in batches of ``--batch-size``; each batch becomes one part file."""
    order = {(q.split, q.question_id): index for index, q in enumerate(plan.questions)}
    batch_size = max(1, plan.request.batch_size)
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        prepared = [
            prepare_task_question(plan.vlm, plan.task, q, plan.image_paths, None, plan.selector, plan.request.budget)
            for q in batch
        ]
        generators = [question_generator(plan.request.seed, q) for q in batch]
        answers = answer_batch(plan, batch, prepared, generators)
        answered = [
            AnsweredQuestion(q, a, p, plan.image_ids[q.image], order[(q.split, q.question_id)])
            for q, a, p in zip(batch, answers, prepared)
        ]
        records = build_records(plan.task, answered, [question_evidence(plan.evidence, item) for item in answered])
        with saving():  # the part and its count in the saved-count line, never one without the other
            store.append(records)
            if on_progress:
                on_progress(len(batch))


def answer_batch(
    plan: RunPlan,
    questions: Sequence[TaskQuestion],
    prepared: Sequence[Prepared],
    generators: Sequence[torch.Generator],
) -> list[Answer]:
    """The model's answers in each question's answer mode (its task's), through ``answer_grouped``; an
    imported run's come from its kept sets (``runner.imported``)."""
    if plan.imported is not None:
        return plan.imported.answers(plan.vlm, plan.task, questions, prepared)
    modes = [plan.task.answer_mode(question) for question in questions]
    return answer_grouped(plan.vlm, plan.selector, plan.request.budget, prepared, modes, generators)
