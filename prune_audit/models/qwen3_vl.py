"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the Qwen2.5-VL adapter plus deepstack features.

What the pruning code sees differently from Qwen2.5-VL (:mod:`prune_audit.models.qwen`):

- geometry: the same ``Qwen2VLImageProcessor`` ``smart_resize`` with 16-px patches, so one
  LLM token per 2x2 merge covers 32x32 processed pixels, row-major (``qwen_smart_resize``);
- positions: 3-D M-RoPE ids from the model's ``get_rope_index`` (images need no
  timestamps); the decoder's rotary table interleaves the three planes over the
  frequencies (``mrope_interleaved``) inside ``rotary_emb``, so the loop only passes ids;
- deepstack: the vision tower also merges the states of a few of its blocks
  (``deepstack_visual_indexes``) into one (N, D) feature set each, and the stock decoder
  adds the k-th set to the visual tokens' hidden states after decoder layer k. The
  pruned prefill does the same through :attr:`DecoderStack.after_layer`: after layer k
  every visual token still in the sequence gets row ``kind`` (its grid index) of the
  k-th set, so deepstack features are pruned with exactly the kept set of the main
  tokens, at input level and in the LLM alike. Tokens an in-LLM selector merges
  (SparseVLM's recycled tokens) get no deepstack addition: there is no official
  pruned Qwen3-VL merge to follow (documented in docs/models.md);
- attention: the decoder normalises each head's queries and keys (``q_norm``,
  ``k_norm``) before RoPE; the attention probe applies them too;
- video clips (:meth:`Qwen3VLModel.prepare_video`): time is text. Each temporal step (two sampled frames) is
  ``<{t:.1f} seconds><|vision_start|>`` + its h x w ``<|video_pad|>`` tokens + ``<|vision_end|>``, t the mean time
  of its two frames in the clip as given, as ``Qwen3VLProcessor.replace_video_token`` (transformers 5.24) expands
  the chat template's one ``<|video_pad|>``, which keeps the template's outer ``<|vision_start|>`` /
  ``<|vision_end|>`` around the steps (Qwen's first transformers processor, 4.57, and vLLM replace that outer pair
  too: two tokens fewer). ``get_rope_index`` gives every step its own t = 1 grid after its timestamp text, so the
  M-RoPE time id is no clip time. The clip's visual tokens are not one run: ``image_span`` runs from the first
  step's first visual token to the last step's last, ``extras["visual_columns"]`` holds the N visual tokens'
  prompt columns, and the timestamps and markers between steps stay in every pruned prompt like the text before
  the clip (:meth:`Qwen3VLModel.input_row`, as LLaVA-NeXT keeps its row newlines): budgets, kinds and selectors
  count the visual tokens only (time-major ``ClipGeometry``, two frames a step), and kept tokens keep their 3-D ids.
  Frames are sampled as qwen-vl-utils reads a video for Qwen3-VL (QwenLM/Qwen3-VL fe120581,
  ``qwen-vl-utils/src/qwen_vl_utils/vision_process.py`` ``fetch_video`` with ``image_patch_size=16``): the
  Qwen2.5-VL frame count (2 fps, 4 to 768 frames, even) and its pixel rule at 32-px tokens (128 to 768 tokens a
  frame, a ``MODEL_SEQ_LEN`` 128000-token budget x 0.9 over the clip), unless the checkpoint declares its own
  (``models.video_sampling``). The clip's deepstack sets come from the same video tower pass and follow the kept
  set. The step attention FastVID and HoliTom read is formed only in Qwen2.5-VL's tower (FastVID's official
  port; HoliTom reads it there), so both are refused on clips here; merging selectors (FastVID's DTM, PruneVid's merge) are refused as on images.

No CLS token, no CLIP text space: the CLS selectors and CDPruner are refused, as are
merging input-level selectors (merged tokens have no 3-D position). Budgets count the
merged tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from prune_audit.compute.shape import VisionShape
from prune_audit.data.video import Clip, sample_clip
from prune_audit.errors import PruneAuditError
from prune_audit.models.base import without_direct_forwards
from prune_audit.models.batch import Batch, TokenRow
from prune_audit.models.kinds import TEXT_AFTER, TEXT_BEFORE
from prune_audit.models.prepared import Prepared, VisionOutput
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners.base import Selection

PROMPT_TEMPLATE = "qwen3_vl"
#: qwen-vl-utils' video limits for Qwen3-VL, in merged tokens (``VIDEO_MIN_TOKEN_NUM``, ``VIDEO_MAX_TOKEN_NUM``,
#: ``MODEL_SEQ_LEN``; its pixel limits are these times the token's area, the clip's total 0.9 of the sequence's)
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS, VIDEO_SEQUENCE_TOKENS = 128, 768, 128000


@without_direct_forwards  # Qwen2.5-VL's direct forwards drop the deepstack features the decoder adds
class Qwen3VLModel(QwenModel):
    """Qwen3-VL adapter (dense decoders; one image per prompt)."""

    family = "qwen3_vl"
    takes_video = True  # timestamps as text between the steps (module docstring)
    #: HiPrune's per-layer attention and the step attention FastVID and HoliTom read are formed only for Qwen2.5-VL's
    #: tower, the one HiPrune's and FastVID's official code runs (HoliTom reads FastVID's signal there)
    input_signals = frozenset({"features", "demand"})
    missing_signals_reason = (
        "its vision tower has no CLS token, no per-layer CLS attention, no HiPrune or step-attention (FastVID, "
        "HoliTom) port to it and no CLIP text space"
    )
    display_name = "Qwen3-VL"
    grounding = None  # Qwen3-VL writes bbox_2d on a 0-1000 grid, not Qwen2.5-VL's pixels: no convention yet
    prompt_templates = (PROMPT_TEMPLATE,)

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration

    @staticmethod
    def vision_shape(config: Any) -> VisionShape:
        """Qwen3-VL's ViT (every block global, fc1/fc2 MLP) and its mergers: the main 2x2 merger and one
        per deepstack set, each applied to every language-model visual token."""
        vision = config.vision_config
        merged_width = vision.hidden_size * vision.spatial_merge_size**2
        merger = ((merged_width, merged_width), (merged_width, vision.out_hidden_size))
        return VisionShape(
            layers=vision.depth,
            width=vision.hidden_size,
            mlp_width=vision.intermediate_size,
            mlp_matrices=2,
            patch_inputs=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            class_tokens=0,
            merge=vision.spatial_merge_size,
            window=0,
            full_attention_layers=(),
            projector=merger * (1 + len(vision.deepstack_visual_indexes)),
        )

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, **sizes: Any
    ) -> Path:
        """A random-weight checkpoint of this family for offline tests (:func:`build_qwen3_vl`)."""
        return build_qwen3_vl(save_dir, words=words, text_layers=text_layers, seed=seed, **sizes)

    def __init__(self, model, image_processor, tokenizer, **kwargs):
        super().__init__(model, image_processor, tokenizer, **kwargs)
        #: ``sets``: per batch row of the current prefill, the (N, D) deepstack sets in decoder-layer order; one per
        #: thread, since threads sharing this model each run their own prefill between ``_vision`` and the loop
        self._deepstack = threading.local()
        self.loop.stack.after_layer = self._add_deepstack

    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        """The tower on a batch of images or of clips: per prompt its (N, D) merged features (a clip's with its
        ``video_grid``); the deepstack sets kept for the decoder loop."""
        clips = {item.video_grid is not None for item in prepared}
        if len(clips) > 1:
            raise PruneAuditError("a batch holds clips and still images; prefill them in separate batches")
        pixels = torch.cat([item.pixel_values for item in prepared]).to(self.device)
        if clips == {True}:
            grid_thw = torch.cat([item.extras["video_grid_thw"] for item in prepared]).to(self.device)
            output = self.model.model.get_video_features(pixels, grid_thw, return_dict=True)
        else:
            grid_thw = torch.cat([item.extras["image_grid_thw"] for item in prepared]).to(self.device)
            output = self.model.model.get_image_features(pixels, grid_thw, return_dict=True)
        # both split every deepstack set per prompt: [set k][prompt b] -> [prompt b][set k]
        self._deepstack.sets = [list(per_prompt) for per_prompt in zip(*output.deepstack_features)]
        return [
            VisionOutput(features, {} if item.video_grid is None else {"video_grid": item.video_grid})
            for features, item in zip(output.pooler_output, prepared)
        ]

    def _clip_signals(self, prepared: Sequence[Prepared]) -> frozenset[str]:
        """A clip adds its temporal grid only: the step attention (FastVID, HoliTom) is formed in Qwen2.5-VL's tower
        alone."""
        return super(QwenModel, self)._clip_signals(prepared)

    def read_clip(self, frames: Any, video_fps: float) -> Clip:
        """As qwen-vl-utils reads a video for Qwen3-VL (module docstring): the Qwen2.5-VL sampling
        (:func:`~prune_audit.data.video.sample_clip`) with its pixel limits scaled to this tower's merged tokens,
        or the limits the checkpoint declares (``models.video_sampling``). The README of QwenLM/Qwen3-VL (fe120581)
        runs the processor with ``do_resize=False`` after qwen-vl-utils, so these frames are the model's."""
        processor = self.image_processor
        area = (processor.patch_size * processor.merge_size) ** 2
        limits = {
            "min_pixels": VIDEO_MIN_TOKENS * area,
            "max_pixels": VIDEO_MAX_TOKENS * area,
            "total_pixels": int(VIDEO_SEQUENCE_TOKENS * area * 0.9),
        }
        return sample_clip(
            frames,
            video_fps,
            patch_size=processor.patch_size,
            merge_size=processor.merge_size,
            **{**limits, **self.video_sampling},
        )

    def prepare_video(self, clip: Clip, question: str) -> Prepared:
        """One (clip, question) prompt: the clip's patches (``video_patches``: normalised with the image processor's
        mean and std, 0.5 and 0.5 in the released checkpoints as in their video processor), each temporal step's
        timestamp and ``<|vision_start|>``, h x w ``<|video_pad|>`` tokens and ``<|vision_end|>`` in the chat
        template's video slot, and the model's own ``get_rope_index`` M-RoPE ids (module docstring). ``image_span``
        runs from the first visual token to the last; ``extras["visual_columns"]`` is the (N,) prompt column of
        each."""
        pixels, grid_thw = self._clip_patches(clip)
        steps, rows, cols = clip.geometry.video_grid
        step_tokens = "<|video_pad|>" * (rows * cols)
        video = "".join(
            f"<{seconds:.1f} seconds><|vision_start|>{step_tokens}<|vision_end|>" for seconds in step_seconds(clip)
        )
        input_ids = self.tokenizer(self.prompt(question).replace("<|image_pad|>", video), return_tensors="pt")
        input_ids = input_ids["input_ids"][0]
        is_video = input_ids == self.model.config.video_token_id
        columns = torch.nonzero(is_video).flatten()
        if columns.numel() != steps * rows * cols:
            raise PruneAuditError(
                f"the prompt holds {columns.numel()} video tokens for a {steps}x{rows}x{cols} clip; check the tokenizer"
            )
        # get_rope_index's modality codes: 1 image, 2 video; it splits the grid into t = 1 steps itself
        positions, _ = self.model.model.get_rope_index(
            input_ids[None], is_video.int()[None] * 2, video_grid_thw=grid_thw
        )
        return Prepared(
            input_ids=input_ids,
            image_span=(int(columns[0]), int(columns[-1]) + 1),
            grid=(steps * rows, cols),
            pixel_values=pixels,
            question=question,
            image_size=clip.geometry.frame.image_size,
            geometry=clip.geometry,
            extras={"video_grid_thw": grid_thw, "positions": positions[:, 0], "visual_columns": columns},
            video_grid=(steps, rows, cols),
        )

    def input_row(self, item: Prepared, output: VisionOutput, selection: Selection | None) -> TokenRow:
        """A clip's language-model input: every text token (the timestamps and markers between the steps too, with
        the kind of the text before the clip: never pruned, never a query row) and the kept visual tokens, in
        prompt order, each at its own M-RoPE id; a still image's as Qwen2.5-VL's."""
        if item.video_grid is None:
            return super().input_row(item, output, selection)
        if selection is not None and selection.sources is not None:
            raise PruneAuditError(f"merged tokens have no original position on {self.family}")
        device = self.device
        ids = item.input_ids.to(device)
        visual_columns = item.extras["visual_columns"].to(device)
        kinds = torch.arange(item.num_visual, device=device) if selection is None else selection.kept.to(device)
        is_text = torch.ones(ids.numel(), dtype=torch.bool, device=device)
        is_text[visual_columns] = False
        text_columns = torch.nonzero(is_text).flatten()
        columns = torch.cat([text_columns, visual_columns[kinds]])
        order = torch.argsort(columns)
        visual = output.features.to(device)[kinds].to(self.dtype)
        embeddings = torch.cat([self.loop.stack.embed_tokens(ids[text_columns]), visual])[order]
        text_kinds = torch.where(text_columns < item.image_span[1], TEXT_BEFORE, TEXT_AFTER)
        row_kinds = torch.cat([text_kinds, kinds])[order]
        return TokenRow(embeddings, row_kinds, self.full_positions(item).to(device)[:, columns[order]])

    def _add_deepstack(self, layer: int, hidden: Tensor, batch: Batch) -> Tensor:
        """(B, L, D) ``hidden`` after decoder layer ``layer`` plus, while ``layer`` has a deepstack set,
        each surviving visual token's own row of it (the stock decoder's ``_deepstack_process``)."""
        sets: list[list[Tensor]] = getattr(self._deepstack, "sets", [])
        if not sets or layer >= len(sets[0]):
            return hidden
        hidden = hidden.clone()
        for b in range(batch.size):
            columns = torch.nonzero(batch.valid[b] & (batch.kinds[b] >= 0)).flatten()
            features = sets[b][layer].to(hidden.device, hidden.dtype)
            hidden[b, columns] += features[batch.kinds[b, columns]]
        return hidden


def step_seconds(clip: Clip) -> list[float]:
    """Each temporal step's time in seconds: the mean time of its first and last sampled frames in the clip as given
    (frame index / the clip's frame rate), as ``Qwen3VLProcessor._calculate_timestamps`` (transformers 5.24) forms it
    from qwen-vl-utils' frame indices and the video's frame rate."""
    if clip.video_fps is None:
        raise PruneAuditError("the clip's frame rate is unknown, so its timestamps are; read it with read_clip")
    seconds = [index / clip.video_fps for index in clip.geometry.frames]
    per_step = clip.geometry.frames_per_step
    return [(seconds[start] + seconds[start + per_step - 1]) / 2 for start in range(0, len(seconds), per_step)]


def build_qwen3_vl(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    image_size: int = 128,
    patch_size: int = 16,
    spatial_merge_size: int = 2,
    vision_hidden_size: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    deepstack_visual_indexes: Sequence[int] = (0, 1),
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    mrope_section: Sequence[int] = (2, 3, 3),
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``Qwen3VLForConditionalGeneration`` with its image processor and tokenizer.

    The image processor is pinned to ``image_size**2`` pixels, so a square image gives an
    ``image_size / (patch_size * spatial_merge_size)``-square token grid. The deepstack sets
    come from the vision blocks ``deepstack_visual_indexes`` and are added after decoder
    layers 0, 1, ...; ``sum(mrope_section)`` must be ``head_dim / 2`` (interleaved M-RoPE). The
    real Qwen3-VL-8B widths are ``vision_hidden_size=1152, vision_layers=27, vision_heads=16,
    deepstack_visual_indexes=(8, 16, 24), text_hidden_size=4096, text_intermediate_size=12288,
    text_layers=36, text_heads=32, text_kv_heads=8, mrope_section=(24, 20, 20)`` (head_dim 128).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from prune_audit.models.build import qwen_tokenizer
    from prune_audit.models.tiny_qwen import qwen_text_config, qwen_vision_token_ids, save_tiny_qwen

    save_dir = Path(save_dir)
    tokenizer = qwen_tokenizer(words)
    config = Qwen3VLConfig(
        vision_config={
            "depth": vision_layers,
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_heads": vision_heads,
            "patch_size": patch_size,
            "spatial_merge_size": spatial_merge_size,
            "temporal_patch_size": 2,
            "out_hidden_size": text_hidden_size,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": list(deepstack_visual_indexes),
        },
        text_config=qwen_text_config(
            tokenizer,
            hidden=text_hidden_size,
            intermediate=text_intermediate_size,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            mrope_section=mrope_section,
            max_positions=512,
            interleaved=True,
        ),
        **qwen_vision_token_ids(tokenizer),
    )
    pixels = image_size * image_size
    return save_tiny_qwen(
        Qwen3VLForConditionalGeneration,
        config,
        tokenizer,
        save_dir,
        seed=seed,
        patch_size=patch_size,
        merge_size=spatial_merge_size,
        min_pixels=pixels,
        max_pixels=pixels,
    )


__all__ = ["Qwen3VLModel", "build_qwen3_vl", "step_seconds", "PROMPT_TEMPLATE"]
