"""LLaVA-1.5 in the Hugging Face layout (``LlavaForConditionalGeneration``).

Vision: CLIP, features of ``vision_feature_layer`` (−2 = output of the penultimate
encoder layer) without the CLS token (strategy ``"default"``), through the MLP
projector. The CLS row and keys come from recomputing the query/key projections of
the encoder layer that produces those features (selectors spec §3), and on request those of the tower's last
layer on its input (PruMerge's official layer). After input-level
selection the prompt is simply shorter, so positions are contiguous (§1.2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from prune_audit.compute.shape import ModelShape
from prune_audit.errors import PruneAuditError
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.executor import DecoderStack
from prune_audit.models.parts import load_part
from prune_audit.models.prefill_assembly import reruns_tower_only
from prune_audit.models.prepared import Prepared, VisionOutput, find_image_span
from prune_audit.models.probe import clip_attention_block, clip_cls_row, clip_logits
from prune_audit.models.shape import clip_text_shape, language_shape, llava_vision_shape
from prune_audit.models.shared_prefix import shared_prefix_logits
from prune_audit.pruners.base import LayerSelector
from prune_audit.pruners.signals import LAST_LAYER_CLS_SIGNALS

VICUNA_V1_SYSTEM = (  # LLaVA's conv_vicuna_v1 ("user"; conv_llava_v1's "human" is another template)
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
PROMPT_TEMPLATES = ("llava_hf", "vicuna_v1")
CLS_SIGNALS = frozenset({"cls_attention", "cls_logits", "vision_keys"})
LAYER_SIGNALS = frozenset({"layer_attention", "layer_cls_attention"})  # every encoder layer up to the feature layer


class LlavaModel(VisionLanguageModel):
    """LLaVA-1.5 adapter; ``clip`` is an optional (CLIPModel, tokenizer) for CDPruner's text relevance."""

    family = "llava"
    input_signals = frozenset(
        {"features", "vision_features", "cls_attention", "cls_logits", "vision_keys", "cls_feature"}
        | {"text_relevance", "demand", "merging_tower"}
        | LAYER_SIGNALS
        | LAST_LAYER_CLS_SIGNALS
    )
    cls_probe_signals, layer_probe_signals = CLS_SIGNALS, LAYER_SIGNALS
    missing_signals_reason = "this adapter does not compute it"
    display_name = "LLaVA"
    # LLaVA-1.5's RefCOCO data: [x1, y1, x2, y2] in 0-1 of the image padded to a square (data.boxes)
    grounding = "llava-1.5"
    prompt_templates = PROMPT_TEMPLATES

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, **sizes: Any
    ) -> Path:
        """:func:`~prune_audit.models.build.build_llava` (``sizes``: its other keywords)."""
        from prune_audit.models.build import build_llava

        return build_llava(save_dir, words=words, text_layers=text_layers, seed=seed, **sizes)

    @classmethod
    def check_clip_text(cls, clip_text: object) -> None:
        """Any CLIP checkpoint is accepted here; its width is checked against the tower once loaded."""

    @classmethod
    def from_model(
        cls, model, source: str, *, prompt_template: str | None, system_prompt: str | None, clip_text: str | None
    ) -> LlavaModel:
        from transformers import AutoProcessor

        processor = load_part("processor", source, lambda: AutoProcessor.from_pretrained(source, backend="pil"))
        clip = None if clip_text is None else load_clip(clip_text, model)
        return cls(
            model, processor, model_id=source, prompt_template=prompt_template, system_prompt=system_prompt, clip=clip
        )

    def __init__(
        self,
        model,
        processor,
        *,
        model_id: str,
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        clip: tuple[Any, Any] | None = None,
    ):
        config = model.config
        if config.vision_feature_select_strategy != "default" or not isinstance(config.vision_feature_layer, int):
            raise PruneAuditError(
                "only LLaVA checkpoints with one vision_feature_layer and the 'default' strategy (CLS dropped) "
                "are supported"
            )
        template = self.resolve_template(prompt_template)
        stack = DecoderStack.one_dimensional(model, config.text_config)
        super().__init__(
            model, processor.tokenizer, stack, model_id=model_id, prompt_template=template, system_prompt=system_prompt
        )
        self.processor = processor
        self.clip = clip
        self.vision_tower = model.model.vision_tower
        hidden_count = config.vision_config.num_hidden_layers + 1
        layer = config.vision_feature_layer
        self.feature_index = layer if layer >= 0 else hidden_count + layer
        if not 1 <= self.feature_index < hidden_count:
            raise PruneAuditError(f"vision_feature_layer {layer} has no encoder layer producing it")
        vision = llava_vision_shape(config, self.feature_index)
        clip_shape = None if clip is None else clip_text_shape(clip[0], vision.width)
        self.shape = ModelShape(vision, language_shape(config.text_config), model.dtype.itemsize, clip_shape)

    # ----- prompts --------------------------------------------------------------------
    def prompt(self, question: str) -> str:
        """The full prompt text with one image placeholder around ``question`` as the task composed it (the
        template adds no instruction). ``vicuna_v1``: LLaVA's ``conv_vicuna_v1`` as ``model_vqa_loader.py`` fills
        it, ``"{system} USER: <image>\n{question} ASSISTANT:"``; ``llava_hf``: the checkpoint's chat template."""
        if self.prompt_template == "vicuna_v1":
            system = self.system_prompt or VICUNA_V1_SYSTEM
            return f"{system} USER: {self.processor.image_token}\n{question} ASSISTANT:"
        if not getattr(self.processor, "chat_template", None):
            raise PruneAuditError(f"{self.model_id} has no chat template; use prompt_template='vicuna_v1'")
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": self.system_prompt}]})
        messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
        return self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def token_geometry(self, image_size: tuple[int, int]):
        """The CLIP pipeline as the llava-hf processor is configured (``hf_crop``, or ``hf_pad`` with
        ``LlavaImageProcessor(do_pad=True)``) on the tower's patch grid."""
        from prune_audit.data.geometry import clip_geometry_from_processor

        return clip_geometry_from_processor(
            self.processor.image_processor, image_size, patch_size=self.model.config.vision_config.patch_size
        )

    def prepare(self, image, question: str) -> Prepared:
        image = image.convert("RGB")
        encoded = self.processor(images=image, text=self.prompt(question), return_tensors="pt")
        input_ids = encoded["input_ids"][0]
        start, end = find_image_span(input_ids, self.model.config.image_token_id)
        pixel_values = encoded["pixel_values"][0]
        patch = self.model.config.vision_config.patch_size
        grid = (pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch)
        if grid[0] * grid[1] != end - start:
            raise PruneAuditError(
                f"the prompt holds {end - start} image tokens but the image gives a {grid[0]}x{grid[1]} grid; "
                f"check num_additional_image_tokens in the processor"
            )
        return Prepared(
            input_ids=input_ids,
            image_span=(start, end),
            grid=grid,
            pixel_values=pixel_values,
            question=question,
            image_size=image.size,
            geometry=self.token_geometry(image.size),
        )

    # ----- vision ---------------------------------------------------------------------
    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        pixels = torch.stack([item.pixel_values for item in prepared]).to(self.device, self.dtype)
        if reruns_tower_only(requires):  # the selector's tower run is the one pass; the stock pass on demand only
            stock = cache(partial(self._stock_features, pixels))

            def row(b: int) -> Tensor:
                return stock()[b]

            return [
                VisionOutput(partial(row, b), {"merging_tower": partial(self._merging_tower, pixels[b])})
                for b in range(len(prepared))
            ]
        hidden = self._tower_states(pixels)
        selected = hidden[self.feature_index]  # (B, 1 + N, Dv), CLS first
        features = self.model.model.multi_modal_projector(selected[:, 1:])
        cls_probs = cls_keys = cls_logits = last_keys = last_logits = None
        if requires & CLS_SIGNALS:
            # the encoder layer whose output is the feature layer
            layer = self.vision_tower.encoder.layers[self.feature_index - 1]
            cls_probs, cls_keys, cls_logits = clip_cls_row(layer, hidden[self.feature_index - 1])
        if requires & LAST_LAYER_CLS_SIGNALS:
            _, last_keys, last_logits = self._last_layer_cls_row(hidden)
        per_layer = self._layer_signals(hidden) if requires & LAYER_SIGNALS else {}
        outputs = []
        for b in range(len(prepared)):
            signals = {}
            if requires & {"vision_features", "text_relevance"}:
                signals["vision_features"] = selected[b, 1:]
            if "cls_feature" in requires:
                signals["cls_feature"] = selected[b, 0]
            if requires & {"cls_attention", "cls_logits"}:
                # the logits come along: score_dtype="model" recomputes the probabilities from them, and a selector
                # may read the logits alone (one full-width head is their sum over heads)
                signals["cls_attention"], signals["cls_logits"] = cls_probs[b, :, 1:], cls_logits[b]
            if "vision_keys" in requires:
                signals["vision_keys"] = cls_keys[b]
            if requires & LAST_LAYER_CLS_SIGNALS:
                signals["last_layer_cls_logits"], signals["last_layer_vision_keys"] = last_logits[b], last_keys[b]
            # the model-dtype twins (half towers) come with the signal they stand for
            signals.update(
                {name: value[b] for name, value in per_layer.items() if name.removeprefix("model_") in requires}
            )
            if "merging_tower" in requires:
                signals["merging_tower"] = partial(self._merging_tower, pixels[b])
            outputs.append(VisionOutput(features[b], signals))
        return outputs

    def _stock_features(self, pixels: Tensor) -> Tensor:
        """(B, N, D) projector outputs of (B, 3, H, W) pixels through the stock tower (the deferred pass of a
        tower-rerunning selector that keeps every token: the batch's, as the stock pass runs otherwise)."""
        return self.model.model.multi_modal_projector(self._tower_states(pixels)[self.feature_index][:, 1:])

    def _last_layer_cls_row(self, hidden: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`clip_cls_row` of the tower's last encoder layer on its input, ``hidden[L - 1]`` of the states
        ``hidden`` (each (B, 1 + N, Dv)): its layer norm and q / k projections only, as PruMerge's official hooks
        on that layer's ``q_proj`` / ``k_proj`` read them (the rest of the layer is never run). The input is the
        feature layer's output under LLaVA's -2 (the feature layer itself under -1)."""
        layers = self.vision_tower.encoder.layers
        return clip_cls_row(layers[-1], hidden[len(layers) - 1])

    def _layer_signals(self, hidden: list[Tensor]) -> dict[str, Tensor]:
        """``layer_attention`` and ``layer_cls_attention``, each (B, Lv, N), of the ``Lv = feature_index``
        encoder layers that run, from their attention recomputed on their inputs ``hidden[l]``.

        A half-precision tower also gets their ``model_`` twins as the official code forms them in its dtype
        (the eager CLIP attention's logits rounded, softmax rounded, head mean then query mean each rounded;
        float32 tensors): the logits are the same float32 products rounded, which is the half product's
        value exactly when the scale 1/sqrt(d) is a power of two (CLIP-L's d = 64) and a GPU accumulates in
        float32.
        """
        half = self.vision_tower.dtype if self.vision_tower.dtype in (torch.float16, torch.bfloat16) else None
        signals: dict[str, list[Tensor]] = {}
        for index, layer in enumerate(self.vision_tower.encoder.layers[: self.feature_index]):
            logits = clip_logits(layer, hidden[index])  # (B, H, 1 + N, 1 + N)
            rows = {"": torch.softmax(logits, dim=-1)}
            if half is not None:
                rows["model_"] = torch.softmax(logits.to(half).float(), dim=-1).to(half)
            for prefix, probs in rows.items():
                # the official head mean then query mean; in half each rounded once
                in_half = probs.dtype != torch.float32
                received = (probs.mean(dim=1).mean(dim=1) if in_half else probs.mean(dim=(1, 2)))[:, 1:]
                signals.setdefault(f"{prefix}layer_attention", []).append(received.float())
                signals.setdefault(f"{prefix}layer_cls_attention", []).append(probs[:, :, 0, 1:].mean(dim=1).float())
        return {name: torch.stack(values, dim=1) for name, values in signals.items()}

    def _merging_tower(self, pixels: Tensor, merge: Callable) -> tuple[Tensor, list[Tensor]]:
        """The tower on one (3, H, W) image up to the feature layer with ``merge`` between the attention and
        the MLP of every layer (``InputSignals.merging_tower``; ToMe's block, proportional attention when
        ``merge.proportional``; FlowCut's cuts), or after the whole layer when ``merge.after_mlp`` (MustDrop's
        window merge): (1 + M, Dv) states, CLS first, and the grid cells each carries.
        ``merge.metric(cls_probs, keys, values)`` picks what the step reads of the layer's heads. With
        ``merge.reads_next_layer``, the CLS row of the layer after the feature layer on the final states (the
        official layer-23 attention of MustDrop's key set; :func:`clip_cls_row`, (H, 1 + M) float32) goes to
        ``merge.next_layer_cls``."""
        tower = self.vision_tower
        hidden = tower.pre_layrnorm(tower.embeddings(pixels[None]))[0]  # (1 + N, Dv)
        size = torch.ones(hidden.shape[0])
        sources = [torch.zeros(0, dtype=torch.long)] + [torch.tensor([cell]) for cell in range(hidden.shape[0] - 1)]
        layers = tower.encoder.layers[: self.feature_index]
        after_mlp = getattr(merge, "after_mlp", False)
        for index, layer in enumerate(layers):
            bias = size.log().to(hidden.device) if merge.proportional else None
            attended, heads = clip_attention_block(layer, hidden, bias)
            metric = merge.metric(heads.cls_probs, heads.keys, heads.values).cpu()
            hidden = hidden + attended
            if not after_mlp:
                hidden, size, sources = merge(index, len(layers), hidden, metric, size, sources)
            hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
            if after_mlp:
                hidden, size, sources = merge(index, len(layers), hidden, metric, size, sources)
        if getattr(merge, "reads_next_layer", False) and len(layers) < len(tower.encoder.layers):
            merge.next_layer_cls(clip_cls_row(tower.encoder.layers[len(layers)], hidden[None])[0][0].cpu())
        return hidden, sources

    def _tower_states(self, pixels: Tensor) -> list[Tensor]:
        """CLIP hidden states 0..feature_index of (B, 3, H, W) pixels, each (B, 1 + N, Dv).

        The same modules in the same order as the stock tower with ``output_hidden_states``,
        but the encoder layers after the feature layer are not run: nothing reads them
        (LLaVA-1.5's layer -2 leaves one of 24 layers, the benchmark model one of 4).
        """
        tower = self.vision_tower
        hidden = tower.pre_layrnorm(tower.embeddings(pixels))
        states = [hidden]
        for layer in tower.encoder.layers[: self.feature_index]:
            hidden = layer(hidden, None)
            states.append(hidden)
        return states

    def project(self, vision_tokens: Tensor) -> Tensor:
        return self.model.model.multi_modal_projector(vision_tokens)

    @property
    def vision_head_dim(self) -> int:
        """Width of one vision-tower attention head (VisionZip's keys)."""
        vision = self.model.config.vision_config
        return vision.hidden_size // vision.num_attention_heads

    def text_chunks(self, prepared: Prepared) -> int:
        """CLIP text-tower chunks :meth:`text_relevance` runs for ``prepared``'s question."""
        context = self.clip[0].config.text_config.max_position_embeddings
        return -(-len(self.clip[1](prepared.question)["input_ids"]) // context)

    def _available_input_signals(self) -> frozenset[str]:
        available = self.input_signals if self.clip is not None else self.input_signals - {"text_relevance"}
        # the last layer's input is among the states run only when the feature layer is the tower's -2 or -1
        if available & LAST_LAYER_CLS_SIGNALS and len(self.vision_tower.encoder.layers) - 1 > self.feature_index:
            available -= LAST_LAYER_CLS_SIGNALS
        return available

    def text_relevance(self, prepared: Prepared, vision: VisionOutput) -> tuple[Tensor, Tensor]:
        """(N,) CDPruner relevance ``mean_m -cos(E_i, T_m)`` (selectors spec §6), in float32 and as the
        official code computes it in the CLIP dtype (unit embeddings, cosines and their mean each rounded).

        ``E`` = CLIP image projection of the post-layernormed feature-layer patches, ``T``
        = CLIP text embeddings of the raw question, split into chunks of the text
        tower's context length (the last chunk zero-padded), one embedding per chunk.
        """
        clip, tokenizer = self.clip
        patches = self.vision_tower.post_layernorm(vision.signals["vision_features"])
        image_embeds = clip.visual_projection(patches.to(clip.dtype))
        ids = tokenizer(prepared.question)["input_ids"]
        context = clip.config.text_config.max_position_embeddings
        chunks = [ids[i : i + context] for i in range(0, len(ids), context)]
        chunks = torch.tensor([chunk + [0] * (context - len(chunk)) for chunk in chunks], device=clip.device)
        pooled = clip.text_model(input_ids=chunks).pooler_output
        text_embeds = clip.text_projection(pooled)
        normalize = torch.nn.functional.normalize
        cosine = normalize(image_embeds.float(), dim=-1) @ normalize(text_embeds.float(), dim=-1).T  # (N, chunks)
        image_units = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
        text_units = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
        return -cosine.mean(dim=1), (-(image_units @ text_units.T)).mean(dim=1)

    # ----- direct forwards (the demo trainer and evaluator) ------------------------------
    @property
    def vision_state_width(self) -> int:
        """Width of the pooled and per-token states :meth:`vision_states` returns (the CLIP width)."""
        return self.model.config.vision_config.hidden_size

    def image_inputs(self, images: Sequence[Any]) -> dict[str, Tensor]:
        """Keyword inputs of :meth:`image_features` for PIL images, through the model's processor."""
        return {"pixels": self.processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]}

    def array_inputs(self, images: Tensor) -> dict[str, Tensor]:
        """Keyword inputs of :meth:`vision_states` for (B, H, W, 3) uint8 images already at the tower's
        size: the processor's normalisation (its resize and centre crop are then identities)."""
        image_processor = self.processor.image_processor
        pixels = torch.as_tensor(images).permute(0, 3, 1, 2).float() / 255.0
        mean = torch.tensor(list(image_processor.image_mean)).view(1, 3, 1, 1)
        std = torch.tensor(list(image_processor.image_std)).view(1, 3, 1, 1)
        return {"pixels": (pixels - mean) / std}

    def image_features(self, pixels: Tensor) -> Tensor:
        """(B, N, D) projected patch features, the language model's image inputs, of (B, 3, H, W) pixels."""
        return torch.stack(list(self.model.get_image_features(pixel_values=pixels).pooler_output))

    def vision_states(self, pixels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The vision tower once, differentiable: (B, N, D) projected features (as :meth:`image_features`),
        (B, Dv) pooled CLS and (B, N, Dv) last-layer patch states."""
        out = self.vision_tower(pixels, output_hidden_states=True)
        selected = out.hidden_states[self.feature_index][:, 1:]  # CLS dropped (the 'default' strategy)
        return self.model.model.multi_modal_projector(selected), out.pooler_output, out.last_hidden_state[:, 1:]

    def shared_prefix_logits(
        self,
        features: Tensor,
        prefix_ids: Tensor,
        image_positions: Tensor,
        suffixes: Sequence[Tensor],
        per_image: int,
        grid: tuple[int, int] | None = None,
        every_position: bool = False,
    ) -> Tensor:
        """(B * per_image, V) logits after each suffix, or (B * per_image, T, V) at ``every_position``
        (:func:`~prune_audit.models.shared_prefix.shared_prefix_logits`); positions are 1-D and contiguous, so
        ``grid`` is not needed."""
        language = self.model.model.language_model
        return shared_prefix_logits(
            language,
            self.model.lm_head,
            features,
            prefix_ids,
            image_positions,
            suffixes,
            per_image,
            every_position=every_position,
        )

    def first_token_logits(self, input_ids: Tensor, attention_mask: Tensor, features: Sequence[Tensor]) -> Tensor:
        """(B, V) logits at the last position of left-padded (B, L) prompts, stock Llava forward.

        ``features[b]`` is a (k_b, D) set of projected patch features in grid order that fills
        row b's k_b image tokens (k_b may be below the grid size: pruning by omission).
        """
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            # positions count real tokens only, so padding never shifts a prompt's RoPE
            position_ids=(attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=list(features))},
            logits_to_keep=1,
        ).logits[:, -1]

    # ----- positions ------------------------------------------------------------------
    def full_positions(self, prepared: Prepared) -> Tensor:
        return torch.arange(prepared.input_ids.numel())[None]

    def _layer_positions(self, selector: LayerSelector | None) -> str:
        return getattr(selector, "positions", "keep_original")

    def _family_description(self) -> dict[str, Any]:
        image_processor = self.processor.image_processor
        crop = getattr(image_processor, "crop_size", None) or {}
        probe_size = (int(crop.get("width", 336)), int(crop.get("height", 336)))
        patch = self.model.config.vision_config.patch_size
        return {
            "processor": {
                "class": type(image_processor).__name__,
                "mode": self.token_geometry(probe_size).mode,
                "size": dict(getattr(image_processor, "size", None) or {}),
                "crop_size": dict(crop),
                "patch_size": patch,
                "vision_feature_layer": self.model.config.vision_feature_layer,
            },
            "clip_text": None if self.clip is None else getattr(self.clip[0].config, "_name_or_path", ""),
        }


def load_clip(source: str, model) -> tuple[Any, Any]:
    """(CLIPModel, tokenizer) on ``model``'s device whose image projection fits its vision tower's width."""
    from transformers import AutoTokenizer, CLIPModel

    clip = load_part("CLIP text tower", source, lambda: CLIPModel.from_pretrained(source, dtype=model.dtype))
    width = model.config.vision_config.hidden_size
    if clip.config.vision_config.hidden_size != width:
        raise PruneAuditError(
            f"the CLIP checkpoint {source} has vision width {clip.config.vision_config.hidden_size}, "
            f"but the LLaVA vision tower has {width}; pass the CLIP model the tower was taken from"
        )
    tokenizer = load_part("CLIP tokenizer", source, lambda: AutoTokenizer.from_pretrained(source))
    return clip.to(model.device).eval(), tokenizer


__all__ = ["LlavaModel", "load_clip", "PROMPT_TEMPLATES", "VICUNA_V1_SYSTEM"]
