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

Ids: GQA question ``image_id * 10 + k`` (k-th short question of the image), object
``image_id * 10 + j`` (j-th object); ScienceQA's id is the image id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prune_audit.data.coco import read_json
from prune_audit.data.scenes import Scene, generate_scene
from prune_audit.demo.scene_questions import (
    CHOICE_LETTERS,
    SceneQuestion,
    choice_question,
    short_questions,
)

DEMO_TASK_SCENES = 200  # the first scenes of the demo question set that the task files ask about
TASK_FILES_VERSION = 1  # part of the cache folder's name: a change of the files' contents gets a new folder


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

    def questions(self, task: str) -> tuple[Path, ...]:
        """``--questions`` of ``task``."""
        return {
            "gqa": (self.gqa_questions, self.gqa_llava),
            "scienceqa": (self.scienceqa,),
            "caption": (self.caption_instances,),
        }[task]

    def evidence(self, task: str) -> Path | None:
        """``--annotations`` of ``task`` (ScienceQA has none)."""
        return {"gqa": self.gqa_scene_graphs, "scienceqa": None, "caption": self.caption_instances}[task]


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
    return files
