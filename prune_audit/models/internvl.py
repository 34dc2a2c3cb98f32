"""InternVL3 in the Hugging Face layout (``InternVLForConditionalGeneration``), with dynamic tiling.

Vision: InternViT (CLS first) on every tile -> the ``vision_feature_layer`` states without CLS
(strategy ``"default"``) -> pixel shuffle with ``downsample_ratio`` 0.5, so each LLM
visual token is the channel concatenation of a 2x2 block of 14-px patches (28x28
processed pixels), row-major -> MLP projector. A 448x448 tile gives 16x16 = 256 tokens.

Geometry (``data.multigrid.internvl_geometry``): with ``crop_to_patches``, which ``InternVLProcessor`` always
passes (the released -hf preprocessor configs say false, with ``min_patches`` 1, ``max_patches`` 12), the image
processor (``GotOcr2ImageProcessor``) resizes the image, aspect not kept, to the ``cols x rows`` tiles of the
grid whose aspect ratio is closest to the image's, cuts them row-major and, with more than one tile, appends a
thumbnail (the whole image at 448x448). The prompt holds 256 ``<IMG_CONTEXT>`` per tile, tiles first, thumbnail
last; the visual tokens are numbered in that order (the tiles a ``TiledGrid``, the thumbnail a second grid). One
tile (``max_patches`` 1, or a 1 x 1 grid) is the whole image resized to 448x448: token (r, c) covers
original pixels ``[c*28/sx, (c+1)*28/sx) x [r*28/sy, (r+1)*28/sy)``.

Positions: the language model (Qwen2.5 in InternVL3) uses 1-D RoPE; after input-level selection
the prompt is simply shorter (compact positions), as for LLaVA.

Signals: the projected features, the pre-projector pixel-shuffled features and the layer-0 text
demand. The LLM input has no CLS token and each LLM token is four ViT patches, so the CLS- and
vision-attention selectors (FasterVLM, VisionZip, VisPruner, SCOPE, HiPrune, VScan) are refused; no
CLIP text space, so CDPruner is refused. The tiles and the thumbnail are several regular grids, each
tile's and the thumbnail's own (``grid_parts``, the same tokens as ``crop_tokens``): uniform's lattice,
E2S's novelty blocks, pooling windows and ToMe's merges lie on each of them (``PER_TILE``); one
tile is one grid, as before tiling. A merged token is exact through the projector path as on one tile:
pooling averages one tile's pixel-shuffled pre-projector tokens and ``project`` runs the token-wise MLP
projector on the mean (ToMe merges projected tokens), it takes the next compact position in the row, and
its sources are cells of that one tile. ``budget_scope=crop`` splits any non-merging input selector's
budget evenly over the tiles and the thumbnail.

Prompt: the official InternVL chat format (ChatML; ``<img>`` + ``<IMG_CONTEXT>`` x N +
``</img>`` then a newline before the question), as ``model.chat`` of the
OpenGVLab/InternVL3 checkpoints builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from prune_audit.compute.shape import ModelShape, VisionShape
from prune_audit.errors import PruneAuditError
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.executor import DecoderStack
from prune_audit.models.parts import SeparateProcessorParts
from prune_audit.models.prepared import Prepared, VisionOutput, find_image_span
from prune_audit.models.selector_support import per_grid_for
from prune_audit.models.shape import language_shape
from prune_audit.pruners.base import LayerSelector
from prune_audit.pruners.layout import GRID_BLOCKS, GRID_MERGE, GRID_SPLIT

PROMPT_TEMPLATE = "internvl_chatml"
# the system message of the official InternVL2.5/3 conversation template ("internvl2_5")
DEFAULT_SYSTEM = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)
START_IMAGE, END_IMAGE, CONTEXT_IMAGE = "<img>", "</img>", "<IMG_CONTEXT>"
#: how pool and ToMe run: each merged token from one tile's grid (or the thumbnail's), docs/models.md
MERGE_PER_TILE = (
    "per tile: it merges within each tile's grid and the thumbnail's, the budget split evenly over "
    "them, each merged token at the next compact position (a project choice, no official code)"
)
#: how a selector that needs only a grid layout runs on each tile's and the thumbnail's grid (``grid_parts``), by
#: its ``Selector.per_grid`` kind: a project choice (no official InternVL pruning code was read), docs/models.md
PER_TILE = MappingProxyType(
    {
        GRID_BLOCKS: "per tile: its novelty blocks split each tile's grid and the thumbnail's (a project choice; E2S has "
        "no public code)",
        GRID_MERGE: MERGE_PER_TILE,
        GRID_SPLIT: "per tile: the budget split evenly over the tiles' and the thumbnail's grids, equal in tokens (a "
        "project choice, no official code); one tile is one grid",
    }
)


class InternVLModel(SeparateProcessorParts, VisionLanguageModel):
    """InternVL3 adapter (one image per prompt, dynamic 448-px tiles plus a thumbnail)."""

    family = "internvl"
    input_signals = frozenset({"features", "vision_features", "demand"})
    missing_signals_reason = (
        "its language model gets no CLS token (each visual token is a 2x2 pixel-shuffled patch group), "
        "this adapter reads no vision-tower attention, and it has no CLIP text space"
    )
    several_crops = True
    per_grid_selectors = per_grid_for(PER_TILE, frozenset())
    token_grids = "several grids"
    display_name = "InternVL"
    # <ref>...</ref><box>[[x1, y1, x2, y2]]</box> on a 0-1000 grid of the original image (data.boxes)
    grounding = "internvl"
    prompt_templates = (PROMPT_TEMPLATE,)

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import InternVLForConditionalGeneration

        return InternVLForConditionalGeneration

    @classmethod
    def build_tiny(
        cls,
        save_dir: str | Path,
        *,
        words: Sequence[str],
        text_layers: int = 2,
        seed: int = 0,
        image_size: int = 32,
        patch_size: int = 8,
        max_patches: int = 6,
        **sizes: Any,
    ) -> Path:
        """A random-weight checkpoint of this family for offline tests (:func:`build_internvl`) that tiles as the
        released processors do, at a small scale: 32-px tiles of 2 x 2 tokens (8-px patches), up to 6 tiles plus
        a thumbnail, so the tests' 64-px scenes get 2 x 2 tiles and a 130 x 100 image 3 x 2."""
        return build_internvl(
            save_dir,
            words=words,
            text_layers=text_layers,
            seed=seed,
            image_size=image_size,
            patch_size=patch_size,
            max_patches=max_patches,
            **sizes,
        )

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
        if config.vision_feature_select_strategy != "default" or not isinstance(config.vision_feature_layer, int):
            raise PruneAuditError(
                "only InternVL checkpoints with one vision_feature_layer and the 'default' strategy (CLS dropped) "
                "are supported"
            )
        if config.downsample_ratio != 0.5:
            raise PruneAuditError(f"InternVL downsample_ratio {config.downsample_ratio} is not supported (0.5 is)")
        text_config = config.text_config
        if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or []):
            raise PruneAuditError("InternVL checkpoints with sliding-window decoder layers are not supported")
        template = self.resolve_template(prompt_template)
        stack = DecoderStack.one_dimensional(model, text_config)
        super().__init__(
            model, tokenizer, stack, model_id=model_id, prompt_template=template, system_prompt=system_prompt
        )
        self.image_processor = image_processor
        self.shape = ModelShape(internvl_vision_shape(config), language_shape(text_config), model.dtype.itemsize)
        patch = config.vision_config.patch_size
        self.patch_size = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
        self.token_pixels = int(round(self.patch_size / config.downsample_ratio))
        size = image_processor.size
        self.tile = (int(size["height"]), int(size["width"]))  # each tile, and the thumbnail
        # InternVLProcessor always tiles (its images_kwargs default crop_to_patches=True), whatever the saved
        # preprocessor_config.json says: the released -hf ones say false, with max_patches 12
        self.min_tiles = int(getattr(image_processor, "min_patches", 1))
        self.max_tiles = int(getattr(image_processor, "max_patches", 1))

    def prompt(self, question: str, num_image_tokens: int = 1) -> str:
        """The InternVL chat prompt for one image followed by ``question``."""
        system = self.system_prompt or DEFAULT_SYSTEM
        image = f"{START_IMAGE}{CONTEXT_IMAGE * num_image_tokens}{END_IMAGE}"
        return (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{image}\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n"
        )

    def token_geometry(self, image_size: tuple[int, int]):
        """The processor's tiles (``data.multigrid.internvl_geometry``): one grid for one tile, else the tiles
        and the thumbnail, one token per ``token_pixels`` square."""
        from prune_audit.data.multigrid import internvl_geometry

        return internvl_geometry(
            image_size,
            tile=self.tile,
            token_pixels=self.token_pixels,
            min_tiles=self.min_tiles,
            max_tiles=self.max_tiles,
        )

    @property
    def tile_grid(self) -> tuple[int, int]:
        """(rows, cols) of the visual tokens of one tile (16 x 16 at 448 px)."""
        return (self.tile[0] // self.token_pixels, self.tile[1] // self.token_pixels)

    @property
    def tile_tokens(self) -> int:
        """Visual tokens of one tile (256 at 448 px)."""
        return self.tile_grid[0] * self.tile_grid[1]

    def prepare(self, image, question: str) -> Prepared:
        image = image.convert("RGB")
        pixel_values = self.image_processor(images=[image], crop_to_patches=True, return_tensors="pt")["pixel_values"]
        geometry = self.token_geometry(image.size)
        tiles = pixel_values.shape[0]
        if tuple(pixel_values.shape[-2:]) != self.tile or tiles * self.tile_tokens != geometry.num_tokens:
            raise PruneAuditError(
                f"the image processor made {tiles} tiles of {tuple(pixel_values.shape[-2:])} px, not "
                f"the {geometry.num_tokens // self.tile_tokens} of {self.tile} px its configuration gives; check size, "
                f"min_patches and max_patches in its preprocessor_config.json"
            )
        input_ids = self.tokenizer(self.prompt(question, geometry.num_tokens), return_tensors="pt")["input_ids"][0]
        span = find_image_span(input_ids, self.model.config.image_token_id)
        return Prepared(
            input_ids=input_ids,
            image_span=span,
            grid=geometry.grid,
            pixel_values=pixel_values,
            question=question,
            image_size=image.size,
            geometry=geometry,
        )

    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        """One tower call over every tile of the batch; each image's tiles' tokens joined in prompt order."""
        pixels = torch.cat([item.pixel_values for item in prepared]).to(self.device, self.dtype)
        shuffled = self._shuffled_patches(pixels)  # (T, tile_tokens, 4 Dv) over the batch's T tiles
        features = self.model.model.multi_modal_projector(shuffled)
        tiles = [item.pixel_values.shape[0] for item in prepared]
        outputs = []
        for image_tiles, image_features in zip(shuffled.split(tiles), features.split(tiles)):
            signals = {"vision_features": image_tiles.flatten(0, 1)} if "vision_features" in requires else {}
            outputs.append(VisionOutput(image_features.flatten(0, 1), signals))
        return outputs

    def crop_tokens(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """Per tile the tower ran on (the tiles, then the thumbnail), its ``tile_tokens`` consecutive visual tokens
        and their (rows, cols) grid."""
        return [
            (torch.arange(tile * self.tile_tokens, (tile + 1) * self.tile_tokens), self.tile_grid)
            for tile in range(item.pixel_values.shape[0])
        ]

    def grid_parts(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """Each tile's and then the thumbnail's ``tile_grid`` of consecutive visual tokens: the tiles' tokens are
        numbered tile by tile, so the joined tile canvas is no row-major grid, but each tile is (one tile: one grid)."""
        return self.crop_tokens(item)

    def tower_crops(self, prepared: Prepared) -> dict[str, Any]:
        """The tower ran on every tile (and the thumbnail) of ``tile // patch`` squared patches."""
        return {
            "crops": int(prepared.pixel_values.shape[0]),
            "crop_grid": (self.tile[0] // self.patch_size, self.tile[1] // self.patch_size),
        }

    def _shuffled_patches(self, pixels: Tensor) -> Tensor:
        """(B, N, 4 Dv) pre-projector tokens of (B, 3, H, W) tiles, as ``get_image_features`` builds them:
        feature-layer states without CLS, pixel-shuffled so token (r, c) holds patches 2r..2r+1 x 2c..2c+1."""
        layer = self.model.config.vision_feature_layer
        out = self.model.model.vision_tower(pixel_values=pixels, output_hidden_states=layer != -1)
        states = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        patches = states[:, 1:]
        side = pixels.shape[-2] // self.patch_size
        grid = patches.reshape(patches.shape[0], side, pixels.shape[-1] // self.patch_size, -1)
        shuffled = self.model.model.pixel_shuffle(grid, scale_factor=self.model.config.downsample_ratio)
        return shuffled.reshape(shuffled.shape[0], -1, shuffled.shape[-1])

    @property
    def vision_head_dim(self) -> int:
        """Width of one InternViT attention head."""
        vision = self.model.config.vision_config
        return vision.hidden_size // vision.num_attention_heads

    def project(self, vision_tokens: Tensor) -> Tensor:
        return self.model.model.multi_modal_projector(vision_tokens)

    def full_positions(self, prepared: Prepared) -> Tensor:
        return torch.arange(prepared.input_ids.numel())[None]

    def _layer_positions(self, selector: LayerSelector | None) -> str:
        return getattr(selector, "positions", "keep_original")

    def _family_description(self) -> dict[str, Any]:
        size = getattr(self.image_processor, "size", None) or {}
        return {
            "processor": {
                "class": type(self.image_processor).__name__,
                "mode": "internvl_tiles (one tile: hf_crop, a plain resize, no crop)",
                "size": dict(size),
                "crop_to_patches": True,  # as InternVLProcessor calls it
                "min_patches": self.min_tiles,
                "max_patches": self.max_tiles,
                "patch_size": self.patch_size,
                "downsample_ratio": self.model.config.downsample_ratio,
                "vision_feature_layer": self.model.config.vision_feature_layer,
            },
        }


def internvl_vision_shape(config: Any) -> VisionShape:
    """InternViT (CLS + patches, every layer runs: the adapter reads its feature layer from a full forward)
    and the projector after the 2x2 pixel shuffle (LayerNorm, then 4 Dv -> D and D -> D)."""
    vision, text_width = config.vision_config, config.text_config.hidden_size
    patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
    shuffled_width = vision.hidden_size * 4
    return VisionShape(
        layers=vision.num_hidden_layers,
        width=vision.hidden_size,
        mlp_width=vision.intermediate_size,
        mlp_matrices=2,
        patch_inputs=vision.num_channels * patch**2,
        class_tokens=1,
        merge=2,
        window=0,
        full_attention_layers=(),
        projector=((shuffled_width, text_width), (text_width, text_width)),
    )


def build_internvl(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    image_size: int = 112,
    patch_size: int = 14,
    vision_hidden_size: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    max_patches: int = 1,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``InternVLForConditionalGeneration`` (InternViT + Qwen2) with its
    PIL image processor (``image_size`` tiles; up to ``max_patches`` of them plus a thumbnail, ``crop_to_patches``
    when ``max_patches > 1``) and tokenizer.

    ``image_size`` must be a multiple of ``2 * patch_size``: a tile gives
    ``(image_size / (2 * patch_size))**2`` visual tokens. The released InternVL3 processors tile with
    ``max_patches=12``; the real InternVL3-8B widths are
    ``image_size=448, vision_hidden_size=1024, vision_layers=24, vision_heads=16,
    text_hidden_size=3584, text_intermediate_size=18944, text_layers=28, text_heads=28, text_kv_heads=4``.
    """
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration

    from prune_audit.models.build import qwen_tokenizer

    if image_size % (2 * patch_size):
        raise ValueError(f"image_size {image_size} must be a multiple of 2 * patch_size = {2 * patch_size}")
    save_dir = Path(save_dir)
    tokenizer = qwen_tokenizer(words, extra_special_tokens=(START_IMAGE, END_IMAGE, CONTEXT_IMAGE))
    ids = tokenizer.convert_tokens_to_ids
    config = InternVLConfig(
        vision_config={
            "hidden_size": vision_hidden_size,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": vision_heads,
            "intermediate_size": 2 * vision_hidden_size,
            "image_size": [image_size, image_size],
            "patch_size": [patch_size, patch_size],
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
        image_token_id=ids(CONTEXT_IMAGE),
        image_seq_length=(image_size // (2 * patch_size)) ** 2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).eval()
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": image_size, "width": image_size},
        crop_to_patches=max_patches > 1,
        min_patches=1,
        max_patches=max_patches,
    )
    model.save_pretrained(save_dir)
    image_processor.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir


__all__ = ["InternVLModel", "build_internvl", "PROMPT_TEMPLATE", "DEFAULT_SYSTEM"]
