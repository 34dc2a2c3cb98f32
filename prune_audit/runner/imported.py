"""``prune-audit import``: a kept-set file (``records.interchange``) as the answers of a run.

Planning (``runner.plan``) restricts the run to the file's questions, checks every kept set against
the model's token grid and depth, and records the import in the manifest's ``selector`` block
(:func:`plan_import`); then
``execute`` writes the run directory as for ``run``, through the same record builder. The answers
come from the file (:meth:`ImportedAnswers.from_file`: the answer mode's reduction rebuilt from the
line, the token counts and analytic cost from the kept sets on the model's prompt), or, with
``--model``, from the model answering under the imported kept sets forced (``forced_kept`` for
one stage at layer 0, ``forced_stages`` for in-LLM stages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.errors import PruneAuditError
from prune_audit.records.consistency import budget_problem, visual_tokens_problem
from prune_audit.records.interchange import (
    COST_FIELDS,
    GENERATION_SUMMARY,
    SIGNAL_SOURCES_FIELD,
    KeptQuestion,
    KeptSets,
)
from prune_audit.runner.answering import answer_grouped
from prune_audit.runner.questions import prepare_task_question

if TYPE_CHECKING:
    from prune_audit.answer_modes import AnswerMode, Generation, Greedy, LetterChoice, Reduction, YesNo
    from prune_audit.models import Answer, Prepared, VisionLanguageModel
    from prune_audit.runner.request import RunRequest
    from prune_audit.tasks import Task, TaskQuestion


@dataclass
class ImportedAnswers:
    """The kept sets of a run's questions, and whether the model re-answers under them (``--model``)."""

    by_key: dict[tuple[str, int], KeptQuestion]
    reanswer: bool

    def answers(
        self, vlm: VisionLanguageModel, task: Task, questions: Sequence[TaskQuestion], prepared: Sequence[Prepared]
    ) -> list[Answer]:
        """One answer per question, in order."""
        lines = [self.by_key[(q.split, q.question_id)] for q in questions]
        modes = [task.answer_mode(q) for q in questions]
        if self.reanswer:
            return _reanswer(vlm, lines, prepared, modes)
        return [_answer_from_line(vlm, line, item, mode) for line, item, mode in zip(lines, prepared, modes)]


def plan_import(
    request: RunRequest,
    vlm: VisionLanguageModel,
    task: Task,
    questions: Sequence[TaskQuestion],
    image_paths: dict[str, Path],
    manifest: dict[str, Any],
    embedded: dict[str, bytes] | None,
) -> ImportedAnswers | None:
    """``import``: the kept sets checked on each image's prompt, the import recorded in the manifest (None for a
    run that imports nothing)."""
    if request.kept_sets is None:
        return None
    from prune_audit.safety.fingerprint import file_sha256

    first_question = {question.image: question for question in reversed(questions)}
    prepared = {
        image: prepare_task_question(vlm, task, question, image_paths, embedded)
        for image, question in first_question.items()
    }
    check_kept_sets(request.kept_sets, vlm, prepared, request.reanswer)
    if not request.reanswer:
        check_answers(request.kept_sets, task, questions)
    sha256 = file_sha256(request.kept_sets.path)
    manifest["selector"] = imported_selector(request.kept_sets, sha256, request.reanswer)
    manifest["budget"] = request.kept_sets.header.get("budget")
    by_key = {(line.split, line.question_id): line for line in request.kept_sets.questions}
    return ImportedAnswers(by_key, request.reanswer)


def restrict_questions(kept_sets: KeptSets, questions: Sequence[TaskQuestion]) -> list[TaskQuestion]:
    """The planned questions the file answers, in the question files' order; a question of the file that the
    question files lack, or another image than theirs, is refused naming its line."""
    planned = {(q.split, q.question_id): q for q in questions}
    for line in kept_sets.questions:
        question = planned.get((line.split, line.question_id))
        if question is None:
            raise PruneAuditError(
                f"{line.line}: question {line.split}/{line.question_id} is not in the question "
                f"files; pass the files it was asked from (--pope / --questions)"
            )
        if question.image != line.image:
            raise PruneAuditError(
                f"{line.line}: image {line.image!r}, but the question files ask question "
                f"{line.split}/{line.question_id} about {question.image!r}"
            )
    keys = {(line.split, line.question_id) for line in kept_sets.questions}
    return [q for q in questions if (q.split, q.question_id) in keys]


def check_kept_sets(
    kept_sets: KeptSets, vlm: VisionLanguageModel, prepared: dict[str, Prepared], reanswer: bool
) -> None:
    """Every stage's indices lie on its image's token grid (``prepared``: each image's prompt), its layer in the
    model and its token count within the image's; the kept sets realise the header's budget; re-answering also
    needs kept sets the model can be forced to (no merged tokens)."""
    for line in kept_sets.questions:
        rows, cols = prepared[line.image].grid
        for number, stage in enumerate(line.stages):
            at = f"{line.line}: stage {number}"
            largest = max([*stage.kept, *(i for sources in stage.merged for i in sources)], default=-1)
            if largest >= rows * cols:
                raise PruneAuditError(
                    f"{at}: grid index {largest} is outside the {rows}x{cols} token grid of "
                    f"{line.image} under {vlm.model_id}; check --geometry / --model"
                )
            if stage.layer >= vlm.num_layers:
                raise PruneAuditError(
                    f"{at}: layer {stage.layer} is outside the model's {vlm.num_layers} decoder layers"
                )
            problem = visual_tokens_problem(stage.fed, prepared[line.image].num_visual)
            if problem is not None:
                raise PruneAuditError(f'{at}: "tokens" claims {problem} under {vlm.model_id}')
            if reanswer and stage.merged:
                raise PruneAuditError(
                    f"{at}: merged tokens cannot be forced on the model; import without --model "
                    f"to audit them with the file's answers"
                )
        if reanswer and line.stages and line.stages[0].layer < 0:
            raise PruneAuditError(
                f"{line.line}: cuts inside the vision tower (negative layers) cannot be forced on the model; "
                f"import without --model"
            )
        if reanswer and len(line.stages) > 1 and line.stages[0].layer == 0:
            raise PruneAuditError(
                f"{line.line}: a stage at layer 0 followed by in-LLM stages cannot be forced; import without --model"
            )
    _check_budget(kept_sets, vlm.num_layers, {image: item.num_visual for image, item in prepared.items()})


def _check_budget(kept_sets: KeptSets, num_layers: int, num_visual: dict[str, int]) -> None:
    """The header's budget is at most each image's visual tokens and near what the kept sets realise
    (``records.consistency.budget_problem``)."""
    from prune_audit.compute.budget import budget_share, tokens_for_share

    budget = kept_sets.header.get("budget")
    if budget is None:
        return
    share = budget_share(budget)
    expected, realised = [], []
    for line in kept_sets.questions:
        tokens = num_visual[line.image]
        if share is None and budget > tokens:
            raise PruneAuditError(
                f'{kept_sets.path} line 1 (header): "budget" {budget} is more than the '
                f"{tokens} visual tokens of {line.image}; give the budget the pruner ran at"
            )
        expected.append(tokens_for_share(share, tokens) if share is not None else budget)
        per_layer = tokens_per_layer(line, tokens, num_layers)
        realised.append(sum(per_layer) / len(per_layer))
    problem = budget_problem(budget, sum(expected) / len(expected), sum(realised) / len(realised))
    if problem is not None:
        raise PruneAuditError(f"{kept_sets.path} line 1 (header): {problem}; give the budget the pruner ran at")


def tokens_per_layer(line: KeptQuestion, num_visual: int, num_layers: int) -> list[int]:
    """The visual tokens at the input of each decoder layer under the line's stages."""
    per_layer = [num_visual] * num_layers
    for stage in line.stages:
        for layer in range(max(stage.layer, 0), num_layers):  # a vision-tower cut (< 0) reaches layer 0
            per_layer[layer] = stage.fed
    return per_layer


def check_answers(kept_sets: KeptSets, task: Task, questions: Sequence[TaskQuestion]) -> None:
    """Every line's answer holds what its question's answer mode needs (``_reduction``), checked before writing."""
    by_key = {(q.split, q.question_id): q for q in questions}
    for line in kept_sets.questions:
        _reduction(line, task.answer_mode(by_key[(line.split, line.question_id)]))


def imported_selector(kept_sets: KeptSets, file_sha256: str, reanswer: bool) -> dict[str, Any]:
    """The manifest's ``selector`` block: the file's selector (stage inferred from its layers when not given)
    and ``imported``: the file's name, sha256, format version and where the answers come from."""
    selector = dict(kept_sets.header["selector"])
    in_llm = any(stage.layer > 0 for line in kept_sets.questions for stage in line.stages)
    if selector["name"] != "none" and selector.get("stage") is None:
        selector["stage"] = "llm" if in_llm else "input"
    # an in-LLM selector may keep at the input alone: its own tower stage held the budget, no decoder stage was due
    tower_only = selector.get("stage") == "llm" and not in_llm
    if selector["name"] != "none" and selector["stage"] != ("llm" if in_llm else "input") and not tower_only:
        raise PruneAuditError(
            f"{kept_sets.path} line 1 (header): selector stage {selector['stage']!r}, but the "
            f"kept sets are taken {'inside the decoder' if in_llm else 'at its input (layer 0)'}; "
            f"give the stage the pruner works at, or leave it out"
        )
    selector.setdefault("stage", None)
    selector.setdefault("options", {})
    selector["imported"] = {
        "file": kept_sets.path.name,
        "sha256": file_sha256,
        "format_version": kept_sets.header["version"],
        "answers": "model" if reanswer else "file",
    }
    if selector["name"] == "none" and (selector.get("stage") is not None or in_llm):
        raise PruneAuditError(
            f'{kept_sets.path} line 1 (header): the unpruned selector "none" has no stage and '
            f"keeps every token; name the pruner that made the kept sets"
        )
    if (selector["name"] == "none") != (kept_sets.header.get("budget") is None):
        raise PruneAuditError(
            f'{kept_sets.path} line 1 (header): "budget" must be null exactly for the unpruned '
            f'selector "none"; give the pruner\'s budget in visual tokens'
        )
    return selector


def check_imported_manifest(kept_sets: KeptSets, manifest: dict[str, Any]) -> None:
    """The manifest the import is about to write passes the check every reader applies (``read_manifest``)."""
    from prune_audit.records.manifest import manifest_problem

    problem = manifest_problem(manifest)
    if problem is not None:
        name, what = problem
        raise PruneAuditError(
            f"{kept_sets.path} line 1 (header): the run it makes would be refused by every reader "
            f"(manifest field {name!r} {what}); correct the header (docs/interchange.md)"
        )


# ----- answers ------------------------------------------------------------------------


def _reanswer(
    vlm: VisionLanguageModel, lines: Sequence[KeptQuestion], prepared: Sequence[Prepared], modes: Sequence[AnswerMode]
) -> list[Answer]:
    """The model's answers with each line's kept sets forced: rows grouped by how they are forced."""
    kinds = ["none" if not line.stages else "input" if line.stages[0].layer == 0 else "llm" for line in lines]
    by_row: dict[int, Answer] = {}
    for kind in ("none", "input", "llm"):
        rows = [row for row, row_kind in enumerate(kinds) if row_kind == kind]
        if not rows:
            continue
        forced_kept = [lines[row].stages[0].kept for row in rows] if kind == "input" else None
        forced_stages = (
            [[(stage.layer, stage.kept) for stage in lines[row].stages] for row in rows] if kind == "llm" else None
        )
        answers = answer_grouped(
            vlm,
            None,
            None,
            [prepared[row] for row in rows],
            [modes[row] for row in rows],
            forced_kept=forced_kept,
            forced_stages=forced_stages,
        )
        by_row.update(zip(rows, answers))
    return [by_row[row] for row in range(len(lines))]


def _answer_from_line(vlm: VisionLanguageModel, line: KeptQuestion, item: Prepared, mode: AnswerMode) -> Answer:
    """The line's answer with the token counts of its kept sets on ``item`` (the model's prompt) and its cost:
    the line's, else the analytic cost of the kept sets forced (no selector arithmetic)."""
    from prune_audit.compute.cost import PrefillCost
    from prune_audit.models.accounting import question_cost
    from prune_audit.models.answers import Answer

    per_layer = tokens_per_layer(line, item.num_visual, vlm.num_layers)
    parts = {part: math.nan for part in ("vision", "selection", "prefill")} | dict(line.latency_ms or {})
    answer = Answer(
        reduced=_reduction(line, mode),
        kept=line.stages[-1].kept if line.stages else list(range(item.num_visual)),
        kept_stages=[stage.kept for stage in line.stages],
        stage_layers=[stage.layer for stage in line.stages],
        tokens_per_layer=per_layer,
        visual_tokens_avg=sum(per_layer) / len(per_layer),
        prefill_tokens=item.input_ids.numel() - item.num_visual + per_layer[0],
        latency_ms=sum(parts.values()),
        merged_stages=[stage.merged for stage in line.stages],
        latency_parts=parts,
    )
    if line.cost is not None:
        numbers = {
            name: value if name == "flop_equivalent_tokens" else int(value)
            for name, value in line.cost.items()
            if name in COST_FIELDS
        }
        sources = line.cost.get(SIGNAL_SOURCES_FIELD)  # absent or null: not known
        answer.cost = PrefillCost(**numbers, signal_sources=None if sources is None else tuple(sources))
    else:
        answer.cost = question_cost(vlm, item, answer, None, None, None, forced=True)
    return answer


def _reduction(line: KeptQuestion, mode: AnswerMode) -> Reduction:
    """The answer mode's reduction from the line's answer (docs/interchange.md says which fields each needs)."""
    from prune_audit.answer_modes import (
        Generation,
        Greedy,
        LetterChoice,
        OptionLetters,
        YesNo,
    )

    answer = line.answer
    if isinstance(mode, OptionLetters):
        probs = answer.get("letter_probs")
        if probs is None or len(probs) != len(mode.letters):
            raise PruneAuditError(
                f'{line.line}: a multiple-choice answer needs "letter_probs", one per offered '
                f"letter ({len(mode.letters)})"
            )
        return _agreeing(line, LetterChoice.from_probabilities(tuple(probs), mode.letters))
    if isinstance(mode, Greedy):
        token_probs, stopped = answer.get("token_probs"), answer.get("stopped")
        summary = [answer.get(name) for name in GENERATION_SUMMARY]
        if isinstance(stopped, bool) and token_probs is not None:
            return _within(line, mode, Generation.from_token_probs(answer["text"].strip(), tuple(token_probs), stopped))
        if all(value is not None for value in summary):
            return _within(line, mode, Generation.from_summary(answer["text"].strip(), *summary))
        raise PruneAuditError(
            f'{line.line}: a generated answer needs "stopped" (true when it ended with '
            f'end-of-sequence) and "token_probs" (each generated token\'s probability) or '
            f'"sequence_probability", "mean_token_probability" and "answer_tokens"'
        )
    if "p_yes" in answer and "p_no" in answer:
        return _agreeing(line, YesNo.from_probabilities(answer["p_yes"], answer["p_no"]))
    text, probability = answer["text"].strip().lower(), answer.get("probability")
    if text not in ("yes", "no") or probability is None:
        raise PruneAuditError(
            f'{line.line}: a yes/no answer needs "p_yes" and "p_no", or "text" yes/no with its "probability"'
        )
    p_yes = probability if text == "yes" else 1 - probability
    return _agreeing(line, YesNo.from_probabilities(p_yes, 1 - p_yes))  # only the two-way probability is known


def _within(line: KeptQuestion, mode: Greedy, generation: Generation) -> Generation:
    """``generation``, of at most the task's ``max_new_tokens`` tokens (what a run could generate)."""
    if generation.answer_tokens > mode.max_new_tokens:
        raise PruneAuditError(
            f"{line.line}: answer of {generation.answer_tokens} tokens, but the task generates at "
            f'most {mode.max_new_tokens} (header "max_new_tokens"); give the header the limit '
            f"the answers were generated under"
        )
    return generation


def _agreeing(line: KeptQuestion, reduced: YesNo | LetterChoice) -> YesNo | LetterChoice:
    """``reduced``, whose answer (the most probable) is the line's answer text, as in a run's records."""
    if line.answer["text"].strip().lower() != reduced.answer.lower():
        raise PruneAuditError(
            f"{line.line}: answer text {line.answer['text']!r}, but its probabilities answer "
            f"{reduced.answer!r}; give the text and the probabilities the model gave"
        )
    return reduced


__all__ = [
    "ImportedAnswers",
    "check_answers",
    "check_imported_manifest",
    "check_kept_sets",
    "imported_selector",
    "plan_import",
    "restrict_questions",
    "tokens_per_layer",
]
