"""The demo's reading (TextVQA) and grounding (RefCOCO) questions, their task files, and the training stage that
continues a task demo on them."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from prune_audit.data.boxes import BOX_CONVENTIONS, Box, box_iou
from prune_audit.data.geometry import clip_geometry
from prune_audit.data.scenes import CATEGORY_COLOUR_NAMES, generate_scene
from prune_audit.demo.batches import check_mix, sample_batch
from prune_audit.demo.scene_questions import (
    GROUND_FORMS,
    GROUNDING,
    box_answer,
    ground_questions,
    reading_words,
    text_question,
)
from prune_audit.demo.train import DEMO_RECIPES, READING_WORDS, DemoRecipe, train_demo_model
from prune_audit.models.build import WORD_PATTERN

LLAVA = BOX_CONVENTIONS["llava-1.5"]
SQUARE = clip_geometry((96, 96), mode="llava_pad")  # the demo's images: square, 96 px


def test_a_text_question_asks_for_the_scenes_word_with_the_textvqa_prompt():
    scene = generate_scene(4, 0, words=True)
    question = text_question(scene)
    assert question is not None and question.answer == scene.texts[0].word
    assert question.prompt == "What is written in the image?\nAnswer the question using a single word or phrase."
    assert text_question(generate_scene(4, 0)) is None


def test_grounding_answers_are_llava_boxes_of_the_referred_shape_within_half_a_pixel():
    for index in range(20):
        scene = generate_scene(4, index, words=True)
        for question in ground_questions(scene):
            numbers = LLAVA.parse(question.answer)
            assert numbers is not None
            obj = scene.objects[question.evidence[0]]
            rows, cols = np.nonzero(obj.mask)
            truth = Box(cols.min(), rows.min(), cols.max() + 1, rows.max() + 1)
            read = LLAVA.to_image(numbers, SQUARE)
            assert max(abs(a - b) for a, b in zip(read.as_list(), truth.as_list(), strict=True)) <= 0.5
            assert box_iou(read, truth) > 0.9  # two decimals of 96 px: within half a pixel per side
            assert question.prompt == LLAVA.prompt(question.question)


def test_each_expression_names_one_shape_by_colour_relation_or_size():
    forms = set()
    for index in range(60):
        scene = generate_scene(4, index, words=True)
        questions = ground_questions(scene)
        forms |= {q.form for q in questions}
        for question in questions:
            target = scene.objects[question.evidence[0]]
            if question.form == "colour":
                assert question.question == f"the {CATEGORY_COLOUR_NAMES[target.category]} {target.category}"
            if question.form == "largest":
                assert max(int(o.mask.sum()) for o in scene.objects) == int(target.mask.sum())
    assert forms == set(GROUND_FORMS)


def test_reading_and_grounding_use_only_the_reading_vocabulary():
    words = set(READING_WORDS)
    assert set(reading_words()) <= words and {f"{n / 100:.2f}" for n in range(101)} <= words
    for index in range(30):
        scene = generate_scene(4, index, words=True)
        for question in [text_question(scene), *ground_questions(scene)]:
            if question is not None:
                assert set(re.findall(WORD_PATTERN, f"{question.prompt} {question.answer}")) <= words
    assert box_answer(generate_scene(4, 0), 0).startswith("[0.")


def test_a_six_kind_mix_draws_scenes_with_words_and_the_same_count_per_image():
    batch = sample_batch(1, 0, images=6, questions_per_image=8, image_size=64, patch_size=16, mix=(2, 1, 1, 1, 1, 2))
    assert len(batch.questions) == 6 * 8
    for image, scene in enumerate(batch.scenes):
        kinds = [q.question.kind for q in batch.questions if q.image == image]
        if scene.texts:
            assert kinds == ["yesno", "yesno", "short", "choice", "caption", "text", "ground", "ground"]
        else:  # no free spot for a word: grounding instead
            assert kinds == ["yesno", "yesno", "short", "choice", "caption", "ground", "ground", "ground"]
    four = sample_batch(1, 0, images=6, questions_per_image=8, image_size=64, patch_size=16, mix=(2, 1, 1, 1))
    assert all(scene.texts == () for scene in four.scenes)
    check_mix((2, 1, 1, 1, 0, 2))
    with pytest.raises(ValueError, match="mix"):
        check_mix((2, 1, 1, 1, 1, 1, 1))


def test_scenes_with_words_label_each_words_patches_and_presence():
    from prune_audit.data.scene_text import SCENE_WORDS
    from prune_audit.demo.batches import BACKGROUND_CLASS, WORD_CLASSES, patch_labels

    batch = sample_batch(2, 0, images=4, questions_per_image=8, image_size=96, patch_size=8, mix=(2, 1, 1, 1, 1, 2))
    assert batch.presence.shape == (4, 10 + WORD_CLASSES)
    for b, scene in enumerate(batch.scenes):
        for text in scene.texts:
            word = SCENE_WORDS.index(text.word)
            assert batch.presence[b, 10 + word] == 1 and batch.presence[b, 10:].sum() == 1
            labels = patch_labels(scene, 8).reshape(12, 12)
            x1, y1, x2, y2 = text.box
            inside = labels[(y1 + y2) // 2 // 8, (x1 + x2) // 2 // 8]
            assert inside == BACKGROUND_CLASS + 1 + word
    plain = sample_batch(2, 0, images=4, questions_per_image=8, image_size=96, patch_size=8, mix=(4, 2, 2, 1))
    assert plain.presence.shape == (4, 10) and int(plain.patch_labels.max()) <= BACKGROUND_CLASS


# ----- the demo's TextVQA and RefCOCO files ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def reading_files(tmp_path_factory):
    from prune_audit.demo.questions import demo_question_set, demo_task_files

    question_set = demo_question_set(tmp_path_factory.mktemp("cache"), scenes=20, pope_images=5)
    return demo_task_files(question_set)


def test_textvqa_files_read_back_with_the_words_ink_box_as_the_ocr_token(reading_files):
    from prune_audit.data.textvqa import load_rosetta_ocr, load_textvqa
    from prune_audit.tasks.registry import get_task

    questions = load_textvqa(reading_files.textvqa_questions)
    ocr = load_rosetta_ocr(reading_files.textvqa_ocr)
    assert len(questions) >= 18
    for question in questions:
        scene = generate_scene(2026, question.question_id - 1, words=True)
        [token] = ocr[question.image_id]
        x1, y1, x2, y2 = scene.texts[0].box
        assert token.word == scene.texts[0].word and question.answers == (token.word,) * 10
        assert (token.x * 96, token.y * 96, token.width * 96, token.height * 96) == pytest.approx(
            (x1, y1, x2 - x1, y2 - y1)
        )
        assert (reading_files.reading_images / question.image).is_file()
    task = get_task("textvqa")
    task.check_questions(task.read_questions(list(reading_files.questions("textvqa"))))


def test_refcoco_files_refer_to_each_shape_with_its_exact_box(reading_files):
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.refcoco import load_refcoco

    questions = load_refcoco(list(reading_files.questions("refcoco")))
    coco = CocoInstances.load(reading_files.refcoco_instances)
    assert len(questions) > 40 and {q.split for q in questions} == {"val"}
    for question in questions:
        scene = generate_scene(2026, question.image_id - 1, words=True)
        [asked] = [q for q in ground_questions(scene) if q.question == question.text]
        target = scene.objects[asked.evidence[0]]
        assert question.category == target.category
        assert np.array_equal(coco.category_mask(question.image_id, target.category), target.mask)
        assert LLAVA.to_image(LLAVA.parse(asked.answer), SQUARE).as_list() == pytest.approx(
            question.box.as_list(), abs=0.5
        )


def test_the_reading_images_are_the_scenes_with_their_word(reading_files):
    from PIL import Image

    name = json.loads(reading_files.refcoco_instances.read_text())["images"][3]["file_name"]
    scene = generate_scene(2026, 3, words=True)
    pixels = np.asarray(Image.open(reading_files.reading_images / name).convert("RGB"), dtype=np.int16)
    assert np.abs(pixels - scene.image).max() <= 6  # JPEG at quality 100, no chroma subsampling


# ----- continuing a task demo on reading and grounding ------------------------------------------------------------

TINY_FIRST = DemoRecipe(
    seed=3,
    steps=2,
    images_per_step=2,
    warmup_steps=1,
    image_size=96,  # room for the words (at 64 px most do not fit)
    patch_size=16,
    vision_width=32,
    vision_layers=2,
    text_width=32,
    text_layers=2,
    heads=2,
    monitor_every=2,
    monitor_images=3,
    mix=(4, 2, 2, 1),
)


def test_a_continuing_recipe_starts_from_the_earlier_weights_with_each_words_rows(tmp_path, monkeypatch):
    import torch

    from prune_audit.demo.evaluate import load_demo

    monkeypatch.setitem(DEMO_RECIPES, "tiny-first", TINY_FIRST)
    train_demo_model(TINY_FIRST, tmp_path / "first", log=lambda line: None)
    second = replace(
        TINY_FIRST,
        init_from="tiny-first",
        mix=(2, 1, 1, 1, 1, 2),
        steps=1,
        learning_rate=0.0,
        box_sigma=0.02,
        position_head=True,
    )
    summary = train_demo_model(second, tmp_path / "second", init_dir=tmp_path / "first", log=lambda line: None)
    first, continued = load_demo(tmp_path / "first"), load_demo(tmp_path / "second")
    assert {"text", "ground", "ground@0.5"} <= set(summary["history"][-1]["task_accuracy"])
    old, new = first.tokenizer.get_vocab(), continued.tokenizer.get_vocab()
    assert set(old) < set(new) and "hotel" in new and "0.57" in new
    embed_old = first.model.get_input_embeddings().weight
    embed_new = continued.model.get_input_embeddings().weight
    for word in ("circle", "USER", "?", "Describe"):  # rows follow their word (learning rate 0: unchanged)
        assert torch.equal(embed_new[new[word]], embed_old[old[word]])
    vision_old = dict(first.model.named_parameters())
    for name, value in continued.model.named_parameters():
        if "vision" in name:
            assert torch.equal(value, vision_old[name])
    with pytest.raises(ValueError, match="--init"):
        train_demo_model(second, tmp_path / "third", log=lambda line: None)
    with pytest.raises(ValueError, match="not trained by"):
        train_demo_model(second, tmp_path / "fourth", init_dir=tmp_path / "second", log=lambda line: None)


def test_the_shipped_task_demo_recipe_chains_its_four_stages():
    stages = ["demo-tasks-stage1", "demo-tasks-reading", "demo-tasks-grounding", "demo-tasks"]
    assert [DEMO_RECIPES[name].init_from for name in stages] == [None, *stages[:-1]]
    reading, grounding, shipped = (DEMO_RECIPES[name] for name in stages[1:])
    assert len(reading.mix) == 6 and reading.words == READING_WORDS
    assert reading.box_sigma is None and not reading.position_head
    assert grounding.box_sigma is not None and grounding.position_head
    assert shipped == replace(grounding, init_from="demo-tasks-grounding", steps=shipped.steps, learning_rate=3e-4)
    assert DEMO_RECIPES["demo-tasks-stage1"].mix == (4, 2, 2, 1)


def test_the_qwen_task_demo_recipe_reads_without_grounding_after_its_first_stage():
    first, shipped = DEMO_RECIPES["demo-qwen-tasks-stage1"], DEMO_RECIPES["demo-qwen-tasks"]
    assert first.init_from is None and first.mix == (4, 2, 2, 1) and first.family == "qwen2_5_vl"
    assert shipped.init_from == "demo-qwen-tasks-stage1" and shipped.mix == (2, 1, 1, 1, 1)
    assert shipped.reads and shipped.words == READING_WORDS and shipped.family == first.family


def test_demo_train_refuses_a_continuing_recipe_without_its_first_stage_before_writing(tmp_path):
    from typer.testing import CliRunner

    from prune_audit.cli.main import app

    for extra in ([], ["--init", str(tmp_path)]):  # no --init; a folder no training wrote
        result = CliRunner().invoke(
            app, ["demo", "train", "--model", "demo-tasks", "--out", str(tmp_path / "m"), *extra]
        )
        assert result.exit_code != 0 and "Traceback" not in result.output and result.output.count("\n") == 1
        assert "demo-tasks-grounding" in result.output and not (tmp_path / "m").exists()


@pytest.fixture(scope="module")
def box_forcing():
    """The shipped task demo (its vocabulary writes boxes) and the teacher forcing of one grounding answer."""
    from prune_audit.demo.answer_targets import AnswerTarget, prompt_pieces, teacher_forcing
    from prune_audit.demo.assets import DEMO_MODELS
    from prune_audit.demo.evaluate import load_demo

    vlm = load_demo(DEMO_MODELS["demo-tasks"])
    pieces = prompt_pieces(vlm, 144)
    targets = [
        AnswerTarget(GROUNDING.prompt("the red star"), "[0.10, 0.20, 0.50, 0.60]", True),
        AnswerTarget("Describe this image in detail.", "a star", True),
    ]
    return vlm, teacher_forcing(vlm, pieces, targets)


def test_box_numbers_of_a_grounding_answer_get_gaussian_soft_targets(box_forcing):
    import torch

    from prune_audit.demo.answer_targets import answer_loss, box_number_targets

    vlm, forcing = box_forcing
    numbers = forcing.numbers[~forcing.numbers.isnan()]
    assert (
        numbers.tolist() == pytest.approx([0.10, 0.20, 0.50, 0.60])
        and (forcing.rows[~forcing.numbers.isnan()] == 0).all()
    )
    vocabulary = len(vlm.tokenizer)
    soft = box_number_targets(forcing, torch.tensor([0.30, 0.0]), 0.02, vocabulary)
    ids = vlm.tokenizer.convert_tokens_to_ids
    assert torch.allclose(soft.sum(-1), torch.ones(2)) and int(soft[0].argmax()) == ids("0.30")
    assert soft[0, ids("0.29")] == pytest.approx(float(soft[0, ids("0.31")]))
    # hand-computed: weights exp(-(d / 0.02)^2 / 2) at d = 0, 0.01, 0.02, ... normalised; beyond 0.3 negligible
    weights = np.exp(-((np.arange(101) / 100 - 0.30) ** 2) / (2 * 0.02**2))
    assert float(soft[0, ids("0.32")]) == pytest.approx(weights[32] / weights.sum(), rel=1e-5)
    assert float(soft[1, ids("0.00")]) > float(soft[1, ids("0.01")]) > 0 and float(soft[:, ids("star")].sum()) == 0
    # the loss: one-word cross-entropy everywhere but at the box numbers, where the soft cross-entropy replaces it
    logits = torch.randn(
        2, max(len(s) for s in forcing.suffixes), vocabulary, generator=torch.Generator().manual_seed(0)
    )
    plain, soft_loss = answer_loss(logits, forcing), answer_loss(logits, forcing, 0.02)
    log_p = logits[forcing.rows, forcing.cols].log_softmax(-1)
    token = -log_p[torch.arange(len(forcing.targets)), forcing.targets]
    is_number = ~forcing.numbers.isnan()
    token[is_number] = -(
        box_number_targets(forcing, forcing.numbers[is_number], 0.02, vocabulary) * log_p[is_number]
    ).sum(-1)
    expected = torch.stack([token[forcing.rows == row].mean() for row in range(2)]).mean()
    assert torch.allclose(soft_loss, expected) and not torch.allclose(plain, soft_loss)


def test_forced_box_hits_score_the_argmax_numbers_by_iou_at_one_half(box_forcing):
    import torch

    from prune_audit.demo.answer_targets import forced_box_hits

    vlm, forcing = box_forcing
    ids = vlm.tokenizer.convert_tokens_to_ids
    cols = forcing.cols[~forcing.numbers.isnan()].tolist()

    def hits(*numbers: str) -> list[bool]:
        logits = torch.zeros(2, max(len(s) for s in forcing.suffixes), len(vlm.tokenizer))
        for col, word in zip(cols, numbers, strict=True):
            logits[0, col, ids(word)] = 1.0
        return forced_box_hits(logits, forcing).tolist()

    # truth [0.1, 0.2, 0.5, 0.6]: area 0.16
    assert hits("0.10", "0.20", "0.50", "0.60") == [True, False]  # the caption writes no box
    assert hits("0.10", "0.20", "0.50", "0.44") == [True, False]  # inside the truth: IoU 0.096 / 0.16 = 0.6
    assert hits("0.10", "0.20", "0.50", "0.39") == [False, False]  # IoU 0.076 / 0.16 = 0.475
    assert hits("0.50", "0.60", "0.10", "0.20") == [False, False]  # inverted corners name no region


def test_position_loss_costs_about_one_for_the_centre_guess_and_zero_for_the_true_positions():
    import torch
    from torch import nn

    from prune_audit.demo.train import position_loss

    side, width = 4, 3
    head = nn.Linear(width, 2)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(0.5)
    features = torch.randn(2, side * side, width)
    # the discrete centres (k + 0.5) / side have variance (1 - 1 / side^2) / 12
    with torch.no_grad():
        assert float(position_loss(head, features)) == pytest.approx(1 - 1 / side**2)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    exact = torch.stack([rows.flatten(), cols.flatten(), torch.ones(side * side)], -1).expand(2, -1, -1)
    with torch.no_grad():  # row-major tokens: the head reads (row, col) from the first two features
        head.weight.copy_(torch.tensor([[1 / side, 0, 0], [0, 1 / side, 0]]))
        head.bias.fill_(0.5 / side)
        assert float(position_loss(head, exact)) == pytest.approx(0, abs=1e-12)
