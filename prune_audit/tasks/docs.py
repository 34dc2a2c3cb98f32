"""Generate docs/tasks.md from the registered tasks: ``python -m prune_audit.tasks.docs [PATH]``."""

from __future__ import annotations

import sys
from pathlib import Path

from prune_audit.tasks.base import Task
from prune_audit.tasks.registry import get_task, list_tasks

DOC_PATH = Path("docs") / "tasks.md"

INTRO = """# Tasks (`prune-audit run --task NAME`)

<!-- generated from the task classes in prune_audit/tasks by `python -m prune_audit.tasks.docs`; do not edit -->

A task is the kind of question a run audits. Pruning, token geometry and retention do not depend on it;
the task says how its question files are read (every entry validated before anything is written), how
the model answers, how an answer is scored, what the `confidence` column holds, which image region is a
question's evidence (the `retention` and `lost` columns), and which metrics its report shows. The run's
manifest records the task (`task`, and `max_new_tokens` for tasks that generate); every later command
reads it from there. Every record holds the core columns (`task`, `answer_text`, `references`,
`confidence`, `correct`, the retention columns) and its task's own columns ([records.md](records.md)).

The prompt is composed once: the task owns its instruction (the text its official evaluation puts after the
question: LLaVA-1.5's question files and `model_vqa_science.py`, lmms-eval's `post_prompt`), added on its own
line unless the question file already carries it (LLaVA's GQA and POPE files do), and a question carrying
another task's instruction is refused; the model's `--prompt-template` only wraps the result in its conversation
([models.md](models.md)); a checkpoint evaluated by another convention declares its own instruction per task in
`task_instructions.json` (the bundled demos ask POPE bare, as their cards measure). The manifest records the template and the first question's full prompt (`prompt`), and
`run` prints the template it used. The grounding task (`refcoco`) has no instruction: its whole question is the
answering family's own grounding prompt around the expression, and its answer is read in that family's box
convention (a family without one is refused before anything runs).

On the bundled task demo (`prune-audit study --model demo-tasks --tasks pope,gqa,scienceqa,caption,textvqa,refcoco
--selectors divprune,fastv,e2s --budgets 16,64 --limit 600 --threads 1`) the model reads every word and grounds 0.272
of 600 referring expressions unpruned. FastV at 16 tokens loses the word in 98 % of the TextVQA questions and reads
8.5 % of those, at confidence 0.99. Every pruned run grounds far fewer expressions than the referred shapes it keeps
would suggest (DivPrune at 64 tokens loses none of them, and grounds 0.037). The whole table (accuracy, ECE, AUROC,
evidence lost, and accuracy on the questions that lost it, pruned and dense) is in the [task demo's
card](../prune_audit/assets/demo-tasks/MODEL_CARD.md#accuracy-per-task-and-what-pruning-does); the README's
[task section](../README.md#tasks-pope-gqa-scienceqa-img-captions-textvqa-and-refcoco-grounding) sums it up.

```
prune-audit run                                         # POPE on the bundled demo
prune-audit run --task gqa                              # the demo's GQA questions, answered by demo-tasks
prune-audit run --task textvqa                          # the demo's scenes with a word, read by demo-tasks
prune-audit run --task refcoco                          # the demo's referring expressions, grounded by demo-tasks
prune-audit run --task gqa --model M --questions testdev_balanced_questions.json \\
    --questions llava_gqa_testdev_balanced.jsonl --images gqa/images [--annotations sceneGraphs.json]
prune-audit run --task scienceqa --model M --questions llava_test_CQM-A.json --images scienceqa/images
prune-audit run --task caption --model M --questions instances_val2014.json [--questions captions_val2014.json] \\
    --annotations instances_val2014.json --images val2014 --limit 500
prune-audit run --task textvqa --model M --questions TextVQA_0.5.1_val.json \\
    --questions llava_textvqa_val_v051_ocr.jsonl --images train_images \\
    [--annotations TextVQA_Rosetta_OCR_v0.2_val.json]
prune-audit score --task gqa answers.jsonl --questions testdev_balanced_questions.json   # released answers
prune-audit run --task scienceqa --model M --questions ScienceQA-IMG/test-00000-of-00001.parquet  # lmms-eval files
prune-audit run --task refcoco --model M --questions 'refcoco/refs(unc).p' --questions refcoco/instances.json \\
    --annotations refcoco/instances.json --images train2014 --split testA
prune-audit run --task refcoco --model M --questions RefCOCO/data/testA-00000-of-00001.parquet  # lmms-eval files
prune-audit run --task video_mc --model QWEN25VL --questions MVBench/json/action_count.json --images frames \\
    --selector evs --budget 25%                         # frames/<video>/ holds each video's frames
prune-audit run --task video_presence --model QWEN25VL --questions presence.json --images frames \\
    --annotations instances.json                        # object tracks in the YouTube-VIS layout
```

Video tasks (`video_mc`, `video_presence`) ask about clips: each question's video (`x.mp4`) is read from the frame
folder `--images DIR/x/` (PNG or JPEG frames in name order; a video file is refused: extract its frames), sampled
and resized as the family reads a video (Qwen2.5-VL and Qwen3-VL: qwen-vl-utils at the question's `fps`, frames per
second of the folder, 2 when the question gives none; LLaVA-OneVision: lmms-eval's 32 uniformly spaced frames), and
answered by a family that takes clips (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision; others refuse). Their
selectors are the video selectors and the image selectors with a per-frame run, which select on each temporal step
alone at an even share of the budget (a project convention; [fidelity.md](fidelity.md) names them); other image
selectors are refused on clips. Their records hold the clip columns
(`sampled_frames`, `frame_retention` and `frame_retention_stages`, `window`, `window_retention`, `lost_in_window`
and `lost_in_window_stages`; [records.md](records.md)): the core `retention` and `lost` count the evidence object
over every sampled frame.

Question files in the Parquet layout of the lmms-eval datasets (`.parquet`; see each task's "Parquet files")
embed their images, so they need no `--images`: every embedded image the run uses is decoded, and its
`image_source` name checked to be writable (no NUL byte, no part over 255 bytes, no name that is also another's
folder), before anything is written; the run writes them to `RUN_DIR/images/` (its manifest's images folder, pinned by their sha256,
read again by `visualize --run` and `intervene`), and a run reads either Parquet files or the task's own files.
`score --task pope`, `score --task gqa`, `score --task textvqa` and `score --task video_mc` (Video-MME's rows) read
them too, without their images (GQA: only the `*_instructions` files); `score --task scienceqa` refuses them, because lmms-lab/ScienceQA's rows have no problem id to match an
answers file's `question_id` (row order would silently pair answers with the wrong questions once either file
is filtered): pass LLaVA's `llava_test_CQM-A.json`.

Plug-in tasks: a `prune_audit.tasks.Task` subclass exposed under the entry-point group `prune_audit.tasks`
registers under the entry point's name, as selectors do under `prune_audit.selectors`. Its records hold the
core columns and its own, declared on the class (`record_columns`, each a `prune_audit.record_columns.Column`;
null in other tasks' rows, placed after the built-in tasks' columns), as every built-in task declares its own.

`calibrate`, `cascade`, `intervene`, `visualize --run` and `merge` read every task. A task without a yes/no
answer is analysed through its top-label confidence: the event "the answer is correct" at probability
`confidence`, so ECE, AUROC and AURC are as for POPE, Brier and NLL are the top-label ones, temperature scaling
rescales the confidence's logit (the answer never changes), POPE's precision, recall, F1 and yes ratio are left
out, and a cascade's disagreement compares answers as the task normalises them (GQA: LLaVA's rule).
`study --task NAME --questions FILE...` runs a selector x budget grid of any one task; `study --tasks
pope,gqa,scienceqa,caption --questions TASK=FILE...` runs one grid per task, with a summary row per run (its
`task` column) and a report section per task showing that task's report metrics.
"""


def _details(task: object) -> str:
    """The task module's docstring after its first paragraph (which repeats the summary)."""
    text = (sys.modules[type(task).__module__].__doc__ or "").strip()
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


def _instruction(task: Task) -> str:
    """The task's instruction as the page shows it: quoted, or none."""
    return f"`{task.instruction}` on its own line after the question (once)" if task.instruction else "none"


def tasks_markdown() -> str:
    """docs/tasks.md: the introduction, then one section per registered task."""
    lines = [INTRO]
    for name in list_tasks():
        task = get_task(name)
        lines += [
            f"## {name}",
            "",
            task.summary + ".",
            "",
            f"- instruction: {_instruction(task)}",
            f"- answer: {task.answer_mode_text}"
            + (
                f" (at most {task.default_max_new_tokens} new tokens by default; `--max-new-tokens N`)"
                if task.default_max_new_tokens is not None
                else ""
            ),
            f"- confidence: {task.confidence_definition}",
            f"- correct: {task.correct_definition}",
            f"- evidence: {task.evidence_definition}",
            f"- splits: {', '.join(task.splits) if task.splits else 'none (records use the split ' + repr(name) + ')'}",
            f"- report metrics: {', '.join(task.report_metrics)}",
            f"- Parquet files: {task.parquet_layout or 'none'}",
            "",
            _details(task),
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write the generated page to PATH (default docs/tasks.md, relative to the working directory)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DOC_PATH
    path.write_text(tasks_markdown(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
