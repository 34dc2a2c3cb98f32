"""Which adapter serves which checkpoint: one registration per config ``model_type``.

Adding a family is one adapter module (a :class:`VisionLanguageModel` subclass implementing its
abstract methods, ``build_tiny`` (the offline random-weight builder) among them, and setting the class-level
declarations: signals, positions, token grids, prompt templates) plus one :func:`register_family` line below;
``tests/models/test_families_registry.py`` then runs every check on it. ``docs/models.md`` lists the families.
"""

from __future__ import annotations

from prune_audit.errors import PruneAuditError
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.internvl import InternVLModel
from prune_audit.models.llava import LlavaModel
from prune_audit.models.llava_next import LlavaNextModel
from prune_audit.models.llava_onevision import LlavaOnevisionModel
from prune_audit.models.qwen import QwenModel
from prune_audit.models.qwen2_vl import Qwen2VLModel
from prune_audit.models.qwen3_vl import Qwen3VLModel

_ADAPTERS: dict[str, type[VisionLanguageModel]] = {}


def register_family(model_type: str, adapter: type[VisionLanguageModel]) -> None:
    """Serve checkpoints whose config says ``model_type`` with ``adapter``."""
    if model_type in _ADAPTERS and _ADAPTERS[model_type] is not adapter:
        raise ValueError(f"model_type {model_type!r} is already served by {_ADAPTERS[model_type].__name__}")
    _ADAPTERS[model_type] = adapter


def family_names() -> list[str]:
    """The registered ``model_type`` values, in registration order."""
    return list(_ADAPTERS)


def video_families() -> list[str]:
    """The registered ``model_type`` values whose adapter reads video clips (``takes_video``)."""
    return [name for name, adapter in _ADAPTERS.items() if adapter.takes_video]


def support_table() -> str:
    """The families x selectors table of docs/models.md and README.md (Markdown, one row per registered selector),
    from the adapters' class-level declarations and the selector classes' traits."""
    words = {family: adapter.support_words() for family, adapter in _ADAPTERS.items()}
    lines = ["| selector | " + " | ".join(_ADAPTERS) + " |", "|---" * (1 + len(_ADAPTERS)) + "|"]
    for name in next(iter(words.values()), {}):
        lines.append(f"| {name} | " + " | ".join(words[family][name] for family in _ADAPTERS) + " |")
    return "\n".join(lines) + "\n"


def adapter_for(model_type: str, source: str) -> type[VisionLanguageModel]:
    """The adapter class for a checkpoint's ``model_type``; one-line error when none is registered."""
    if model_type not in _ADAPTERS:
        raise PruneAuditError(f"{source} is a {model_type!r} model; supported families: {', '.join(family_names())}")
    return _ADAPTERS[model_type]


register_family("llava", LlavaModel)
register_family("qwen2_5_vl", QwenModel)
register_family("qwen2_vl", Qwen2VLModel)
register_family("internvl", InternVLModel)
register_family("qwen3_vl", Qwen3VLModel)
register_family("llava_next", LlavaNextModel)
register_family("llava_onevision", LlavaOnevisionModel)

__all__ = ["register_family", "family_names", "adapter_for", "support_table"]
