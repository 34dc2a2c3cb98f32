"""Answer yes/no questions with a demo model through its family's real forward.

The vision tower runs once per image; the language model then takes the full prompt
of each question with the image's projected patch features (all of them, or for LLaVA
a subset in original order for pruning experiments), so the prompt carries exactly as
many image tokens as features are kept. The forward is the adapter's
``first_token_logits`` (the stock ``LlavaForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` forward); prompts come from the adapter's
``prompt`` (the checkpoint's chat format).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from prune_audit.models.base import VisionLanguageModel

# instructions the demo model was trained with after the POPE question (the first is none)
DEMO_INSTRUCTIONS: tuple[str, ...] = ("", "Answer yes or no.", "Answer the question using a single word or phrase.")


def load_demo(model_dir: str | Path) -> VisionLanguageModel:
    """A saved demo checkpoint through :func:`~prune_audit.models.loading.load_vlm` (the family by config
    ``model_type``), on the CPU in float32, eval mode."""
    from prune_audit.models.loading import load_vlm

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(2, "no demo checkpoint (config.json) in this folder", str(model_dir))
    return load_vlm(model_dir, device="cpu", dtype="float32")


def prompt_text(vlm: VisionLanguageModel, question: str, instruction: str = "") -> str:
    """The model's chat prompt for one image and ``question`` (plus ``instruction``)."""
    return vlm.prompt(f"{question} {instruction}".strip())


def prompt_ids(vlm: VisionLanguageModel, text: str, num_image_tokens: int) -> Tensor:
    """(L,) token ids of ``text`` with its single image token expanded to ``num_image_tokens``."""
    ids = vlm.tokenizer(text, return_tensors="pt").input_ids[0]
    image_id = vlm.model.config.image_token_id
    at = (ids == image_id).nonzero().flatten()
    if at.numel() != 1:
        raise ValueError(f"the prompt must hold exactly one image placeholder, found {at.numel()}")
    image = torch.full((num_image_tokens,), image_id, dtype=ids.dtype)
    return torch.cat([ids[: at[0]], image, ids[at[0] + 1 :]])


@dataclass(frozen=True)
class Answers:
    """Per question: p_yes and p_no over the full vocabulary, and whether yes wins."""

    p_yes: Tensor
    p_no: Tensor

    @property
    def says_yes(self) -> Tensor:
        return self.p_yes > self.p_no

    @property
    def confidence(self) -> Tensor:
        """Full-vocabulary probability of the chosen answer."""
        return torch.maximum(self.p_yes, self.p_no)


def answer(vlm: VisionLanguageModel, features: Sequence[Tensor], texts: Sequence[str]) -> Answers:
    """Answer prompts ``texts`` (one ``<image>`` each) given per-question features.

    Args:
        features: per question a (k_i, D) tensor of projected patch features, in
            original grid order; k_i may be smaller than the grid (pruning).
        texts: per question the chat-template prompt (``prompt_text``).
    """
    if len(features) != len(texts):
        raise ValueError(f"{len(features)} feature sets for {len(texts)} prompts")
    ids = [prompt_ids(vlm, text, int(f.shape[0])) for f, text in zip(features, texts, strict=True)]
    pad = vlm.tokenizer.pad_token_id
    length = max(int(i.numel()) for i in ids)
    # left padding keeps every prompt's last token at the final position
    input_ids = torch.full((len(ids), length), pad, dtype=torch.long)
    attention = torch.zeros((len(ids), length), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, length - seq.numel() :] = seq
        attention[row, length - seq.numel() :] = 1
    with torch.no_grad():
        logits = vlm.first_token_logits(input_ids, attention, features)
    probs = torch.softmax(logits.float(), dim=-1)
    yes_id, no_id = vlm.tokenizer.convert_tokens_to_ids(["yes", "no"])
    return Answers(p_yes=probs[:, yes_id], p_no=probs[:, no_id])


def features_by_image(
    vlm: VisionLanguageModel, image_dir: Path, names: Sequence[str], batch_size: int = 64
) -> dict[str, Tensor]:
    """Per image file name, its (N, D) projected features; pixels from the model's own processor."""
    from PIL import Image

    features: dict[str, Tensor] = {}
    unique = list(dict.fromkeys(names))
    for start in range(0, len(unique), batch_size):
        chunk = unique[start : start + batch_size]
        images = [Image.open(Path(image_dir) / name).convert("RGB") for name in chunk]
        with torch.no_grad():
            features.update(zip(chunk, vlm.image_features(**vlm.image_inputs(images)), strict=True))
    return features


def answer_pairs(
    vlm: VisionLanguageModel,
    features: dict[str, Tensor],
    pairs: Sequence[tuple[str, str]],
    *,
    instruction: str = "",
    batch_size: int = 64,
) -> dict[tuple[str, str], Answers]:
    """Answers for unique (image, object) pairs with all of each image's tokens."""
    from prune_audit.data.pope_build import question_text

    unique = list(dict.fromkeys(pairs))
    result: dict[tuple[str, str], Answers] = {}
    for start in range(0, len(unique), batch_size):
        chunk = unique[start : start + batch_size]
        texts = [prompt_text(vlm, question_text(obj), instruction) for _, obj in chunk]
        answers = answer(vlm, [features[image] for image, _ in chunk], texts)
        for row, key in enumerate(chunk):
            result[key] = Answers(p_yes=answers.p_yes[row], p_no=answers.p_no[row])
    return result


def evaluate_question_set(
    vlm: VisionLanguageModel, question_set, *, splits: Sequence[str] | None = None, instruction: str = ""
) -> dict[str, float]:
    """Unpruned accuracy on a demo question set, per split and overall.

    Returns keys ``accuracy`` (all questions of ``splits``), ``<split>`` per split,
    ``yes_accuracy`` / ``no_accuracy`` and ``questions`` (count).
    """
    from prune_audit.data.pope import POPE_SPLITS, load_pope

    splits = tuple(splits or POPE_SPLITS)
    questions = [q for split in splits for q in load_pope(question_set.question_file(split), split)]
    features = features_by_image(vlm, question_set.image_dir, [q.image for q in questions])
    answers = answer_pairs(vlm, features, [(q.image, q.object) for q in questions], instruction=instruction)
    correct = {q: bool(answers[(q.image, q.object)].says_yes) == (q.label == "yes") for q in questions}

    def rate(selected: list) -> float:
        return sum(correct[q] for q in selected) / len(selected)

    summary = {"accuracy": rate(questions), "questions": float(len(questions))}
    summary.update({split: rate([q for q in questions if q.split == split]) for split in splits})
    for label in ("yes", "no"):
        summary[f"{label}_accuracy"] = rate([q for q in questions if q.label == label])
    return summary
