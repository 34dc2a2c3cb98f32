"""The demo's GQA, ScienceQA and caption question files, in the formats the tasks read.

Built from the demo question set's held-out scenes (the images the POPE files ask about, same
seed, size and file names), regenerated with ``data.scenes.generate_scene`` so every answer and
evidence region is exact, and written once into the cache beside the question set:

* GQA (``--task gqa``): GQA's question JSON (answer, ``fullAnswer`` and the ``annotations`` that
  map word spans of question, answer and full answer to scene-graph object ids), LLaVA's
  ``llava_gqa_testdev_balanced.jsonl`` layout (question id, image, question + instruction), and
  GQA scene graphs (every object's box, ``x y w h`` from its exact mask). Every unambiguous
  short question of a scene (``demo.scene_questions.short_questions``); the annotations name
  exactly the question's evidence objects, so GQA's box evidence covers their masks.
* ScienceQA (``--task scienceqa``): LLaVA's ``llava_test_CQM-A.json`` layout, one question per
  image ("Which of these shapes is in the image?", options A-D, the answer letter).
* caption (``--task caption``): COCO instances of the scenes (exact RLE masks), the caption task's
  questions and evidence at once.
* TextVQA (``--task textvqa``) and RefCOCO (``--task refcoco``) ask about the same scenes drawn with a word
  (``generate_scene(words=True)``: the same shapes, a word in a free spot), written as JPEG files (quality 100,
  no chroma subsampling; TextVQA names an image ``{image_id}.jpg``) into ``reading_images``. TextVQA: its
  question JSON (``TextVQA_0.5.1_val.json`` layout: "what is written in the image?", the word as all ten
  human answers, the image size) and a Rosetta OCR file (the word's exact ink box, as fractions of the image).
  RefCOCO: the ``refer`` layout, a refs list (``refs.json``: one ref per referred shape, its expressions
  ``demo.scene_questions.ground_questions`` as sentences, split ``val``) and the scenes' ``instances.json``.

Ids: GQA question ``image_id * 10 + k`` (k-th short question of the image), object
``image_id * 10 + j`` (j-th object); ScienceQA's and TextVQA's id is the image id; RefCOCO: sentence
``image_id * 10 + k``, ref and annotation ``image_id * 10 + j`` (the referred j-th object).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from prune_audit.data.coco import read_json
from prune_audit.data.scenes import CATEGORIES, Scene, coco_categories, export_coco_entries, generate_scene
from prune_audit.data.textvqa import ANNOTATORS
from prune_audit.demo.scene_questions import (
    CHOICE_LETTERS,
    TEXT_QUESTION,
    SceneQuestion,
    choice_question,
    ground_questions,
    short_questions,
)

DEMO_TASK_SCENES = 200  # the first scenes of the demo question set that the task files ask about
TASK_FILES_VERSION = 3  # part of the cache folder's name: a change of the files' contents gets a new folder
JPEG_SETTINGS = {"quality": 100, "subsampling": 0}  # TextVQA's images are JPEG files; these keep the words' edges


@dataclass(frozen=True)
class DemoTaskFiles:
    """Paths of the demo's task question files (``root``) for images in the demo question set."""

    root: Path

    @property
    def gqa_questions(self) -> Path:
        return self.root / "demo_gqa_questions.json"

    @property
    def gqa_llava(self) -> Path:
        return self.root / "llava_gqa_demo.jsonl"

    @property
    def gqa_scene_graphs(self) -> Path:
        return self.root / "demo_gqa_scene_graphs.json"

    @property
    def scienceqa(self) -> Path:
        return self.root / "llava_demo_CQM-A.json"

    @property
    def caption_instances(self) -> Path:
        return self.root / "demo_caption_instances.json"

    @property
    def reading_images(self) -> Path:
        """The scenes drawn with a word, which TextVQA and RefCOCO ask about."""
        return self.root / "reading_images"

    @property
    def textvqa_questions(self) -> Path:
        return self.root / "demo_textvqa_val.json"

    @property
    def textvqa_ocr(self) -> Path:
        return self.root / "demo_textvqa_rosetta_ocr.json"

    @property
    def refcoco_refs(self) -> Path:
        return self.root / "refs.json"

    @property
    def refcoco_instances(self) -> Path:
        return self.root / "instances.json"

    def questions(self, task: str) -> tuple[Path, ...]:
        """``--questions`` of ``task``."""
        return {
            "gqa": (self.gqa_questions, self.gqa_llava),
            "scienceqa": (self.scienceqa,),
            "caption": (self.caption_instances,),
            "textvqa": (self.textvqa_questions,),
            "refcoco": (self.refcoco_refs, self.refcoco_instances),
        }[task]

    def evidence(self, task: str) -> Path | None:
        """``--annotations`` of ``task`` (ScienceQA has none)."""
        return {
            "gqa": self.gqa_scene_graphs,
            "scienceqa": None,
            "caption": self.caption_instances,
            "textvqa": self.textvqa_ocr,
            "refcoco": self.refcoco_instances,
        }[task]

    def images(self, task: str) -> Path | None:
        """``--images`` of ``task``: the scenes with a word for TextVQA and RefCOCO; None: the question set's."""
        return self.reading_images if task in ("textvqa", "refcoco") else None


def _box(mask: np.ndarray) -> dict[str, int]:
    """The tight box of a mask in GQA's pixel convention (columns ``x .. x+w-1``, rows ``y .. y+h-1``)."""
    rows, cols = np.nonzero(mask)
    return {
        "x": int(cols.min()),
        "y": int(rows.min()),
        "w": int(cols.max() - cols.min() + 1),
        "h": int(rows.max() - rows.min() + 1),
    }


def _spans(sentence: str, named: dict[str, str]) -> dict[str, str]:
    """GQA annotation spans: the index of each word naming an object (``named``: word -> object id)."""
    words = sentence.rstrip(".?").replace(",", "").split(" ")
    return {str(index): named[word] for index, word in enumerate(words) if word in named}


def _full_answer(scene: Scene, question: SceneQuestion) -> str:
    """GQA's ``fullAnswer``: a sentence naming every evidence object."""
    names = [scene.objects[i].category for i in question.evidence]
    if question.form in ("left", "above"):
        relation = "left of" if question.form == "left" else "above"
        return f"The {names[1]} is {relation} the {names[0]}."
    if question.form == "count":
        listed = ", ".join(f"the {name}" for name in names)
        return f"There {'is' if len(names) == 1 else 'are'} {question.answer} {'shape' if len(names) == 1 else 'shapes'}: {listed}."
    others = [name for name in names if name != question.answer]
    if not others:
        return f"The {question.answer} is the only shape."
    return f"The {question.answer} is larger than {', '.join(f'the {name}' for name in others)}."


def _gqa_entries(scene: Scene, image_id: int, file_name: str) -> tuple[dict, list[dict], dict]:
    """(GQA questions by id, LLaVA question lines, scene graph) of one scene."""
    object_ids = {i: str(image_id * 10 + i) for i in range(len(scene.objects))}
    by_name = {obj.category: object_ids[i] for i, obj in enumerate(scene.objects)}
    questions, lines = {}, []
    for k, question in enumerate(short_questions(scene)):
        key = str(image_id * 10 + k)
        full = _full_answer(scene, question)
        evidence_names = {scene.objects[i].category: object_ids[i] for i in question.evidence}
        annotations = {
            "question": _spans(question.question, evidence_names),
            "answer": {"0": by_name[question.answer]} if question.answer in by_name else {},
            "fullAnswer": _spans(full, evidence_names),
        }
        questions[key] = {
            "imageId": Path(file_name).stem,
            "question": question.question,
            "answer": question.answer,
            "fullAnswer": full,
            "annotations": annotations,
            "types": {"detailed": question.form},
        }
        lines.append({"question_id": key, "image": file_name, "text": question.prompt, "category": question.form})
    graph = {
        "width": scene.image.shape[1],
        "height": scene.image.shape[0],
        "objects": {object_ids[i]: {"name": obj.category, **_box(obj.mask)} for i, obj in enumerate(scene.objects)},
    }
    return questions, lines, graph


def _scienceqa_entry(scene: Scene, image_id: int, file_name: str) -> dict:
    question = choice_question(np.random.default_rng([image_id, 4]), scene)
    options = "\n".join(f"{letter}. {option}" for letter, option in zip(CHOICE_LETTERS, question.options))
    return {
        "id": str(image_id),
        "image": file_name,
        "conversations": [
            {"from": "human", "value": f"<image>\n{question.question}\n{options}"},
            {"from": "gpt", "value": question.answer},
        ],
    }


def _textvqa_entries(scene: Scene, image_id: int, stem: str) -> tuple[dict, dict]:
    """(TextVQA question entry, Rosetta OCR entry) of a scene drawn with a word."""
    text = scene.texts[0]
    height, width = scene.image.shape[:2]
    x1, y1, x2, y2 = text.box
    question = {
        "question_id": image_id,
        "image_id": stem,
        "question": TEXT_QUESTION,
        "answers": [text.word] * ANNOTATORS,
        "image_width": width,
        "image_height": height,
        "ocr_tokens": [text.word],
        "set_name": "val",
    }
    box = {
        "top_left_x": x1 / width,
        "top_left_y": y1 / height,
        "width": (x2 - x1) / width,
        "height": (y2 - y1) / height,
    }
    return question, {"image_id": stem, "ocr_info": [{"word": text.word, "bounding_box": box}]}


def _refs(scene: Scene, image_id: int) -> list[dict]:
    """The ``refer`` refs of a scene: one per referred shape, its expressions as sentences."""
    by_object: dict[int, list[str]] = {}
    for question in ground_questions(scene):
        by_object.setdefault(question.evidence[0], []).append(question.question)
    refs, sentence = [], 0
    for j, expressions in sorted(by_object.items()):
        sentences = []
        for expression in expressions:
            sentences.append({"sent_id": image_id * 10 + sentence, "sent": expression, "raw": expression})
            sentence += 1
        ref = {"ref_id": image_id * 10 + j, "ann_id": image_id * 10 + j, "image_id": image_id, "split": "val"}
        refs.append({**ref, "category_id": CATEGORIES.index(scene.objects[j].category) + 1, "sentences": sentences})
    return refs


def write_reading_files(files: DemoTaskFiles, seed: int, image_ids: list[int], image_size: int) -> None:
    """The TextVQA and RefCOCO files and their images, about held-out scenes ``image_ids`` drawn with a word."""
    files.reading_images.mkdir(parents=True, exist_ok=True)
    questions, ocr, refs, images, annotations = [], [], [], [], []
    for image_id in image_ids:
        scene = generate_scene(seed, image_id - 1, image_size=image_size, split="heldout", words=True)
        stem = f"scenes{seed}_text_{image_id:012d}"
        Image.fromarray(scene.image).save(files.reading_images / f"{stem}.jpg", **JPEG_SETTINGS)
        image, objects = export_coco_entries(scene, image_id, f"{stem}.jpg", first_annotation_id=image_id * 10)
        images.append(image)
        annotations += objects
        refs += _refs(scene, image_id)
        if scene.texts:
            question, tokens = _textvqa_entries(scene, image_id, stem)
            questions.append(question)
            ocr.append(tokens)
    version = {"dataset_name": "textvqa", "dataset_version": "0.5.1", "dataset_type": "val"}
    files.textvqa_questions.write_text(json.dumps({**version, "data": questions}))
    files.textvqa_ocr.write_text(json.dumps({**version, "data": ocr}))
    files.refcoco_refs.write_text(json.dumps(refs))
    coco = {"images": images, "annotations": annotations, "categories": coco_categories()}
    files.refcoco_instances.write_text(json.dumps(coco))


def write_task_files(out_dir: Path, instances: Path, *, seed: int, scenes: int, image_size: int) -> DemoTaskFiles:
    """Write the three tasks' files for the first ``scenes`` scenes of the held-out stream ``seed``.

    ``instances`` is the demo question set's COCO file of those scenes (``data.scenes.export_coco``:
    image id ``index + 1``), whose file names and masks the files reuse.
    """
    coco = read_json(instances, "demo instances file", "remove the demo cache folder to rebuild it")
    images = [image for image in coco["images"] if image["id"] <= scenes]
    gqa_questions, gqa_lines, graphs, scienceqa = {}, [], {}, []
    for image in images:
        scene = generate_scene(seed, image["id"] - 1, image_size=image_size, split="heldout")
        questions, lines, graph = _gqa_entries(scene, image["id"], image["file_name"])
        gqa_questions.update(questions)
        gqa_lines += lines
        graphs[Path(image["file_name"]).stem] = graph
        scienceqa.append(_scienceqa_entry(scene, image["id"], image["file_name"]))
    files = DemoTaskFiles(Path(out_dir))
    files.root.mkdir(parents=True, exist_ok=True)
    files.gqa_questions.write_text(json.dumps(gqa_questions))
    files.gqa_llava.write_text("".join(json.dumps(line) + "\n" for line in gqa_lines))
    files.gqa_scene_graphs.write_text(json.dumps(graphs))
    files.scienceqa.write_text(json.dumps(scienceqa))
    kept = {image["id"] for image in images}
    subset = {**coco, "images": images, "annotations": [a for a in coco["annotations"] if a["image_id"] in kept]}
    files.caption_instances.write_text(json.dumps(subset))
    write_reading_files(files, seed, [image["id"] for image in images], image_size)
    return files
