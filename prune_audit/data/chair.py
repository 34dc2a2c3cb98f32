"""CHAIR: COCO object mentions in a caption, hallucinated and omitted objects.

Re-implements ``utils/chair.py`` of LisaAnne/Hallucination (Rohrbach et al., EMNLP 2018) with its
bundled synonym list (``assets/chair/synonyms.txt``, see its NOTICE.md). As there:

- each synonym line is split on ``", "``; its first entry is the COCO category every entry stands
  for, and a word listed on two lines belongs to the later one. Two entries keep a leading space
  (``" motor bike"``, ``" cheesecake"``) and so never match, exactly as in CHAIR;
- a caption is lowercased, tokenised, each token singularised; adjacent pairs in
  :data:`DOUBLE_WORDS` become one word (``hot dog``, ``teddy bear``, ``dining table``...), ``baby``
  / ``adult`` + animal becomes the animal (not a person), ``passenger`` + jet/train the vehicle,
  ``bow tie`` a tie and ``toilet seat`` a toilet; when ``toilet`` and ``seat`` both occur every
  ``seat`` is dropped (a toilet's seat is no chair);
- every remaining word in the list is a mention of its category, repeats included: CHAIR-i counts
  mentions (hallucinated mentions / all mentions), CHAIR-s whether any mention is hallucinated.

Differences, because nothing may be downloaded at run time (no nltk data, no ``pattern``):
tokens are runs of letters and digits joined by hyphens (``nltk.word_tokenize`` also splits
``dog's`` into ``dog`` + ``'s``, which the two agree on for object words); :func:`singularize`
applies English plural rules and, where rules disagree (``ties``: ``tie`` or ``ty``?), takes the
form CHAIR lists. ``pattern.en.singularize`` turns ``glass`` into ``glas``, which CHAIR mends with
a ``wine glas`` rule; here ``glass`` stays ``glass`` and ``wine glass`` matches directly.
Object recall and omissions (annotated objects never mentioned) are this project's additions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError

SYNONYMS_FILE = Path(__file__).resolve().parents[1] / "assets" / "chair" / "synonyms.txt"
DOUBLE_WORDS = (
    "motor bike",
    "motor cycle",
    "air plane",
    "traffic light",
    "street light",
    "traffic signal",
    "stop light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "suit case",
    "sports ball",
    "baseball bat",
    "baseball glove",
    "tennis racket",
    "wine glass",
    "hot dog",
    "cell phone",
    "mobile phone",
    "teddy bear",
    "hair drier",
    "potted plant",
    "bow tie",
    "laptop computer",
    "stove top oven",
    "home plate",
    "train track",
)
"""Word pairs CHAIR reads as one word (``coco_double_words`` in ``chair.py``)."""
ANIMAL_WORDS = ("bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "animal", "cub")
VEHICLE_WORDS = ("jet", "train")
IRREGULAR_PLURALS = {
    "men": "man",
    "women": "woman",
    "children": "child",
    "feet": "foot",
    "teeth": "tooth",
    "geese": "goose",
    "mice": "mouse",
    "oxen": "ox",
    "knives": "knife",
    "wives": "wife",
    "leaves": "leaf",
    "loaves": "loaf",
    "shelves": "shelf",
    "wolves": "wolf",
    "calves": "calf",
    "halves": "half",
    "scarves": "scarf",
}
_TOKEN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_ES_PLURAL = ("sses", "shes", "ches", "xes", "zzes", "oes")
_NOT_PLURAL = ("ss", "us", "is")


@dataclass(frozen=True)
class ChairVocabulary:
    """CHAIR's words: ``synonyms`` maps each listed word to its COCO category; ``pairs`` the merged pairs."""

    synonyms: dict[str, str]
    pairs: dict[str, str]

    @property
    def categories(self) -> tuple[str, ...]:
        """The categories (first entries of the lines), in file order."""
        return tuple(dict.fromkeys(self.synonyms.values()))

    @property
    def words(self) -> frozenset[str]:
        """Every single word that can end a singularisation: listed words and the parts of pairs."""
        return frozenset(part for word in (*self.synonyms, *self.pairs) for part in word.split(" "))


def read_vocabulary(path: str | Path = SYNONYMS_FILE) -> ChairVocabulary:
    """The synonym list at ``path`` (default: the bundled one) with CHAIR's pair rules."""
    synonyms: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        entries = line.strip().split(", ")
        if not entries[0]:
            raise PruneAuditError(f"{path}:{number}: an empty synonym line; give a COCO category and its synonyms")
        synonyms.update(dict.fromkeys(entries, entries[0]))
    pairs = {pair: pair for pair in DOUBLE_WORDS}
    for animal in ANIMAL_WORDS:
        pairs[f"baby {animal}"] = pairs[f"adult {animal}"] = animal
    for vehicle in VEHICLE_WORDS:
        pairs[f"passenger {vehicle}"] = vehicle
    pairs.update({"bow tie": "tie", "toilet seat": "toilet"})
    return ChairVocabulary(synonyms=synonyms, pairs=pairs)


@lru_cache(maxsize=1)
def default_vocabulary() -> ChairVocabulary:
    """The bundled CHAIR vocabulary, read once."""
    return read_vocabulary()


def with_categories(
    vocabulary: ChairVocabulary, categories: Iterable[str], source: str = "the instances file"
) -> ChairVocabulary:
    """``vocabulary`` plus each one- or two-word name of ``categories`` it does not list, as its own synonym.

    A COCO-format file's category names are COCO's (all listed: nothing changes) unless it annotates
    other objects, such as the demo's shapes; their mentions then count as CHAIR counts COCO's (a
    two-word name is merged as CHAIR's pairs are; longer names cannot be, and are left out). A name
    CHAIR could not match as an object word is refused (``check_category_name``), naming ``source``.
    """
    missing = {name: name for name in categories if name not in vocabulary.synonyms and name not in vocabulary.pairs}
    if not missing:
        return vocabulary
    for name in missing:
        check_category_name(name, source)
    single = {name: name for name in missing if " " not in name}
    pairs = {name: name for name in missing if name.count(" ") == 1}
    return ChairVocabulary(synonyms={**vocabulary.synonyms, **single, **pairs}, pairs={**vocabulary.pairs, **pairs})


FUNCTION_WORDS = frozenset(
    (
        "a",
        "an",
        "the",
        "this",
        "that",
        "these",
        "those",
        "some",
        "any",
        "no",
        "not",
        "and",
        "or",
        "but",
        "of",
        "in",
        "on",
        "at",
        "to",
        "by",
        "for",
        "with",
        "from",
        "as",
        "into",
        "onto",
        "over",
        "under",
        "near",
        "next",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "has",
        "have",
        "it",
        "its",
        "there",
        "here",
        "i",
        "you",
        "he",
        "she",
        "we",
        "they",
        "one",
    )
)
"""Words of nearly every caption ("A dog is on the grass"): a category named by one would be "mentioned" by
every caption, so such names are refused (``check_category_name``)."""


def check_category_name(name: str, source: str) -> None:
    """Refuse an added category name CHAIR cannot match sensibly: one a caption's tokens never spell (capitals,
    punctuation, extra spaces: the object is then omitted from every caption), or one with a function word or a
    word without a letter (then nearly every caption "mentions" it)."""
    words = name.split(" ")
    if len(words) > 2:
        return  # left out, as documented in ``with_categories``
    if _TOKEN.findall(name) != words:
        reason = "captions are matched as lowercase words of letters, digits and hyphens, so it never matches"
    elif any(word in FUNCTION_WORDS or not any(c.isalpha() for c in word) for word in words):
        reason = "it is a word of nearly every caption, so every caption would mention it"
    else:
        return
    raise PruneAuditError(
        f"category {name!r} of {source} cannot name an object in captions: {reason}; rename it "
        f"in the instances file to the object's noun (lowercase, e.g. 'circle' or 'traffic cone')"
    )


def singularize(word: str, known: Collection[str] = ()) -> str:
    """The singular of a lowercase English word; a candidate in ``known`` wins over the plain rule.

    Rules: irregular plurals (men, mice, knives...); ``-ies`` -> ``-y``; ``-sses``, ``-shes``,
    ``-ches``, ``-xes``, ``-zzes``, ``-oes`` lose ``es``; words ending ``ss``, ``us``, ``is`` stay;
    any other ``-s`` is dropped. A word in ``known`` stays as it is (``skis``, ``people``); when the
    rule's result is not in ``known`` but dropping ``s`` (or ``es``, not after ``i``) gives a known
    word, that word is taken (``ties`` -> ``tie``, ``buses`` -> ``bus``).
    """
    if word in known or word in IRREGULAR_PLURALS.values():
        return word
    if word in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[word]
    if len(word) < 3 or not word.endswith("s") or word.endswith(_NOT_PLURAL):
        return word
    if word.endswith("ies") and len(word) > 4:
        rule = word[:-3] + "y"
    elif word.endswith(_ES_PLURAL):
        rule = word[:-2]
    else:
        rule = word[:-1]
    candidates = [rule, word[:-1]]  # ties: "ty" by rule, "tie" listed
    if word.endswith("es") and not word.endswith("ies"):
        candidates.append(word[:-2])  # buses -> bus (but skies is never ski)
    return next((candidate for candidate in candidates if candidate in known), rule)


def caption_words(caption: str, vocabulary: ChairVocabulary | None = None) -> list[str]:
    """The caption's words as CHAIR matches them: lowercased, singularised, pairs merged, toilet seats dropped."""
    vocabulary = vocabulary or default_vocabulary()
    known = vocabulary.words
    tokens = [singularize(token, known) for token in _TOKEN.findall(caption.lower())]
    words, index = [], 0
    while index < len(tokens):
        pair = " ".join(tokens[index : index + 2])
        if pair in vocabulary.pairs:
            words.append(vocabulary.pairs[pair])
            index += 2
        else:
            words.append(tokens[index])
            index += 1
    if "toilet" in words and "seat" in words:
        words = [word for word in words if word != "seat"]
    return words


@dataclass(frozen=True)
class Mention:
    """One object word in a caption: the word as matched and the COCO category it names."""

    word: str
    category: str


def mentions(caption: str, vocabulary: ChairVocabulary | None = None) -> list[Mention]:
    """Every COCO object mention of the caption, in order, repeats included."""
    vocabulary = vocabulary or default_vocabulary()
    return [
        Mention(word, vocabulary.synonyms[word])
        for word in caption_words(caption, vocabulary)
        if word in vocabulary.synonyms
    ]


@dataclass(frozen=True)
class CaptionScore:
    """CHAIR and omissions of one caption against one image's objects.

    Attributes:
        mentions: every object mention (repeats included).
        mentioned: the categories mentioned, each once, in order of first mention.
        hallucinated: mentioned categories not present, each once.
        hallucinated_mentions: mentions of absent categories (repeats included; CHAIR-i's numerator).
        omitted: annotated categories never mentioned, in annotation order.
        annotated: the categories the instances annotate (what recall and omissions count).
    """

    mentions: tuple[Mention, ...]
    mentioned: tuple[str, ...]
    hallucinated: tuple[str, ...]
    hallucinated_mentions: int
    omitted: tuple[str, ...]
    annotated: tuple[str, ...]

    @property
    def chair_i(self) -> float:
        """Hallucinated mentions / mentions; 0 for a caption without mentions (as ``chair.py``)."""
        return self.hallucinated_mentions / len(self.mentions) if self.mentions else 0.0

    @property
    def chair_s(self) -> bool:
        """Whether any mention is hallucinated."""
        return self.hallucinated_mentions > 0

    @property
    def recall(self) -> float:
        """Share of annotated categories mentioned; NaN when nothing is annotated."""
        return 1 - len(self.omitted) / len(self.annotated) if self.annotated else math.nan


def score_caption(
    caption: str,
    annotated: Sequence[str],
    also_present: Collection[str] = (),
    vocabulary: ChairVocabulary | None = None,
) -> CaptionScore:
    """Mentions, hallucinations and omissions of ``caption``.

    Args:
        caption: the generated text.
        annotated: COCO category names of the image's instances (order kept for ``omitted``).
        also_present: further categories that count as present but not as omissions (CHAIR also
            counts objects the reference captions mention; see :func:`caption_objects`).
        vocabulary: default the bundled CHAIR list.
    """
    vocabulary = vocabulary or default_vocabulary()
    truth = [vocabulary.synonyms.get(name, name) for name in dict.fromkeys(annotated)]
    present = {*truth, *also_present}
    found = mentions(caption, vocabulary)
    mentioned = tuple(dict.fromkeys(mention.category for mention in found))
    return CaptionScore(
        mentions=tuple(found),
        mentioned=mentioned,
        hallucinated=tuple(category for category in mentioned if category not in present),
        hallucinated_mentions=sum(mention.category not in present for mention in found),
        omitted=tuple(category for category in truth if category not in mentioned),
        annotated=tuple(truth),
    )


def caption_objects(captions: Sequence[str], vocabulary: ChairVocabulary | None = None) -> set[str]:
    """Categories the reference captions of an image mention (CHAIR's ``get_annotations_from_captions``)."""
    return {mention.category for caption in captions for mention in mentions(caption, vocabulary)}


def chair_metrics(scores: Sequence[CaptionScore]) -> dict[str, Any]:
    """Corpus CHAIR as ``chair.py`` reports it, plus pooled recall and omissions.

    ``chair_s``: share of captions with a hallucination; ``chair_i``: hallucinated mentions / all
    mentions (pooled; 0 without mentions); ``recall``: annotated categories mentioned / annotated
    (pooled); ``omitted``: annotated categories never mentioned (count); ``mentions_per_caption``.
    """
    if not scores:
        raise PruneAuditError("no captions to score")
    mentions_total = sum(len(score.mentions) for score in scores)
    annotated = sum(len(score.annotated) for score in scores)
    omitted = sum(len(score.omitted) for score in scores)
    return {
        "n": len(scores),
        "chair_s": sum(score.chair_s for score in scores) / len(scores),
        "chair_i": sum(score.hallucinated_mentions for score in scores) / mentions_total if mentions_total else 0.0,
        "recall": 1 - omitted / annotated if annotated else math.nan,
        "omitted": omitted,
        "mentions_per_caption": mentions_total / len(scores),
    }
