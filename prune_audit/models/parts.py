"""Reading a checkpoint's parts, for the loader and the family adapters alike (no family imported here, so
``base`` and the adapters can use it without an import cycle through ``loading`` -> ``families``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prune_audit.errors import PruneAuditError

T = TypeVar("T")


# where the checkpoint was read from and how it is stored do not change the model
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "dtype", "torch_dtype", "transformers_version"})


def config_hash(config: dict[str, Any]) -> str:
    """16 hex digits of SHA-256 over the sorted config, without path, dtype and library version."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
        return value

    text = json.dumps(strip(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_part(what: str, source: str, loader: Callable[[], T]) -> T:
    """``loader()``, with a missing or unreadable checkpoint part turned into one line naming it."""
    from safetensors import SafetensorError

    try:
        return loader()
    except SafetensorError as error:
        raise PruneAuditError(
            f"the {what} weights in {source} are damaged or incomplete ({error}); copy or download the checkpoint again"
        ) from None
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = "" if Path(source).exists() else " (the hub may be unreachable from here: pass a local path)"
        raise PruneAuditError(f"could not load the {what} from {source!r}{hint}: {first_line}") from None


def image_processor_and_tokenizer(source: str) -> tuple[Any, Any]:
    """The PIL image processor and the tokenizer of the checkpoint at ``source``, loaded on their own: the
    Qwen-VL and InternVL processor classes want a video processor (torchvision) the adapters never use."""
    from transformers import AutoImageProcessor, AutoTokenizer

    image_processor = load_part(
        "image processor", source, lambda: AutoImageProcessor.from_pretrained(source, backend="pil")
    )
    return image_processor, load_part("tokenizer", source, lambda: AutoTokenizer.from_pretrained(source))


class SeparateProcessorParts:
    """Mixin of the families whose image processor and tokenizer load on their own (Qwen-VL, InternVL,
    LLaVA-OneVision): ``from_model`` for an adapter built as ``cls(model, image_processor, tokenizer, ...)``."""

    @classmethod
    def from_model(
        cls, model, source: str, *, prompt_template: str | None, system_prompt: str | None, clip_text: str | None
    ) -> Any:
        cls.check_clip_text(clip_text)  # type: ignore[attr-defined]  # the family's VisionLanguageModel side
        image_processor, tokenizer = image_processor_and_tokenizer(source)
        return cls(  # type: ignore[call-arg]
            model,
            image_processor,
            tokenizer,
            model_id=source,
            prompt_template=prompt_template,
            system_prompt=system_prompt,
        )


__all__ = ["config_hash", "load_part", "image_processor_and_tokenizer", "SeparateProcessorParts"]
