"""Temporal presence: "Is there a {category} at the beginning of the video?" (or at the end, or in the video),
answered yes/no by the first token and scored as POPE.

Question file: a JSON list of ``{"question_id", "video", "question", "answer": "yes" | "no", "category",
"window": [first, last] | null}`` (``data.video_questions.load_presence``; the window in the clip's frames as
stored, inclusive; null: the whole clip), the instruction POPE's (LLaVA's short-answer line) after the question.
Evidence (``--annotations``): object tracks in the YouTube-VIS layout (``data.youtube_vis``), the asked category's
union mask in each sampled frame, whatever the label: a "no, not at the beginning" object may be there later.
The records hold POPE's answer columns (shared, ``records.schema.tasks_columns``), so every POPE analysis reads
them, and the clip columns (``tasks.clips.CLIP_COLUMNS``): per-frame retention, the window, ``lost_in_window``.
Released answers (``prune-audit score --task video_presence answers.jsonl --questions FILE``) are scored by POPE's
evaluate.py as ``pope score`` scores them: LLaVA's ``question_id`` + ``text`` lines matched by id, POPE's ``answer``
lines by order, free text read as no when its first sentence holds "no", "No" or "not".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.answer_modes import YES_NO
from prune_audit.data.video_questions import PresenceQuestion, load_presence
from prune_audit.errors import PruneAuditError
from prune_audit.tasks.base import Scored
from prune_audit.tasks.clips import ClipTask, TrackEvidence
from prune_audit.tasks.pope import PopeTask, yes_no_scored
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import AnswerMode, YesNo
    from prune_audit.data.clip_retention import Window
    from prune_audit.tasks.base import TaskQuestion


@register_task
class VideoPresenceTask(ClipTask):
    name = "video_presence"
    summary = "temporal presence yes/no (Is there a <object> at the beginning / end of the video?), scored as POPE"
    answer_mode_text = PopeTask.answer_mode_text
    confidence_definition = PopeTask.confidence_definition
    correct_definition = PopeTask.correct_definition
    evidence_definition = (
        "the asked category's per-frame masks from object tracks (YouTube-VIS layout), over every sampled frame; "
        "the window's frames give window_retention and lost_in_window"
    )
    evidence_noun = "the asked objects"
    evidence_label = "asked object"
    evidence_fate = "questions by the fate of the asked object over the clip"
    evidence_questions = "questions"
    instruction = PopeTask.instruction
    report_metrics = PopeTask.report_metrics
    # POPE's answer columns, shared (records.schema.tasks_columns): the same yes/no reduction and meaning
    record_columns = PopeTask.record_columns
    required_columns = PopeTask.required_columns
    binary_view = PopeTask.binary_view

    def read_questions(self, paths: Sequence[Path]) -> list[TaskQuestion]:
        return [replace(question, split=self.name) for question in load_presence(paths)]

    def load_questions(self, paths: Sequence[Path]) -> tuple[list[TaskQuestion], dict[str, bytes] | None]:
        if any(Path(path).suffix == ".parquet" for path in paths):
            raise PruneAuditError("video_presence reads JSON question lists, not Parquet; pass its JSON file")
        return self.read_questions(paths), None

    def clip_window(self, question: Any) -> Window | None:
        return question.window

    def answer_mode(self, question: TaskQuestion) -> AnswerMode:
        return YES_NO

    def score(self, question: TaskQuestion, reduced: YesNo) -> Scored:
        assert isinstance(question, PresenceQuestion)
        return yes_no_scored(question.category, question.label, reduced)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """POPE's evaluate.py (``prune-audit pope score``'s report) over the questions' labels, one split (the
        task's): LLaVA's answers (``question_id`` + ``text``) matched by id, POPE's (``answer``) by order."""
        from prune_audit.data.pope import PopeQuestion
        from prune_audit.data.pope_score import score_files

        questions = []
        for question in self.load_questions(question_files)[0]:
            assert isinstance(question, PresenceQuestion)
            fields = (question.question_id, question.split, question.image, question.text, question.label)
            questions.append(PopeQuestion(*fields, object=question.category))
        return score_files(answers, list(question_files), questions)

    def load_evidence(self, path: Path, questions: Sequence[TaskQuestion]) -> TrackEvidence:
        """The tracks file, every question's video and category checked to be in it."""
        from prune_audit.data.youtube_vis import VideoTracks

        tracks = VideoTracks.load(path)
        for question in questions:
            assert isinstance(question, PresenceQuestion)
            tracks.video_id(question.image)
            if question.category not in tracks.frames.category_ids:
                raise PruneAuditError(
                    f"question {question.split}/{question.question_id} asks about {question.category!r}, which is no "
                    f"category of {path}; pass the matching --annotations file"
                )
        return TrackEvidence(tracks, lambda question: question.category)


__all__ = ["VideoPresenceTask"]
