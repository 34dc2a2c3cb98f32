"""The released tokenizers, image processors and chat templates of llava-1.5-7b-hf, Qwen2.5-VL-7B-Instruct and
InternVL3-1B-hf (../shared/released/, see docs/released-files.md) under tiny random weights (tests/released_models.py).

Checked against what the release itself says, never against the adapters' own arithmetic: the image token count
per image (576 at LLaVA's 336 px; Qwen's from transformers' ``smart_resize``; InternVL's 256 per tile that
``InternVLProcessor`` cuts), the yes/no and option-letter token sets (every single-token spelling, found by scanning
the whole vocabulary), the yes probability equal to the stock Hugging Face forward, greedy decoding stopping at the
release's end tokens, and ``prune-audit run`` end to end on a few POPE questions. Full prompt strings are
tests/test_prompts*'s business; here only counts, sets, probabilities and end tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.models.answers import Greedy, letter_token_ids
from prune_audit.models.loading import load_vlm
from tests.released_models import (
    INTERNVL,
    LLAVA,
    QWEN,
    RELEASED,
    build_released_internvl,
    build_released_llava,
    build_released_qwen,
    released_config,
)
from tests.tiny_models import random_image, stock_inputs

pytestmark = pytest.mark.skipif(
    not all((RELEASED / name).is_dir() for name in (LLAVA, QWEN, INTERNVL)),
    reason=f"released tokenizer files not found at {RELEASED} (docs/released-files.md; set PRUNE_AUDIT_RELEASED)",
)
BUILDERS = {LLAVA: build_released_llava, QWEN: build_released_qwen, INTERNVL: build_released_internvl}
WORD_START = ("\u2581", "\u0120")  # SentencePiece (LLaMA) and byte-level BPE (Qwen) word-start markers
LETTERS = ("A", "B", "C", "D", "E")  # ScienceQA offers up to five options


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("released")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: load_vlm(path, device="cpu", dtype="float32") for name, path in checkpoints.items()}


def image_token_id(name: str) -> int:
    config = released_config(name)
    return config.get("image_token_index", config.get("image_token_id"))


def spellings(tokenizer, word: str) -> list[int]:
    """Every vocabulary entry that reads ``word`` in any letter case, with or without a word-start marker: a scan of
    the whole vocabulary, independent of how the adapters look tokens up."""
    found = []
    for token, token_id in tokenizer.get_vocab().items():
        text = token[1:] if token.startswith(WORD_START) else token
        if text.lower() == word.lower():
            found.append(token_id)
    return sorted(found)


def qwen_tokens(width: int, height: int) -> int:
    """Qwen2.5-VL's tokens for an image: transformers' ``smart_resize`` at the released pixel range, one token per
    28 x 28 px (14-px patches merged 2 x 2)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    config = json.loads((RELEASED / QWEN / "preprocessor_config.json").read_text())
    rows, cols = smart_resize(
        height, width, factor=28, min_pixels=config["min_pixels"], max_pixels=config["max_pixels"]
    )
    return rows // 28 * (cols // 28)


def internvl_tiles(checkpoint: Path, image: Image.Image) -> int:
    """Tiles (thumbnail included) the released image processor cuts as ``InternVLProcessor`` calls it."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    return processor(images=[image], crop_to_patches=True, return_tensors="pt")["pixel_values"].shape[0]


def test_released_special_tokens(models):
    """The release's vocabulary, image token and end tokens, as its model card and config give them."""
    llava, qwen, internvl = models[LLAVA].tokenizer, models[QWEN].tokenizer, models[INTERNVL].tokenizer
    assert len(llava) == 32002 and llava.convert_tokens_to_ids("<image>") == 32000 == image_token_id(LLAVA)
    assert (llava.bos_token_id, llava.eos_token_id) == (1, 2)
    assert len(qwen) == 151643 + 22 and qwen.convert_tokens_to_ids("<|image_pad|>") == 151655 == image_token_id(QWEN)
    assert qwen.eos_token_id == 151645 and qwen.bos_token_id is None
    assert internvl.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>"]) == [151665, 151666, 151667]
    assert image_token_id(INTERNVL) == 151667 and internvl.eos_token_id == 151645


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (130, 100), (64, 64)])
def test_image_tokens_per_image(models, checkpoints, size):
    """The prompt's image tokens and the visual tokens are the release's count for each image size."""
    image = random_image(sum(size), size)
    expected = {
        LLAVA: 576,  # 336 px, 14-px patches, CLS dropped
        QWEN: qwen_tokens(*size),
        INTERNVL: 256 * internvl_tiles(checkpoints[INTERNVL], image),
    }
    for name, vlm in models.items():
        prepared = vlm.prepare(image, "Is there a cat in the image?")
        assert int((prepared.input_ids == image_token_id(name)).sum()) == expected[name] == prepared.num_visual, name


def test_internvl_tiles_as_its_processor(models):
    """The released -hf preprocessor_config says crop_to_patches false, but InternVLProcessor always tiles: a
    640 x 480 image is 4 x 3 tiles and a thumbnail, 13 x 256 tokens (docs/models.md), not one 448-px tile."""
    prepared = models[INTERNVL].prepare(random_image(1, (640, 480)), "Is there a cat in the image?")
    assert prepared.pixel_values.shape[0] == 13 and prepared.num_visual == 3328


def test_yes_no_token_sets(models):
    """yes/no are summed over every single-token spelling in the real vocabulary (case and word-start variants)."""
    for name, vlm in models.items():
        assert vlm.yes_ids == spellings(vlm.tokenizer, "yes"), name
        assert vlm.no_ids == spellings(vlm.tokenizer, "no"), name
        marker = "\u2581" if name == LLAVA else "\u0120"
        spelled = {prefix + word for prefix in ("", marker) for word in ("yes", "Yes", "YES")}
        assert set(vlm.tokenizer.convert_ids_to_tokens(vlm.yes_ids)) == spelled, name


def test_option_letter_token_sets(models):
    for name, vlm in models.items():
        for letter in LETTERS:
            assert letter_token_ids(vlm.tokenizer, letter, name) == spellings(vlm.tokenizer, letter), (name, letter)


def stock_yes_probability(vlm, prepared, yes_ids: list[int]) -> float:
    """p(yes) from the stock ``model(**inputs)`` forward, over the vocabulary-scan spellings."""
    with torch.no_grad():
        logits = vlm.model(**stock_inputs(vlm, prepared)).logits[0, -1].double()
    return float(torch.softmax(logits, dim=-1)[yes_ids].sum())


def test_yes_probability_equals_stock_forward(models):
    image = random_image(3, (130, 100))
    for name, vlm in models.items():
        prepared = vlm.prepare(image, "Is there a dog in the image?")
        [answer] = vlm.answer([prepared])
        expected = stock_yes_probability(vlm, prepared, spellings(vlm.tokenizer, "yes"))
        assert answer.p_yes == pytest.approx(expected, rel=1e-4, abs=1e-9), name


def steer_to_end(vlm, first: int, end: int):
    """A hook on the LM head: its first call (the prompt's last position) picks ``first``, every later call (one
    per decoding step) the end token ``end``."""
    calls = []

    def hook(module, args, output):
        output = output.clone()
        target = end if calls else first
        calls.append(target)
        output[..., target] = output.max() + 10.0
        return output

    return vlm.model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("name", [LLAVA, QWEN, INTERNVL])
def test_generation_stops_on_released_end_tokens(models, checkpoints, name):
    """Greedy decoding stops at each end token of the release (generation config and tokenizer), and the end token
    is not part of the answer."""
    vlm = models[name]
    generation = json.loads((checkpoints[name] / "generation_config.json").read_text())
    released_ends = generation["eos_token_id"]
    released_ends = released_ends if isinstance(released_ends, list) else [released_ends]
    assert set(vlm.eos_ids()) == {*released_ends, vlm.tokenizer.eos_token_id}
    word = vlm.tokenizer.convert_tokens_to_ids("Yes")
    prepared = vlm.prepare(random_image(4, (64, 64)), "Is there a cat in the image?")
    for end in set(vlm.eos_ids()):
        handle = steer_to_end(vlm, word, end)
        try:
            [answer] = vlm.answer([prepared], mode=Greedy(8))
        finally:
            handle.remove()
        assert answer.reduced.stopped and answer.answer == "Yes" and answer.reduced.answer_tokens == 1, (name, end)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> dict[str, Path | list[Path]]:
    """14 synthetic 64-px COCO scenes and their POPE files (as the ``workspace`` fixture builds them)."""
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope_build import build_pope, write_pope_files
    from prune_audit.data.scenes import export_coco

    root = tmp_path_factory.mktemp("scenes")
    instances = export_coco(root / "coco", seed=5, count=14, image_size=64)
    questions = build_pope(CocoInstances.load(instances), sample_images=None, seed=0)
    return {
        "images": root / "coco" / "images",
        "instances": instances,
        "pope": write_pope_files(questions, root / "pope", prefix="scenes"),
    }


def asked(calls: list[tuple[Image.Image, str]], image: Image.Image, question: str) -> str:
    """The prompt text the run gave ``prepare`` for ``question`` on ``image`` (the task may add its instruction)."""
    pixels = np.asarray(image.convert("RGB"))
    texts = {text for seen, text in calls if question in text and np.array_equal(np.asarray(seen), pixels)}
    assert len(texts) == 1, texts
    return texts.pop()


@pytest.mark.parametrize("name", [LLAVA, QWEN, INTERNVL])
def test_run_end_to_end(checkpoints, models, scenes, tmp_path, monkeypatch, name):
    """`prune-audit run --limit 4` on the released files: four records, each yes probability the stock forward's
    on the prompt text the run asked."""
    vlm = models[name]
    calls: list[tuple[Image.Image, str]] = []
    prepare = type(vlm).prepare

    def spy(self, image, question):
        calls.append((image.copy(), question))
        return prepare(self, image, question)

    monkeypatch.setattr(type(vlm), "prepare", spy)
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(checkpoints[name]),
        "--images",
        str(scenes["images"]),
        "--annotations",
        str(scenes["instances"]),
        "--pope",
        str(scenes["pope"][0]),
        "--limit",
        "4",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--quiet",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    records = pd.read_parquet(out / "records.parquet")
    assert len(records) == 4
    questions = {q["question_id"]: q for q in map(json.loads, scenes["pope"][0].read_text().splitlines())}
    yes_ids = spellings(vlm.tokenizer, "yes")
    for record in records.itertuples():
        question = questions[int(record.question_id)]
        image = Image.open(scenes["images"] / question["image"])
        prepared = prepare(vlm, image.convert("RGB"), asked(calls, image, question["text"]))
        assert record.p_yes == pytest.approx(stock_yes_probability(vlm, prepared, yes_ids), rel=1e-4, abs=1e-9)
