"""Tiny random-weight checkpoints beside the released tokenizer, processor and chat-template files kept in
the shared data folder (``../shared/released``, or ``$PRUNE_AUDIT_RELEASED``; docs/released-files.md lists each
file and its source: they are public files of other projects, so the repository does not hold them): the real vocabulary, special token ids, end tokens and image
processors, with tiny widths and two decoder layers, so tests run the released text and image
pipelines on CPU in seconds."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import torch

RELEASED = Path(os.environ.get("PRUNE_AUDIT_RELEASED", Path(__file__).resolve().parents[2] / "shared" / "released"))
LLAVA, QWEN, INTERNVL = "llava-1.5-7b-hf", "Qwen2.5-VL-7B-Instruct", "InternVL3-1B-hf"
# written by save_pretrained (and read by released_config), never copied from the release
CONFIG_FILES = ("config.json", "config_values.json")


def unpack_release(name: str, target: Path) -> Path:
    """Copy ``RELEASED/<name>`` into ``target``, decompressing ``*.gz`` (the large tokenizer files)."""
    target.mkdir(parents=True, exist_ok=True)
    for source in sorted((RELEASED / name).iterdir()):
        if source.name in CONFIG_FILES or source.name == "README.md":
            continue
        if source.suffix == ".gz":
            with gzip.open(source, "rb") as packed, open(target / source.stem, "wb") as out:
                shutil.copyfileobj(packed, out)
        else:
            shutil.copy(source, target / source.name)
    return target


def released_config(name: str) -> dict:
    """The released ``config.json`` of ``name`` (InternVL3-1B-hf: the values its config holds, README.md); ids and
    vocabulary sizes are read from it, never retyped."""
    folder = RELEASED / name
    path = folder / "config.json" if (folder / "config.json").exists() else folder / "config_values.json"
    return json.loads(path.read_text())


def _save(model_class: type, config, target: Path, seed: int, name: str) -> Path:
    """Seeded random weights of ``model_class`` saved in ``target``, the release's generation config kept (its end
    tokens; ``save_pretrained`` would write one derived from ``config``)."""
    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(target)
    released = RELEASED / name / "generation_config.json"
    if released.exists():
        shutil.copy(released, target / released.name)
    return target


def build_released_llava(target: Path, seed: int = 0) -> Path:
    """llava-1.5-7b-hf's released tokenizer, 336-px CLIP processor and chat template; a 2-layer CLIP tower
    (336 px, 14-px patches: 576 visual tokens) and a 2-layer Llama decoder of width 64 over its 32064-row
    vocabulary, with its image, pad, BOS and EOS ids."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    unpack_release(LLAVA, target)
    real = released_config(LLAVA)
    text, vision = real["text_config"], real["vision_config"]
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": vision["image_size"],
            "patch_size": vision["patch_size"],
            "hidden_act": "quick_gelu",
        },
        text_config={
            "model_type": "llama",
            "vocab_size": real["vocab_size"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": text["max_position_embeddings"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": real["pad_token_id"],
            "tie_word_embeddings": False,
        },
        image_token_index=real["image_token_index"],
        pad_token_id=real["pad_token_id"],
        projector_hidden_act=real["projector_hidden_act"],
        vision_feature_layer=real["vision_feature_layer"],
        vision_feature_select_strategy=real["vision_feature_select_strategy"],
        tie_word_embeddings=False,
    )
    return _save(LlavaForConditionalGeneration, config, target, seed, LLAVA)


def build_released_qwen(target: Path, seed: int = 0) -> Path:
    """Qwen2.5-VL-7B-Instruct's released tokenizer, image processor (dynamic resolution, 14-px patches merged
    2 x 2) and chat template; a 2-block vision tower and a 2-layer decoder of width 64 over its 152064-row
    vocabulary, with its vision token ids and end token."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    unpack_release(QWEN, target)
    real = released_config(QWEN)
    vision = real["vision_config"]
    ids = {
        key: real[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    }
    config = Qwen2_5_VLConfig(
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": vision["patch_size"],
            "spatial_merge_size": vision["spatial_merge_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "window_size": vision["window_size"],
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
        text_config={
            "vocab_size": real["vocab_size"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": real["bos_token_id"],
            "eos_token_id": real["eos_token_id"],
            "pad_token_id": 151643,
            "tie_word_embeddings": False,
        },
        tie_word_embeddings=False,
        **ids,
    )
    return _save(Qwen2_5_VLForConditionalGeneration, config, target, seed, QWEN)


def build_released_internvl(target: Path, seed: int = 0) -> Path:
    """InternVL3-1B-hf's tokenizer (rebuilt from the released Qwen2.5-VL files as transformers' conversion script
    builds it, see docs/released-files.md), its 448-px tiling image processor and chat template; a 1-layer
    InternViT (448-px tiles, 14-px patches: 256 tokens a tile after the 2 x 2 pixel shuffle) and a 2-layer Qwen2
    decoder of width 64 over its 151674-row vocabulary."""
    from transformers import AutoTokenizer, InternVLConfig, InternVLForConditionalGeneration

    unpack_release(INTERNVL, target)
    real = released_config(INTERNVL)
    qwen = unpack_release(QWEN, target / "qwen")
    recipe = json.loads((target / "tokenizer_recipe.json").read_text())
    # the script adds <img> ... </box> (151665-151673; image_token_id 151667 is <IMG_CONTEXT>), then <video> (151674)
    # comes with the named extra special tokens; transformers 5 names the added list "extra_special_tokens"
    tokenizer = AutoTokenizer.from_pretrained(qwen)
    tokenizer.add_special_tokens(
        {"extra_special_tokens": recipe["additional_special_tokens"]}, replace_extra_special_tokens=False
    )
    tokenizer.save_pretrained(qwen)
    tokenizer = AutoTokenizer.from_pretrained(qwen, extra_special_tokens=recipe["extra_special_tokens"])
    tokenizer.model_max_length = recipe["model_max_length"]
    tokenizer.chat_template = (target / "chat_template.jinja").read_text()
    tokenizer.save_pretrained(target)
    shutil.rmtree(qwen)
    (target / "tokenizer_recipe.json").unlink()
    vision, text = real["vision_config"], real["text_config"]
    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": vision["image_size"],
            "patch_size": vision["patch_size"],
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": text["vocab_size"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 8192,
            "bos_token_id": None,
            "eos_token_id": text["eos_token_id"],
            "pad_token_id": 151643,
            "tie_word_embeddings": False,
        },
        image_token_id=real["image_token_id"],
        downsample_ratio=real["downsample_ratio"],
        vision_feature_layer=real["vision_feature_layer"],
        vision_feature_select_strategy=real["vision_feature_select_strategy"],
        tie_word_embeddings=False,
    )
    return _save(InternVLForConditionalGeneration, config, target, seed, INTERNVL)
