"""``prune-audit demo``: the bundled demo model and its synthetic question set."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prune_audit.cli.common import ThreadsOption, handle_errors

app = typer.Typer(
    help="The bundled demo: a small LLaVA trained on synthetic shape scenes, and its POPE-style questions.",
    epilog="Without --model, `prune-audit run` and `prune-audit visualize` use this demo; "
    "`prune-audit demo questions` prints where its images, masks and question files are.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def demo() -> None:
    """The bundled demo model and its synthetic question set."""


@app.command("train")
@handle_errors
def train(
    out: Annotated[Path, typer.Option("--out", help="Folder for the trained checkpoint (float16) and training.json.")],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Which demo's recipe: demo (LLaVA), demo-qwen (Qwen2.5-VL), their task-mix versions "
            "demo-tasks-stage1 and demo-qwen-tasks; the shipped demo-tasks' later stages demo-tasks-reading "
            "(stage 1 continued on reading and grounding), demo-tasks-grounding (reading continued on grounding) and "
            "demo-tasks (grounding continued); or demo-video (the shipped demo-qwen continued on synthetic clips); a "
            "continuing recipe needs --init unless it continues a shipped demo.",
        ),
    ] = "demo",
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and the training scenes.")] = 1,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Optimiser steps, fresh scenes or clips each (default: the recipe's).")
    ] = None,
    threads: Annotated[
        int,
        typer.Option(
            min=1, help="CPU threads; the weights depend on this number, so it defaults to the shipped recipe's 1."
        ),
    ] = 1,
    text_layers: Annotated[
        int | None, typer.Option("--text-layers", min=1, help="Decoder layers (default: the recipe's).")
    ] = None,
    text_width: Annotated[
        int | None, typer.Option("--text-width", min=8, help="Decoder width (default: the recipe's).")
    ] = None,
    log_file: Annotated[
        Path | None, typer.Option("--log-file", help="Also append progress lines to this file.")
    ] = None,
    monitor_every: Annotated[
        int | None,
        typer.Option("--monitor-every", min=1, help="Steps between held-out checks (default: the recipe's 100)."),
    ] = None,
    mix: Annotated[
        str | None,
        typer.Option(
            "--mix",
            help="Train on the task mix: questions per image of yes/no, short answer, multiple choice, "
            "caption and optionally reading and grounding, e.g. 4,2,2,1 or 2,2,1,1,1,3 (the vocabulary grows to "
            "their words; default: the recipe's, yes/no only for demo and demo-qwen).",
        ),
    ] = None,
    init: Annotated[
        Path | None,
        typer.Option(
            "--init",
            help="Folder of the model a continuing recipe starts from, trained by the recipe before it "
            "(demo-tasks-reading: a demo-tasks-stage1 model; demo-tasks-grounding: a demo-tasks-reading one; "
            "demo-tasks: a demo-tasks-grounding one; demo-video: default the shipped demo-qwen).",
        ),
    ] = None,
) -> None:
    """Train a demo model from scratch on CPU (each shipped demo: --model NAME --seed 1 --threads 1)."""
    from dataclasses import asdict, replace

    from prune_audit.demo import DEMO_MODELS
    from prune_audit.demo.batches import check_mix
    from prune_audit.demo.train import DEMO_RECIPES, check_init, train_demo_model
    from prune_audit.safety.ownership import hold_output_dir
    from prune_audit.threads import check_threads

    check_threads(threads)  # bounded by the usable cores like every --threads (far more crash OpenBLAS)
    if model not in DEMO_RECIPES:
        raise ValueError(f"--model must be one of {', '.join(DEMO_RECIPES)}, got {model!r}")
    counts = None
    if mix is not None:
        parts = [part.strip() for part in mix.split(",")]
        if not all(part.isascii() and part.isdigit() for part in parts):
            raise ValueError(
                f"--mix takes whole counts separated by commas (yes/no,short,choice,caption[,text,ground]), got "
                f"{mix!r}; "
                f"e.g. --mix 4,2,2,1"
            )
        counts = tuple(int(part) for part in parts)
        check_mix(counts)
    recipe = DEMO_RECIPES[model]
    if counts is not None and recipe.clip_frames is not None:
        raise ValueError(f"--mix sets the still scenes' task mix; {model} trains on clips: leave --mix out")
    if init is None and recipe.init_from in DEMO_MODELS:  # a shipped demo continues from its bundled weights
        init = DEMO_MODELS[recipe.init_from]
    recipe = replace(
        recipe,
        seed=seed,
        threads=threads,
        steps=steps or recipe.steps,
        text_layers=text_layers or recipe.text_layers,
        text_width=text_width or recipe.text_width,
        mix=counts or recipe.mix,
        monitor_every=monitor_every or recipe.monitor_every,
    )
    if recipe.text_width % recipe.heads:
        raise ValueError(
            f"--text-width {recipe.text_width} is not a multiple of the {recipe.heads} attention heads; pick one that is"
        )

    def log(line: str) -> None:
        print(line, flush=True)
        if log_file is not None:
            with log_file.open("a") as handle:
                handle.write(line + "\n")

    check_init(recipe, init)  # before the output folder is taken
    settings = asdict(recipe)  # a checkpoint is replaced only by one of the same recipe
    with hold_output_dir(out, "demo train", settings):  # held through training: no other command takes OUT meanwhile
        summary = train_demo_model(recipe, out, init_dir=init, log=log)
    final = summary["history"][-1]
    log(f"saved {out} after {summary['train_minutes']} min; monitor accuracy {final['heldout_accuracy']:.3f}")


ScenesOption = Annotated[int, typer.Option("--scenes", min=1, help="Held-out scenes to generate.")]
PopeImagesOption = Annotated[
    int, typer.Option("--pope-images", min=1, help="Images sampled for the POPE questions (6 per image and split).")
]
CacheOption = Annotated[
    Path | None, typer.Option("--cache-dir", help="Cache folder (default $PRUNE_AUDIT_CACHE or ~/.cache/prune-audit).")
]


@app.command("questions")
@handle_errors
def questions(
    cache_dir: CacheOption = None,
    scenes: ScenesOption = 1000,
    pope_images: PopeImagesOption = 500,
) -> None:
    """Generate (once) the demo question set and its GQA, ScienceQA and caption files, and print their paths."""
    from prune_audit.data.pope import POPE_SPLITS
    from prune_audit.demo.assets import DEMO_TASKS
    from prune_audit.demo.questions import demo_question_set, demo_task_files

    question_set = demo_question_set(cache_dir, scenes=scenes, pope_images=pope_images)
    task_files = demo_task_files(question_set)
    lines = [
        ("instances", str(question_set.instances)),
        ("images", str(question_set.image_dir)),
        *((split, str(question_set.question_file(split))) for split in POPE_SPLITS),
    ]
    for task in DEMO_TASKS:  # --questions (then --annotations, if any) of `run --task TASK`
        paths = [*task_files.questions(task), task_files.evidence(task)]
        lines.append((task, " ".join(dict.fromkeys(str(path) for path in paths if path is not None))))
    lines.append(("reading_images", str(task_files.reading_images)))  # --images of textvqa and refcoco
    width = max(len(label) for label, _ in lines) + 2  # the longest label still has a space before its path
    for label, value in lines:
        print(f"{label + ':':<{width}}{value}")


@app.command("clips")
@handle_errors
def clips(
    cache_dir: CacheOption = None,
    count: Annotated[int, typer.Option("--clips", min=1, help="Held-out clips to generate.")] = 200,
) -> None:
    """Generate (once) the video demo's clips (frame folders), their video_presence and MVBench-layout question
    files and YouTube-VIS track annotations, and print their paths."""
    from prune_audit.demo.clip_files import demo_clip_files

    files = demo_clip_files(cache_dir, clips=count)
    lines = [
        ("videos", files.videos),
        ("presence", files.presence),
        ("mvbench", files.mvbench),
        ("tracks", files.tracks),
    ]
    for label, path in lines:
        print(f"{label + ':':<10}{path}")


@app.command("evaluate")
@handle_errors
def evaluate(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A bundled demo (demo, demo-qwen, demo-tasks, demo-qwen-tasks) or a demo checkpoint "
            "folder (default: demo).",
        ),
    ] = None,
    cache_dir: CacheOption = None,
    scenes: ScenesOption = 1000,
    pope_images: PopeImagesOption = 500,
    instruction: Annotated[
        str, typer.Option(help="Text after the POPE question, e.g. 'Answer yes or no.' (default none).")
    ] = "",
    threads: ThreadsOption = None,
) -> None:
    """Unpruned accuracy of a demo checkpoint on the demo question set, per POPE split."""
    import json

    from prune_audit.threads import configure_threads

    configure_threads(threads)

    from prune_audit.demo import DEMO_MODELS
    from prune_audit.demo.assets import is_demo_name
    from prune_audit.demo.evaluate import evaluate_question_set, load_demo
    from prune_audit.demo.questions import demo_question_set

    model = model or "demo"
    vlm = load_demo(DEMO_MODELS[model] if is_demo_name(model) else model)
    question_set = demo_question_set(cache_dir, scenes=scenes, pope_images=pope_images)
    summary = evaluate_question_set(vlm, question_set, instruction=instruction)
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}))


@app.command("lmms-tasks")
@handle_errors
def lmms_tasks(
    out: Annotated[
        Path,
        typer.Argument(
            metavar="DIR",
            help="Folder for the tasks (a new or empty folder, or the "
            "tasks this command wrote before); lmms-eval reads it with --include_path.",
        ),
    ],
    questions: Annotated[
        int, typer.Option("--questions", min=1, help="POPE questions: the first N of the demo's first POPE file.")
    ] = 100,
    captions: Annotated[
        int, typer.Option("--captions", min=1, help="Images to describe: the first N demo scenes.")
    ] = 20,
) -> None:
    """Write offline lmms-eval tasks over the demo questions and images: localpope, localpope_mc, localpope_rounds
    and localcaption (docs/lmms-eval.md). lmms-eval's own tasks download their datasets; these run offline:
    lmms-eval eval --model prune_audit --model_args pretrained=demo,selector=fastv,budget=16 --tasks localpope
    --include_path DIR."""
    from prune_audit.demo.lmms_tasks import TASKS, write_demo_tasks
    from prune_audit.safety.ownership import hold_output_dir

    settings = {"questions": questions, "captions": captions}
    with hold_output_dir(out, "demo lmms-tasks", settings, option="DIR"):
        write_demo_tasks(out, questions, captions)
    print(f"wrote {', '.join(TASKS)} to {out}; run them with lmms-eval eval --include_path {out} --tasks TASKS")
