"""The frame sizes a checkpoint reads its clips at, where they differ from qwen-vl-utils' defaults.

A clip's frames are resized as qwen-vl-utils resizes them for Qwen2.5-VL's official video evaluations
(``data.video``: ``min_pixels`` 128 x 28 x 28 and a ``total_pixels`` budget over the clip's frames): a released
checkpoint is read exactly so. A checkpoint trained at other frame sizes declares them beside its weights in
``video_sampling.json``, ``{"min_pixels": int, "total_pixels": int}`` (either key may be left out): the video demo
was trained on 96 x 96 px frames, which the defaults would enlarge to 320 x 320 px (400 tokens a temporal step
instead of the 36 it learned on), so ``prune-audit demo train`` writes the sizes of its clips there.

A family that reads a fixed number of uniformly spaced frames (LLaVA-OneVision: lmms-eval's ``max_frames_num``)
declares that count instead, ``{"frames": int}``: each family names the keys it reads
(``VisionLanguageModel.video_sampling_keys``) and any other key is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from prune_audit.errors import PruneAuditError
from prune_audit.models.declared import declared_json

VIDEO_SAMPLING_FILE = "video_sampling.json"
VIDEO_SAMPLING_KEYS = ("min_pixels", "total_pixels")


def checkpoint_video_sampling(source: str | Path, keys: tuple[str, ...] = VIDEO_SAMPLING_KEYS) -> dict[str, int]:
    """The clip sampling a checkpoint folder declares in ``video_sampling.json``: the ``data.video.sample_clip``
    pixel limits, or the family's other ``keys`` (empty for a hub id or a folder without the file: the family's
    defaults apply)."""
    fields = ", ".join(f'"{key}": N' for key in keys)
    fix = f"write it as {{{fields}}} with positive whole numbers, or remove it"
    declared = declared_json(source, VIDEO_SAMPLING_FILE, "video sampling", fix)
    if declared is None:
        return {}
    where = str(Path(source) / VIDEO_SAMPLING_FILE)
    if not isinstance(declared, dict) or not set(declared) <= set(keys):
        raise PruneAuditError(f"{where} may hold only {', '.join(keys)} for this family; {fix}")
    for key, value in declared.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PruneAuditError(f"{where}: {key} is {value!r}; {fix}")
    return declared


def write_video_sampling(folder: Path, sampling: dict[str, int]) -> None:
    """Declare ``sampling`` in ``folder`` (a checkpoint being saved)."""
    (folder / VIDEO_SAMPLING_FILE).write_text(json.dumps(sampling, indent=2) + "\n")


__all__ = ["VIDEO_SAMPLING_FILE", "checkpoint_video_sampling", "write_video_sampling"]
