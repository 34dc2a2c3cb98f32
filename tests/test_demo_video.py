"""The video demo: clip questions hand-checked on a fixed clip, clip batches, the training forward against the stock
Qwen2.5-VL video forward, and `demo train --model demo-video` end to end (2 steps of a small batch, from the shipped
demo-qwen) with its held-out presence monitor per window."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import stock_inputs
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.scene_clips import ClipObject, SceneClip, generate_clip
from prune_audit.data.scenes import CATEGORIES
from prune_audit.data.video import sample_clip
from prune_audit.demo import train as demo_train
from prune_audit.demo.clip_batches import sample_clip_batch
from prune_audit.demo.clip_questions import (
    choice_answers,
    choice_question,
    choice_questions,
    clip_vocabulary_words,
    presence_answer,
    presence_question,
    presence_questions,
    window_frames,
)
from prune_audit.demo.clip_train import clip_features, clip_logits, clip_prompt, clip_target, demo_clip_sampling
from prune_audit.demo.evaluate import load_demo
from prune_audit.demo.train import CLIP_WORDS, DEMO_RECIPES
from prune_audit.models.build import WORD_PATTERN

FRAMES, SIZE = 8, 64


def box(x0: int, y0: int, side: int = 10) -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[y0 : y0 + side, x0 : x0 + side] = True
    return mask


def track(category: str, span: tuple[int, int], x0: int, x1: int, y: int = 20) -> ClipObject:
    """A 10 px square moving from x0 to x1 (linear) during ``span``, absent outside it."""
    first, last = span
    masks = np.zeros((FRAMES, SIZE, SIZE), dtype=bool)
    for f in range(first, last + 1):
        x = round(x0 + (x1 - x0) * (f - first) / max(1, last - first))
        masks[f] = box(x, y)
    return ClipObject(category, masks, span, (x0 + 5.0, y + 5.0), (x1 + 5.0, y + 5.0))


@pytest.fixture
def fixed_clip() -> SceneClip:
    """circle: whole clip, static; star: enters at frame 3, moves left to right; heart: leaves after frame 4."""
    objects = (
        track("circle", (0, 7), 5, 5, y=5),
        track("star", (3, 7), 5, 45, y=25),
        track("heart", (0, 4), 30, 30, y=45),
    )
    return SceneClip(np.zeros((FRAMES, SIZE, SIZE, 3), np.uint8), objects)


def test_windows_are_the_first_and_last_quarter_and_answers_follow_the_masks(fixed_clip):
    assert window_frames("beginning", 8) == (0, 1) and window_frames("end", 8) == (6, 7)
    assert window_frames("video", 8) is None and window_frames("end", 16) == (12, 15)
    answers = {
        (c, w): presence_answer(fixed_clip, c, w)
        for c in ("circle", "star", "heart")
        for w in ("beginning", "end", "video")
    }
    assert answers == {
        ("circle", "beginning"): "yes", ("circle", "end"): "yes", ("circle", "video"): "yes",
        ("star", "beginning"): "no", ("star", "end"): "yes", ("star", "video"): "yes",
        ("heart", "beginning"): "yes", ("heart", "end"): "no", ("heart", "video"): "yes",
    }  # fmt: skip
    assert presence_answer(fixed_clip, "arrow", "video") == "no"
    question = presence_question(fixed_clip, "star", "beginning")
    assert question.question == "Is there a star at the beginning of the video?"
    assert (question.answer, question.window, question.evidence) == ("no", (0, 1), (1,))
    arrow = presence_question(fixed_clip, "arrow", "end")
    assert arrow.question == "Is there an arrow at the end of the video?" and arrow.evidence == ()
    assert presence_question(fixed_clip, "heart", "video").window is None


def test_a_sliver_in_the_window_is_never_asked(fixed_clip):
    sliver = fixed_clip.objects[0].masks.copy()
    sliver[:2] = False
    sliver[1, 0, :3] = True  # 3 pixels in frame 1
    clip = SceneClip(fixed_clip.frames, (replace(fixed_clip.objects[0], masks=sliver), *fixed_clip.objects[1:]))
    assert presence_answer(clip, "circle", "beginning") is None
    with pytest.raises(ValueError, match="sliver"):
        presence_question(clip, "circle", "beginning")


def test_choice_forms_answer_only_when_unambiguous(fixed_clip):
    assert choice_answers(fixed_clip) == {"appears_last": 1, "disappears_first": 2, "left_to_right": 1}
    question = choice_question(np.random.default_rng(0), fixed_clip, "disappears_first", 2)
    assert question.answer == "heart" and question.question == "Which shape disappears first?"
    assert len(question.candidates) == 4 and len(set(question.candidates)) == 4 and "heart" in question.candidates
    assert {"circle", "star"} <= set(question.candidates)  # the clip's other shapes are candidates first
    a, b, c, d = question.candidates
    assert question.prompt == (
        f"Question:Which shape disappears first?\nOption:\n(A) {a}\n(B) {b}\n(C) {c}\n(D) {d}\n"
        "Only give the best option.\n"
    )  # MVBench's prompt as lmms-eval writes it
    assert question.letter == "ABCD"[question.candidates.index("heart")]
    both = SceneClip(fixed_clip.frames, (fixed_clip.objects[1], track("arrow", (3, 7), 0, 50)))
    assert "left_to_right" not in choice_answers(both) and "appears_last" not in choice_answers(both)
    assert choice_questions(np.random.default_rng(0), SceneClip(fixed_clip.frames, fixed_clip.objects[:1]), 2) == []


def test_presence_questions_are_balanced_with_hard_negatives_and_in_the_vocabulary():
    rng = np.random.default_rng(3)
    hard = total = 0
    words = set(CLIP_WORDS)
    for index in range(40):
        clip = generate_clip(5, index, split="train")
        asked = presence_questions(rng, clip, 8)
        assert [q.answer for q in asked] == ["yes"] * 4 + ["no"] * 4
        for q in asked:
            assert presence_answer(clip, q.category, q.form) == q.answer
            hard += q.answer == "no" and q.category in clip.categories
            total += q.answer == "no"
        for q in [*asked, *choice_questions(rng, clip, 2)]:
            assert set(re.findall(WORD_PATTERN, q.prompt)) <= words, q.prompt
    assert 0.2 < hard / total < 0.8
    assert set(clip_vocabulary_words()) <= words and CLIP_WORDS[: len(demo_train.DEMO_WORDS)] == demo_train.DEMO_WORDS


def test_clip_batches_keep_the_question_count_and_label_tokens_per_temporal_step():
    batch = sample_clip_batch(1, 0, clips=6, presence=4, choices=2, image_size=64, frames=8, cell=16)
    assert len(batch.questions) == 6 * 6 and batch.per_clip == 6
    assert batch.patch_labels.shape == (6, 4 * 16) and batch.presence.shape == (6, len(CATEGORIES))
    again = sample_clip_batch(1, 0, clips=6, presence=4, choices=2, image_size=64, frames=8, cell=16)
    assert again.questions == batch.questions and torch.equal(again.patch_labels, batch.patch_labels)
    for b, clip in enumerate(batch.clips):
        mine = batch.questions[b * 6 : (b + 1) * 6]
        assert sum(q.answer == "yes" for q in mine if q.kind == "presence") * 2 == sum(
            q.kind == "presence" for q in mine
        )
        labelled = {CATEGORIES[int(c)] for c in batch.patch_labels[b].unique() if c < len(CATEGORIES)}
        assert labelled <= set(clip.categories)


@pytest.fixture(scope="module")
def video_model(tmp_path_factory):
    """`demo train --model demo-video --steps 2` on a small batch (2 clips a step, 6 monitor clips)."""
    out = tmp_path_factory.mktemp("video") / "model"
    small = replace(DEMO_RECIPES["demo-video"], images_per_step=2, monitor_images=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(DEMO_RECIPES, "demo-video", small)
        result = CliRunner().invoke(app, ["demo", "train", "--model", "demo-video", "--out", str(out), "--steps", "2"])
    assert result.exit_code == 0, result.output
    return out


def test_demo_train_on_clips_monitors_presence_per_window(video_model):
    summary = json.loads((video_model / "training.json").read_text())
    assert summary["recipe"]["clip_frames"] == 8 and summary["recipe"]["init_from"] == "demo-qwen"
    (entry,) = summary["history"]
    assert entry["step"] == 2 and entry["heldout_accuracy"] == entry["task_accuracy"]["presence"]
    assert {"presence:beginning", "presence:end", "presence:video", "choice"} <= set(entry["task_accuracy"])
    vocabulary = load_demo(video_model).tokenizer.get_vocab()
    assert set(CLIP_WORDS) <= set(vocabulary) and "<|video_pad|>" in vocabulary
    # it reads clips at the frame size it was trained on (every frame of a 96 px clip kept at 96 px)
    sampling = json.loads((video_model / "video_sampling.json").read_text())
    assert sampling == {"min_pixels": 96 * 96, "total_pixels": 96 * 96 * 8 // 2}


def test_the_clip_tasks_default_to_the_video_demo_and_its_clip_files():
    from prune_audit.demo import default_demo
    from prune_audit.demo.assets import demo_assets
    from prune_audit.errors import PruneAuditError

    assert default_demo(["video_presence"]) == default_demo(["video_presence", "video_mc"]) == "demo-video"
    assert default_demo(["pope"]) == "demo" and default_demo(["gqa"]) == "demo-tasks"
    with pytest.raises(PruneAuditError, match="no bundled demo answers both"):
        default_demo(["video_mc", "pope"])
    assets = demo_assets(name="demo-video")
    questions, videos, tracks = assets.questions("video_presence")
    assert [path.name for path in questions] == ["demo_video_presence.json"] and tracks is not None
    assert (videos / json.loads(questions[0].read_text())[0]["video"]).is_dir()
    questions, videos, tracks = assets.questions("video_mc")
    assert [path.name for path in questions] == ["demo_mvbench.json"] and tracks is None
    assert json.loads((assets.model_dir / "video_sampling.json").read_text())["min_pixels"] == 96 * 96


def test_the_training_forward_equals_the_stock_video_forward(video_model):
    vlm = load_demo(video_model)
    prompt = clip_prompt(vlm, 96, 8, 2.0)
    clip = generate_clip(9, 0, image_size=96, split="heldout")
    question = presence_questions(np.random.default_rng(0), clip, 2)[1]
    with torch.no_grad():
        target = clip_target(question, "Answer yes or no.")
        suffix = prompt.pieces.suffix(vlm, target.prompt)
        fast = clip_logits(vlm, prompt, clip_features(vlm, (clip,)), [suffix], False)[0]
        from PIL import Image

        frames = [Image.fromarray(frame) for frame in clip.frames]
        read = sample_clip(frames, clip.fps, patch_size=8, merge_size=2, **demo_clip_sampling(96, 8))
        assert read.geometry.video_grid == (4, 6, 6) and read.geometry.frames == tuple(range(8))
        item = vlm.prepare_video(read, target.prompt)
        assert torch.equal(item.input_ids, torch.cat([prompt.prefix, suffix]))
        stock = vlm.model(**stock_inputs(vlm, item)).logits[0, -1]
    assert torch.allclose(fast, stock, atol=1e-4)


def test_demo_clips_prints_the_files_and_a_mix_on_the_video_recipe_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["demo", "clips", "--cache-dir", str(tmp_path / "cache"), "--clips", "3"])
    assert result.exit_code == 0, result.output
    paths = dict(line.split(":", 1) for line in result.output.splitlines())
    assert set(paths) == {"videos", "presence", "mvbench", "tracks"}
    assert len(list(Path(paths["videos"].strip()).iterdir())) == 3
    assert json.loads(Path(paths["presence"].strip()).read_text())[0]["video"] == "clips11_000001"
    refused = CliRunner().invoke(
        app, ["demo", "train", "--model", "demo-video", "--out", str(tmp_path / "m"), "--mix", "4,2,2,1"]
    )
    assert refused.exit_code != 0 and "leave --mix out" in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_the_trained_prompts_are_the_video_tasks_prompts_word_for_word(tmp_path):
    """What `run --task video_presence|video_mc` asks about the demo's clip files is what demo-video trained on
    (the demo tokenizer drops whitespace, so words decide): MVBench's prompt, and the presence question with one of
    the trained instructions."""
    from prune_audit.demo.clip_files import write_clip_files
    from prune_audit.demo.clip_questions import choice_prompt
    from prune_audit.demo.evaluate import DEMO_INSTRUCTIONS
    from prune_audit.tasks import get_task

    files = write_clip_files(tmp_path / "clips", seed=5, clips=12)
    words = re.compile(WORD_PATTERN).findall
    mc = get_task("video_mc")
    entries = json.loads(files.mvbench.read_text())
    for question, entry in zip(mc.read_questions([files.mvbench]), entries, strict=True):
        trained = choice_prompt(entry["question"], tuple(entry["candidates"]))
        assert words(mc.prompt_text(question)) == words(trained)
    presence = get_task("video_presence")
    for question, entry in zip(presence.read_questions([files.presence]), json.loads(files.presence.read_text())):
        asked = words(presence.prompt_text(question))
        assert any(asked == words(f"{entry['question']} {instruction}") for instruction in DEMO_INSTRUCTIONS)
