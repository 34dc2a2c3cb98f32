"""``prune-audit import``: a kept-set file (``records.interchange``) as the answers of a run.

Planning (``runner.plan``) restricts the run to the file's questions, checks every kept set against
the model's token grid and depth, and records the import in the manifest's ``selector`` block; then
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
from prune_audit.records.interchange import GENERATION_SUMMARY, KeptQuestion, KeptSets

if TYPE_CHECKING:
    from prune_audit.answer_modes import AnswerMode, Reduction
    from prune_audit.models import Answer, Prepared, VisionLanguageModel
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


def restrict_questions(kept_sets: KeptSets, questions: Sequence[TaskQuestion]) -> list[TaskQuestion]:
    """The planned questions the file answers, in the question files' order; a question of the file that the
    question files lack, or another image than theirs, is refused naming its line."""
    planned = {(q.split, q.question_id): q for q in questions}
    for line in kept_sets.questions:
        question = planned.get((line.split, line.question_id))
        if question is None:
            raise PruneAuditError(f"{line.line}: question {line.split}/{line.question_id} is not in the question "
                                  f"files; pass the files it was asked from (--pope / --questions)")
        if question.image != line.image:
            raise PruneAuditError(f"{line.line}: image {line.image!r}, but the question files ask question "
                                  f"{line.split}/{line.question_id} about {question.image!r}")
    keys = {(line.split, line.question_id) for line in kept_sets.questions}
    return [q for q in questions if (q.split, q.question_id) in keys]


def check_kept_sets(kept_sets: KeptSets, vlm: VisionLanguageModel, grids: dict[str, tuple[int, int]],
                    reanswer: bool) -> None:
    """Every stage's indices lie on its image's token grid and every layer in the model; re-answering also needs
    kept sets the model can be forced to (no merged tokens)."""
    for line in kept_sets.questions:
        rows, cols = grids[line.image]
        for number, stage in enumerate(line.stages):
            at = f"{line.line}: stage {number}"
            largest = max([*stage.kept, *(i for sources in stage.merged for i in sources)], default=-1)
            if largest >= rows * cols:
                raise PruneAuditError(f"{at}: grid index {largest} is outside the {rows}x{cols} token grid of "
                                      f"{line.image} under {vlm.model_id}; check --geometry / --model")
            if stage.layer >= vlm.num_layers:
                raise PruneAuditError(f"{at}: layer {stage.layer} is outside the model's {vlm.num_layers} decoder "
                                      f"layers")
            if reanswer and stage.merged:
                raise PruneAuditError(f"{at}: merged tokens cannot be forced on the model; import without --model "
                                      f"to audit them with the file's answers")
        if reanswer and len(line.stages) > 1 and line.stages[0].layer == 0:
            raise PruneAuditError(f"{line.line}: a stage at layer 0 followed by in-LLM stages cannot be forced; "
                                  f"import without --model")


def check_answers(kept_sets: KeptSets, task: Task, questions: Sequence[TaskQuestion]) -> None:
    """Every line's answer holds what its question's answer mode needs (``_reduction``), checked before writing."""
    by_key = {(q.split, q.question_id): q for q in questions}
    for line in kept_sets.questions:
        _reduction(line, task.answer_mode(by_key[(line.split, line.question_id)]))


def imported_selector(kept_sets: KeptSets, file_sha256: str, reanswer: bool) -> dict[str, Any]:
    """The manifest's ``selector`` block: the file's selector (stage inferred from its layers when not given)
    and ``imported``: the file's name, sha256, format version and where the answers come from."""
    selector = dict(kept_sets.header["selector"])
    if selector["name"] != "none" and selector.get("stage") not in ("input", "llm"):
        in_llm = any(stage.layer > 0 for line in kept_sets.questions for stage in line.stages)
        selector["stage"] = "llm" if in_llm else "input"
    selector.setdefault("stage", None)
    selector.setdefault("options", {})
    selector["imported"] = {"file": kept_sets.path.name, "sha256": file_sha256, "format_version": kept_sets.header["version"],
                            "answers": "model" if reanswer else "file"}
    if (selector["name"] == "none") != (kept_sets.header.get("budget") is None):
        raise PruneAuditError(f"{kept_sets.path} line 1 (header): \"budget\" must be null exactly for the unpruned "
                              f"selector \"none\"; give the pruner's budget in visual tokens")
    return selector


# ----- answers ------------------------------------------------------------------------


def _reanswer(vlm: VisionLanguageModel, lines: Sequence[KeptQuestion], prepared: Sequence[Prepared],
              modes: Sequence[AnswerMode]) -> list[Answer]:
    """The model's answers with each line's kept sets forced: rows grouped by how they are forced."""
    from prune_audit.runner.execute import answer_grouped

    kinds = ["none" if not line.stages else "input" if line.stages[0].layer == 0 else "llm" for line in lines]
    by_row: dict[int, Answer] = {}
    for kind in ("none", "input", "llm"):
        rows = [row for row, row_kind in enumerate(kinds) if row_kind == kind]
        if not rows:
            continue
        forced_kept = [lines[row].stages[0].kept for row in rows] if kind == "input" else None
        forced_stages = ([[(stage.layer, stage.kept) for stage in lines[row].stages] for row in rows]
                         if kind == "llm" else None)
        answers = answer_grouped(vlm, None, None, [prepared[row] for row in rows], [modes[row] for row in rows],
                                 forced_kept=forced_kept, forced_stages=forced_stages)
        by_row.update(zip(rows, answers))
    return [by_row[row] for row in range(len(lines))]


def _answer_from_line(vlm: VisionLanguageModel, line: KeptQuestion, item: Prepared, mode: AnswerMode) -> Answer:
    """The line's answer with the token counts of its kept sets on ``item`` (the model's prompt) and its cost:
    the line's, else the analytic cost of the kept sets forced (no selector arithmetic)."""
    from prune_audit.compute.cost import PrefillCost
    from prune_audit.models.accounting import question_cost
    from prune_audit.models.answers import Answer

    per_layer = [item.num_visual] * vlm.num_layers
    for stage in line.stages:
        for layer in range(stage.layer, vlm.num_layers):
            per_layer[layer] = stage.fed
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
        answer.cost = PrefillCost(**{name: value if name == "flop_equivalent_tokens" else int(value)
                                     for name, value in line.cost.items()})
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
            raise PruneAuditError(f"{line.line}: a multiple-choice answer needs \"letter_probs\", one per offered "
                                  f"letter ({len(mode.letters)})")
        return LetterChoice.from_probabilities(tuple(probs), mode.letters)
    if isinstance(mode, Greedy):
        token_probs, stopped = answer.get("token_probs"), answer.get("stopped")
        summary = [answer.get(name) for name in GENERATION_SUMMARY]
        if isinstance(stopped, bool) and token_probs is not None:
            return Generation.from_token_probs(answer["text"].strip(), tuple(token_probs), stopped)
        if all(value is not None for value in summary):
            return Generation.from_summary(answer["text"].strip(), *summary)
        raise PruneAuditError(f"{line.line}: a generated answer needs \"stopped\" (true when it ended with "
                              f"end-of-sequence) and \"token_probs\" (each generated token's probability) or "
                              f"\"sequence_probability\", \"mean_token_probability\" and \"answer_tokens\"")
    if "p_yes" in answer and "p_no" in answer:
        return YesNo.from_probabilities(answer["p_yes"], answer["p_no"])
    text, probability = answer["text"].strip().lower(), answer.get("probability")
    if text not in ("yes", "no") or probability is None:
        raise PruneAuditError(f"{line.line}: a yes/no answer needs \"p_yes\" and \"p_no\", or \"text\" yes/no with "
                              f"its \"probability\"")
    p_yes = probability if text == "yes" else 1 - probability
    return YesNo.from_probabilities(p_yes, 1 - p_yes)  # only the two-way probability is known




def export_run(run_dir: Path, out: Path) -> int:
    """Write the kept sets and answers of the run in ``run_dir`` to ``out`` (.jsonl or .parquet); the number of
    questions. ``out`` may be new or a kept-set file (``export`` rewrites only its own kind of file)."""
    from prune_audit.records.interchange import (
        check_suffix,
        header_of,
        is_kept_set_file,
        question_line,
        write_kept_sets,
    )
    from prune_audit.records.store import read_run

    check_suffix(out, "--out")
    manifest, records = read_run(Path(run_dir))  # the input first: a mistyped run is named as such
    if out.exists() and not (out.is_file() and is_kept_set_file(out)):
        raise PruneAuditError(f"--out {out} exists and is not a kept-set file; export never replaces other files: "
                              f"pass a new file name")
    write_kept_sets(header_of(manifest), [question_line(record) for record in records.to_pylist()], out)
    return records.num_rows


__all__ = ["ImportedAnswers", "check_answers", "check_kept_sets", "export_run", "imported_selector", "restrict_questions"]
