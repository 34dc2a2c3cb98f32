"""Multiple-choice video QA in the MVBench and Video-MME layouts, answered by the first token over the option
letters (as ScienceQA).

Prompts as lmms-eval builds them (EvolvingLMMs-Lab/lmms-eval 75571cfe, ``tasks/mvbench/utils.py``
``mvbench_doc_to_text`` with the sub-task yamls' ``post_prompt``, and ``tasks/videomme/utils.py``
``videomme_doc_to_text`` with ``videomme.yaml``'s default ``post_prompt``):

- MVBench: ``"Question:" + question + "\\nOption:\\n" + "(A) cand\\n(B) cand\\n..." + "Only give the best option.\\n"``;
- Video-MME: ``"Select the best answer to the following multiple-choice question based on the video and the
  subtitles. Respond with only the letter (A, B, C, or D) of the correct option.\\n" + question + "\\n" +
  "\\n".join(options) + "\\n" + "\\nAnswer with the option's letter from the given choices directly."`` (its
  wording names subtitles even without them, as lmms-eval's does).

lmms-eval generates up to 16 tokens and reads a letter from them; here the answer is the offered letter of highest
first-token probability and the confidence its probability renormalised over the offered letters (ScienceQA's
path), so no parsing decides an answer. Splits: an MVBench question's is its file's stem (its sub-task), a Video-MME
question's its ``duration`` (short / medium / long, which ``--split`` picks; ``videomme`` without one). The videos are folders of frames (``--images DIR``: ``x.mp4`` is read from
``DIR/x/``); MVBench names no image regions, so video_mc runs have no evidence (their clip columns hold the sampled
frames alone).

Released answers (``prune-audit score --task video_mc answers.jsonl --questions FILE``, LLaVA's ``question_id`` +
``text`` lines, MVBench or Video-MME files, Video-MME's Parquet too) are scored by lmms-eval's own letter rule of each
layout, which parses free text (``data.video_answers``: MVBench's ``mcq_acc``, accuracy over the answered questions;
Video-MME's ``extract_mcq_answer``, over all), per split and overall. Ids: an MVBench entry's index in its file (with
several files each answer line names its file's stem in ``split``), a Video-MME row's ``question_id`` ("001-1") or the
records' integer id (``export --answers``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from prune_audit.answer_modes import OptionLetters
from prune_audit.data.video_questions import MVBENCH, VIDEOMME_SPLITS, VideoChoiceQuestion, load_video_choice
from prune_audit.errors import PruneAuditError
from prune_audit.tasks.base import CONFIDENCE_METRICS, Scored
from prune_audit.tasks.clips import ClipTask
from prune_audit.tasks.registry import register_task
from prune_audit.tasks.scienceqa import ScienceQaTask

if TYPE_CHECKING:
    from prune_audit.answer_modes import LetterChoice
    from prune_audit.tasks.base import TaskQuestion

MVBENCH_POST_PROMPT = "Only give the best option.\n"
VIDEOMME_PRE_PROMPT = (
    "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
VIDEOMME_POST_PROMPT = "\nAnswer with the option's letter from the given choices directly."


def lmms_eval_prompt(question: VideoChoiceQuestion, post_prompt: str | None = None) -> str:
    """The question as lmms-eval's ``doc_to_text`` of its layout writes it (``post_prompt``: the layout's own for
    None)."""
    if question.layout == MVBENCH:
        options = "".join(f"({letter}) {option}\n" for letter, option in zip(question.letters, question.options))
        post = MVBENCH_POST_PROMPT if post_prompt is None else post_prompt
        return "Question:" + question.question + "\nOption:\n" + options + post
    post = VIDEOMME_POST_PROMPT if post_prompt is None else post_prompt
    return VIDEOMME_PRE_PROMPT + "\n" + question.question + "\n" + "\n".join(question.options) + "\n" + post


@register_task
class VideoMcTask(ClipTask):
    name = "video_mc"
    summary = "multiple-choice video QA (MVBench / Video-MME layouts, lmms-eval's prompts), answered by its letter"
    answer_mode_text = "the first token over the offered option letters"
    confidence_definition = "the chosen letter's first-token probability renormalised over the offered letters"
    correct_definition = "the chosen letter equals the answer letter (MVBench: the letter of the answer's candidate)"
    evidence_definition = "none: the question files name no image regions"
    evidence_noun = "the evidence regions (none for video_mc)"
    names_evidence = False
    splits = VIDEOMME_SPLITS  # Video-MME's durations; an MVBench question's split is its file's stem (its sub-task)
    parquet_layout = "lmms-eval/Video-MME (its question rows; the videos are not embedded: their frames in --images)"
    report_metrics = ("accuracy", "loyalty", *CONFIDENCE_METRICS)
    # ScienceQA's letter columns, shared (records.schema.tasks_columns): the same answer mode and meaning
    record_columns = ScienceQaTask.record_columns

    def read_questions(self, paths: Sequence[Path]) -> list[TaskQuestion]:
        return list(load_video_choice(paths))

    def load_questions(self, paths: Sequence[Path]) -> tuple[list[TaskQuestion], dict[str, bytes] | None]:
        """MVBench / Video-MME JSON lists, or Video-MME's Parquet rows (which embed no videos)."""
        return self.read_questions(paths), None

    def prompt_text(self, question: TaskQuestion, declared: Mapping[str, str] | None = None) -> str:
        """lmms-eval's text of the question's layout; a checkpoint's declared instruction replaces its post_prompt."""
        assert isinstance(question, VideoChoiceQuestion)
        return lmms_eval_prompt(question, (declared or {}).get(self.name))

    def answer_mode(self, question: TaskQuestion) -> OptionLetters:
        assert isinstance(question, VideoChoiceQuestion)
        return OptionLetters(question.letters)

    def score(self, question: TaskQuestion, choice: LetterChoice) -> Scored:
        assert isinstance(question, VideoChoiceQuestion)
        columns: dict[str, Any] = {"letter_probs": list(choice.letter_probs), "options_offered": len(question.options)}
        return Scored(choice.answer, (question.answer,), choice.answer == question.answer, choice.confidence, columns)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """A LLaVA answers file scored by lmms-eval's letter rule of each question's layout (MVBench's ``mcq_acc``,
        Video-MME's ``extract_characters_regex``: ``data.video_answers``), per split and overall; Video-MME's
        Parquet rows read without their videos."""
        from prune_audit.data.video_answers import score_video_choice_answers

        return score_video_choice_answers(answers, question_files, load_video_choice(question_files))

    def load_evidence(self, path: Path, questions: Sequence[TaskQuestion]) -> NoReturn:
        raise PruneAuditError(
            "MVBench and Video-MME name no image regions, so video_mc runs have no evidence: drop --annotations"
        )


__all__ = ["VideoMcTask", "lmms_eval_prompt"]
