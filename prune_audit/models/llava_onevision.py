"""LLaVA-OneVision in the Hugging Face layout (``LlavaOnevisionForConditionalGeneration``).

As LLaVA-NeXT (``llava_next.py``: base view plus unpadded tiles, one ``image_newline`` per tile-grid row
kept like text, budgets over all visual tokens, compact positions) with three differences:

- the vision tower is SigLIP without CLS (strategy ``"full"``, ``vision_feature_layer`` -1 in the released
  checkpoints): a 384-px crop gives 27 x 27 = 729 patches of 14 px from its top left (its last 6 px unseen),
  so the joined tile grid is not one affine grid (``data.multigrid.RectilinearGrid``);
- ``anyres_max_9`` bilinearly downsamples an unpadded tile grid above 9 crops' worth of patches (ratio above
  1.1) after the projector; a downsampled token's footprint is its cell of the coarser grid (a convention:
  the bilinear sample reads the 2 x 2 patches around the cell centre);
- the decoder is Qwen2 (1-D RoPE); the prompt is the llava-hf OneVision chat format (ChatML, the default system
  message, ``<image>`` tokens then a newline before the question), built here with the image processor and
  tokenizer loaded on their own: ``LlavaOnevisionProcessor`` wants a video processor (torchvision) never used.
  The image token count is the geometry's (visual tokens plus newlines), tested equal to the processor's rule.

Video clips (``read_clip``, ``prepare_video``): as lmms-eval's ``llava_onevision`` model reads a video
(EvolvingLMMs-Lab/lmms-eval ``lmms_eval/models/llava_onevision.py`` at 008d347f: ``load_video`` takes the frames
at ``np.linspace(0, total - 1, max_frames_num, dtype=int)``, ``max_frames_num`` 32, so a clip of fewer frames
repeats some; a checkpoint may declare another count, ``{"frames": N}`` in ``video_sampling.json``), each frame
resized to the tower's ``tile`` x ``tile`` (PIL bicubic, as the video processor's ``size``), rescaled and normalised
with the image processor's factors (the released checkpoints' video processor uses the same); the prompt puts
``<video>`` where an image's ``<image>`` goes. The model side is transformers 5.24's ``get_video_features``: each
frame through the tower (no anyres tiling), the projector, ``apply_pooling``'s bilinear 2 x 2 resize of the
``side`` x ``side`` patch grid to ``ceil(side / 2)`` squared tokens (27 -> 14, 196 a frame), frames in time order,
then ONE ``image_newline`` after the last frame: the ``<video>`` span is T x 196 + 1 tokens. The clip's tokens are
time-major then row-major (``video_grid`` (T, 14, 14), one frame a temporal step: ``frames_per_step`` 1); the
trailing newline is no frame's token and is kept like LLaVA-NeXT's row newlines (never pruned, never counted in a
budget). A pooled token's footprint is its cell of the 14 x 14 grid over the 378 px the patches cover (27 px a
cell; the bilinear sample reads the 2 x 2 patches around the cell centre), the ``anyres_max`` convention. The
tower gives no attention by frame here (FastVID's ``step_attention``; its official OneVision port reads SigLIP's
attention-pooling head instead), so FastVID is refused on clips.

Every selector that needs CLS attention is refused (SigLIP has no CLS), as on LLaVA-NeXT HiPrune, VScan and
CDPruner, and pooling (it averages pre-projector features; ``anyres_max`` resizes the tile grid after the
projector). Uniform, ToMe and E2S run per grid as on LLaVA-NeXT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from prune_audit.compute.shape import ModelShape
from prune_audit.data.geometry import TokenGeometry
from prune_audit.data.video import Clip, ClipGeometry, read_frames
from prune_audit.errors import PruneAuditError
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.executor import DecoderStack
from prune_audit.models.llava_next import PER_GRID, LlavaNextModel, visual_columns
from prune_audit.models.parts import SeparateProcessorParts
from prune_audit.models.prepared import Prepared, VisionOutput, find_image_span
from prune_audit.models.selector_support import crop_grid_for, per_grid_for, refused_for
from prune_audit.models.shape import language_shape, llava_vision_shape
from prune_audit.pruners.layout import PRE_PROJECTOR_FEATURES

PROMPT_TEMPLATE = "onevision_chatml"
DEFAULT_SYSTEM = "You are a helpful assistant."  # the llava-hf OneVision chat template's system message
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
CLIP_FRAMES = 32  # lmms-eval llava_onevision's max_frames_num default (the OneVision video evaluations)


class LlavaOnevisionModel(SeparateProcessorParts, LlavaNextModel):
    """LLaVA-OneVision adapter (one image per prompt, anyres-max tiling, SigLIP tower without CLS)."""

    family = "llava_onevision"
    input_signals = frozenset({"features", "demand"})
    cls_probe_signals = layer_probe_signals = frozenset()  # SigLIP has no CLS token; no tower attention read
    missing_signals_reason = (
        "its visual tokens form two grids (base view and unpadded tiles), its SigLIP tower has no CLS token, "
        "anyres_max resizes the tile grid after the projector, this adapter reads no CLIP text space, and on clips "
        "it computes no tower attention by frame"
    )
    display_name = "LLaVA-OneVision"
    grounding = None  # no box convention declared (LLaVA-NeXT inherits none either)
    #: anyres_max resizes the tile grid after the projector: no pre-projector features of each token (pooling's);
    #: FlowCut's anyres port is LLaVA-NeXT's (its SigLIP tower has no tower hook here: refused by its signal)
    lacks = LlavaNextModel.lacks | {PRE_PROJECTOR_FEATURES}
    refused_selectors = refused_for(lacks)
    crop_grid_selectors = crop_grid_for(lacks)
    per_grid_selectors = per_grid_for(PER_GRID, lacks)
    prompt_templates = (PROMPT_TEMPLATE,)
    takes_video = True
    video_sampling_keys = ("frames",)  # lmms-eval's max_frames_num: the frames a clip is read at

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import LlavaOnevisionForConditionalGeneration

        return LlavaOnevisionForConditionalGeneration

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, image_size: int = 60
    ) -> Path:
        """A random-weight checkpoint of this family for offline tests (:func:`build_llava_onevision`)."""
        return build_llava_onevision(save_dir, words=words, text_layers=text_layers, seed=seed, tile=image_size)

    check_clip_text = VisionLanguageModel.__dict__["check_clip_text"]  # SigLIP: no CLIP space for CDPruner's relevance

    def __init__(
        self,
        model,
        image_processor,
        tokenizer,
        *,
        model_id: str,
        prompt_template: str | None = None,
        system_prompt: str | None = None,
    ):
        config = model.config
        if config.vision_feature_select_strategy != "full" or not isinstance(config.vision_feature_layer, int):
            raise PruneAuditError(
                "only LLaVA-OneVision checkpoints with one vision_feature_layer and the 'full' "
                "strategy (SigLIP, no CLS) are supported"
            )
        tile = config.vision_config.image_size
        size = dict(image_processor.size)
        if (size.get("height"), size.get("width")) != (tile, tile) or getattr(image_processor, "do_center_crop", False):
            raise PruneAuditError(
                f"{model_id}: the LLaVA-OneVision processor must resize each crop to the tower's "
                f"{tile} x {tile} input without a centre crop (size is {size})"
            )
        if not config.vision_aspect_ratio.startswith("anyres_max_"):
            raise PruneAuditError(
                f"vision_aspect_ratio {config.vision_aspect_ratio!r} is not supported (anyres_max_N is)"
            )
        template = self.resolve_template(prompt_template)
        stack = DecoderStack.one_dimensional(model, config.text_config)
        VisionLanguageModel.__init__(
            self, model, tokenizer, stack, model_id=model_id, prompt_template=template, system_prompt=system_prompt
        )
        self.image_processor = image_processor
        self.clip = None
        self.vision_tower = model.model.vision_tower
        hidden_count = config.vision_config.num_hidden_layers + 1
        layer = config.vision_feature_layer
        self.feature_index = layer if layer >= 0 else hidden_count + layer
        if not 1 <= self.feature_index < hidden_count:
            raise PruneAuditError(f"vision_feature_layer {layer} has no encoder layer producing it")
        self.tile = tile
        self.pinpoints = [tuple(int(side) for side in pair) for pair in config.image_grid_pinpoints]
        self.max_tiles = int(config.vision_aspect_ratio.removeprefix("anyres_max_"))
        self.shape = ModelShape(
            llava_vision_shape(config, self.feature_index, class_tokens=0),
            language_shape(config.text_config),
            model.dtype.itemsize,
        )

    def prompt(self, question: str, num_image_tokens: int = 1, placeholder: str = IMAGE_TOKEN) -> str:
        """The OneVision chat prompt for one image or clip (``num_image_tokens`` ``placeholder`` tokens: ``<image>``,
        or ``<video>`` for a clip) and ``question``."""
        system = self.system_prompt or DEFAULT_SYSTEM
        return (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{placeholder * num_image_tokens}\n"
            f"{question}<|im_end|>\n<|im_start|>assistant\n"
        )

    def token_geometry(self, image_size: tuple[int, int]):
        """The base view plus the anyres tile grid pooled down to ``max_tiles`` (``onevision_geometry``)."""
        from prune_audit.data.multigrid import onevision_geometry

        return onevision_geometry(image_size, max_tiles=self.max_tiles, **self.tiling_parameters())

    def prepare(self, image, question: str) -> Prepared:
        from prune_audit.data.multigrid import anyres_crop_patches, anyres_layout

        image = image.convert("RGB")
        encoded = self.image_processor(images=[image], return_tensors="pt")
        layout = self.tiling_parameters()
        geometry = self.token_geometry(image.size)
        base, tiles = geometry.grids
        rows, cols = tiles.grid
        prompt = self.prompt(question, geometry.num_tokens + rows)  # every visual token, one newline per row
        input_ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        start, end = find_image_span(input_ids, self.model.config.image_token_id)
        unpadded = anyres_layout(image.size, **layout).grid
        return Prepared(
            input_ids=input_ids,
            image_span=(start, end),
            grid=geometry.grid,
            pixel_values=encoded["pixel_values"][0],
            question=question,
            image_size=image.size,
            geometry=geometry,
            extras={
                "image_sizes": encoded["image_sizes"],
                "visual_columns": visual_columns(start, base.num_tokens, tiles.grid),
                "crop_patches": torch.from_numpy(anyres_crop_patches(image.size, **layout)),
                "tile_grid": torch.tensor([*unpadded, rows, cols]),
            },
        )

    def read_clip(self, frames: Any, video_fps: float) -> Clip:
        """As lmms-eval's ``llava_onevision`` reads a video (module docstring): ``frames`` (a frame folder, or PIL
        images of one size) at ``video_fps``, ``video_sampling["frames"]`` (default 32) of them uniformly spaced,
        each resized to ``tile`` x ``tile``."""
        from PIL import Image

        images = read_frames(frames) if isinstance(frames, (str, Path)) else [image.convert("RGB") for image in frames]
        if len({image.size for image in images}) > 1:
            raise PruneAuditError("the clip's frames differ in size; give frames of one size")
        if not video_fps > 0:
            raise PruneAuditError(f"a clip needs a positive frame rate; got {video_fps} fps")
        count = self.video_sampling.get("frames", CLIP_FRAMES)
        chosen = uniform_frame_indices(len(images), count)
        frame = pooled_frame_geometry(images[0].size, self.tile, self.model.config.vision_config.patch_size)
        resized = tuple(images[i].resize((self.tile, self.tile), Image.Resampling.BICUBIC) for i in chosen)
        geometry = ClipGeometry(frame, tuple(chosen), count / len(images) * video_fps, frames_per_step=1)
        return Clip(resized, geometry)

    def prepare_video(self, clip: Clip, question: str) -> Prepared:
        """One (clip, question) prompt: the clip's T frames as (T, 3, tile, tile) ``pixel_values_videos`` of one
        video (:func:`frame_pixels`), ``<video>`` tokens for its T x h x w pooled tokens and the trailing newline."""
        geometry = clip.geometry
        expected = pooled_frame_geometry(
            geometry.frame.image_size, self.tile, self.model.config.vision_config.patch_size
        )
        if geometry.frames_per_step != 1 or geometry.frame != expected:
            raise PruneAuditError(
                "the clip was not read for this LLaVA-OneVision checkpoint (one frame a step, its pooled grid); "
                "read it with this model's read_clip"
            )
        steps, rows, cols = geometry.video_grid
        prompt = self.prompt(question, steps * rows * cols + 1, placeholder=VIDEO_TOKEN)  # one newline after all
        input_ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        start, end = find_image_span(input_ids, self.model.config.video_token_id)
        return Prepared(
            input_ids=input_ids,
            image_span=(start, end),
            grid=(steps * rows, cols),
            pixel_values=frame_pixels(clip.frames, self.image_processor),
            question=question,
            image_size=geometry.frame.image_size,
            geometry=geometry,
            extras={"visual_columns": start + torch.arange(steps * rows * cols)},  # the newline is the span's last
            video_grid=(steps, rows, cols),
        )

    def grid_parts(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """A clip's tokens are one (T * h, w) grid; an image's the base view and the tile grid (LLaVA-NeXT's)."""
        if item.video_grid is not None:
            return VisionLanguageModel.grid_parts(self, item)
        return super().grid_parts(item)

    def crop_tokens(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """Per crop the tower ran on, its tokens and grid: a clip's frames (each h x w, in time order); an image's
        base view and tiles (LLaVA-NeXT's)."""
        if item.video_grid is None:
            return super().crop_tokens(item)
        steps, rows, cols = item.video_grid
        return [(torch.arange(t * rows * cols, (t + 1) * rows * cols), (rows, cols)) for t in range(steps)]

    def _token_crops(self, item: Prepared) -> Tensor:
        """(N,) each visual token's crop, as LLaVA-NeXT's; once ``anyres_max`` resized the tile grid, a resized
        token's crop is that of the patch under its cell's centre (the bilinear sample reads the patches around
        that centre, which may straddle a tile border: a documented convention, as its footprint)."""
        crop_of = super()._token_crops(item)  # (base + rows x cols,) before the resize
        rows, cols, out_rows, out_cols = item.extras["tile_grid"].tolist()
        base = crop_of.numel() - rows * cols
        tiles = crop_of[base:].reshape(rows, cols)
        if (out_rows, out_cols) != (rows, cols):
            centre_rows = ((torch.arange(out_rows) + 0.5) * rows / out_rows).long()
            centre_cols = ((torch.arange(out_cols) + 0.5) * cols / out_cols).long()
            tiles = tiles[centre_rows][:, centre_cols]
        return torch.cat([crop_of[:base], tiles.flatten()])

    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        clips = [item.video_grid is not None for item in prepared]
        if any(clips) and not all(clips):
            raise PruneAuditError("a batch holds clips and still images; prefill them in separate batches")
        if clips[0]:
            return self._video_vision(prepared)
        outputs = []
        for item in prepared:  # images have different crop counts: one tower call per image
            crops = item.pixel_values.to(self.device, self.dtype)
            patches = self._tower_states(crops)[self.feature_index]  # (K, side^2, Dv), no CLS
            projected = self.model.model.multi_modal_projector(
                patches.flatten(0, 1)[item.extras["crop_patches"].to(self.device)]
            )
            rows, cols, out_rows, out_cols = item.extras["tile_grid"].tolist()
            base = projected[: projected.shape[0] - rows * cols]
            tiles = projected[base.shape[0] :]
            if (out_rows, out_cols) != (rows, cols):  # anyres_max: the stock bilinear resize, after the projector
                grid = tiles.reshape(rows, cols, -1).permute(2, 0, 1)[None]
                grid = torch.nn.functional.interpolate(grid, [out_rows, out_cols], mode="bilinear")[0]
                tiles = grid.permute(1, 2, 0).reshape(out_rows * out_cols, -1)
            outputs.append(VisionOutput(torch.cat([base, tiles])))
        return outputs

    def _video_vision(self, prepared: Sequence[Prepared]) -> list[VisionOutput]:
        """Per clip its (T * h * w, D) pooled frame tokens, time-major then row-major, and its ``video_grid``: as
        ``get_video_features``, each frame's patches through the projector, then the bilinear resize of the
        ``side`` x ``side`` grid to h x w (``apply_pooling``); the trailing newline is added by :meth:`input_row`."""
        outputs = []
        for item in prepared:  # clips may differ in frame count: one tower call per clip
            frames = item.pixel_values.to(self.device, self.dtype)  # (T, 3, tile, tile)
            patches = self._tower_states(frames)[self.feature_index]  # (T, side^2, Dv), no CLS
            projected = self.model.model.multi_modal_projector(patches)  # (T, side^2, D)
            steps, rows, cols = cast(tuple[int, int, int], item.video_grid)  # a clip: _vision checked
            side = math.isqrt(projected.shape[1])
            grid = projected.reshape(steps, side, side, -1).permute(0, 3, 1, 2)
            pooled = torch.nn.functional.interpolate(grid, [rows, cols], mode="bilinear")  # (T, D, h, w)
            features = pooled.permute(0, 2, 3, 1).reshape(steps * rows * cols, -1)
            outputs.append(VisionOutput(features, {"video_grid": item.video_grid}))
        return outputs

    def _tower_states(self, pixels: Tensor) -> list[Tensor]:
        """SigLIP hidden states 0..feature_index of (B, 3, H, W) crops, each (B, P, Dv): the stock modules in order,
        no later layer (``feature_index`` is the last one in the released checkpoints)."""
        hidden = self.vision_tower.embeddings(pixels)
        states = [hidden]
        for layer in self.vision_tower.encoder.layers[: self.feature_index]:
            hidden = layer(hidden, None)
            states.append(hidden)
        return states

    def tower_crops(self, prepared: Prepared) -> dict[str, Any]:
        """Every crop through the tower; the projector ran on the base view and the whole unpadded tile grid (a
        clip: every frame's patches)."""
        side = self.tile // self.model.config.vision_config.patch_size
        if prepared.video_grid is not None:
            frames = int(prepared.pixel_values.shape[0])
            return {"crops": frames, "crop_grid": (side, side), "projected_tokens": frames * side * side}
        return {
            "crops": int(prepared.pixel_values.shape[0]),
            "crop_grid": (side, side),
            "projected_tokens": int(prepared.extras["crop_patches"].numel()),
        }

    def _family_description(self) -> dict[str, Any]:
        image_processor = self.image_processor
        return {
            "processor": {
                "class": type(image_processor).__name__,
                "mode": "llava_onevision_anyres",
                "size": dict(image_processor.size),
                "image_grid_pinpoints": [list(pair) for pair in self.pinpoints],
                "vision_aspect_ratio": self.model.config.vision_aspect_ratio,
                "patch_size": self.model.config.vision_config.patch_size,
                "vision_feature_layer": self.model.config.vision_feature_layer,
            },
        }


def uniform_frame_indices(total: int, count: int) -> list[int]:
    """The ``count`` frames lmms-eval's ``load_video`` reads of ``total``: ``np.linspace(0, total - 1, count,
    dtype=int)`` (truncated; a clip of fewer than ``count`` frames repeats some). One-line error on an empty clip."""
    if total < 1 or count < 1:
        raise PruneAuditError(f"a clip needs frames to sample; got {count} of {total} frames")
    return np.linspace(0, total - 1, count, dtype=int).tolist()


def pooled_frame_geometry(image_size: tuple[int, int], tile: int, patch_size: int) -> TokenGeometry:
    """One frame's pooled tokens: the frame resized to ``tile`` x ``tile``, its ``side = tile // patch_size`` patches
    from the top left (378 of 384 px) pooled to ``ceil(side / 2)`` squared tokens, each the cell of that coarser grid
    (27 px at 384 px; the ``anyres_max`` footprint convention). One-line error when the cell is no whole pixel count."""
    side = tile // patch_size
    pooled = math.ceil(side / 2)
    if side * patch_size % pooled:
        raise PruneAuditError(
            f"{side} patches of {patch_size} px pooled to {pooled} tokens give no whole-pixel token cell; "
            "this tower size is not supported on clips"
        )
    width, height = image_size
    return TokenGeometry(
        mode="hf_crop",
        image_width=width,
        image_height=height,
        processed_width=side * patch_size,
        processed_height=side * patch_size,
        grid_rows=pooled,
        grid_cols=pooled,
        token_pixels=side * patch_size // pooled,
        scale_x=tile / width,
        scale_y=tile / height,
    )


def frame_pixels(frames: Sequence[Any], image_processor: Any) -> Tensor:
    """(T, 3, H, W) float32 ``pixel_values_videos`` of one clip from T RGB frames already resized to the tower's
    input: rescaled and normalised with the image processor's factors, channels first (the video processor's
    ``do_rescale`` and ``do_normalize``)."""
    video = torch.from_numpy(np.stack([np.asarray(frame, dtype=np.float32) for frame in frames])).permute(0, 3, 1, 2)
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(image_processor.image_std, dtype=torch.float32)[:, None, None]
    return (video * image_processor.rescale_factor - mean) / std


def build_llava_onevision(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    tile: int = 60,
    patch_size: int = 14,
    vision_hidden_size: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    max_tiles: int = 1,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``LlavaOnevisionForConditionalGeneration`` (SigLIP + projector + Qwen2) with its
    PIL processor: ``tile``-px crops (60 px hold 4 patches of 14 px, leaving 4 px unseen as 384 px leave 6),
    canvases of 1 x 2, 2 x 1 and 2 x 2 tiles, and ``anyres_max_{max_tiles}`` (1: the tests' 2 x 2 canvases are
    downsampled; the released checkpoints use 9).

    The real LLaVA-OneVision-Qwen2-7B widths are ``tile=384, vision_hidden_size=1152, vision_layers=26
    (feature layer -1), vision_heads=16, text_hidden_size=3584, text_intermediate_size=18944, text_layers=28,
    text_heads=28, text_kv_heads=4, max_tiles=9`` (pinpoints up to 2304 x 2304).
    """
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
    )

    from prune_audit.models.build import qwen_tokenizer

    save_dir = Path(save_dir)
    tokenizer = qwen_tokenizer(words, extra_special_tokens=("<video>",))  # <image> is among its special tokens
    ids = tokenizer.convert_tokens_to_ids
    pinpoints = [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    config = LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": vision_heads,
            "image_size": tile,
            "patch_size": patch_size,
            "vision_use_head": False,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": len(tokenizer),
            "hidden_size": text_hidden_size,
            "intermediate_size": text_intermediate_size,
            "num_hidden_layers": text_layers,
            "num_attention_heads": text_heads,
            "num_key_value_heads": text_kv_heads,
            "max_position_embeddings": 512,
            "bos_token_id": None,
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": False,
        },
        image_token_index=ids(IMAGE_TOKEN),
        video_token_index=ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio=f"anyres_max_{max_tiles}",
        image_grid_pinpoints=pinpoints,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints
    )
    model.save_pretrained(save_dir)
    image_processor.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir


__all__ = [
    "LlavaOnevisionModel",
    "build_llava_onevision",
    "frame_pixels",
    "pooled_frame_geometry",
    "uniform_frame_indices",
]
