"""``load_vlm``: open a LLaVA or Qwen2.5-VL checkpoint behind one interface."""

from __future__ import annotations

from pathlib import Path

import torch

from prune_audit.errors import PruneAuditError
from prune_audit.models.base import VisionLanguageModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FAMILIES = ("llava", "qwen2_5_vl")


def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise PruneAuditError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise PruneAuditError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _load(what: str, source: str, loader):
    try:
        return loader()
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = "" if Path(source).exists() else " (the hub may be unreachable from here: pass a local path)"
        raise PruneAuditError(f"could not load the {what} from {source!r}{hint}: {first_line}") from None


def load_vlm(
    path_or_hub_id: str | Path,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    clip_text: str | Path | None = None,
) -> VisionLanguageModel:
    """Load a checkpoint with ``from_pretrained`` (SDPA attention, PIL image processing).

    Args:
        path_or_hub_id: local folder or hub id of a LLaVA (``llava``) or Qwen2.5-VL
            (``qwen2_5_vl``) checkpoint.
        device: ``"auto"`` (CUDA if available, else CPU) or a torch device string.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU) or float32/bfloat16/float16.
        prompt_template: LLaVA ``"llava_hf"`` (the checkpoint's chat template, default)
            or ``"vicuna_v1"``; Qwen ``"qwen2_5_vl"``.
        system_prompt: replaces the template's system text.
        clip_text: a CLIP checkpoint (text tower and projections) for CDPruner's text
            relevance; LLaVA only.
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # the audit shows its own progress; per-load bars would interleave with it on stderr
    transformers_logging.disable_progress_bar()

    source = str(path_or_hub_id)
    config = _load("model config", source, lambda: AutoConfig.from_pretrained(source))
    family = config.model_type
    if family not in FAMILIES:
        raise PruneAuditError(f"{source} is a {family!r} model; supported families: {', '.join(FAMILIES)}")
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    if family == "qwen2_5_vl" and clip_text is not None:
        raise PruneAuditError("clip_text applies to LLaVA's CLIP vision tower; Qwen2.5-VL has no CLIP space")
    model_class = _model_class(family)
    model = _load("model", source, lambda: model_class.from_pretrained(
        source, dtype=resolved_dtype, attn_implementation="sdpa"
    ))
    model = model.to(resolved_device).eval()
    if family == "llava":
        from prune_audit.models.llava import LlavaModel

        processor = _load("processor", source, lambda: AutoProcessor.from_pretrained(source, backend="pil"))
        clip = None if clip_text is None else _load_clip(str(clip_text), model, resolved_device)
        return LlavaModel(model, processor, model_id=source, prompt_template=prompt_template,
                          system_prompt=system_prompt, clip=clip)
    from prune_audit.models.qwen import QwenModel

    image_processor = _load(
        "image processor", source, lambda: AutoImageProcessor.from_pretrained(source, backend="pil")
    )
    tokenizer = _load("tokenizer", source, lambda: AutoTokenizer.from_pretrained(source))
    return QwenModel(model, image_processor, tokenizer, model_id=source, prompt_template=prompt_template,
                     system_prompt=system_prompt)


def _model_class(family: str):
    if family == "llava":
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def _load_clip(source: str, model, device: torch.device):
    """(CLIPModel, tokenizer) whose image projection fits the LLaVA vision tower's width."""
    from transformers import AutoTokenizer, CLIPModel

    clip = _load("CLIP text tower", source, lambda: CLIPModel.from_pretrained(source, dtype=model.dtype))
    width = model.config.vision_config.hidden_size
    if clip.config.vision_config.hidden_size != width:
        raise PruneAuditError(
            f"the CLIP checkpoint {source} has vision width {clip.config.vision_config.hidden_size}, "
            f"but the LLaVA vision tower has {width}; pass the CLIP model the tower was taken from"
        )
    tokenizer = _load("CLIP tokenizer", source, lambda: AutoTokenizer.from_pretrained(source))
    return clip.to(device).eval(), tokenizer


__all__ = ["load_vlm", "resolve_device", "resolve_dtype", "DTYPES", "FAMILIES"]
