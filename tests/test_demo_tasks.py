"""The demo's questions beyond yes/no: generation with evidence, and training on the task mix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prune_audit.data.scenes import CATEGORIES, Scene, SceneObject, generate_scene
from prune_audit.demo.answer_targets import (
    AnswerTarget,
    answer_target,
    exact_matches,
    teacher_forcing,
)
from prune_audit.demo.batches import MixQuestion, check_mix, sample_batch
from prune_audit.demo.scene_questions import (
    CHOICE_LETTERS,
    caption_question,
    choice_question,
    count_question,
    evidence_mask,
    largest_question,
    short_questions,
    spatial_question,
    vocabulary_words,
)
from prune_audit.demo.train import (
    DEFAULT_MIX,
    MIX_WORDS,
    DemoRecipe,
    prompt_pieces,
    scene_inputs,
    train_demo_model,
)

SIZE = 64


def disc(cx: float, cy: float, radius: float) -> np.ndarray:
    """(SIZE, SIZE) bool disc with pixel centres inside."""
    coords = np.arange(SIZE) + 0.5
    x, y = np.meshgrid(coords, coords)
    return (x - cx) ** 2 + (y - cy) ** 2 <= radius**2


def scene_of(*objects: tuple[str, np.ndarray]) -> Scene:
    return Scene(np.zeros((SIZE, SIZE, 3), np.uint8), tuple(SceneObject(name, mask) for name, mask in objects))


def test_spatial_questions_name_the_one_shape_on_that_side_and_both_objects_as_evidence():
    scene = scene_of(("star", disc(10, 10, 5)), ("heart", disc(40, 50, 5)), ("ring", disc(54, 20, 5)))
    left = spatial_question(scene, 1, "left")
    assert left is not None and left.answer == "star" and left.evidence == (1, 0)
    assert left.prompt == "Which shape is left of the heart?\nAnswer the question using a single word or phrase."
    above = spatial_question(scene, 1, "above")  # star and ring are both above the heart: ambiguous
    assert above is None
    assert spatial_question(scene, 0, "left") is None  # nothing is left of the star
    ring_above = spatial_question(scene, 0, "above")
    assert ring_above is None  # the ring (y 20) is below the star (y 10)
    close = scene_of(("star", disc(20, 10, 4)), ("heart", disc(22, 40, 4)), ("ring", disc(50, 40, 4)))
    assert spatial_question(close, 1, "left") is None  # the star is within the margin of the heart's x


def test_count_largest_choice_and_caption_answers_and_evidence():
    scene = scene_of(("arrow", disc(12, 12, 9)), ("circle", disc(45, 15, 5)), ("star", disc(30, 48, 5)))
    count = count_question(scene)
    assert count.answer == "three" and count.evidence == (0, 1, 2)
    largest = largest_question(scene)
    assert largest is not None and largest.answer == "arrow" and largest.evidence == (0, 1, 2)
    even = scene_of(("arrow", disc(12, 12, 5)), ("circle", disc(45, 15, 5)))
    assert largest_question(even) is None  # equal areas: no clear largest
    caption = caption_question(scene)
    assert caption.answer == "an arrow , a star and a circle" and caption.evidence == (0, 2, 1)
    assert caption.prompt == "Describe this image in detail."
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = choice_question(rng, scene)
        present = [option for option in choice.options if option in scene.categories]
        assert len(choice.options) == 4 and len(set(choice.options)) == 4 and len(present) == 1
        assert choice.options[CHOICE_LETTERS.index(choice.answer)] == present[0]
        assert scene.objects[choice.evidence[0]].category == present[0]
        assert choice.prompt.splitlines()[1:5] == [
            f"{letter}. {option}" for letter, option in zip("ABCD", choice.options)
        ]


def test_evidence_masks_are_the_union_of_the_named_objects_visible_masks():
    scene = generate_scene(0, 5, image_size=96)
    for question in short_questions(scene):
        expected = np.logical_or.reduce([scene.objects[i].mask for i in question.evidence])
        assert np.array_equal(evidence_mask(scene, question), expected)


def test_generated_questions_cover_every_form_and_use_only_vocabulary_words():
    import re

    words = set(vocabulary_words())
    forms, letters = set(), set()
    rng = np.random.default_rng(1)
    for index in range(60):
        scene = generate_scene(2, index, image_size=96, split="train")
        questions = [*short_questions(scene), choice_question(rng, scene), caption_question(scene)]
        forms |= {q.form for q in questions}
        letters |= {q.answer for q in questions if q.kind == "choice"}
        for question in questions:
            assert set(re.findall(r"\w+|[^\w\s]+", f"{question.prompt} {question.answer}")) <= words
    assert forms == {"left", "above", "count", "largest", "choice", "caption"} and letters == set(CHOICE_LETTERS)
    assert set(CATEGORIES) <= words


# ----- training on the task mix ------------------------------------------------------------------------------------

TINY_MIX = DemoRecipe(
    seed=3,
    steps=2,
    images_per_step=2,
    warmup_steps=1,
    image_size=64,
    patch_size=16,
    vision_width=32,
    vision_layers=2,
    text_width=32,
    text_layers=2,
    heads=2,
    monitor_every=2,
    monitor_images=3,
    mix=DEFAULT_MIX,
)
TINY_MIX_QWEN = DemoRecipe(
    seed=3,
    steps=2,
    images_per_step=2,
    warmup_steps=1,
    image_size=64,
    patch_size=8,
    vision_width=32,
    vision_layers=2,
    text_width=32,
    text_layers=2,
    heads=2,
    monitor_every=2,
    monitor_images=3,
    mix=DEFAULT_MIX,
    family="qwen2_5_vl",
    merge=2,
    train_sizes=(64, 96),
    kv_heads=1,
)


@pytest.fixture(scope="module", params=["llava", "qwen"])
def mix_model(request, tmp_path_factory):
    """A 2-step tiny model of each family trained on the mix, saved and loaded back."""
    from prune_audit.demo.evaluate import load_demo

    recipe = TINY_MIX if request.param == "llava" else TINY_MIX_QWEN
    out = tmp_path_factory.mktemp(f"mix-{request.param}") / "model"
    summary = train_demo_model(recipe, out, log=lambda line: None)
    return recipe, out, summary, load_demo(out)


def test_mix_batches_ask_each_kind_per_image_with_balanced_yes_no():
    batch = sample_batch(0, 3, images=5, questions_per_image=8, image_size=64, patch_size=16, mix=(4, 2, 1, 1))
    assert len(batch.questions) == 40 and all(isinstance(q, MixQuestion) for q in batch.questions)
    for image in range(5):
        kinds = [q.question.kind for q in batch.questions if q.image == image]
        assert kinds == ["yesno"] * 4 + ["short"] * 2 + ["choice", "caption"]
        answers = [q.question.answer for q in batch.questions if q.image == image and q.question.kind == "yesno"]
        assert sorted(answers) == ["no", "no", "yes", "yes"]
    again = sample_batch(0, 3, images=5, questions_per_image=8, image_size=64, patch_size=16, mix=(4, 2, 1, 1))
    assert again.questions == batch.questions


@pytest.mark.parametrize("mix", [(4, 2, 1), (3, 1, 1, 1), (0, 0, 0, 0), (2, -1, 1, 1), (2, 1.5, 1, 1)])
def test_bad_mixes_are_refused(mix):
    with pytest.raises(ValueError, match="mix"):
        check_mix(mix)


def test_mix_training_extends_the_vocabulary_and_reports_each_kind(mix_model):
    _, _, summary, vlm = mix_model
    assert "<unk>" not in vlm.tokenizer.convert_ids_to_tokens(vlm.tokenizer.convert_tokens_to_ids(list(MIX_WORDS)))
    last = summary["history"][-1]
    assert set(last["task_accuracy"]) == {
        "caption",
        "choice",
        "short",
        "short:above",
        "short:count",
        "short:largest",
        "short:left",
    }
    assert all(0.0 <= value <= 1.0 for value in last["task_accuracy"].values())
    assert list(summary["recipe"]["mix"]) == list(DEFAULT_MIX)


def test_teacher_forced_logits_equal_the_full_forward_at_every_answer_token(mix_model):
    import torch

    recipe, _, _, vlm = mix_model
    batch = sample_batch(0, 0, images=2, questions_per_image=8, image_size=64, patch_size=recipe.cell, mix=DEFAULT_MIX)
    pieces = prompt_pieces(vlm, recipe.grid**2)
    forcing = teacher_forcing(vlm, pieces, [answer_target(q, "Answer yes or no.") for q in batch.questions])
    assert forcing.every_position
    with torch.no_grad():
        features = vlm.image_features(**scene_inputs(vlm, batch.scenes))
        features = torch.stack(list(features))
        logits = vlm.shared_prefix_logits(
            features,
            pieces.prefix,
            pieces.image_positions,
            forcing.suffixes,
            sum(DEFAULT_MIX),
            grid=(recipe.grid, recipe.grid),
            every_position=True,
        )
        for row, col in zip(forcing.rows.tolist(), forcing.cols.tolist()):
            ids = torch.cat([pieces.prefix, forcing.suffixes[row][: col + 1]])[None]
            full = vlm.first_token_logits(ids, torch.ones_like(ids), [features[batch.questions[row].image]])
            assert torch.allclose(full[0], logits[row, col], atol=1e-4)
    # generated answers end in the end-of-sequence token; first-token answers force one token
    ends = [forcing.targets[forcing.rows == row][-1].item() for row in range(len(batch.questions))]
    kinds = [q.question.kind for q in batch.questions]
    assert all((end == vlm.eos_ids()[0]) == (kind in ("short", "caption")) for end, kind in zip(ends, kinds))


def test_exact_match_needs_every_token_and_restricts_choices_to_the_offered_letters(mix_model):
    import torch

    recipe, _, _, vlm = mix_model
    pieces = prompt_pieces(vlm, recipe.grid**2)
    targets = [
        AnswerTarget("Describe this image in detail.", "a star", True),
        AnswerTarget("Which of these shapes is in the image?", "B", False, ("A", "B", "C", "D")),
    ]
    forcing = teacher_forcing(vlm, pieces, targets)
    logits = torch.zeros(2, max(len(s) for s in forcing.suffixes), len(vlm.tokenizer))
    ids = vlm.tokenizer.convert_tokens_to_ids
    caption_cols = forcing.cols[forcing.rows == 0].tolist()
    for col, token in zip(caption_cols, forcing.targets[forcing.rows == 0].tolist()):
        logits[0, col, token] = 5.0
    choice_col = forcing.cols[forcing.rows == 1].item()
    logits[1, choice_col, ids("star")] = 9.0  # a word outranks every letter, but B leads the letters
    logits[1, choice_col, ids("B")] = 3.0
    assert exact_matches(logits, forcing).tolist() == [True, True]
    logits[0, caption_cols[-1], ids("no")] = 6.0  # the end token is not the argmax: greedy would go on
    assert exact_matches(logits, forcing).tolist() == [False, True]


def test_demo_train_cli_takes_the_mix_and_refuses_a_bad_one_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    result = CliRunner().invoke(app, ["demo", "train", "--out", str(tmp_path / "m"), "--mix", "4,2,x,1"])
    assert result.exit_code != 0 and "--mix" in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(app, ["demo", "train", "--out", str(tmp_path / "m"), "--mix", "3,2,1,1"])
    assert result.exit_code != 0 and "even yes/no" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m").exists()


# ----- the demo's task files and `run --task` on them ----------------------------------------------------------------


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    from prune_audit.demo.questions import demo_question_set, demo_task_files

    question_set = demo_question_set(tmp_path_factory.mktemp("cache"), scenes=30, pope_images=10)
    return question_set, demo_task_files(question_set)


def test_task_files_are_deterministic_and_match_the_question_sets_scenes(task_files, tmp_path):
    import json

    from prune_audit.data.coco import CocoInstances
    from prune_audit.demo.questions import demo_question_set, demo_task_files

    question_set, files = task_files
    again = demo_task_files(demo_question_set(tmp_path, scenes=30, pope_images=10))
    for task in ("gqa", "scienceqa", "caption"):
        for path in files.questions(task):
            assert path.read_bytes() == again.root.joinpath(path.name).read_bytes()
    coco = CocoInstances.load(files.caption_instances)
    full = CocoInstances.load(question_set.instances)
    assert list(coco.images) == list(range(1, 31))
    for image_id in (1, 17, 30):  # the regenerated scene is the exported one, mask for mask
        scene = generate_scene(2026, image_id - 1, image_size=96)
        assert coco.object_names(image_id) == list(scene.categories) == full.object_names(image_id)
        for obj in scene.objects:
            assert np.array_equal(coco.category_mask(image_id, obj.category), obj.mask)
    sqa = json.loads(files.scienceqa.read_text())
    assert [entry["id"] for entry in sqa] == [str(i) for i in range(1, 31)]


def test_gqa_annotations_name_the_evidence_objects_and_their_boxes_cover_the_masks(task_files):
    from prune_audit.data.gqa import evidence_mask as box_evidence
    from prune_audit.data.gqa import load_gqa, load_scene_graphs

    _, files = task_files
    graphs = load_scene_graphs(files.gqa_scene_graphs)
    questions = load_gqa(files.gqa_questions, files.gqa_llava, graphs)
    assert len(questions) > 60
    for question in questions:
        image_id = int(question.image_id.split("_")[1])
        scene = generate_scene(2026, image_id - 1, image_size=96)
        [asked] = [q for q in short_questions(scene) if q.question == question.question]
        assert question.answer == asked.answer and question.text == asked.prompt
        graph = graphs[question.image_id]
        named = {graph.objects[object_id].name for object_id in question.evidence_object_ids}
        assert named == {scene.objects[i].category for i in asked.evidence}
        boxes = box_evidence(question, graph)
        assert not (evidence_mask(scene, asked) & ~boxes).any()  # every evidence pixel lies in the boxes


def test_every_task_reads_the_demo_files_and_their_evidence(task_files):
    from prune_audit.tasks.registry import get_task

    _, files = task_files
    for name in ("gqa", "scienceqa", "caption"):
        task = get_task(name)
        questions = task.read_questions(list(files.questions(name)))
        task.check_questions(questions)
        assert len({(q.split, q.question_id) for q in questions}) == len(questions)
        if files.evidence(name) is not None:
            task.load_evidence(files.evidence(name), questions)


def test_caption_scoring_counts_the_demo_shapes_as_chair_counts_coco_objects(task_files):
    from prune_audit.data.chair import (
        default_vocabulary,
        score_caption,
        with_categories,
    )
    from prune_audit.tasks.registry import get_task

    assert with_categories(default_vocabulary(), ["dog", "person"]) is default_vocabulary()  # COCO: unchanged
    _, files = task_files
    task = get_task("caption")
    task.read_questions([files.caption_instances])
    scored = score_caption("two circles , a star and a heart", ["circle", "cross"], vocabulary=task.vocabulary)
    assert scored.mentioned == ("circle", "star", "heart") and scored.hallucinated == ("star", "heart")
    assert scored.omitted == ("cross",)


TASK_DEMO_RUNS = [
    (model, task) for model in ("demo-tasks", "demo-qwen-tasks") for task in ("gqa", "scienceqa", "caption")
] + [("demo-tasks", "textvqa"), ("demo-tasks", "refcoco"), ("demo-qwen-tasks", "textvqa")]  # the scenes with a word


@pytest.mark.parametrize(
    ("model", "task"),
    [("demo", "gqa"), ("demo", "caption"), ("demo-qwen", "gqa"), ("demo-qwen", "caption"), *TASK_DEMO_RUNS],
)
def test_run_task_on_the_bundled_demo_needs_no_question_files(model, task, tmp_path):
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    out = tmp_path / task
    generation = ["--max-new-tokens", "6"] if task != "scienceqa" else []  # scienceqa answers by its first token
    result = CliRunner().invoke(
        app, ["run", "--model", model, "--task", task, "--limit", "3", *generation, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output[-2000:]
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 3 and {r["task"] for r in records} == {task}
    if task == "scienceqa":  # a question's own image, no evidence boxes; the shipped demos answer with a letter
        assert all(r["answer_text"] in ("A", "B", "C", "D") for r in records)
    else:
        assert all(r["evidence_objects"] for r in records)  # evidence from the scene graphs / masks


def test_scienceqa_on_the_yes_no_demo_names_its_missing_option_letters_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    result = CliRunner().invoke(
        app, ["run", "--model", "demo", "--task", "scienceqa", "--limit", "2", "--out", str(tmp_path / "a")]
    )
    assert result.exit_code != 0 and "option letter" in result.output and "Traceback" not in result.output


def test_a_task_without_model_runs_on_the_task_demo_in_its_own_folder(tmp_path, monkeypatch):
    """`run --task gqa` answers with demo-tasks into runs/demo-tasks-gqa-dense; POPE keeps the yes/no demo."""
    import json

    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--task", "gqa", "--limit", "2", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output[-2000:]
    manifest = json.loads((tmp_path / "runs" / "demo-tasks-gqa-dense-limit2" / "manifest.json").read_text())
    assert Path(manifest["model"]["id"]).name == "demo-tasks"
    planned = CliRunner().invoke(app, ["study", "--tasks", "pope,gqa", "--plan", "--limit", "2"])
    assert planned.exit_code == 0, planned.output[-2000:]
    commands = [line for line in planned.output.splitlines() if line.startswith("prune-audit run")]
    assert commands and all("--model demo-tasks" in line for line in commands)
    assert "--model" not in CliRunner().invoke(app, ["study", "--plan", "--limit", "2"]).output  # POPE: the yes/no demo


def test_scienceqa_runs_on_the_demo_files_with_a_mix_trained_model(task_files, tmp_path, mix_model):
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    _, model_dir, _, _ = mix_model
    question_set, files = task_files
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--task",
            "scienceqa",
            "--model",
            str(model_dir),
            "--questions",
            str(files.scienceqa),
            "--images",
            str(question_set.image_dir),
            "--limit",
            "3",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output[-2000:]
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 3 and all(r["answer_text"] in ("A", "B", "C", "D") for r in records)


def test_a_model_demo_train_wrote_reads_the_demo_questions_by_default(mix_model, tmp_path):
    """`demo train --out DIR` then `run --model DIR --task T`: no question files needed, as for the bundled demos."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    _, model_dir, _, _ = mix_model
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["run", "--task", "scienceqa", "--model", str(model_dir), "--limit", "3", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert len(pq.read_table(out / "records.parquet")) == 3
    elsewhere = tmp_path / "not-a-demo"
    elsewhere.mkdir()
    (elsewhere / "training.json").write_text("{}")  # no recipe: not a demo-trained folder
    result = CliRunner().invoke(app, ["run", "--model", str(elsewhere), "--out", str(tmp_path / "b")])
    assert result.exit_code != 0 and "--model needs questions" in result.output


def test_visualize_on_a_model_demo_train_wrote_reads_the_demo_scene_annotations(mix_model, tmp_path):
    from typer.testing import CliRunner

    from prune_audit.cli.main import app
    from prune_audit.demo.assets import demo_assets

    _, model_dir, _, _ = mix_model
    image = sorted(demo_assets().images_dir.glob("*.png"))[0]
    out = tmp_path / "figure.png"
    result = CliRunner().invoke(
        app,
        [
            "visualize",
            str(image),
            "--model",
            str(model_dir),
            "--budget",
            "2",
            "--selector",
            "random",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert out.is_file() and "not one of the" not in result.output


def test_each_offered_option_is_trained_at_its_last_word_with_its_presence(mix_model):
    """The auxiliary option targets sit on the option words, yes exactly for the answer's option."""
    recipe, _, _, vlm = mix_model
    pieces = prompt_pieces(vlm, recipe.grid**2)
    scene = generate_scene(0, 1, image_size=recipe.image_size)
    question = choice_question(np.random.default_rng(0), scene)
    forcing = teacher_forcing(vlm, pieces, [answer_target(MixQuestion(0, question), "")])
    words = vlm.tokenizer.convert_ids_to_tokens(forcing.suffixes[0][forcing.option_cols].tolist())
    assert words == list(question.options)
    assert forcing.option_present.tolist() == [letter == question.answer for letter in "ABCD"]
    assert forcing.option_rows.tolist() == [0] * 4 and forcing.every_position


def test_a_killed_training_rerun_on_its_folder_resumes_to_the_same_weights(tmp_path):
    """Stopped after its first checkpoint and rerun, a training ends with the uninterrupted run's bytes."""
    from dataclasses import replace

    from prune_audit.demo.train import CHECKPOINT_FILE

    recipe = replace(TINY_MIX, steps=4, monitor_every=2)
    straight = train_demo_model(recipe, tmp_path / "straight", log=lambda line: None)

    def killed_at_second_monitor(line: str) -> None:
        if line.startswith("monitor step 4"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_demo_model(recipe, tmp_path / "resumed", log=killed_at_second_monitor)
    assert (tmp_path / "resumed" / CHECKPOINT_FILE).is_file()
    lines: list[str] = []
    resumed = train_demo_model(recipe, tmp_path / "resumed", log=lines.append)
    assert lines[0].startswith("resuming from step 2/4")
    weights = "model.safetensors"
    assert (tmp_path / "resumed" / weights).read_bytes() == (tmp_path / "straight" / weights).read_bytes()
    assert [h["task_accuracy"] for h in resumed["history"]] == [h["task_accuracy"] for h in straight["history"]]
    assert not (tmp_path / "resumed" / CHECKPOINT_FILE).exists()


# unpruned floors on each task's first 60 demo questions (the full files: GQA 0.937 / 0.974, the others 1.000;
# the task demos' cards); issue 24 asks for 90 % on each task and the yes/no floor in test_demo_model.py
TASK_FLOORS = {"gqa": 0.85, "scienceqa": 0.95, "caption": 0.95}
# both also read their scenes' words (the full file: 1.000); demo-tasks grounds their expressions (Acc@0.5 0.282 on the
# full file, 0.100 on these 60; before its grounding stages 0.010 on the full file)
READING_FLOORS = {"demo-tasks": {"textvqa": 0.95, "refcoco": 0.05}, "demo-qwen-tasks": {"textvqa": 0.95}}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["demo-tasks", "demo-qwen-tasks"])
def test_the_task_demos_answer_every_task(model, tmp_path):
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    for task, floor in {**TASK_FLOORS, **READING_FLOORS[model]}.items():
        out = tmp_path / task
        result = CliRunner().invoke(
            app, ["run", "--model", model, "--task", task, "--limit", "60", "--threads", "1", "--out", str(out)]
        )
        assert result.exit_code == 0, result.output[-2000:]
        correct = pq.read_table(out / "records.parquet").column("correct").to_pylist()
        assert len(correct) == 60 and sum(correct) / 60 >= floor, (task, sum(correct) / 60)
