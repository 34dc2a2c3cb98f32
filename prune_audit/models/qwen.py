"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``).

Each LLM visual token is a 2x2 merge of 14-px patches (28x28 processed pixels),
row-major. Positions are 3-D M-RoPE ids from the model's own ``get_rope_index`` over
the unpruned prompt; pruned prompts keep the original ids of the surviving tokens,
for input-level and in-LLM selectors alike (selectors spec §1.2, evaluation spec D3).
The vision tower has no CLS token, so CLS-based selectors are refused; its per-layer
received attention (``layer_attention``, HiPrune, and VScan's Qwen path) is recomputed as
HiPrune's Qwen2.5-VL code forms it (:meth:`QwenModel._layer_attention`).

The processor is composed here from the PIL image processor and the tokenizer
because ``Qwen2_5_VLProcessor`` requires a video processor, which needs torchvision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from prune_audit.compute.shape import ModelShape, VisionShape
from prune_audit.data.video import Clip, sample_clip
from prune_audit.errors import PruneAuditError
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.executor import DecoderStack
from prune_audit.models.hooks import capture_inputs
from prune_audit.models.parts import SeparateProcessorParts
from prune_audit.models.prepared import Prepared, VisionOutput, find_image_span
from prune_audit.models.probe import single_tensor_rope
from prune_audit.models.shape import language_shape, qwen_vision_shape
from prune_audit.models.shared_prefix import shared_prefix_logits
from prune_audit.pruners.base import LayerSelector
from prune_audit.pruners.composed import RunSelector, budget_parts
from prune_audit.pruners.signals import STEP_ATTENTION

DEFAULT_SYSTEM = "You are a helpful assistant."
PROMPT_TEMPLATE = "qwen2_5_vl"


class QwenModel(SeparateProcessorParts, VisionLanguageModel):
    """Qwen2.5-VL adapter (one image per prompt)."""

    family = "qwen2_5_vl"
    input_signals = frozenset({"features", "demand", "layer_attention"})
    missing_signals_reason = (
        "its windowed vision tower has no CLS token, no per-layer CLS attention and no CLIP text space"
    )
    layer_probe_signals = frozenset({"layer_attention"})  # every block's attention recomputed (compute accounting)
    #: ``InputSignals.vision_tower``: which official layer numbers per-layer selectors use
    vision_tower = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"
    # bbox_2d JSON in absolute pixels of the resized input (data.boxes)
    grounding = "qwen2.5-vl"
    prompt_templates = (PROMPT_TEMPLATE,)
    input_positions = "keep_original"  # 3-D M-RoPE ids cannot be renumbered meaningfully; every public port keeps them
    #: whether :meth:`prepare_video` reads clips (Qwen2.5-VL's video path; its subclasses' differ and refuse)
    takes_video = True
    resizes_images = True  # prepare_for resizes the image for a selector acting on it (VTC-Bench on Qwen2-VL)

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, **sizes: Any
    ) -> Path:
        """:func:`~prune_audit.models.build.build_qwen2_5_vl` (``sizes``: its other keywords)."""
        from prune_audit.models.build import build_qwen2_5_vl

        return build_qwen2_5_vl(save_dir, words=words, text_layers=text_layers, seed=seed, **sizes)

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
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb

        template = self.resolve_template(prompt_template)
        text_config = model.config.text_config
        if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or []):
            raise PruneAuditError(
                f"{self.display_name} checkpoints with sliding-window decoder layers are not supported"
            )
        language = model.model.language_model
        stack = DecoderStack(
            embed_tokens=language.embed_tokens,
            layers=language.layers,
            norm=language.norm,
            lm_head=model.lm_head,
            rotary=language.rotary_emb,
            apply_rope=single_tensor_rope(apply_rotary_pos_emb),
            config=text_config,
        )
        super().__init__(
            model, tokenizer, stack, model_id=model_id, prompt_template=template, system_prompt=system_prompt
        )
        self.image_processor = image_processor
        self.shape = ModelShape(self.vision_shape(model.config), language_shape(text_config), model.dtype.itemsize)

    @staticmethod
    def vision_shape(config: Any) -> VisionShape:
        """The vision tower and merger the compute accounting counts (Qwen2.5-VL's windowed ViT)."""
        return qwen_vision_shape(config)

    def prompt(self, question: str, num_image_tokens: int = 1) -> str:
        """The Qwen2.5-VL chat prompt for one image followed by ``question``."""
        system = self.system_prompt or DEFAULT_SYSTEM
        pad = "<|image_pad|>" * num_image_tokens
        return (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>"
            f"{question}<|im_end|>\n<|im_start|>assistant\n"
        )

    def token_geometry(self, image_size: tuple[int, int]):
        """``smart_resize`` as the ``Qwen2VLImageProcessor`` is configured (its min/max pixels, patch and
        merge sizes: 28-px tokens for Qwen2-VL and Qwen2.5-VL, 32-px for Qwen3-VL)."""
        from prune_audit.data.geometry import qwen_geometry_from_processor

        return qwen_geometry_from_processor(self.image_processor, image_size)

    def prepare(self, image, question: str) -> Prepared:
        image = image.convert("RGB")
        pixels = self.image_processor(images=[image], return_tensors="pt")
        grid_thw = pixels["image_grid_thw"]
        merge = self.image_processor.merge_size
        grid = (int(grid_thw[0, 1]) // merge, int(grid_thw[0, 2]) // merge)
        input_ids = self.tokenizer(self.prompt(question, grid[0] * grid[1]), return_tensors="pt")["input_ids"][0]
        config = self.model.config
        span = find_image_span(input_ids, config.image_token_id)
        token_types = (input_ids == config.image_token_id).int()
        positions, _ = self.model.model.get_rope_index(input_ids[None], token_types[None], image_grid_thw=grid_thw)
        return Prepared(
            input_ids=input_ids,
            image_span=span,
            grid=grid,
            pixel_values=pixels["pixel_values"],
            question=question,
            image_size=image.size,
            geometry=self.token_geometry(image.size),
            extras={"image_grid_thw": grid_thw, "positions": positions[:, 0]},
        )

    def prepare_for(self, image, question: str, selector: RunSelector | None = None, budget: Any = None) -> Prepared:
        """:meth:`prepare` of the image resized for an input selector that acts on it (:meth:`image_resizer`):
        VTC-Bench's downsampling baseline (Chenfei-Liao/VTC-Bench 983e443e,
        ``external/DART/lmms-eval/lmms_eval/models/qwen2_vl.py`` with ``VTC_IMAGE_RATIO``) resizes the PIL image
        with ``Image.BICUBIC`` and lets the processor's ``smart_resize`` set the token grid, so the tower reruns on
        fewer pixels and every token of the smaller image is fed. The size is the selector's
        (``resized_image_size``) for the input budget resolved on the image's own N tokens; the prompt keeps the
        original ``image_size``, its ``geometry`` is the resized image's mapped back to the original pixels
        (:func:`~prune_audit.data.geometry.mapped_to_original`, so retention, lost and diluted go through it) and
        ``dense_grid`` the original's grid.

        The seam is the selector's ``resizes_image`` trait honoured here rather than a selection: the token grid
        of a resized image is the processor's (no grid of the N tokens gives it), its 3-D M-RoPE ids are those
        of the smaller grid, and the tower's and the LLM's work shrink with it, so the prompt itself differs."""
        resizer = self.image_resizer(selector)
        if resizer is None or budget is None:
            return self.prepare(image, question)
        from PIL import Image

        from prune_audit.compute.budget import resolve_budget
        from prune_audit.data.geometry import mapped_to_original

        image = image.convert("RGB")
        dense = self.token_geometry(image.size).grid
        tokens = cast(
            int, resolve_budget(budget_parts(selector, budget)[0], dense[0] * dense[1])
        )  # one part's budget: an int
        try:
            size = resizer.resized_image_size(image.size, tokens, lambda wh: self.token_geometry(wh).num_tokens)
        except ValueError as error:
            raise PruneAuditError(f"selector {resizer.name!r} failed at budget {tokens}: {error}") from None
        resized = self.prepare(image if size == image.size else image.resize(size, Image.Resampling.BICUBIC), question)
        geometry = mapped_to_original(resized.geometry, image.size)
        return replace(resized, image_size=image.size, geometry=geometry, dense_grid=dense)

    def tower_crops(self, prepared: Prepared) -> dict[str, Any]:
        """On a clip the tower attends within each temporal step (its ``cu_seqlens`` split the T steps, windows
        tile each step), so it runs as on T images of one step's patches; a still image: one image of its grid."""
        if prepared.video_grid is None:
            return super().tower_crops(prepared)
        steps, rows, cols = prepared.video_grid
        merge = self.image_processor.merge_size
        return {"crops": steps, "crop_grid": (rows * merge, cols * merge)}

    def read_clip(self, frames: Any, video_fps: float) -> Clip:
        """As qwen-vl-utils reads a video for Qwen2.5-VL (:func:`prune_audit.data.video.sample_clip`) at the tower's
        token size, within its default pixel limits or those the checkpoint declares (``models.video_sampling``)."""
        if not self.takes_video:
            return super().read_clip(frames, video_fps)
        processor = self.image_processor
        return sample_clip(
            frames, video_fps, patch_size=processor.patch_size, merge_size=processor.merge_size, **self.video_sampling
        )

    def prepare_video(self, clip: Clip, question: str) -> Prepared:
        """One (clip, question) prompt: the clip's 2T sampled frames (:func:`prune_audit.data.video.sample_clip`) as
        ``pixel_values_videos`` (:func:`video_patches`), ``<|video_pad|>`` tokens for its T x h x w merged tokens, and
        the model's own ``get_rope_index`` M-RoPE ids with the time axis (``second_per_grid_ts`` = 2 / sample fps,
        scaled by the tower's ``tokens_per_second``)."""
        if not self.takes_video:
            raise self.no_video_path()
        pixels, grid_thw = self._clip_patches(clip)
        steps, rows, cols = clip.geometry.video_grid
        seconds = torch.tensor([clip.seconds_per_step])
        prompt = self.prompt(question, steps * rows * cols).replace("<|image_pad|>", "<|video_pad|>")
        input_ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        video_token = self.model.config.video_token_id
        token_types = (input_ids == video_token).int() * 2  # get_rope_index's modality codes: 1 image, 2 video
        positions, _ = self.model.model.get_rope_index(
            input_ids[None], token_types[None], video_grid_thw=grid_thw, second_per_grid_ts=seconds
        )
        return Prepared(
            input_ids=input_ids,
            image_span=find_image_span(input_ids, video_token),
            grid=(steps * rows, cols),
            pixel_values=pixels,
            question=question,
            image_size=clip.geometry.frame.image_size,
            geometry=clip.geometry,
            extras={"video_grid_thw": grid_thw, "second_per_grid_ts": seconds, "positions": positions[:, 0]},
            video_grid=(steps, rows, cols),
        )

    def _clip_patches(self, clip: Clip) -> tuple[Tensor, Tensor]:
        """The clip's ``pixel_values_videos`` (:func:`video_patches`) and its (1, 3) ``video_grid_thw`` in patches;
        one line when the clip was sampled for another token size."""
        merge, patch = self.image_processor.merge_size, self.image_processor.patch_size
        if clip.geometry.frame.token_pixels != patch * merge:
            raise PruneAuditError(
                f"the clip was sampled for {clip.geometry.frame.token_pixels}-px tokens, but this model's are "
                f"{patch * merge} px; sample it with patch_size={patch}, merge_size={merge}"
            )
        steps, rows, cols = clip.geometry.video_grid
        return video_patches(clip.frames, self.image_processor), torch.tensor([[steps, rows * merge, cols * merge]])

    def _video_vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        """The vision tower on clips: per clip its (T * h * w, D) merged features and its ``video_grid``."""
        if any(item.video_grid is None for item in prepared):
            raise PruneAuditError("a batch holds clips and still images; prefill them in separate batches")
        if "layer_attention" in requires:
            raise PruneAuditError("per-layer vision attention is not computed on clips; choose a features selector")
        pixels = torch.cat([item.pixel_values for item in prepared]).to(self.device)
        grid_thw = torch.cat([item.extras["video_grid_thw"] for item in prepared]).to(self.device)
        if STEP_ATTENTION not in requires:
            features = self.model.model.get_video_features(pixels, grid_thw, return_dict=True).pooler_output
            return [
                VisionOutput(per_clip, {"video_grid": item.video_grid}) for per_clip, item in zip(features, prepared)
            ]
        features, attention = self._step_attention(pixels, grid_thw)
        return [
            VisionOutput(per_clip, {"video_grid": item.video_grid, STEP_ATTENTION: received})
            for per_clip, received, item in zip(features, attention, prepared)
        ]

    def _clip_signals(self, prepared: Sequence[Prepared]) -> frozenset[str]:
        """A clip adds its temporal grid and, recomputed on request, its step attention (:meth:`_step_attention`)."""
        signals = super()._clip_signals(prepared)
        return signals | {STEP_ATTENTION} if signals and self.takes_video else signals

    def _step_attention(self, pixels: Tensor, grid_thw: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per clip its (T * h * w, D) merged features and (T * h * w,) step attention, merged-token raster order
        (``InputSignals.step_attention``).

        As LunarShen/FastVID's Qwen2.5-VL vision attention (``fastvid_qwen25vl``, commit a40a109c) forms
        ``frame_attn_weights`` in the tower's last block: per temporal step, the softmax over its merged tokens of
        the step's mean query (RoPE applied, mean over the step's patches) against each merged token's mean key (its
        4 patches), scaled by 1 / sqrt(d), mean over heads. Formed in float32 on the block's input (the official
        means are in the model dtype).
        """
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
        from transformers.vision_utils import get_vision_window_index

        visual = self.model.model.visual
        block = visual.blocks[-1]
        with capture_inputs([block.attn]) as inputs:  # this call's own, thread-safe
            features = self.model.model.get_video_features(pixels, grid_thw, return_dict=True).pooler_output
        ((args, kwargs),) = inputs
        hidden, (cos, sin) = (args[0] if args else kwargs["hidden_states"]), kwargs["position_embeddings"]
        width, heads, unit = hidden.shape[-1], block.attn.num_heads, visual.spatial_merge_unit
        # queries and keys only (the qkv weight's first two thirds): the values are not needed
        qk = torch.nn.functional.linear(hidden, block.attn.qkv.weight[: 2 * width], block.attn.qkv.bias[: 2 * width])
        qk = qk.reshape(hidden.shape[0], 2, heads, -1).permute(1, 0, 2, 3)
        query, key = apply_rotary_pos_emb_vision(qk[0], qk[1], cos, sin)
        window_index, _ = get_vision_window_index(
            grid_thw,
            spatial_merge_size=visual.spatial_merge_size,
            window_size=visual.window_size,
            patch_size=visual.patch_size,
        )
        per_clip, start, head_width = [], 0, query.shape[-1]
        for steps, rows, cols in grid_thw.tolist():  # window order keeps each step's merged tokens together
            count = steps * rows * cols // unit
            patches = slice(start * unit, (start + count) * unit)
            q = query[patches].transpose(0, 1).float().reshape(heads, steps, -1, head_width).mean(dim=2, keepdim=True)
            k = key[patches].transpose(0, 1).float().reshape(heads, steps, -1, unit, head_width).mean(dim=3)
            logits = q @ k.transpose(-2, -1) / math.sqrt(head_width)  # (H, T, 1, h * w)
            received = torch.softmax(logits, dim=-1).mean(dim=0).flatten()  # (T * h * w,) window order
            raster = torch.empty_like(received)
            raster[window_index[start : start + count] - start] = received
            per_clip.append(raster)
            start += count
        return list(features), per_clip

    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        if prepared[0].video_grid is not None:
            return self._video_vision(prepared, requires)
        pixels = torch.cat([item.pixel_values for item in prepared]).to(self.device)
        grid_thw = torch.cat([item.extras["image_grid_thw"] for item in prepared]).to(self.device)
        if "layer_attention" not in requires:
            features = self.model.model.get_image_features(pixels, grid_thw, return_dict=True).pooler_output
            return [VisionOutput(per_image) for per_image in features]
        features, received = self._layer_attention(pixels, grid_thw)
        tower = {
            "vision_tower": self.vision_tower,
            "full_attention_layers": tuple(self.model.config.vision_config.fullatt_block_indexes),
        }
        return [
            VisionOutput(per_image, {"layer_attention": attention, **tower})
            for per_image, attention in zip(features, received)
        ]

    def _layer_attention(self, pixels: Tensor, grid_thw: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per image its (N, D) merged features and (Lv, N) attention each merged token receives in every
        vision block, merged-token raster order (``InputSignals.layer_attention`` of this tower).

        As Danielement321/HiPrune ``Qwen2_5_VL/qwen2_5_vl_HiPrune.py`` (commit 6e83a124, run with
        ``flash_attention_2`` by ``bench_qwen.sh``) forms it: each block's softmax(q k^T / sqrt(d)) over
        all the image's patches, RoPE applied, windowed blocks included (the recomputed weights ignore the
        windows), mean over heads, over the query patches (the official sum: a constant factor), then
        over the 4 patches the merger joins into one token. Formed in float32 on the block inputs.
        """
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
        from transformers.vision_utils import get_vision_window_index

        visual = self.model.model.visual
        with capture_inputs([block.attn for block in visual.blocks]) as inputs:  # this call's own, thread-safe
            features = self.model.model.get_image_features(pixels, grid_thw, return_dict=True).pooler_output
        # the attention's normed input and rotary tables, window order
        captured = [
            (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"]) for args, kwargs in inputs
        ]
        window_index, _ = get_vision_window_index(
            grid_thw,
            spatial_merge_size=visual.spatial_merge_size,
            window_size=visual.window_size,
            patch_size=visual.patch_size,
        )
        unit = visual.spatial_merge_unit
        counts = (grid_thw.prod(dim=1) // unit).tolist()  # merged tokens per image, contiguous in window order
        per_image: list[list[Tensor]] = [[] for _ in counts]
        for (hidden, (cos, sin)), block in zip(captured, visual.blocks):
            heads, width = block.attn.num_heads, hidden.shape[-1]
            # queries and keys only (the qkv weight's first two thirds): the values are not needed
            qk = torch.nn.functional.linear(
                hidden, block.attn.qkv.weight[: 2 * width], block.attn.qkv.bias[: 2 * width]
            )
            qk = qk.reshape(hidden.shape[0], 2, heads, -1).permute(1, 0, 2, 3)
            query, key = apply_rotary_pos_emb_vision(qk[0], qk[1], cos, sin)
            start = 0
            for image, count in enumerate(counts):
                rows = slice(start * unit, (start + count) * unit)
                q, k = query[rows].transpose(0, 1).float(), key[rows].transpose(0, 1).float()  # (H, P, d)
                probs = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
                received = probs.mean(dim=(0, 1)).view(count, unit).mean(dim=1)  # (N,) window order
                order = window_index[start : start + count] - start  # window slot -> raster merged token
                raster = torch.empty_like(received)
                raster[order] = received
                per_image[image].append(raster)
                start += count
        return list(features), [torch.stack(layers) for layers in per_image]

    @property
    def vision_head_dim(self) -> int:
        """Width of one vision-tower attention head."""
        vision = self.model.config.vision_config
        return vision.hidden_size // vision.num_heads

    # ----- direct forwards (the demo trainer and evaluator) ------------------------------
    @property
    def vision_state_width(self) -> int:
        """Width of the pooled and per-token states :meth:`vision_states` returns (the merged tokens')."""
        return self.model.config.text_config.hidden_size

    def image_inputs(self, images: Sequence[Any]) -> dict[str, Tensor]:
        """Keyword inputs of :meth:`image_features` / :meth:`vision_states` for PIL images
        (dynamic resolution: each image keeps its own patch grid)."""
        encoded = self.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": encoded["pixel_values"], "grid_thw": encoded["image_grid_thw"]}

    def array_inputs(self, images: Tensor) -> dict[str, Tensor]:
        """:meth:`image_inputs` of (B, H, W, 3) uint8 images."""
        from PIL import Image

        return self.image_inputs([Image.fromarray(np.asarray(image)) for image in images])

    def image_features(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """Per image its (N_i, D) merged features, the language model's image inputs, in row-major order."""
        return list(self.model.model.get_image_features(pixel_values, grid_thw, return_dict=True).pooler_output)

    def vision_states(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The vision tower once, differentiable, for images of one size: (B, N, D) merged features,
        (B, D) their mean (the tower has no CLS) and the (B, N, D) features again as token states."""
        merged = self.model.model.visual(pixel_values, grid_thw=grid_thw).pooler_output
        features = merged.view(len(grid_thw), -1, merged.shape[-1])
        return features, features.mean(dim=1), features

    def shared_prefix_logits(
        self,
        features: Tensor,
        prefix_ids: Tensor,
        image_positions: Tensor,
        suffixes: Sequence[Tensor],
        per_image: int,
        grid: tuple[int, int] | None = None,
        every_position: bool = False,
        rope: tuple[Tensor, int] | None = None,
    ) -> Tensor:
        """(B * per_image, V) logits after each suffix, or (B * per_image, T, V) at ``every_position``
        (:func:`~prune_audit.models.shared_prefix.shared_prefix_logits`) with the M-RoPE ids of the
        unpruned prompt; ``grid`` is the (rows, cols) of merged tokens. ``rope``: the prompt's own (3, P) M-RoPE ids
        of the prefix and the id of every suffix's first token, where the prompt gives them (a clip's, from
        :meth:`prepare_video`: its time axis), instead of those of an image of ``grid``."""
        if rope is None:
            if grid is None:
                raise ValueError("Qwen2.5-VL needs the image's token grid for its M-RoPE positions")
            ids = torch.cat([prefix_ids, suffixes[0]])
            positions = self._rope_positions(ids[None], [grid])[:, 0]
            start = prefix_ids.numel()
            rope = positions[:, :start], int(positions[0, start])
        language = self.model.model.language_model
        return shared_prefix_logits(
            language,
            self.model.lm_head,
            features,
            prefix_ids,
            image_positions,
            suffixes,
            per_image,
            prefix_positions=rope[0],
            suffix_start=rope[1],
            every_position=every_position,
        )

    def first_token_logits(self, input_ids: Tensor, attention_mask: Tensor, features: Sequence[Tensor]) -> Tensor:
        """(B, V) logits at the last position of left-padded (B, L) prompts, stock forward.

        ``features[b]`` is the full (n*n, D) merged-token set of a square image (the demo scenes):
        M-RoPE ids need the grid, which a pruned subset no longer gives.
        """
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        grids = []
        for item in features:
            side = math.isqrt(int(item.shape[0]))
            if side * side != item.shape[0]:
                raise ValueError(
                    f"{item.shape[0]} image tokens are not a square grid; pass every token of a square image"
                )
            grids.append((side, side))
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=self._rope_positions(input_ids, grids, attention_mask),
            mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=list(features))},
            logits_to_keep=1,
        ).logits[:, -1]

    def _rope_positions(
        self, input_ids: Tensor, grids: Sequence[tuple[int, int]], attention_mask: Tensor | None = None
    ) -> Tensor:
        """(3, B, L) M-RoPE ids from the model's ``get_rope_index``; ``grids`` in merged tokens per row."""
        merge = self.image_processor.merge_size
        grid_thw = torch.tensor([[1, rows * merge, cols * merge] for rows, cols in grids])
        token_types = (input_ids == self.model.config.image_token_id).int()
        positions, _ = self.model.model.get_rope_index(
            input_ids, token_types, image_grid_thw=grid_thw, attention_mask=attention_mask
        )
        return positions

    def full_positions(self, prepared: Prepared) -> Tensor:
        return prepared.extras["positions"]

    def _layer_positions(self, selector: LayerSelector | None) -> str:
        # 3-D ids cannot be renumbered meaningfully; every public Qwen port keeps them
        return "keep_original"

    def _family_description(self) -> dict[str, Any]:
        size = getattr(self.image_processor, "size", None) or {}
        return {
            "processor": {
                "class": type(self.image_processor).__name__,
                "mode": "qwen_smart_resize",
                "min_pixels": size.get("shortest_edge"),
                "max_pixels": size.get("longest_edge"),
                "patch_size": self.image_processor.patch_size,
                "merge_size": self.image_processor.merge_size,
            },
            "positions": "keep_original (3-D M-RoPE ids of the unpruned prompt)",
        }


def video_patches(frames: Sequence[Any], image_processor: Any) -> Tensor:
    """(T * gh * gw, C * 2 * p * p) ``pixel_values_videos`` of 2T RGB frames of one size (multiples of p * merge),
    as the Qwen2-VL video processor flattens them: each frame rescaled and normalised with the image processor's
    mean and std, two consecutive frames joined into one temporal patch, patches ordered (t, merged row, merged col,
    row in merge, col in merge) and each flattened (channel, frame of the pair, patch row, patch col)."""
    patch, merge = image_processor.patch_size, image_processor.merge_size
    pair = image_processor.temporal_patch_size
    video = torch.from_numpy(np.stack([np.asarray(frame, dtype=np.float32) for frame in frames])).permute(0, 3, 1, 2)
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(image_processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)
    video = (video * image_processor.rescale_factor - mean) / std
    count, channels, height, width = video.shape
    if count % pair:
        raise PruneAuditError(f"a clip of {count} frames is not whole temporal patches of {pair}; sample it again")
    rows, cols = height // patch, width // patch
    grid = video.reshape(count // pair, pair, channels, rows // merge, merge, patch, cols // merge, merge, patch)
    # (t, merged row, merged col, row in merge, col in merge, channel, frame of the pair, patch row, patch col)
    grid = grid.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return grid.reshape(count // pair * rows * cols, channels * pair * patch * patch).contiguous()


__all__ = ["QwenModel", "PROMPT_TEMPLATE", "DEFAULT_SYSTEM", "video_patches"]
