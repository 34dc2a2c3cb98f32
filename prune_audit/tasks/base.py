"""The task seam: what a kind of question is, independent of the model and the selector.

A :class:`Task` says how its question files are read (validated before anything is
written), the prompt, how the model answers (an answer mode of ``prune_audit.answer_modes``), how
an answer is scored, what its confidence is, which image region is its evidence (for
retention and lost objects) and which metrics its report shows. The runner, the record
builder and the analyses ask the run's task; none of them knows a task by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pyarrow as pa

from prune_audit.answer_modes import Greedy, check_max_new_tokens
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import Column, column
from prune_audit.tasks.prompts import compose_prompt

if TYPE_CHECKING:
    from prune_audit.answer_modes import AnswerMode, Reduction
    from prune_audit.data.boxes import Box
    from prune_audit.data.geometry import TokenGeometry
    from prune_audit.data.lmms_parquet import ParquetQuestions
    from prune_audit.data.retention import ObjectArea


LOGIT_LIMIT = 50.0
"""Bound of the top-label logit (``Task.binary_view``): sigmoid(50) is 1 - 2e-22, 1.0 in float64."""

GENERATED_CONFIDENCES = {
    "sequence": "the product of the generated tokens' probabilities (sequence_prob)",
    "mean-token": "the geometric mean of the generated tokens' probabilities, length-normalised (mean_token_prob)",
}
"""``--confidence`` choice -> its definition, for the tasks that generate their answers (``Task.confidences``)."""

GENERATED_COLUMNS: tuple[Column, ...] = (
    column(
        "sequence_prob",
        pa.float64(),
        "probability of the whole generated answer: the product of its tokens' full-vocabulary probabilities",
    ),
    column(
        "mean_token_prob",
        pa.float64(),
        "the length-normalised form: geometric mean of the generated tokens' probabilities (1.0 for an empty answer)",
    ),
    column("answer_tokens", pa.int64(), "tokens generated, the end-of-sequence token excluded"),
    column("stopped", pa.bool_(), "generation ended with an end-of-sequence token (false: cut at max_new_tokens)"),
)
"""The record columns every task that generates its answers shares (``Task.generates``), defined once here; the
run schema places them before the first generating task's own columns (``records.schema.run_columns``)."""


class TaskQuestion(Protocol):
    """What the runner reads of any task's question: its key, its image and its prompt text.

    ``(split, question_id)`` keys the records (``records.schema.KEY_COLUMNS``); ``image`` is the
    file name under ``--images``; ``text`` the question as its file gives it (``Task.prompt_text`` adds the
    task's instruction).
    """

    @property
    def question_id(self) -> int: ...

    @property
    def split(self) -> str: ...

    @property
    def image(self) -> str: ...

    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class Scored:
    """One answered question, scored by its task.

    Attributes:
        answer_text: the model's answer as text (``answer_text`` column).
        references: the reference answers it is scored against (``references``).
        correct: the task's correctness rule (``correct``).
        confidence: the task's confidence definition (``confidence``).
        columns: the task's own record columns (``Task.record_columns``, plus ``GENERATED_COLUMNS`` when it
            generates), name -> value.
    """

    answer_text: str
    references: tuple[str, ...]
    correct: bool
    confidence: float
    columns: dict[str, Any]


@dataclass(frozen=True)
class FigureBoxes:
    """The boxes ``visualize --run`` draws over a recorded question (``Task.figure_boxes``), in image pixels.

    Attributes:
        evidence: (label, box) of each evidence box, framed like the evidence mask (TextVQA: each answer token's
            OCR box and its word; RefCOCO: the target box); an empty label writes none.
        answer: (label, box) of the model's answer box (RefCOCO: the predicted box and its IoU); None: none.
        note: words the figure's title adds (RefCOCO: "no box parsed" for an answer without a box).
    """

    evidence: tuple[tuple[str, Box], ...] = ()
    answer: tuple[str, Box] | None = None
    note: str = ""


class AnsweringModel(Protocol):
    """What a task may read of the model that answers its questions (``Task.use_model``): the family's declarations,
    never its weights. ``models.VisionLanguageModel`` is one."""

    display_name: str
    grounding: str | None
    """The family's box convention for grounding answers (``data.boxes.BOX_CONVENTIONS``); None: it has none."""

    def token_geometry(self, image_size: tuple[int, int]) -> Any:
        """The token geometry of an image of ``image_size`` (width, height) under the model's processor."""
        ...


class Evidence(Protocol):
    """The evidence regions of a run's questions, read from its ``--annotations`` file."""

    def image_id(self, image: str) -> int:
        """The image's id in the annotations (the exchangeable unit of bootstrap and conformal splits)."""
        ...

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        """Refuse an image whose (width, height) is not the annotated one."""
        ...

    def area(self, question: Any, image_id: int, geometry: TokenGeometry) -> ObjectArea | None:
        """The question's evidence region under ``geometry``; None when it has none."""
        ...

    def objects(self, question: Any, image_id: int, geometry: TokenGeometry) -> list[tuple[str, ObjectArea]]:
        """Each object of the evidence region on its own, (name, area), for the per-object lost column."""
        ...

    def record_mask(self, record: dict[str, Any]) -> np.ndarray | None:
        """A recorded question's evidence region in image pixels, (height, width) bool, from its record (``image``,
        ``image_id``, ``evidence_objects`` and the task's own columns; ``visualize --run`` draws it); None when the
        question has none."""
        ...


class Task(ABC):
    """One kind of question (POPE yes/no, short answers, multiple choice, captions).

    Class attributes:
        name: the registry name (``run --task NAME``).
        summary: one line for ``--help`` and docs/tasks.md.
        answer_mode_text: how the model answers, in words.
        confidence_definition: what the ``confidence`` column holds, in words (every ``--confidence`` form).
        correct_definition: what the ``correct`` column holds, in words.
        evidence_definition: which image region counts as the question's evidence, in words.
        evidence_noun: the evidence regions as the run summary names them.
        evidence_label: the evidence region as the legend of ``visualize --run``'s figure names its outline.
        evidence_fate: the questions whose evidence the retention figure and tables follow, and by what, in words
            (POPE: "'yes' questions by the fate of the queried object"); empty for a task without evidence.
        names_evidence: whether its questions name image regions at all (``--annotations``).
        evidence_questions: the questions whose evidence ``lost`` counts, as a plural noun for figure labels
            (POPE: "yes-questions"); empty for a task without evidence.
        instruction: the text its official evaluation puts after the question (LLaVA-1.5's question files,
            lmms-eval's ``post_prompt``), composed once by ``prompt_text``; empty: none.
        splits: the values ``--split`` may take besides ``all`` (empty: the task has no splits).
        report_metrics: names of the metrics (``analysis.metric_table``) its reports show; POPE's answer scores
            (precision, recall, F1, yes ratio) need a yes/no answer.
        default_max_new_tokens: the generation limit of a task that answers by greedy decoding (``--max-new-tokens``
            overrides it); None for a task answered by its first token.
        confidences: the confidence definitions a generating task offers (``--confidence``), the default first:
            ``sequence`` (the product of the tokens' probabilities) and ``mean-token`` (their geometric mean).
        record_columns: the task's own record columns, in schema order (``record_columns.Column``, without
            ``tasks``): only its rows hold them, and ``score`` returns exactly these (``Scored.columns``). A task
            that generates also holds ``GENERATED_COLUMNS``. The run schema is assembled from every registered
            task's columns (``records.schema.run_columns``), so a plug-in task declares its own here.
    """

    default_max_new_tokens: ClassVar[int | None] = None
    confidences: ClassVar[tuple[str, ...]] = ()
    record_columns: ClassVar[tuple[Column, ...]] = ()

    @classmethod
    def generates(cls) -> bool:
        """Whether the task answers by greedy decoding (it has a generation limit), so that its rows hold
        ``GENERATED_COLUMNS``."""
        return cls.default_max_new_tokens is not None

    def __init__(self, max_new_tokens: int | None = None, confidence: str | None = None) -> None:
        if confidence is not None and confidence not in self.confidences:
            offered = (
                f"choose {' or '.join(self.confidences)}" if self.confidences else "it has one definition: drop it"
            )
            raise PruneAuditError(f"--confidence {confidence!r} does not apply to task {self.name}; {offered}")
        self.confidence = confidence or (self.confidences[0] if self.confidences else None)
        if max_new_tokens is not None:
            if self.default_max_new_tokens is None:
                raise PruneAuditError(
                    f"--max-new-tokens applies to tasks that generate their answers; {self.name} "
                    f"answers by its first token: drop it"
                )
            check_max_new_tokens(max_new_tokens, "--max-new-tokens")
        self.max_new_tokens = max_new_tokens if max_new_tokens is not None else self.default_max_new_tokens

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    answer_mode_text: ClassVar[str] = ""
    confidence_definition: ClassVar[str] = ""
    correct_definition: ClassVar[str] = ""
    evidence_definition: ClassVar[str] = ""
    evidence_noun: ClassVar[str] = "the evidence regions"
    evidence_label: ClassVar[str] = "evidence region"
    evidence_fate: ClassVar[str] = ""
    evidence_questions: ClassVar[str] = ""
    names_evidence: ClassVar[bool] = True
    reads_clips: ClassVar[bool] = False
    """Whether the task's questions ask about video clips (``tasks.clips.ClipTask``): the run prepares them through
    the model's video path and their records hold ``tasks.clips.CLIP_COLUMNS``."""
    """Whether the task's questions name image regions (``load_evidence``); ScienceQA's do not: its figures and tables
    leave retention and lost objects out."""
    instruction: ClassVar[str] = ""
    splits: ClassVar[tuple[str, ...]] = ()
    report_metrics: ClassVar[tuple[str, ...]] = ()

    def prompt_text(self, question: TaskQuestion, declared: Mapping[str, str] | None = None) -> str:
        """The question as the model is asked it, before the model's conversation wrapper: its text and the task's
        instruction, composed once (``tasks.prompts.compose_prompt``: never repeated, never after another).
        ``declared``: the instructions a checkpoint's own evaluation asks by task name (``vlm.task_instructions``),
        which replace the task's where they name it."""
        instruction = (declared or {}).get(self.name, self.instruction)
        return compose_prompt(question.text, instruction, f"question {question.split}/{question.question_id}")

    def use_model(self, model: AnsweringModel) -> None:
        """Take the facts of the model that will answer (its family's conventions), before any prompt is composed or
        answer scored; a family the task cannot ask is refused in one line. Most tasks ask every family alike and
        need none; the grounding task asks for and reads boxes in the family's own convention."""

    def confidence_in_use(self) -> str:
        """What the ``confidence`` column holds in this task's runs under its ``--confidence`` choice
        (calibration.json's conventions)."""
        if self.confidence is None:
            return self.confidence_definition
        return f"--confidence {self.confidence}: {GENERATED_CONFIDENCES[self.confidence]}"

    @abstractmethod
    def read_questions(self, paths: Sequence[Path]) -> list[TaskQuestion]:
        """Every question of the run's question files (``--pope`` / ``--questions``, in the order given),
        validated; a PruneAuditError naming file and entry otherwise. Files another file refers to are
        read together (GQA: LLaVA's question file and GQA's question JSON). A question id may appear once over
        all the files (``data.question_ids.note_question``: the same file twice would count each question twice)."""

    parquet_layout: ClassVar[str | None] = None
    """The lmms-eval dataset whose Parquet files (questions plus embedded images) the task reads; None: none."""

    def read_parquet(self, paths: Sequence[Path]) -> ParquetQuestions[TaskQuestion]:
        """Every question of ``parquet_layout``'s Parquet files, validated, with the image bytes they embed (a task
        with a ``parquet_layout`` overrides it; ``parquet_inputs`` refuses Parquet files for the others)."""
        raise NotImplementedError(f"task {self.name} declares parquet_layout but does not read it")

    def load_questions(self, paths: Sequence[Path]) -> tuple[list[TaskQuestion], dict[str, bytes] | None]:
        """The questions of the run's question files and, for Parquet files (``.parquet``: ``read_parquet``), the
        images they embed by name (None for the task's own files, whose images lie in ``--images``)."""
        if not self.parquet_inputs(paths):
            return self.read_questions(paths), None
        loaded = self.read_parquet(paths)
        return loaded.questions, loaded.images

    def parquet_inputs(self, paths: Sequence[Path]) -> bool:
        """Whether ``paths`` are Parquet files (``.parquet``) rather than the task's own question files; a mix, or
        Parquet files for a task without ``parquet_layout``, is refused."""
        parquet = [path for path in paths if Path(path).suffix == ".parquet"]
        if parquet and self.parquet_layout is None:
            raise PruneAuditError(
                f"task {self.name} reads no Parquet question files; pass its own question files (docs/tasks.md)"
            )
        if parquet and len(parquet) != len(paths):
            raise PruneAuditError(
                "pass either Parquet question files (images embedded) or the task's own question files, not both"
            )
        return bool(parquet)

    def check_questions(self, questions: Sequence[TaskQuestion]) -> None:
        """Refuse a question list the task cannot score (for instance, questions without references)."""

    @abstractmethod
    def answer_mode(self, question: TaskQuestion) -> AnswerMode:
        """How the model answers ``question``."""

    @abstractmethod
    def score(self, question: TaskQuestion, reduced: Reduction) -> Scored:
        """The answer text, references, correctness, confidence and the task's own columns of the model's
        answer, ``reduced`` in the question's answer mode."""

    answer_subsets: ClassVar[dict[str, str]] = {}
    """The question subsets ``score --subset NAME`` scores alone, each with what it holds (none: every question)."""

    @abstractmethod
    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """Score a released answers file (LLaVA's ``question_id`` + ``text`` lines) against the task's question
        files as its official evaluation does (``prune-audit score``): the report's summary numbers and
        ``per_question`` rows; ``subset``, one of ``answer_subsets``, scores that subset's questions alone."""

    def image_id(self, question: TaskQuestion) -> int | None:
        """The question's image id without annotations (None: the task needs ``--annotations`` for it)."""
        return None

    @abstractmethod
    def load_evidence(self, path: Path, questions: Sequence[TaskQuestion]) -> Evidence:
        """The ``--annotations`` file as evidence regions, every question's evidence checked to exist in it."""

    def question_evidence(self, questions: Sequence[TaskQuestion]) -> Evidence | None:
        """The evidence regions the questions carry themselves, for a run without ``--annotations`` (lmms-lab's
        RefCOCO rows hold the referred object's polygon); None, the default: the questions name regions only an
        annotations file draws."""
        return None

    def figure_boxes(self, record: dict[str, Any], evidence: Evidence | None) -> FigureBoxes:
        """The boxes ``visualize --run`` draws over a recorded question, from its record and, when the run had
        ``--annotations``, its ``evidence``; default none (the evidence mask alone is drawn)."""
        return FigureBoxes()

    required_columns: ClassVar[tuple[str, ...]] = ()
    """The task's own record columns the analyses read (each must hold a value in every row)."""

    def binary_view(self, records: pa.Table, source: str) -> dict[str, Any]:
        """The records as the analyses (``analysis.questions.QuestionTable``) read them: four (n,) arrays,
        ``label_yes`` and ``answer_yes`` (bool), ``p_yes`` (float64) and ``logit_diff`` (its logit), plus
        ``answer`` ((n,) str, compared across runs) and ``top_label`` (bool).

        This default serves a task without a yes/no answer: the event is "the answer is correct" at probability
        ``confidence`` (``label_yes`` = correct, ``answer_yes`` all true, ``p_yes`` = confidence, its logit clipped
        to +-LOGIT_LIMIT so that a confidence of exactly 0 or 1 stays finite), ``top_label`` true. Brier and NLL
        are then those of the top-label confidence, and temperature scaling rescales its logit.
        """
        correct = records["correct"].to_numpy(zero_copy_only=False).astype(bool)
        confidence = records["confidence"].to_numpy().astype(np.float64)
        with np.errstate(divide="ignore"):
            logit = np.clip(np.log(confidence) - np.log1p(-confidence), -LOGIT_LIMIT, LOGIT_LIMIT)
        return {
            "label_yes": correct,
            "answer_yes": np.ones_like(correct),
            "p_yes": confidence,
            "logit_diff": logit,
            "answer": self.comparable_answers(records),
            "top_label": True,
        }

    reference_comparison_meanings: ClassVar[dict[str, str]] = {}
    """Name -> meaning of each number of ``reference_comparison`` (written into calibration.json)."""

    def reference_comparison(self, records: pa.Table, reference: pa.Table) -> dict[str, float | int] | None:
        """The task's own comparison of a run's records with a reference run's on the same questions (``calibrate
        --reference``; a study's pruned runs against its dense run), name -> value as declared in
        ``reference_comparison_meanings``; None for a task without one."""
        return None

    def summary_rows(self, records: pa.Table) -> list[tuple[str, str]]:
        """The task's own lines of the run summary (name, formatted value), after the common ones."""
        return []

    def comparable_answers(self, records: pa.Table) -> np.ndarray:
        """(n,) str: each answer as two runs' answers are compared (default ``answer_text`` as generated)."""
        return records["answer_text"].to_numpy(zero_copy_only=False).astype(str)


class GeneratingTask(Task):
    """A task the model answers by greedy decoding up to ``max_new_tokens`` (``default_max_new_tokens`` set)."""

    def answer_mode(self, question: TaskQuestion) -> Greedy:
        return Greedy(int(self.max_new_tokens))  # type: ignore[arg-type]  # set: the class declares a default


CONFIDENCE_METRICS = ("ece", "ece_mass", "mce", "ce_debiased_l2", "brier", "nll", "auroc", "aurc")
"""The calibration and selective-prediction metrics every built-in task reports after its answer metrics
(``report_metrics``)."""


__all__ = [
    "CONFIDENCE_METRICS",
    "GeneratingTask",
    "GENERATED_COLUMNS",
    "GENERATED_CONFIDENCES",
    "AnsweringModel",
    "Evidence",
    "FigureBoxes",
    "Scored",
    "Task",
    "TaskQuestion",
]
