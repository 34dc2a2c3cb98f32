"""Train the bundled demo model: a small LLaVA, from scratch, on synthetic scenes, on CPU.

Recipe (measured in the demo-model feasibility study, /work/shared/specs/demo-model.md):

* loss: cross-entropy of the answer token (full vocabulary, last prompt position),
  plus two dense signals on the vision tower that stand in for CLIP pretraining:
  a multi-label BCE on the pooled CLS (so the CLS attention means something) and a
  per-patch class-or-background CE on the last layer (hard, achromatic classes
  need it). The two heads are not part of the saved checkpoint.
* data: fresh scenes every step, ``questions_per_image`` (8) questions per image,
  half yes and half no, negatives mixing POPE's three kinds.
* speed: the prompt prefix ``<s> USER : <image>*N`` runs through the language model
  once per image; its cache is repeated for the image's questions and only the
  question suffixes run per question (equal to the full forward; see the tests).
* AdamW (lr 1e-3, betas 0.9/0.98, weight decay 0.05 on matrices), linear warm-up
  then cosine decay to 5 %, gradient clipping at 1, deterministic algorithms,
  everything seeded: a rerun on the same machine with the same thread count gives
  the same weights. One thread is the default: on a shared 2-core machine two
  threads ran 3x slower per step than one (they wait for each other).
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prune_audit.data.scenes import CATEGORIES
from prune_audit.demo.batches import BACKGROUND_CLASS, SceneBatch, pixel_values, sample_batch
from prune_audit.data.pope_build import question_text
from prune_audit.demo.evaluate import DEMO_INSTRUCTIONS, answer, prompt_ids, prompt_text
from prune_audit.models.llava import LlavaModel

# held-out monitoring scenes during training; the demo question set uses another seed
MONITOR_SEED = 7
DEMO_WORDS: tuple[str, ...] = (
    *CATEGORIES,
    *"Is there a an in the image Answer yes or no question using single word phrase".split(),
)


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines a trained demo model (with the torch build and CPU)."""

    seed: int = 1
    steps: int = 1000
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
    text_width: int = 128
    text_layers: int = 3
    heads: int = 4
    monitor_every: int = 100
    monitor_images: int = 100

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


class VisionHeads(nn.Module):
    """Auxiliary heads on the vision tower: pooled CLS -> classes, patch -> class or background."""

    def __init__(self, width: int):
        super().__init__()
        self.presence = nn.Linear(width, len(CATEGORIES))
        self.patch = nn.Linear(width, BACKGROUND_CLASS + 1)


@dataclass(frozen=True)
class PromptPieces:
    """Token ids of the training prompts, split around the image span.

    Attributes:
        prefix: (P,) ids up to and including the last ``<image>`` (shared by all prompts).
        image_positions: (N,) positions of the ``<image>`` tokens in ``prefix``.
        suffixes: (category, instruction index) -> (T,) ids after the image span.
    """

    prefix: Tensor
    image_positions: Tensor
    suffixes: dict[tuple[str, int], Tensor]


def prompt_pieces(processor, num_image_tokens: int) -> PromptPieces:
    """Split every (category, instruction) chat prompt at the end of its image span."""
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    prefix, suffixes = None, {}
    for category in CATEGORIES:
        for index, instruction in enumerate(DEMO_INSTRUCTIONS):
            ids = prompt_ids(processor, prompt_text(processor, question_text(category), instruction), num_image_tokens)
            end = int((ids == image_id).nonzero().max()) + 1
            if prefix is not None and not torch.equal(prefix, ids[:end]):
                raise ValueError("the chat template puts text before the image that depends on the question")
            prefix = ids[:end]
            suffixes[(category, index)] = ids[end:]
    assert prefix is not None
    return PromptPieces(prefix, (prefix == image_id).nonzero().flatten(), suffixes)


def pixel_stats(processor) -> tuple[list[float], list[float]]:
    """The image processor's normalisation (mean, std) per channel."""
    return list(processor.image_processor.image_mean), list(processor.image_processor.image_std)


def batch_loss(
    vlm: LlavaModel, heads: VisionHeads, pieces: PromptPieces, batch: SceneBatch, instructions: np.ndarray
) -> dict[str, Tensor]:
    """Answer CE, CLS presence BCE and patch CE for one batch (and their sum, ``total``).

    Args:
        instructions: (Q,) index into ``DEMO_INSTRUCTIONS`` per question.
    """
    pixels = pixel_values(batch.scenes, *pixel_stats(vlm.processor))
    features, pooled, patches = vlm.vision_states(pixels)
    per_image = len(batch.questions) // len(batch.scenes)
    suffixes = [pieces.suffixes[(q.category, int(i))] for q, i in zip(batch.questions, instructions, strict=True)]
    logits = vlm.shared_prefix_logits(features, pieces.prefix, pieces.image_positions, suffixes, per_image)
    targets = torch.tensor(vlm.tokenizer.convert_tokens_to_ids([q.answer for q in batch.questions]))
    losses = {
        "answer": F.cross_entropy(logits.float(), targets),
        "presence": F.binary_cross_entropy_with_logits(heads.presence(pooled), batch.presence),
        "patch": F.cross_entropy(heads.patch(patches).flatten(0, 1), batch.patch_labels.flatten()),
    }
    losses["total"] = losses["answer"] + losses["presence"] + losses["patch"]
    return losses


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


def monitor_accuracy(vlm: LlavaModel, recipe: DemoRecipe) -> float:
    """Held-out accuracy on ``monitor_images`` fresh scenes through the full-prompt path."""
    batch = sample_batch(
        MONITOR_SEED, 0, images=recipe.monitor_images, questions_per_image=4,
        image_size=recipe.image_size, patch_size=recipe.patch_size, split="heldout",
    )
    with torch.no_grad():
        features = vlm.image_features(pixel_values(batch.scenes, *pixel_stats(vlm.processor)))
    texts = [
        prompt_text(vlm.processor, question_text(q.category), DEMO_INSTRUCTIONS[i % len(DEMO_INSTRUCTIONS)])
        for i, q in enumerate(batch.questions)
    ]
    says_yes = answer(vlm, [features[q.image] for q in batch.questions], texts).says_yes
    truth = torch.tensor([q.answer == "yes" for q in batch.questions])
    return float((says_yes == truth).float().mean())


def _fresh_model(recipe: DemoRecipe, scratch: Path) -> LlavaModel:
    """The adapter around a randomly initialised demo Llava, built by ``models.build``."""
    from prune_audit.demo.evaluate import load_demo
    from prune_audit.models.build import build_llava

    build_llava(
        scratch,
        words=DEMO_WORDS,
        image_size=recipe.image_size,
        patch_size=recipe.patch_size,
        vision_hidden_size=recipe.vision_width,
        vision_intermediate_size=4 * recipe.vision_width,
        vision_layers=recipe.vision_layers,
        vision_heads=recipe.heads,
        text_hidden_size=recipe.text_width,
        text_intermediate_size=(8 * recipe.text_width) // 3,
        text_layers=recipe.text_layers,
        text_heads=recipe.heads,
        seed=recipe.seed,
    )
    return load_demo(scratch)


def train_demo_model(
    recipe: DemoRecipe, out_dir: Path, *, log: Callable[[str], None] = print
) -> dict:
    """Train with ``recipe`` and save the float16 checkpoint + processor in ``out_dir``.

    Returns the training summary that is also written to ``out_dir/training.json``.
    """
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(recipe.seed)
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as scratch:
        vlm = _fresh_model(recipe, Path(scratch))
    vlm.model.train()
    heads = VisionHeads(vlm.model.config.vision_config.hidden_size)
    parameters = [p for p in (*vlm.model.parameters(), *heads.parameters()) if p.requires_grad]
    optimizer = _optimizer(parameters, recipe)
    pieces = prompt_pieces(vlm.processor, recipe.grid**2)
    history, start = [], time.perf_counter()
    for step in range(recipe.steps):
        batch = sample_batch(
            recipe.seed, step, images=recipe.images_per_step, questions_per_image=recipe.questions_per_image,
            image_size=recipe.image_size, patch_size=recipe.patch_size,
        )
        # one instruction per step keeps the suffixes the same length (no padding work)
        instruction = np.random.default_rng([recipe.seed, step, 1]).integers(len(DEMO_INSTRUCTIONS))
        instructions = np.full(len(batch.questions), instruction)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, recipe)
        losses = batch_loss(vlm, heads, pieces, batch, instructions)
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
            accuracy = monitor_accuracy(vlm, recipe)
            vlm.model.train()
            minutes = (time.perf_counter() - start) / 60
            history.append({"step": done, "minutes": round(minutes, 2), "heldout_accuracy": round(accuracy, 4)})
            log(f"monitor step {done}: held-out accuracy {accuracy:.3f} after {minutes:.1f} min")
    summary = {
        "recipe": asdict(recipe),
        "train_minutes": round((time.perf_counter() - start) / 60, 2),
        "history": history,
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
    }
    _save(vlm.model.eval(), vlm.processor, out_dir, summary)
    return summary


def _save(model, processor, out_dir: Path, summary: dict) -> None:
    """Write the float16 checkpoint, processor and summary; replace ``out_dir`` only when complete."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=out_dir.parent))
    try:
        model.to(torch.float16).save_pretrained(staging)
        processor.save_pretrained(staging)
        (staging / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        for item in staging.iterdir():
            out_dir.mkdir(exist_ok=True)
            shutil.move(str(item), out_dir / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
