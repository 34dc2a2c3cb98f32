"""Vision-language models under visual-token pruning (the only place that touches transformers internals).

>>> from prune_audit.models import load_vlm
>>> vlm = load_vlm("llava-hf/llava-1.5-7b-hf")            # doctest: +SKIP
>>> answers = vlm.answer([vlm.prepare(image, question)], get_selector("fastv"), 128)  # doctest: +SKIP
"""

from prune_audit.models.answers import Answer
from prune_audit.models.base import VisionLanguageModel
from prune_audit.models.families import family_names, register_family
from prune_audit.models.loading import load_vlm
from prune_audit.models.prepared import Prepared

__all__ = ["Answer", "Prepared", "VisionLanguageModel", "family_names", "load_vlm", "register_family"]
