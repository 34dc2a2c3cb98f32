"""Train the bundled demo model: a small LLaVA, from scratch, on synthetic scenes, on CPU.

Recipe (measured in the demo-model feasibility study, /work/shared/specs/demo-model.md):

* loss: cross-entropy of the answer token (full vocabulary, last prompt position),
  plus two dense signals on the vision tower that stand in for CLIP pretraining:
  a multi-label BCE on the pooled CLS (so the CLS attention means something) and a
  per-patch class-or-background CE on the last layer (hard, achromatic classes
  need it). The two heads are not part of the saved checkpoint.
* data: fresh scenes every step, ``questions_per_image`` (8) questions per image,
  half yes and half no, negatives mixing POPE's three kinds. With a task ``mix`` (``--mix``,
  e.g. ``DEFAULT_MIX``), each image also gets short-answer, multiple-choice and caption
  questions (``demo.scene_questions``), the vocabulary grows to ``MIX_WORDS``, and generated
  answers are trained on every answer token and the end token (``demo.answer_targets``), and each
  multiple-choice option's presence is trained at its last word (``answer_targets.option_loss``); the
  monitor then also reports held-out exact match per kind and short-answer form.
* speed: the prompt prefix up to the last image token (``<s> USER : <image>*N``)
  runs through the language model once per image; its cache is repeated for the
  image's questions and only the question suffixes run per question (equal to the
  full forward; see the tests).
* families: the trainer only calls the adapter's public demo methods (``array_inputs``,
  ``vision_states``, ``shared_prefix_logits``, ``image_features``, ``prompt``), so the same
  recipe trains the LLaVA demo (``demo``) and the Qwen2.5-VL demo (``demo-qwen``: 2x2
  patch merge, M-RoPE, dynamic resolution: each step's scenes are drawn at one of
  ``train_sizes``, so the model sees several token grids). On Qwen, which has no CLS,
  both auxiliary heads read the merged tokens (their mean for the presence loss).
* AdamW (lr 1e-3, betas 0.9/0.98, weight decay 0.05 on matrices), linear warm-up
  then cosine decay to 5 %, gradient clipping at 1, deterministic algorithms,
  everything seeded: a rerun on the same machine with the same thread count gives
  the same weights. A run writes ``CHECKPOINT_FILE`` at every monitor step; the same command run
  again on the same folder continues from it, to the same final weights. One thread is the
  default: on a shared 2-core machine two threads ran 3x slower per step than one (they wait
  for each other).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prune_audit.data.pope_build import question_text
from prune_audit.data.scene_clips import CLIP_FPS, CLIP_FRAMES
from prune_audit.data.scenes import CATEGORIES, Scene
from prune_audit.demo.answer_targets import (
    PromptPieces,
    answer_loss,
    answer_target,
    exact_matches,
    forced_box_hits,
    option_loss,
    prompt_pieces,
    teacher_forcing,
)
from prune_audit.demo.batches import (
    BACKGROUND_CLASS,
    WORD_CLASSES,
    MixQuestion,
    SceneBatch,
    full_mix,
    mix_reads,
    sample_batch,
)
from prune_audit.demo.checkpoint import CHECKPOINT_FILE, resume, save_checkpoint
from prune_audit.demo.clip_batches import ClipBatch, sample_clip_batch
from prune_audit.demo.clip_questions import clip_vocabulary_words
from prune_audit.demo.clip_train import ClipPrompt, clip_accuracy, clip_batch_loss, clip_prompt, demo_clip_sampling
from prune_audit.demo.evaluate import DEMO_INSTRUCTIONS, answer, prompt_text
from prune_audit.demo.scene_questions import (
    KINDS,
    SceneQuestion,
    caption_question,
    choice_question,
    ground_questions,
    reading_words,
    short_questions,
    text_question,
    vocabulary_words,
)
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.task_instructions import DEMO_TASK_INSTRUCTIONS, write_task_instructions
from prune_audit.models.video_sampling import write_video_sampling
from prune_audit.safety.atomic import staging_folder

# held-out monitoring scenes during training; the demo question set uses another seed
MONITOR_SEED = 7
DEMO_WORDS: tuple[str, ...] = (
    *CATEGORIES,
    *"Is there a an in the image Answer yes or no question using single word phrase".split(),
)
# a model trained on the task mix also reads and writes the other kinds' words (ids after DEMO_WORDS' ids)
MIX_WORDS: tuple[str, ...] = tuple(dict.fromkeys((*DEMO_WORDS, *vocabulary_words())))
# a mix that reads words or grounds expressions also writes the words and box numbers (ids after MIX_WORDS')
READING_WORDS: tuple[str, ...] = tuple(dict.fromkeys((*MIX_WORDS, *reading_words())))
# the video demo continues demo-qwen: its words first (same ids), then the clip questions' (ids after them)
CLIP_WORDS: tuple[str, ...] = tuple(dict.fromkeys((*DEMO_WORDS, *clip_vocabulary_words())))
CLIP_CHOICES = 2  # choice questions per training clip (presence questions stand in where a clip answers none)
# questions per image of each kind (KINDS order) of the mix recipe: 4 yes/no (balanced), 2 short answers,
# 2 multiple choices (the two-hop kind: with one, 4,2,1,1, it stayed at chance for 1,000 steps) and the
# caption (the same answer whatever the step, so one)
DEFAULT_MIX: tuple[int, ...] = (4, 2, 2, 1)
# the reading stage: yes/no, short, choice, caption, text, ground per image
READING_MIX: tuple[int, ...] = (2, 1, 1, 1, 1, 2)
READING_STEPS = 1200
# the grounding stages: twice the reading stage's grounding questions per image
GROUNDING_MIX: tuple[int, ...] = (2, 1, 1, 1, 1, 4)
GROUNDING_STEPS = 1500
GROUNDING_MORE_STEPS = 1200


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines a trained demo model (with the torch build and CPU)."""

    seed: int = 1
    steps: int = 1200
    images_per_step: int = 32
    questions_per_image: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    threads: int = 1
    image_size: int = 96
    patch_size: int = 8
    vision_width: int = 128
    vision_layers: int = 4
    text_width: int = 64
    text_layers: int = 12
    heads: int = 4
    monitor_every: int = 100
    monitor_images: int = 100
    family: str = "llava"
    merge: int = 1
    train_sizes: tuple[int, ...] = ()
    kv_heads: int = 4
    mix: tuple[int, ...] | None = None
    """Questions per image of each kind in ``KINDS`` order (the task mix, vocabulary ``MIX_WORDS``, or
    ``READING_WORDS`` with reading or grounding questions); None: ``questions_per_image`` yes/no questions and
    ``DEMO_WORDS``, the shipped yes/no demos' recipe."""
    box_sigma: float | None = None
    """The width (in 0-1 box units) of the Gaussian soft target of every box number a grounding answer writes
    (``answer_targets.box_number_targets``); None: each number's one word, as every other answer token."""
    position_head: bool = False
    """Whether an auxiliary head reads each image token's row and column from the projected features
    (``position_loss``)."""
    init_from: str | None = None
    """The ``DEMO_RECIPES`` name of the model this recipe continues (its weights start the run, ``--init``; rows of
    words the vocabulary adds start random); None: from scratch."""
    clip_frames: int | None = None
    """Frames of every training clip (``data.scene_clips``): the recipe trains on clips through Qwen2.5-VL's video
    path (``demo.clip_train``), ``questions_per_image`` presence and ``CLIP_CHOICES`` choice questions per clip,
    ``images_per_step`` clips per step, and monitors ``monitor_images`` held-out clips; None: still scenes."""

    @property
    def words(self) -> tuple[str, ...]:
        """The vocabulary the recipe's questions and answers need (an earlier recipe's words first, same ids)."""
        if self.clip_frames is not None:
            return CLIP_WORDS
        if self.mix is None:
            return DEMO_WORDS
        reads = any(full_mix(self.mix)[KINDS.index(kind)] for kind in ("text", "ground"))
        return READING_WORDS if reads else MIX_WORDS

    @property
    def reads(self) -> bool:
        """Whether the scenes carry words (a mix with reading questions), which the auxiliary heads then label."""
        return self.mix is not None and mix_reads(self.mix)

    @property
    def cell(self) -> int:
        """Pixels per side of one language-model image token (patch times merge)."""
        return self.patch_size * self.merge

    @property
    def grid(self) -> int:
        """Image tokens per side at ``image_size`` (the monitor's and the demo question set's size)."""
        return self.image_size // self.cell

    def step_size(self, step: int) -> int:
        """The scene size of training step ``step`` (one of ``train_sizes``, or ``image_size``)."""
        if not self.train_sizes:
            return self.image_size
        return self.train_sizes[int(np.random.default_rng([self.seed, step, 2]).integers(len(self.train_sizes)))]


# `prune-audit demo train --model NAME` starts from these: the recipes of the two shipped demos. The
# LLaVA demo's language model has 12 layers so that every in-LLM schedule maps to distinct layers and
# budget 16 stays feasible with 144 tokens (8 layers leave 144 / 8 = 18 tokens per layer at layer 0)
DEMO_RECIPES: dict[str, DemoRecipe] = {
    "demo": DemoRecipe(),
    "demo-qwen": DemoRecipe(
        family="qwen2_5_vl",
        merge=2,
        train_sizes=(96, 128),
        text_layers=8,
        text_width=96,
        vision_width=96,
        kv_heads=2,
        steps=1000,
    ),
}
# the task demos' first stages: the same architectures trained on the task mix (twice the steps: nine questions of
# four kinds per image, the multiple-choice options' presence targets included)
DEMO_RECIPES["demo-tasks-stage1"] = replace(DEMO_RECIPES["demo"], steps=2400, mix=DEFAULT_MIX, monitor_every=200)
DEMO_RECIPES["demo-qwen-tasks-stage1"] = replace(
    DEMO_RECIPES["demo-qwen"], steps=2400, mix=DEFAULT_MIX, monitor_every=200
)
# the Qwen2.5-VL task demo reads words too: its four-task model continues as the LLaVA one's reading stage does,
# without grounding (its boxes are Qwen2.5-VL's bbox_2d pixels, which the demo's questions do not write)
DEMO_RECIPES["demo-qwen-tasks"] = replace(
    DEMO_RECIPES["demo-qwen-tasks-stage1"],
    init_from="demo-qwen-tasks-stage1",
    images_per_step=16,
    steps=READING_STEPS,
    mix=READING_MIX[:5],
    learning_rate=5e-4,
    warmup_steps=50,
    monitor_every=100,
)
# the LLaVA task demo reads words and grounds expressions, in three stages after its four-task first stage.
# Reading: all six kinds, grounding weighted most (a box is four numbers to place); warm-up and peak rate are
# halved, as for any fine-tuning of trained weights, and half the scenes per step keep a step near the first stage's
# cost (the grounding answers are long)
DEMO_RECIPES["demo-tasks-reading"] = replace(
    DEMO_RECIPES["demo-tasks-stage1"],
    init_from="demo-tasks-stage1",
    images_per_step=16,
    steps=READING_STEPS,
    mix=READING_MIX,
    learning_rate=5e-4,
    warmup_steps=50,
    monitor_every=100,
)
# grounding: the reading stage's boxes stayed near-constant with one-word number targets, so every box number is
# trained towards a Gaussian over the box numbers (a near miss costs less than a far one), the image features learn
# to carry each token's position (they carried none), grounding weighs twice as much again, and the other kinds
# stay in the mix so that their accuracy holds
DEMO_RECIPES["demo-tasks-grounding"] = replace(
    DEMO_RECIPES["demo-tasks-reading"],
    init_from="demo-tasks-reading",
    steps=GROUNDING_STEPS,
    mix=GROUNDING_MIX,
    box_sigma=0.02,
    position_head=True,
)
# the shipped task demo: the grounding stage, still improving at its end (its monitor rose about 2 points per 100
# steps), continues on the same mix from a lower peak rate
DEMO_RECIPES["demo-tasks"] = replace(
    DEMO_RECIPES["demo-tasks-grounding"],
    init_from="demo-tasks-grounding",
    steps=GROUNDING_MORE_STEPS,
    learning_rate=3e-4,
)
# the video demo: demo-qwen's weights continue on clips of moving, appearing and vanishing shapes (issue 43), at
# one size (96 px: 4 temporal steps x 36 tokens = 144 clip tokens); the fine-tuning's halved peak rate and warm-up,
# 8 clips (32 frame pairs, as many vision-tower cells as 32 still scenes) of 10 questions per step
DEMO_RECIPES["demo-video"] = replace(
    DEMO_RECIPES["demo-qwen"],
    init_from="demo-qwen",
    clip_frames=CLIP_FRAMES,
    train_sizes=(),
    images_per_step=8,
    questions_per_image=8,
    learning_rate=5e-4,
    warmup_steps=50,
    steps=1800,
    monitor_every=100,
    monitor_images=60,
)


class VisionHeads(nn.Module):
    """Auxiliary heads on the vision tower: pooled CLS -> classes, patch -> class or background; ``words``: also
    the scene words (``WORD_CLASSES`` more of each, ``demo.batches``), for a mix that reads; ``feature_width``: also
    each image token's (row, column) from the projected features the language model reads (``position_loss``)."""

    def __init__(self, width: int, words: bool = False, feature_width: int | None = None):
        super().__init__()
        extra = WORD_CLASSES if words else 0
        self.presence = nn.Linear(width, len(CATEGORIES) + extra)
        self.patch = nn.Linear(width, BACKGROUND_CLASS + 1 + extra)
        self.position = None if feature_width is None else nn.Linear(feature_width, 2)


def position_loss(head: nn.Linear, features: Tensor) -> Tensor:
    """Mean squared error of each image token's predicted (row, column) centre, in 0-1 of the square grid, scaled
    by 12 (the variance of a uniform position is 1/12, so guessing the centre everywhere costs about 1).

    Grounding writes where a shape is, but the first stages' image features hold no position a linear probe finds
    (R^2 below 0 for the row and the column on held-out scenes; the card), so this head asks the language model's
    input for it.

    Args:
        features: (B, N, D) projected image features of square grids, tokens row-major.
    """
    side = math.isqrt(features.shape[1])
    centres = (torch.arange(side, dtype=features.dtype) + 0.5) / side
    target = torch.stack(torch.meshgrid(centres, centres, indexing="ij"), -1).reshape(-1, 2)
    return 12 * F.mse_loss(head(features), target.expand(features.shape[0], -1, -1))


def scene_inputs(vlm: VisionLanguageModel, scenes) -> dict[str, Tensor]:
    """The adapter's vision inputs for generated scenes (square, already at a size the model takes)."""
    return vlm.array_inputs(torch.from_numpy(np.stack([scene.image for scene in scenes])))


def batch_loss(
    vlm: VisionLanguageModel,
    heads: VisionHeads,
    pieces: PromptPieces,
    batch: SceneBatch,
    instruction: str,
    box_sigma: float | None = None,
) -> dict[str, Tensor]:
    """Answer CE, presence BCE (pooled CLS, or mean token), patch CE and, when a question offers options, the
    option-presence CE (``answer_targets.option_loss``) for one batch (and their sum, ``total``).

    Args:
        instruction: text after every yes/no question of the batch (one of ``DEMO_INSTRUCTIONS``).
        box_sigma: the width of the box numbers' soft targets (``answer_targets.answer_loss``); None: one word.
    """
    features, pooled, patches = vlm.vision_states(**scene_inputs(vlm, batch.scenes))
    forcing = teacher_forcing(vlm, pieces, [answer_target(q, instruction) for q in batch.questions])
    side = math.isqrt(features.shape[1])
    logits = vlm.shared_prefix_logits(
        features,
        pieces.prefix,
        pieces.image_positions,
        forcing.suffixes,
        len(batch.questions) // len(batch.scenes),
        grid=(side, side),
        every_position=forcing.every_position,
    )
    losses = {
        "answer": answer_loss(logits, forcing, box_sigma),
        "presence": F.binary_cross_entropy_with_logits(heads.presence(pooled), batch.presence),
        "patch": F.cross_entropy(heads.patch(patches).flatten(0, 1), batch.patch_labels.flatten()),
    }
    if heads.position is not None:
        losses["position"] = position_loss(heads.position, features)
    if forcing.option_rows.numel():  # multiple choice: each option's presence at its last word
        losses["options"] = option_loss(logits, forcing)
    losses["total"] = sum(losses.values())
    return losses


def check_init(recipe: DemoRecipe, init_dir: Path | None) -> None:
    """Refuse (``ValueError``, one line) a continuing recipe without ``init_dir``, or with a folder whose
    ``training.json`` names another recipe than ``recipe.init_from``; nothing to check for a recipe from scratch."""
    if recipe.init_from is None:
        return
    earlier = DEMO_RECIPES[recipe.init_from]
    summary = Path(init_dir or "") / "training.json"
    if init_dir is None or not summary.is_file():
        raise ValueError(f"the recipe continues {recipe.init_from}: pass --init with the folder of that model")
    try:
        trained = json.loads(summary.read_text())["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        trained = None
    expected = json.loads(json.dumps(asdict(earlier)))
    defaults = json.loads(json.dumps(asdict(DemoRecipe())))
    # fields added to the recipe since that model was trained are absent from its file, at their default
    if not isinstance(trained, dict) or trained != {
        key: value for key, value in expected.items() if key in trained or value != defaults[key]
    }:
        raise ValueError(f"{init_dir} was not trained by the {recipe.init_from} recipe; pass that model's folder")


def start_from(vlm: VisionLanguageModel, recipe: DemoRecipe, init_dir: Path | None) -> None:
    """Load the weights of ``init_dir``, a model trained by ``DEMO_RECIPES[recipe.init_from]``, into ``vlm``, whose
    vocabulary holds that model's words (at other ids, possibly): each word's embedding and output rows move to its
    new id; the rows of added words keep their random start. Refused when the folder's ``training.json`` names
    another recipe or a word of the earlier vocabulary is missing.
    """
    from prune_audit.demo.evaluate import load_demo

    check_init(recipe, init_dir)
    start = load_demo(init_dir)
    old_vocab, new_vocab = start.tokenizer.get_vocab(), vlm.tokenizer.get_vocab()
    missing = sorted(set(old_vocab) - set(new_vocab))
    if missing:
        raise ValueError(f"the recipe's vocabulary lacks words of {init_dir}: {', '.join(missing)}")
    old_ids = torch.tensor(list(old_vocab.values()))
    new_ids = torch.tensor([new_vocab[word] for word in old_vocab])
    state = vlm.model.state_dict()
    with torch.no_grad():
        for name, value in start.model.state_dict().items():
            if value.shape == state[name].shape and value.shape[:1] != (len(old_vocab),):
                state[name].copy_(value.float())
            else:  # a per-word table (input embeddings, output head): rows by word
                state[name][new_ids] = value.float()[old_ids]


def learning_rate_at(step: int, recipe: DemoRecipe) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_fraction`` of the peak."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    floor = recipe.final_lr_fraction
    return recipe.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(parameters: list[nn.Parameter], recipe: DemoRecipe) -> torch.optim.AdamW:
    matrices = [p for p in parameters if p.ndim >= 2]
    others = [p for p in parameters if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": recipe.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=(0.9, 0.98))


def monitor_accuracy(vlm: VisionLanguageModel, recipe: DemoRecipe) -> float:
    """Held-out accuracy on ``monitor_images`` fresh scenes (``image_size``) through the full-prompt path."""
    batch = sample_batch(
        MONITOR_SEED,
        0,
        images=recipe.monitor_images,
        questions_per_image=4,
        image_size=recipe.image_size,
        patch_size=recipe.cell,
        split="heldout",
    )
    with torch.no_grad():
        features = vlm.image_features(**scene_inputs(vlm, batch.scenes))
    texts = [
        prompt_text(vlm, question_text(q.category), DEMO_INSTRUCTIONS[i % len(DEMO_INSTRUCTIONS)])
        for i, q in enumerate(batch.questions)
    ]
    says_yes = answer(vlm, [features[q.image] for q in batch.questions], texts).says_yes
    truth = torch.tensor([q.answer == "yes" for q in batch.questions])
    return float((says_yes == truth).float().mean())


def monitor_task_accuracy(vlm: VisionLanguageModel, recipe: DemoRecipe) -> dict[str, float]:
    """Held-out exact match per short-answer form and per kind (short, choice, caption) on ``monitor_images``
    fresh scenes: every unambiguous short question of a scene, one choice and its caption, teacher-forced
    (equal to greedy decoding's exact match, see ``demo.answer_targets``)."""
    batch = sample_batch(
        MONITOR_SEED,
        0,
        images=recipe.monitor_images,
        questions_per_image=2,
        image_size=recipe.image_size,
        patch_size=recipe.cell,
        split="heldout",
        mix=recipe.mix,  # scenes with a word when the mix reads (the shapes are those without)
    )
    rng = np.random.default_rng([MONITOR_SEED, 1])
    asked = [
        MixQuestion(b, q)
        for b, scene in enumerate(batch.scenes)
        for q in (*short_questions(scene), choice_question(rng, scene), caption_question(scene), *_reading(scene))
    ]
    pieces = prompt_pieces(vlm, recipe.grid**2)
    correct: dict[str, list[bool]] = {}
    with torch.no_grad():
        features = vlm.image_features(**scene_inputs(vlm, batch.scenes))
        for b, image_features in enumerate(features):  # per image: its questions share its prefix
            mine = [q for q in asked if q.image == b]
            forcing = teacher_forcing(vlm, pieces, [answer_target(q, "") for q in mine])
            logits = vlm.shared_prefix_logits(
                image_features[None],
                pieces.prefix,
                pieces.image_positions,
                forcing.suffixes,
                len(mine),
                grid=(recipe.grid, recipe.grid),
                every_position=forcing.every_position,
            )
            box_hits = forced_box_hits(logits, forcing).tolist()
            for k, (question, hit) in enumerate(zip(mine, exact_matches(logits, forcing).tolist(), strict=True)):
                asked_kind = question.question.kind
                for key in (asked_kind, f"short:{question.question.form}") if asked_kind == "short" else (asked_kind,):
                    correct.setdefault(key, []).append(hit)
                if asked_kind == "ground":
                    correct.setdefault("ground@0.5", []).append(box_hits[k])
    return {key: round(sum(hits) / len(hits), 4) for key, hits in sorted(correct.items())}


def _reading(scene: Scene) -> list[SceneQuestion]:
    """The monitor's reading and grounding questions of a scene drawn with a word (none for another scene)."""
    reading = text_question(scene)
    return [] if reading is None else [reading, *ground_questions(scene)]


def _fresh_model(recipe: DemoRecipe, scratch: Path) -> VisionLanguageModel:
    """The adapter around a randomly initialised demo model of ``recipe.family``, built by its ``build_tiny``."""
    from prune_audit.demo.evaluate import load_demo
    from prune_audit.models.llava import LlavaModel
    from prune_audit.models.qwen import QwenModel

    shared = {
        "words": recipe.words,
        "patch_size": recipe.patch_size,
        "vision_hidden_size": recipe.vision_width,
        "vision_intermediate_size": 4 * recipe.vision_width,
        "vision_layers": recipe.vision_layers,
        "vision_heads": recipe.heads,
        "text_hidden_size": recipe.text_width,
        "text_intermediate_size": (8 * recipe.text_width) // 3,
        "text_layers": recipe.text_layers,
        "text_heads": recipe.heads,
        "seed": recipe.seed,
    }
    if recipe.family == "llava":
        LlavaModel.build_tiny(scratch, image_size=recipe.image_size, **shared)
    elif recipe.family == "qwen2_5_vl":
        head_dim = recipe.text_width // recipe.heads
        sizes = recipe.train_sizes or (recipe.image_size,)
        # M-RoPE: temporal, height and width share the rotary frequencies about equally
        section = (head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6)
        QwenModel.build_tiny(
            scratch,
            image_size=recipe.image_size,
            spatial_merge_size=recipe.merge,
            text_kv_heads=recipe.kv_heads,
            mrope_section=section,
            min_pixels=min(sizes) ** 2,
            max_pixels=max(sizes) ** 2,
            **shared,
        )
    else:
        raise ValueError(f"no demo recipe for the family {recipe.family!r}; use llava or qwen2_5_vl")
    return load_demo(scratch)


def _prompts(vlm: VisionLanguageModel, recipe: DemoRecipe) -> dict[int, PromptPieces] | ClipPrompt:
    """The training prompts: per scene size its prompt pieces, or the clip prompt of a video recipe."""
    if recipe.clip_frames is not None:
        return clip_prompt(vlm, recipe.image_size, recipe.clip_frames, CLIP_FPS)
    return {size: prompt_pieces(vlm, (size // recipe.cell) ** 2) for size in recipe.train_sizes or (recipe.image_size,)}


def _step_losses(
    vlm: VisionLanguageModel,
    heads: VisionHeads,
    recipe: DemoRecipe,
    step: int,
    pieces: dict[int, PromptPieces] | ClipPrompt,
) -> dict[str, Tensor]:
    """The losses of training step ``step``: its fresh scenes (or clips) and their questions."""
    # one instruction per step keeps the yes/no suffixes the same length (less padding work)
    instruction = DEMO_INSTRUCTIONS[np.random.default_rng([recipe.seed, step, 1]).integers(len(DEMO_INSTRUCTIONS))]
    if isinstance(pieces, ClipPrompt):
        clips = _clip_batch(recipe, recipe.seed, step, recipe.images_per_step, "train")
        return clip_batch_loss(vlm, heads, pieces, clips, instruction)
    size = recipe.step_size(step)
    batch = sample_batch(
        recipe.seed,
        step,
        images=recipe.images_per_step,
        questions_per_image=recipe.questions_per_image,
        image_size=size,
        patch_size=recipe.cell,
        mix=recipe.mix,
    )
    return batch_loss(vlm, heads, pieces[size], batch, instruction, recipe.box_sigma)


def _clip_batch(recipe: DemoRecipe, seed: int, step: int, clips: int, split: str) -> ClipBatch:
    """Clip batch ``step`` of the stream ``(split, seed)`` at the video recipe's size and frame count."""
    return sample_clip_batch(
        seed,
        step,
        clips=clips,
        presence=recipe.questions_per_image,
        choices=CLIP_CHOICES,
        image_size=recipe.image_size,
        frames=recipe.clip_frames or CLIP_FRAMES,
        cell=recipe.cell,
        split=split,
    )


def _monitor(
    vlm: VisionLanguageModel, recipe: DemoRecipe, pieces: dict[int, PromptPieces] | ClipPrompt
) -> tuple[float, dict[str, float]]:
    """Held-out yes/no accuracy (a video recipe: presence accuracy) and the accuracy per task, kind or window."""
    if isinstance(pieces, ClipPrompt):
        held_out = _clip_batch(recipe, MONITOR_SEED, 0, recipe.monitor_images, "heldout")
        tasks = clip_accuracy(vlm, pieces, held_out)
        return tasks["presence"], tasks
    accuracy = monitor_accuracy(vlm, recipe)
    return accuracy, monitor_task_accuracy(vlm, recipe) if recipe.mix is not None else {}


def train_demo_model(
    recipe: DemoRecipe, out_dir: Path, *, init_dir: Path | None = None, log: Callable[[str], None] = print
) -> dict:
    """Train with ``recipe`` and save the float16 checkpoint + processor in ``out_dir``; ``init_dir``: the model
    ``recipe.init_from`` trained, whose weights start the run.

    Returns the training summary that is also written to ``out_dir/training.json``.
    """
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(recipe.seed)
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as scratch:
        vlm = _fresh_model(recipe, Path(scratch))
    if recipe.init_from is not None:
        start_from(vlm, recipe, init_dir)
    vlm.model.train()
    feature_width = recipe.text_width if recipe.position_head else None  # the projector writes the LM width
    heads = VisionHeads(vlm.vision_state_width, words=recipe.reads, feature_width=feature_width)
    parameters = [p for p in (*vlm.model.parameters(), *heads.parameters()) if p.requires_grad]
    optimizer = _optimizer(parameters, recipe)
    pieces = _prompts(vlm, recipe)
    first, history, minutes_before = resume(out_dir, recipe, vlm, heads, optimizer)
    if first:
        log(f"resuming from step {first}/{recipe.steps} ({CHECKPOINT_FILE} in {out_dir})")
    start = time.perf_counter() - 60 * minutes_before
    for step in range(first, recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, recipe)
        losses = _step_losses(vlm, heads, recipe, step, pieces)
        optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(parameters, recipe.grad_clip)
        optimizer.step()
        done = step + 1
        if done % 10 == 0 or done == recipe.steps:
            parts = " ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
            log(f"step {done}/{recipe.steps} {parts} elapsed {time.perf_counter() - start:.0f}s")
        if done % recipe.monitor_every == 0 or done == recipe.steps:
            vlm.model.eval()
            accuracy, tasks = _monitor(vlm, recipe, pieces)
            vlm.model.train()
            minutes = (time.perf_counter() - start) / 60
            entry = {"step": done, "minutes": round(minutes, 2), "heldout_accuracy": round(accuracy, 4)}
            history.append({**entry, "task_accuracy": tasks} if tasks else entry)
            by_task = "".join(f", {key} {value:.3f}" for key, value in tasks.items())
            log(f"monitor step {done}: held-out accuracy {accuracy:.3f}{by_task} after {minutes:.1f} min")
            if done < recipe.steps:
                save_checkpoint(out_dir, recipe, done, minutes, history, vlm, heads, optimizer)
    summary = {
        "recipe": asdict(recipe),
        "train_minutes": round((time.perf_counter() - start) / 60, 2),
        "history": history,
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
    }
    clips = None if recipe.clip_frames is None else demo_clip_sampling(recipe.image_size, recipe.clip_frames)
    _save(vlm, out_dir, summary, clips)
    return summary


def _save(vlm: VisionLanguageModel, out_dir: Path, summary: dict, clip_sampling: dict[str, int] | None) -> None:
    """Write the float16 checkpoint, its processing parts and summary (and ``clip_sampling``, the frame sizes a
    model trained on clips reads them at: ``models.video_sampling``); replace files in ``out_dir`` only when
    every one is complete.

    They are prepared in a staging folder inside ``out_dir`` (never beside it, in a folder
    of someone else's), which the next ``hold_output_dir`` removes if a kill leaves it.
    """
    # LLaVA saves one processor; Qwen2.5-VL its image processor and tokenizer (no video processor)
    processor = getattr(vlm, "processor", None)
    parts = [processor] if processor is not None else [vlm.image_processor, vlm.tokenizer]
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(out_dir)
    try:
        vlm.model.eval().to(torch.float16).save_pretrained(staging)
        for part in parts:
            part.save_pretrained(staging)
        (staging / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_task_instructions(staging, DEMO_TASK_INSTRUCTIONS)  # evaluated as trained: POPE questions bare
        if clip_sampling is not None:
            write_video_sampling(staging, clip_sampling)
        for item in staging.iterdir():
            os.replace(item, out_dir / item.name)
        (out_dir / CHECKPOINT_FILE).unlink(missing_ok=True)  # the trained model supersedes it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
