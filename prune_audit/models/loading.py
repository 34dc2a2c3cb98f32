"""``load_vlm``: open a checkpoint of any registered family behind one interface (the only loading path;
the parts the adapters read themselves are in ``models.parts``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prune_audit.errors import PruneAuditError
from prune_audit.models.hub import resolve_model_source
from prune_audit.models.parts import load_part
from prune_audit.models.task_instructions import checkpoint_task_instructions
from prune_audit.models.video_sampling import checkpoint_video_sampling
from prune_audit.safety.fingerprint import weight_files

if TYPE_CHECKING:
    from prune_audit.models.base import VisionLanguageModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def checkpoint_family(path_or_hub_id: str | Path) -> tuple[type[VisionLanguageModel], int]:
    """The family adapter and decoder layers of a checkpoint, read from its config alone (no weights);
    another family is refused as :func:`load_vlm` refuses it."""
    from transformers import AutoConfig

    from prune_audit.models.families import adapter_for

    source = resolve_model_source(str(path_or_hub_id))
    config = load_part("model config", source, lambda: AutoConfig.from_pretrained(source))
    return adapter_for(config.model_type, source), int(config.get_text_config().num_hidden_layers)


def load_vlm(
    path_or_hub_id: str | Path,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    clip_text: str | Path | None = None,
    geometry_only: bool = False,
) -> VisionLanguageModel:
    """Load a checkpoint with ``from_pretrained`` (SDPA attention, PIL image processing).

    The config's ``model_type`` picks the family adapter (:mod:`prune_audit.models.families`).

    Args:
        path_or_hub_id: local folder or hub id of a checkpoint of a registered family
            (LLaVA ``llava``, Qwen2.5-VL ``qwen2_5_vl``).
        device: ``"auto"`` (CUDA if available, else CPU) or a torch device string.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU) or float32/bfloat16/float16.
        prompt_template: LLaVA ``"llava_hf"`` (the checkpoint's chat template, default)
            or ``"vicuna_v1"``; Qwen ``"qwen2_5_vl"``.
        system_prompt: replaces the template's system text.
        clip_text: a CLIP checkpoint (text tower and projections) for CDPruner's text
            relevance; LLaVA only.
        geometry_only: the caller needs prompts, token grids, depth and analytic cost only (``import`` without
            ``--model``): a folder without weight files (a processor folder: image processor, tokenizer and
            ``config.json``) is then accepted, its model built from the config on the meta device (no
            parameters in memory; it cannot answer). A folder with weights is loaded as usual.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as transformers_logging

    from prune_audit.models.families import adapter_for

    # the audit shows its own progress; per-load bars would interleave with it on stderr
    transformers_logging.disable_progress_bar()

    # a hub id on an offline machine: its cached snapshot folder, or one line at once
    source = resolve_model_source(str(path_or_hub_id))
    clip_text = None if clip_text is None else resolve_model_source(str(clip_text), "--clip-text")
    config = load_part("model config", source, lambda: AutoConfig.from_pretrained(source))
    adapter = adapter_for(config.model_type, source)
    # options are checked before the weights are read
    adapter.resolve_template(prompt_template)
    adapter.check_clip_text(clip_text)
    task_instructions = checkpoint_task_instructions(source)  # read before the weights: a bad file fails fast
    video_sampling = checkpoint_video_sampling(source, adapter.video_sampling_keys)
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    model_class = adapter.transformers_class()
    if geometry_only and not weight_files(source):
        with torch.device("meta"):
            model = model_class._from_config(config, dtype=resolved_dtype, attn_implementation="sdpa").eval()
    else:
        model = load_part(
            "model",
            source,
            lambda: model_class.from_pretrained(source, dtype=resolved_dtype, attn_implementation="sdpa"),
        )
        model = model.to(resolved_device).eval()
    vlm = adapter.from_model(
        model,
        source,
        prompt_template=prompt_template,
        system_prompt=system_prompt,
        clip_text=None if clip_text is None else str(clip_text),
    )
    vlm.task_instructions = task_instructions
    vlm.video_sampling = video_sampling
    return vlm


__all__ = ["load_vlm", "checkpoint_family", "resolve_device", "resolve_dtype", "DTYPES"]
