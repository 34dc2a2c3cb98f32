"""The demo model: training pieces on a tiny recipe, the question set, and the shipped checkpoint."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.pope_build import question_text
from prune_audit.data.scenes import CATEGORIES, Scene, SceneObject, generate_scene
from prune_audit.demo import DEMO_MODEL_DIR, DEMO_MODELS
from prune_audit.demo.batches import BACKGROUND_CLASS, patch_labels, sample_batch
from prune_audit.demo.evaluate import (
    DEMO_INSTRUCTIONS,
    answer,
    evaluate_question_set,
    load_demo,
    prompt_ids,
    prompt_text,
)
from prune_audit.demo.questions import demo_question_set
from prune_audit.demo.removal import kept_tokens, object_removal
from prune_audit.demo.train import (
    DemoRecipe,
    check_init,
    learning_rate_at,
    prompt_pieces,
    scene_inputs,
    train_demo_model,
)

TINY = DemoRecipe(
    seed=3,
    steps=2,
    images_per_step=3,
    questions_per_image=2,
    warmup_steps=1,
    image_size=64,
    patch_size=16,
    vision_width=32,
    vision_layers=2,
    text_width=32,
    text_layers=2,
    heads=2,
    monitor_every=1,
    monitor_images=3,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-step tiny demo model, saved and loaded back as the shipped one is."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    summary = train_demo_model(TINY, out, log=lambda line: None)
    return out, summary, load_demo(out)


# the Qwen2.5-VL recipe in miniature: 2x2 merge, M-RoPE, scenes at two sizes (4x4 and 6x6 tokens)
TINY_QWEN = DemoRecipe(
    seed=3,
    steps=2,
    images_per_step=3,
    questions_per_image=2,
    warmup_steps=1,
    image_size=64,
    patch_size=8,
    vision_width=32,
    vision_layers=2,
    text_width=32,
    text_layers=2,
    heads=2,
    monitor_every=1,
    monitor_images=3,
    family="qwen2_5_vl",
    merge=2,
    train_sizes=(64, 96),
    kv_heads=1,
)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-qwen") / "model"
    summary = train_demo_model(TINY_QWEN, out, log=lambda line: None)
    return out, summary, load_demo(out)


@pytest.fixture(scope="module")
def small_question_set(tmp_path_factory):
    """A small held-out demo set from the same stream and builder as the default one."""
    return demo_question_set(tmp_path_factory.mktemp("cache"), scenes=200, pope_images=80)


def test_patch_labels_take_the_class_covering_over_a_quarter():
    mask = np.zeros((64, 64), dtype=bool)
    mask[0:16, 0:16] = True  # patch 0 fully
    mask[0:3, 16:32] = True  # patch 1 by 3/16 < 1/4
    mask[16:26, 0:16] = True  # patch 4 by 10/16
    scene = Scene(image=np.zeros((64, 64, 3), np.uint8), objects=(SceneObject("star", mask),))
    labels = patch_labels(scene, 16)
    star = CATEGORIES.index("star")
    assert labels[0] == star and labels[4] == star
    assert labels[1] == BACKGROUND_CLASS and (labels[[2, 3, 5]] == BACKGROUND_CLASS).all()


def test_batches_ask_half_present_half_absent_classes():
    batch = sample_batch(0, 4, images=6, questions_per_image=8, image_size=64, patch_size=16)
    assert len(batch.questions) == 48
    for question in batch.questions:
        present = question.category in batch.scenes[question.image].categories
        assert present == (question.answer == "yes")
    assert sum(q.answer == "yes" for q in batch.questions) == 24
    assert batch.presence.sum(dim=1).tolist() == [len(s.objects) for s in batch.scenes]
    again = sample_batch(0, 4, images=6, questions_per_image=8, image_size=64, patch_size=16)
    assert again.questions == batch.questions


def test_learning_rate_warms_up_then_decays_to_the_floor():
    recipe = DemoRecipe(steps=300, warmup_steps=100)
    assert learning_rate_at(0, recipe) == pytest.approx(1e-5)
    assert learning_rate_at(99, recipe) == pytest.approx(1e-3)
    assert learning_rate_at(100, recipe) == pytest.approx(1e-3)
    assert learning_rate_at(300, recipe) == pytest.approx(5e-5)
    assert learning_rate_at(200, recipe) < learning_rate_at(150, recipe)


def test_pixels_and_prompt_ids_equal_the_processor_path(tiny_model):
    vlm = tiny_model[2]
    processor = vlm.processor
    scene = generate_scene(0, 1, image_size=64)
    text = prompt_text(vlm, question_text("arrow"), DEMO_INSTRUCTIONS[1])
    encoded = processor(images=Image.fromarray(scene.image), text=text, return_tensors="pt")
    assert torch.allclose(encoded["pixel_values"], scene_inputs(vlm, [scene])["pixels"], atol=1e-6)
    assert torch.equal(encoded["input_ids"][0], prompt_ids(vlm, text, 16))
    short = processor.tokenizer.convert_ids_to_tokens(prompt_ids(vlm, text, 2))
    assert short[:5] == ["<s>", "USER", ":", "<image>", "<image>"] and "<unk>" not in short


def assert_same_p_yes_as_the_full_prompt(vlm, batch, instructions, features, probs) -> None:
    """The shared-prefix ``probs`` (Q, V) give p(yes) of the full-prompt answer path, question by question."""
    texts = [
        prompt_text(vlm, question_text(q.category), DEMO_INSTRUCTIONS[i]) for q, i in zip(batch.questions, instructions)
    ]
    full = answer(vlm, [features[q.image] for q in batch.questions], texts)
    yes_id = vlm.tokenizer.convert_tokens_to_ids("yes")
    assert torch.allclose(probs[:, yes_id], full.p_yes, atol=1e-5)


def test_shared_prefix_training_forward_equals_the_full_forward(tiny_model):
    vlm = tiny_model[2]
    batch = sample_batch(0, 0, images=3, questions_per_image=4, image_size=64, patch_size=16)
    instructions = [i % len(DEMO_INSTRUCTIONS) for i in range(len(batch.questions))]
    pieces = prompt_pieces(vlm, 16)
    with torch.no_grad():
        inputs = scene_inputs(vlm, batch.scenes)
        features, _, _ = vlm.vision_states(**inputs)
        assert torch.allclose(features, vlm.image_features(**inputs))
        suffixes = [
            pieces.suffix(vlm, f"{question_text(q.category)} {DEMO_INSTRUCTIONS[i]}".strip())
            for q, i in zip(batch.questions, instructions)
        ]
        logits = vlm.shared_prefix_logits(features, pieces.prefix, pieces.image_positions, suffixes, 4)
        probs = torch.softmax(logits, dim=-1)
    assert_same_p_yes_as_the_full_prompt(vlm, batch, instructions, features, probs)


@pytest.mark.parametrize("size", [64, 96])
def test_qwen_shared_prefix_forward_equals_the_full_forward_at_each_size(tiny_qwen, size):
    vlm = tiny_qwen[2]
    grid = size // TINY_QWEN.cell
    batch = sample_batch(0, 0, images=2, questions_per_image=4, image_size=size, patch_size=TINY_QWEN.cell)
    instructions = [i % len(DEMO_INSTRUCTIONS) for i in range(len(batch.questions))]
    pieces = prompt_pieces(vlm, grid * grid)
    with torch.no_grad():
        inputs = scene_inputs(vlm, batch.scenes)
        assert inputs["grid_thw"].tolist() == [[1, 2 * grid, 2 * grid]] * 2
        features, pooled, _ = vlm.vision_states(**inputs)
        assert features.shape[:2] == (2, grid * grid) and pooled.shape == (2, TINY_QWEN.text_width)
        assert all(torch.allclose(f, g) for f, g in zip(features, vlm.image_features(**inputs)))
        suffixes = [
            pieces.suffix(vlm, f"{question_text(q.category)} {DEMO_INSTRUCTIONS[i]}".strip())
            for q, i in zip(batch.questions, instructions)
        ]
        logits = vlm.shared_prefix_logits(
            features, pieces.prefix, pieces.image_positions, suffixes, 4, grid=(grid, grid)
        )
        probs = torch.softmax(logits, dim=-1)
    assert_same_p_yes_as_the_full_prompt(vlm, batch, instructions, features, probs)
    # the audit's prepare sees the same dynamic-resolution grid and prompt
    prepared = vlm.prepare(Image.fromarray(batch.scenes[0].image), question_text(batch.questions[0].category))
    assert prepared.grid == (grid, grid)
    assert torch.equal(
        prepared.input_ids, prompt_ids(vlm, prompt_text(vlm, question_text(batch.questions[0].category)), grid * grid)
    )


def test_qwen_training_is_deterministic_and_loads_through_the_family_registry(tiny_qwen, tmp_path):
    from prune_audit.models import load_vlm
    from prune_audit.models.qwen import QwenModel

    out, summary, vlm = tiny_qwen
    train_demo_model(TINY_QWEN, tmp_path / "again", log=lambda line: None)
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()
    assert isinstance(vlm, QwenModel) and isinstance(load_vlm(out, device="cpu"), QwenModel)
    recipe = json.loads((out / "training.json").read_text())["recipe"]
    assert recipe["train_sizes"] == [64, 96] and recipe["family"] == "qwen2_5_vl"
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["spatial_merge_size"] == 2
    assert (
        sum(config["text_config"]["rope_parameters"]["mrope_section"]) == TINY_QWEN.text_width // TINY_QWEN.heads // 2
    )


def test_training_is_deterministic_and_saves_a_loadable_float16_checkpoint(tiny_model, tmp_path):
    out, summary, vlm = tiny_model
    again = train_demo_model(TINY, tmp_path / "again", log=lambda line: None)
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()
    accuracies = [entry["heldout_accuracy"] for entry in summary["history"]]
    assert [entry["heldout_accuracy"] for entry in again["history"]] == accuracies and len(accuracies) == TINY.steps
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.float16}
    assert json.loads((out / "training.json").read_text())["recipe"]["seed"] == TINY.seed
    assert vlm.model.config.vision_config.image_size == 64 and vlm.dtype == torch.float32


def test_question_set_is_deterministic_and_pope_shaped(small_question_set, tmp_path):
    again = demo_question_set(tmp_path, scenes=200, pope_images=80)
    assert again.instances.read_bytes() == small_question_set.instances.read_bytes()
    for split in ("random", "popular", "adversarial"):
        lines = small_question_set.question_file(split).read_text().splitlines()
        assert lines == again.question_file(split).read_text().splitlines()
        labels = [json.loads(line)["label"] for line in lines]
        assert len(labels) == 480 and labels.count("yes") == 240
    # a second call reuses the cache instead of regenerating
    assert demo_question_set(tmp_path, scenes=200, pope_images=80).root == again.root


def test_object_removal_runs_every_condition_on_a_tiny_model(tiny_model, small_question_set):
    results = object_removal(tiny_model[2], small_question_set, max_pairs=12)
    assert results["full"].pairs == results["drop_object"].pairs == 12
    assert 0 < results["drop_random_background"].pairs <= 12
    for result in results.values():
        assert 0.0 <= result.accuracy <= 1.0 and 0.0 < result.mean_confidence <= 1.0


def test_removal_conditions_keep_equal_counts_and_drop_the_right_tokens(small_question_set):
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.geometry import clip_geometry

    coco = CocoInstances.load(small_question_set.instances)
    geometry = clip_geometry((96, 96), mode="hf_crop", shortest_edge=96, crop_size=(96, 96), patch_size=8)
    image_id = next(i for i in coco.images if len(coco.object_names(i)) >= 3)
    obj = coco.object_names(image_id)[0]
    kept = kept_tokens(coco, geometry, image_id, obj, np.random.default_rng(0))
    mask = coco.category_mask(image_id, obj)
    touched = {r // 8 * 12 + c // 8 for r, c in zip(*np.nonzero(mask))}
    assert kept["full"].tolist() == list(range(144))
    assert set(kept["drop_object"].tolist()) == set(range(144)) - touched
    assert len(kept["drop_random_nonobject"]) == len(kept["drop_object"])
    assert touched <= set(kept["drop_random_nonobject"].tolist())
    if kept["drop_random_background"] is not None:
        anything = np.zeros_like(mask)
        for name in coco.object_names(image_id):
            anything |= coco.category_mask(image_id, name)
        dropped = set(range(144)) - set(kept["drop_random_background"].tolist())
        assert len(dropped) == len(touched)
        assert not dropped & {r // 8 * 12 + c // 8 for r, c in zip(*np.nonzero(anything))}


def test_cli_writes_the_question_set_and_reports_one_line_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        app, ["demo", "questions", "--cache-dir", str(tmp_path), "--scenes", "120", "--pope-images", "40"]
    )
    assert result.exit_code == 0, result.output
    assert "demo_pope_adversarial.json" in result.output
    missing = runner.invoke(app, ["demo", "evaluate", "--model", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1


# ----- the shipped checkpoint ---------------------------------------------------------


# every bundled demo, with its floor of yes/no accuracy on the small question set: the yes/no demos' targets are
# 97 % (LLaVA) and 95 % (Qwen) on the full set; the task demos must keep the yes/no demos' 97 % (issue 24)
SHIPPED = {"demo": 0.95, "demo-qwen": 0.93, "demo-tasks": 0.97, "demo-qwen-tasks": 0.97}


@pytest.fixture(scope="module", params=sorted(SHIPPED))
def shipped(request, monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return request.param, load_demo(DEMO_MODELS[request.param])


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoint_is_small_and_float16(name):
    folder = DEMO_MODELS[name]
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert size < 10 * 2**20
    assert (folder / "MODEL_CARD.md").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float16"


@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_each_shipped_demo_was_trained_by_its_named_recipe(name):
    """``demo train --model NAME`` retrains the shipped weights: their ``training.json`` holds DEMO_RECIPES[NAME]
    (checked as a recipe continuing NAME checks its --init folder)."""
    check_init(replace(DemoRecipe(), init_from=name), DEMO_MODELS[name])


def test_shipped_llava_demo_has_room_for_in_llm_budgets():
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    grid = config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]
    assert grid * grid >= 100, "budgets of 16/32/64 tokens must be real pruning"
    # budget 16 must be feasible for FastV (all tokens before layer 1): 144 / layers <= 16 with margin
    assert config["text_config"]["num_hidden_layers"] >= 10


def test_shipped_model_answers_held_out_demo_questions(shipped, small_question_set):
    name, vlm = shipped
    summary = evaluate_question_set(vlm, small_question_set)
    assert summary["questions"] == 3 * 480
    assert summary["accuracy"] >= SHIPPED[name], summary
    assert min(summary["yes_accuracy"], summary["no_accuracy"]) >= 0.9, summary


def test_shipped_model_generates_yes_or_no(shipped, small_question_set):
    """The stock ``generate()`` of each family answers with the label, from the adapter's prepared prompt."""
    _, vlm = shipped
    from prune_audit.data.pope import load_pope

    for question in load_pope(small_question_set.question_file("adversarial"))[:4]:
        image = Image.open(small_question_set.image_dir / question.image).convert("RGB")
        prepared = vlm.prepare(image, question.text)
        if "image_grid_thw" in prepared.extras:  # Qwen: patches of every image in one (P, D) tensor
            inputs = {"pixel_values": prepared.pixel_values, "image_grid_thw": prepared.extras["image_grid_thw"]}
        else:  # LLaVA: one (3, H, W) image
            inputs = {"pixel_values": prepared.pixel_values[None]}
        inputs["input_ids"] = prepared.input_ids[None]
        generated = vlm.model.generate(**inputs, max_new_tokens=1, do_sample=False)
        assert vlm.tokenizer.decode(generated[0, -1:]).strip() == question.label


def test_shipped_model_looks_at_the_object(monkeypatch_module, small_question_set):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    results = object_removal(load_demo(DEMO_MODEL_DIR), small_question_set, max_pairs=120)
    assert results["full"].accuracy >= 0.9
    assert results["drop_random_nonobject"].accuracy - results["drop_object"].accuracy >= 0.3
    assert math.isfinite(results["drop_object"].wrong_confidence)


def test_demo_assets_name_a_missing_checkpoint(monkeypatch, tmp_path):
    import prune_audit.demo.assets as assets
    from prune_audit.errors import PruneAuditError

    monkeypatch.setitem(assets.DEMO_MODELS, "demo", tmp_path / "gone")
    with pytest.raises(PruneAuditError, match="demo checkpoint is missing"):
        assets.demo_assets(tmp_path)


def test_run_names_the_missing_qwen_demo_in_one_line(monkeypatch, tmp_path):
    import prune_audit.demo.assets as assets

    monkeypatch.setitem(assets.DEMO_MODELS, "demo-qwen", tmp_path / "gone")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--model", "demo-qwen", "--limit", "2"])
    assert result.exit_code != 0 and result.output.count("\n") == 1
    assert "demo train --model demo-qwen" in result.output
