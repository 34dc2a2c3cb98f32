"""Build POPE-style question sets from any COCO instances file.

Re-implements the rules of POPE's builder (AoiDragon/POPE ``main.py`` + ``utils.py``,
defaults ``--sample_num 3 --img_num 500``; evaluation spec A1), seeded:

- keep images with at least ``sample_num`` distinct objects and sample ``sample_images``
  of them (``random.Random(seed).sample``);
- per image, the first ``sample_num`` objects are the positives (objects are the image's
  categories in order of first appearance among its annotations; POPE's own object lists
  came from a file that is not public);
- after each positive, one negative that is neither an object of the image nor already
  asked about: ``random`` draws uniformly from the objects of the sampled images,
  ``popular`` takes the most frequent such object (image counts over the sample),
  ``adversarial`` the object co-occurring most often with the positive; both fall back
  to the random rule. Count ties keep first-seen order, as POPE's stable sorts do.

The text is ``Is there a/an <object> in the image?`` with the article fixed (no "imange").
Each split draws from its own generator seeded by (seed, split), so a split does not
depend on which other splits are built.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from prune_audit.data.coco import CocoInstances
from prune_audit.data.pope import POPE_SPLITS, PopeQuestion
from prune_audit.errors import PruneAuditError
from prune_audit.safety.atomic import write_files
from prune_audit.safety.inputs import check_image_name
from prune_audit.safety.names import check_plain_name


def question_text(obj: str) -> str:
    """POPE's template with "an" before a vowel."""
    article = "an" if obj[:1] in ("a", "e", "i", "o", "u") else "a"
    return f"Is there {article} {obj} in the image?"


def _co_occurrence(object_lists: Iterable[Sequence[str]]) -> dict[str, list[str]]:
    """For each object, the others ordered by how many sampled images hold both (ties: first seen)."""
    counts: dict[str, Counter[str]] = {}
    for objects in object_lists:
        for obj in objects:
            row = counts.setdefault(obj, Counter())
            row.update(other for other in objects if other != obj)
    return {obj: [other for other, _ in row.most_common()] for obj, row in counts.items()}


class _NegativeSampler:
    """POPE's three negative rules over the objects of the sampled images."""

    def __init__(self, object_lists: Sequence[Sequence[str]], rng: random.Random) -> None:
        image_counts = Counter(obj for objects in object_lists for obj in objects)
        self.vocabulary = list(image_counts)
        self.by_popularity = [obj for obj, _ in image_counts.most_common()]
        self.co_occurring = _co_occurrence(object_lists)
        self.rng = rng

    def random_object(self, excluded: set[str]) -> str:
        if not set(self.vocabulary) - excluded:
            raise PruneAuditError("no object left to ask about as a negative; sample more images")
        while True:
            obj = self.rng.choice(self.vocabulary)
            if obj not in excluded:
                return obj

    def negative(self, split: str, positive: str, excluded: set[str]) -> str:
        ranked = {"popular": self.by_popularity, "adversarial": self.co_occurring.get(positive, [])}.get(split, [])
        for obj in ranked:
            if obj not in excluded:
                return obj
        return self.random_object(excluded)


def sample_pope_images(coco: CocoInstances, sample_images: int | None, seed: int, sample_num: int = 3) -> list[int]:
    """Ids of the sampled images (those with >= sample_num objects), in sample order."""
    eligible = [image_id for image_id in coco.images if len(coco.object_names(image_id)) >= sample_num]
    if sample_images is None:
        sample_images = len(eligible)
    if sample_images > len(eligible):
        raise PruneAuditError(
            f"only {len(eligible)} images in {coco.source} have {sample_num} or more objects; "
            f"cannot sample {sample_images}"
        )
    return random.Random(seed).sample(eligible, sample_images)


def build_pope(
    coco: CocoInstances,
    *,
    sample_images: int | None = 500,
    seed: int = 0,
    splits: Sequence[str] = POPE_SPLITS,
    sample_num: int = 3,
) -> dict[str, list[PopeQuestion]]:
    """POPE questions per split: per image ``sample_num`` x (yes, no), ids from 1 in each split.

    Args:
        coco: the instances file the objects come from.
        sample_images: number of images to sample, None for every eligible image.
        seed: seeds the image sample and each split's negatives.
        splits: any of random / popular / adversarial.
        sample_num: positives per image (POPE: 3).
    """
    unknown = [split for split in splits if split not in POPE_SPLITS]
    if unknown:
        raise PruneAuditError(f"unknown POPE split(s) {', '.join(unknown)}; expected {', '.join(POPE_SPLITS)}")
    image_ids = sample_pope_images(coco, sample_images, seed, sample_num)
    object_lists = [coco.object_names(image_id) for image_id in image_ids]
    result = {}
    for split in splits:
        sampler = _NegativeSampler(object_lists, random.Random(f"{seed}:{split}"))
        questions: list[PopeQuestion] = []
        for image_id, objects in zip(image_ids, object_lists):
            image = check_image_name(coco.images[image_id].file_name, f"{coco.source}: image {image_id}")
            asked: list[str] = []
            for positive in objects[:sample_num]:
                asked.append(positive)
                negative = sampler.negative(split, positive, set(asked) | set(objects))
                asked.append(negative)
                for obj, label in ((positive, "yes"), (negative, "no")):
                    questions.append(PopeQuestion(len(questions) + 1, split, image, question_text(obj), label, obj))
        result[split] = questions
    return result


def pope_lines(questions: Iterable[PopeQuestion]) -> str:
    """JSON Lines in POPE's file format (``question_id``, ``image``, ``text``, ``label``)."""
    return "".join(
        json.dumps({"question_id": q.question_id, "image": q.image, "text": q.text, "label": q.label}) + "\n"
        for q in questions
    )


def write_pope_files(
    question_sets: dict[str, list[PopeQuestion]], out_dir: str | Path, prefix: str = "coco"
) -> list[Path]:
    """Write ``<prefix>_pope_<split>.json`` per split, all or nothing (``safety.atomic.write_files``: staged in a
    hidden folder, then renamed; a killed build's staging folder is removed by the next build of ``out_dir``).

    ``prefix`` and the split names must be plain names, so every file lands inside ``out_dir``.
    """
    check_plain_name(prefix, "--prefix")
    for split in question_sets:
        check_plain_name(split, "--split")
    files = {f"{prefix}_pope_{split}.json": pope_lines(questions) for split, questions in question_sets.items()}
    return write_files(Path(out_dir), files)
