"""Helpers for the model-adapter tests: tiny checkpoints, images, recording selectors, references, run arguments.

The references here use the stock Hugging Face forward only (with per-layer attention
masks injected by forward pre-hooks), so they share no code with the pruning loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from prune_audit.pruners.base import InputSelector, LayerSelector, Reference, Selection, Stage
from prune_audit.pruners.signals import InputSignals, LayerSignals

WORDS = ["is", "there", "a", "an", "cat", "dog", "in", "the", "image", "of", "red", "blue", "what", "color"]
QUESTIONS = ["is there a cat in the image?", "is there a red dog in the image of the cat?"]

INPUT_FIELDS = frozenset({"features", "vision_features", "cls_attention", "vision_keys", "cls_feature", "demand"})
LAYER_FIELDS = frozenset(
    {
        "text_logits",
        "text_probs",
        "hidden_states",
        "previous_hidden_states",
        "text_hidden_states",
        "normed_hidden_states",
        "text_normed_hidden_states",
        "key_norms",
        "text_key_norms",
        "embeddings",
        "text_embeddings",
    }
)


def random_image(seed: int, size: tuple[int, int] = (130, 100)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@dataclass
class RecordingInputSelector(InputSelector):
    """Keeps the first ``budget`` tokens and records the signals it was given."""

    name: ClassVar[str] = "recording_input"
    reference: ClassVar[Reference] = Reference("test", "-")
    requires: ClassVar[frozenset[str]] = INPUT_FIELDS
    records: list[InputSignals] = field(default_factory=list)

    def _select(self, signals: InputSignals, budget: int, generator: Any) -> Selection:
        self.records.append(signals)
        return Selection(kept=torch.arange(budget))


@dataclass
class RecordingLayerSelector(LayerSelector):
    """One stage at ``layer`` keeping the top ``keep`` by ``score_field`` (summed); records its signals."""

    name: ClassVar[str] = "recording_layer"
    reference: ClassVar[Reference] = Reference("test", "-")
    requires: ClassVar[frozenset[str]] = LAYER_FIELDS
    layer: int = 1
    keep: int = 8
    positions: str = "keep_original"
    records: list[LayerSignals] = field(default_factory=list)

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        return [Stage(self.layer, self.keep)]

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> torch.Tensor:
        self.records.append(signals)
        return signals.text_probs.mean(dim=(0, 1))


def stock_inputs(vlm, prepared) -> dict[str, torch.Tensor]:
    """Inputs of the stock ``model(**inputs)`` forward for one prepared prompt."""
    if "video_grid_thw" in prepared.extras:  # a Qwen2.5-VL clip: video patches, its grid and seconds per step
        return {
            "input_ids": prepared.input_ids[None],
            "pixel_values_videos": prepared.pixel_values,
            "video_grid_thw": prepared.extras["video_grid_thw"],
            **{k: v for k, v in prepared.extras.items() if k == "second_per_grid_ts"},
            "mm_token_type_ids": (prepared.input_ids == vlm.model.config.video_token_id).int()[None] * 2,
        }
    if "image_sizes" in prepared.extras:  # LLaVA-NeXT: the crops of one image and its size
        return {
            "input_ids": prepared.input_ids[None],
            "pixel_values": prepared.pixel_values[None],
            "image_sizes": prepared.extras["image_sizes"],
        }
    if "image_grid_thw" not in prepared.extras:  # LLaVA's one (3, H, W) image; InternVL's (tiles, 3, H, W) already
        pixel_values = prepared.pixel_values if prepared.pixel_values.dim() == 4 else prepared.pixel_values[None]
        return {"input_ids": prepared.input_ids[None], "pixel_values": pixel_values}
    image_token = vlm.model.config.image_token_id
    return {
        "input_ids": prepared.input_ids[None],
        "pixel_values": prepared.pixel_values,
        "image_grid_thw": prepared.extras["image_grid_thw"],
        "mm_token_type_ids": (prepared.input_ids == image_token).int()[None],
    }


def assert_batch_equals_one_at_a_time(vlm, prepared, selector, budget) -> None:
    """The prompts ``prepared`` prefilled in one batch keep the same stages, tokens per layer, input selections and
    (within 1e-4) logits as each prompt alone."""
    together, selections = vlm.prefill(prepared, selector, budget)
    for b, item in enumerate(prepared):
        alone, selection = vlm.prefill([item], selector, budget)
        assert together.kept_stages[b] == alone.kept_stages[0]
        assert together.tokens_per_layer[b] == alone.tokens_per_layer[0]
        if selection[0] is not None:
            assert torch.equal(selections[b].kept, selection[0].kept)
        assert (together.logits[b] - alone.logits[0]).abs().max() <= 1e-4


def alive_per_layer(num_layers: int, num_visual: int, stage_layers: list[int], kept_stages: list[list[int]]):
    """Grid indices alive at the input of every layer for a list of stages."""
    alive, result = list(range(num_visual)), []
    for layer in range(num_layers):
        for stage_layer, kept in zip(stage_layers, kept_stages):
            if stage_layer == layer:
                alive = kept
        result.append(alive)
    return result


def visual_columns(prepared) -> torch.Tensor:
    """(N,) prompt column of each visual token: the image span, less LLaVA-NeXT's newline tokens."""
    start, end = prepared.image_span
    return prepared.extras.get("visual_columns", torch.arange(start, end))


def masked_reference_logits(vlm, prepared, stage_layers: list[int], kept_stages: list[list[int]]) -> torch.Tensor:
    """(V,) last-position logits of the stock forward with dropped visual keys masked per layer.

    Equivalent to removing the tokens when positions stay the original ones: the
    remaining rows never see the dropped keys from the stage layer on.
    """
    columns = visual_columns(prepared)
    length = prepared.input_ids.numel()
    layers = vlm.model.model.language_model.layers
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    masks = []
    for alive in alive_per_layer(len(layers), prepared.num_visual, stage_layers, kept_stages):
        keys = torch.ones(length, dtype=torch.bool)
        keys[columns] = False
        keys[columns[torch.as_tensor(alive, dtype=torch.long)]] = True
        masks.append(((causal & keys[None]) | torch.eye(length, dtype=torch.bool))[None, None])

    def hook_for(mask):
        def hook(module, args, kwargs):
            kwargs["attention_mask"] = mask
            return args, kwargs

        return hook

    handles = [layer.register_forward_pre_hook(hook_for(m), with_kwargs=True) for layer, m in zip(layers, masks)]
    try:
        with torch.no_grad():
            return vlm.model(**stock_inputs(vlm, prepared)).logits[0, -1].float()
    finally:
        for handle in handles:
            handle.remove()


def run_args(workspace, checkpoint, out, *extra: str) -> list[str]:
    """``run`` on ``checkpoint`` over the workspace's POPE set (conftest's ``workspace``): 4 questions, batches of 2,
    CPU, then ``extra``."""
    args = [
        "run",
        "--model",
        str(checkpoint),
        "--images",
        str(workspace["images"]),
        "--annotations",
        str(workspace["instances"]),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--limit",
        "4",
        "--batch-size",
        "2",
    ]
    for path in workspace["pope"]:
        args += ["--pope", str(path)]
    return args + list(extra)
