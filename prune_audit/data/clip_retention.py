"""Per-frame retention of an object in a video clip: how much of its mask in each sampled frame the kept tokens see.

A Qwen2.5-VL clip token ``t * h * w + r * w + c`` covers cell (r, c) of the two sampled frames ``2t`` and ``2t + 1``
(:class:`~prune_audit.data.video.ClipGeometry`; a family reading each frame as an image has one frame a step, and
every "2" below is its ``frames_per_step``). An object's masks over the clip's sampled frames reduce to
mask pixels per cell of each frame (:class:`ClipArea`, pixel centres as ``data.geometry.mask_area_per_token``);
then for a kept set (a stage's kept tokens plus the tokens its merged tokens carry):

    frame_retention[k] = sum of frame k's object pixels in cells whose step-(k // 2) token is kept / frame k's pixels

NaN where the object has no pixels in frame k. The whole clip's region (``ClipArea.object_area``: a token's pixels
are its cell's in both of its frames) gives the core ``retention`` / ``lost`` columns: retention over every sampled
frame's pixels, lost when no kept token covers the object in any frame. A question's window (the clip's frames as
stored, first and last inclusive) selects the sampled frames whose stored index lies in it: ``window_retention`` is
the share of their pixels kept, ``lost_in_window`` whether the object had pixels there and none is kept (None when
it had none there, or no sampled frame falls in the window).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from prune_audit.data.geometry import mask_area_per_token
from prune_audit.data.retention import ObjectArea
from prune_audit.data.video import FRAME_FACTOR, ClipGeometry
from prune_audit.errors import PruneAuditError

Window = tuple[int, int]
"""(first, last) frame of a clip as stored, inclusive."""


@dataclass(frozen=True)
class ClipArea:
    """An object's masks over a clip's 2T sampled frames, cell by cell.

    Attributes:
        frame_area: (2T, h * w) int64 object pixels whose centre lies in each cell of each sampled frame.
        frame_total: (2T,) int64 object pixels of each sampled frame (the whole frame, as ``ObjectArea.total_area``).
        frames: (2T,) the sampled frames' indices in the clip as stored (``ClipGeometry.frames``).
        frames_per_step: sampled frames a token covers (``ClipGeometry.frames_per_step``).
    """

    frame_area: np.ndarray
    frame_total: np.ndarray
    frames: tuple[int, ...]
    frames_per_step: int = FRAME_FACTOR

    @property
    def has_mask(self) -> bool:
        return bool(self.frame_total.sum() > 0)

    def object_area(self) -> ObjectArea:
        """The clip-wide region over its T * h * w tokens: a token's pixels are its cell's in both of its frames."""
        steps = self.frame_area.shape[0] // self.frames_per_step
        per_token = self.frame_area.reshape(steps, self.frames_per_step, -1).sum(axis=1).reshape(-1)
        total = int(self.frame_total.sum())
        visible = float(per_token.sum() / total) if total else math.nan
        return ObjectArea(area_per_token=per_token.astype(np.int64), total_area=total, visible_fraction=visible)

    def window_area(self, window: Window | None) -> ObjectArea:
        """The object in the window's sampled frames alone, as a region over the clip's T * h * w tokens
        (:meth:`object_area` with the other frames' pixels left out; the whole clip for None): the evidence a
        question about the window asks for (``intervene`` swaps its cells)."""
        chosen = self.in_window(window)
        return replace(
            self, frame_area=self.frame_area * chosen[:, None], frame_total=self.frame_total * chosen
        ).object_area()

    def kept_pixels(self, covered: Sequence[int]) -> np.ndarray:
        """(2T,) int64 object pixels of each sampled frame in the cells ``covered`` (token indices) keep."""
        frames, cells = self.frame_area.shape
        per_step = self.frames_per_step
        mask = np.zeros(frames // per_step * cells, dtype=bool)
        mask[np.asarray(list(covered), dtype=np.int64)] = True
        per_frame = np.repeat(mask.reshape(frames // per_step, cells), per_step, axis=0)
        return (self.frame_area * per_frame).sum(axis=1)

    def frame_retention(self, covered: Sequence[int]) -> list[float]:
        """Per sampled frame, the share of its object pixels ``covered`` keeps (NaN where it has none)."""
        kept = self.kept_pixels(covered)
        return [float(k / t) if t else math.nan for k, t in zip(kept.tolist(), self.frame_total.tolist())]

    def in_window(self, window: Window | None) -> np.ndarray:
        """(2T,) bool: the sampled frames whose stored index lies in ``window`` (every frame for None)."""
        return frames_in_window(self.frames, window)

    def window_retention(self, covered: Sequence[int], window: Window | None) -> float:
        """Share of the object's pixels in the window's sampled frames that ``covered`` keeps (NaN without any)."""
        chosen = self.in_window(window)
        total = int(self.frame_total[chosen].sum())
        return float(self.kept_pixels(covered)[chosen].sum() / total) if total else math.nan

    def lost_in_window(self, covered: Sequence[int], window: Window | None) -> bool | None:
        """The object has pixels in the window's sampled frames and ``covered`` keeps none of them (None: no
        pixels there)."""
        chosen = self.in_window(window)
        if not self.frame_total[chosen].sum():
            return None
        return not bool(self.kept_pixels(covered)[chosen].sum())


def frames_in_window(frames: Sequence[int], window: Window | None) -> np.ndarray:
    """(len(frames),) bool: the frames (stored indices) that lie in ``window`` (every frame for None)."""
    stored = np.asarray(frames)
    if window is None:
        return np.ones(len(stored), dtype=bool)
    return (stored >= window[0]) & (stored <= window[1])


def clip_area(masks: Sequence[np.ndarray], geometry: ClipGeometry) -> ClipArea:
    """The :class:`ClipArea` of one (H, W) bool mask per sampled frame (2T of them, in ``geometry.frames`` order)."""
    if len(masks) != len(geometry.frames):
        raise PruneAuditError(f"{len(masks)} masks for a clip of {len(geometry.frames)} sampled frames")
    area = np.stack([mask_area_per_token(mask, geometry.frame) for mask in masks]).astype(np.int64)
    total = np.array([int(np.count_nonzero(mask)) for mask in masks], dtype=np.int64)
    return ClipArea(area, total, tuple(geometry.frames), geometry.frames_per_step)


__all__ = ["ClipArea", "Window", "clip_area", "frames_in_window"]
