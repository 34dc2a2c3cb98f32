"""Does the demo model look at the object? Remove its tokens and see.

For every positive question of the demo set (unique (image, object) pairs), the LLM
input keeps a subset of the image's projected patch tokens, in original order:

* ``full``: every token;
* ``drop_object``: every token whose patch holds a pixel of the queried object removed
  (``k`` tokens);
* ``drop_random_nonobject``: ``k`` random tokens not touching the queried object removed;
* ``drop_random_background``: ``k`` random tokens touching no object at all removed
  (pairs where fewer than ``k`` such tokens exist are skipped for this condition).

The token count is the same in the three drop conditions, so a model that reads the
object's tokens fails only in ``drop_object``. Patch membership comes from the exact
COCO masks through the model's token geometry (``data.geometry``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from prune_audit.demo.evaluate import answer, features_by_image, prompt_text

if TYPE_CHECKING:
    from prune_audit.models.llava import LlavaModel

CONDITIONS = ("full", "drop_object", "drop_random_nonobject", "drop_random_background")
CONFIDENT = 0.9


@dataclass(frozen=True)
class ConditionResult:
    """Positive questions under one condition.

    Attributes:
        pairs: questions answered.
        accuracy: share answered "yes".
        mean_confidence: mean full-vocabulary probability of the chosen answer.
        wrong_confidence: the same over wrong answers (NaN when none).
        wrong_confident_share: share of wrong answers with confidence above 0.9.
    """

    pairs: int
    accuracy: float
    mean_confidence: float
    wrong_confidence: float
    wrong_confident_share: float


def _token_sets(coco, geometry, image_id: int, obj: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(object tokens, tokens not touching the object, tokens touching no object), ascending."""
    from prune_audit.data.geometry import mask_area_per_token

    everything = np.zeros((geometry.image_height, geometry.image_width), dtype=bool)
    for ann in coco.annotations_by_image[image_id]:
        everything |= coco.annotation_mask(ann)
    on_object = mask_area_per_token(coco.category_mask(image_id, obj), geometry) > 0
    on_any = mask_area_per_token(everything, geometry) > 0
    return np.flatnonzero(on_object), np.flatnonzero(~on_object), np.flatnonzero(~on_any)


def kept_tokens(coco, geometry, image_id: int, obj: str, rng: np.random.Generator) -> dict[str, np.ndarray | None]:
    """Per condition, the ascending grid indices kept (None when the condition cannot apply)."""
    object_tokens, non_object, background = _token_sets(coco, geometry, image_id, obj)
    everything = np.arange(geometry.num_tokens)
    k = object_tokens.size

    def drop(pool: np.ndarray) -> np.ndarray | None:
        if pool.size < k:
            return None
        return np.setdiff1d(everything, rng.choice(pool, size=k, replace=False))

    return {
        "full": everything,
        "drop_object": np.setdiff1d(everything, object_tokens),
        "drop_random_nonobject": drop(non_object),
        "drop_random_background": drop(background),
    }


def object_removal(
    vlm: LlavaModel,
    question_set,
    *,
    seed: int = 0,
    max_pairs: int | None = None,
    instruction: str = "",
    batch_size: int = 64,
) -> dict[str, ConditionResult]:
    """Run the four conditions over the positive (image, object) pairs of ``question_set``."""
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope import POPE_SPLITS, load_pope
    from prune_audit.data.pope_build import question_text

    coco = CocoInstances.load(question_set.instances)
    positives = [
        (q.image, q.object)
        for split in POPE_SPLITS
        for q in load_pope(question_set.question_file(split), split)
        if q.label == "yes"
    ]
    pairs = list(dict.fromkeys(positives))[:max_pairs]
    features = features_by_image(vlm, question_set.image_dir, [image for image, _ in pairs])
    rng = np.random.default_rng(seed)
    jobs: dict[str, list[tuple[torch.Tensor, str]]] = {c: [] for c in CONDITIONS}
    for image, obj in pairs:
        image_id = coco.image_id(image)
        geometry = vlm.token_geometry(coco.image(image_id).size)
        text = prompt_text(vlm, question_text(obj), instruction)
        for condition, kept in kept_tokens(coco, geometry, image_id, obj, rng).items():
            if kept is not None:
                jobs[condition].append((features[image][torch.from_numpy(kept)], text))
    return {condition: _score(vlm, items, batch_size) for condition, items in jobs.items()}


def _score(vlm: LlavaModel, items: Sequence[tuple[torch.Tensor, str]], batch_size: int) -> ConditionResult:
    says_yes, confidence = [], []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        answers = answer(vlm, [f for f, _ in chunk], [t for _, t in chunk])
        says_yes.append(answers.says_yes)
        confidence.append(answers.confidence)
    yes = torch.cat(says_yes).numpy()
    conf = torch.cat(confidence).numpy()
    wrong = conf[~yes]
    return ConditionResult(
        pairs=int(yes.size),
        accuracy=float(yes.mean()),
        mean_confidence=float(conf.mean()),
        wrong_confidence=float(wrong.mean()) if wrong.size else float("nan"),
        wrong_confident_share=float((wrong > CONFIDENT).mean()) if wrong.size else float("nan"),
    )
