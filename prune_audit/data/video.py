"""Video clips as Qwen2.5-VL reads them: frame sampling, frame size and the clip's token geometry.

Re-implemented from qwen-vl-utils ``vision_process.py`` (QwenLM/Qwen2.5-VL, ``smart_nframes`` and
``fetch_video``; read at the copy gzpeng1984/Qwen2.5-VL 1a399531): from a decoded clip of ``total`` frames at
``video_fps``, ``nframes = total / video_fps * fps`` (``fps`` 2.0) clamped to ``[min_frames, max_frames]`` (4 rounded
up and ``min(768, total)`` rounded down to ``FRAME_FACTOR`` 2) and to ``total``, then floored to a multiple of 2;
the frames at ``round(linspace(0, total - 1, nframes))`` (torch's round: half to even); the sampling rate
``nframes / total * video_fps``. Every frame is resized by ``smart_resize`` to multiples of 28 px within
``[VIDEO_MIN_PIXELS, max_pixels]``, ``max_pixels = max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * 2),
int(VIDEO_MIN_PIXELS * 1.05))``.

No video decoder is needed (decord, torchvision and torchcodec are not dependencies): a clip is a folder of frame
images (PNG or JPEG, in sorted name order) or a list of PIL images, with the clip's frame rate. Differences: the
resize is PIL's bicubic (qwen-vl-utils resizes with torchvision's antialiased bicubic on the float tensor; the two
differ by rounding), and a frame list is sampled as a decoded video is (qwen-vl-utils takes a list of frame files
as already sampled).

Token geometry: Qwen2.5-VL joins two consecutive sampled frames into one temporal patch, so token
``t * h * w + r * w + c`` covers frames ``2t`` and ``2t + 1`` at the 28 x 28 px cell (r, c) of the resized frame
(:class:`ClipGeometry`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prune_audit.data.geometry import TokenGeometry, qwen_geometry
from prune_audit.data.images import open_rgb
from prune_audit.errors import PruneAuditError

FRAME_FACTOR = 2  # frames per temporal patch (Qwen2.5-VL's temporal_patch_size)
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)  # qwen-vl-utils' default without its VIDEO_MAX_PIXELS variable
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")


def sampled_frame_count(
    total: int, video_fps: float, *, fps: float = FPS, min_frames: int = FPS_MIN_FRAMES, max_frames: int | None = None
) -> int:
    """qwen-vl-utils ``smart_nframes`` (fps mode): how many of a clip's ``total`` frames at ``video_fps`` are read.

    One-line PruneAuditError when the clip has fewer than two frames to sample."""
    if total < 1 or not video_fps > 0 or not fps > 0:
        raise PruneAuditError(f"a clip needs frames and positive frame rates; got {total} frames at {video_fps} fps")
    low = -(-min_frames // FRAME_FACTOR) * FRAME_FACTOR
    high = (min(FPS_MAX_FRAMES, total) if max_frames is None else max_frames) // FRAME_FACTOR * FRAME_FACTOR
    count = min(max(total / video_fps * fps, low), high, total)
    count = int(count // FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= count <= total:
        raise PruneAuditError(
            f"a clip of {total} frames gives {count} sampled frames; Qwen2.5-VL needs at least {FRAME_FACTOR}: "
            "give more frames"
        )
    return count


def sampled_frame_indices(total: int, count: int) -> list[int]:
    """The ``count`` frames qwen-vl-utils reads of ``total``: ``round(linspace(0, total - 1, count))``."""
    return torch.linspace(0, total - 1, count).round().long().tolist()


def frame_pixel_limit(
    count: int,
    *,
    total_pixels: int = VIDEO_TOTAL_PIXELS,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
) -> int:
    """qwen-vl-utils' ``max_pixels`` of each of ``count`` sampled frames (the clip's pixel budget shared out, at most
    ``max_pixels`` a frame)."""
    return int(max(min(max_pixels, total_pixels / count * FRAME_FACTOR), int(min_pixels * 1.05)))


@dataclass(frozen=True)
class ClipGeometry:
    """Where each of a clip's visual tokens lies: its temporal step, its frames and its pixels in each frame.

    Attributes:
        frame: the :class:`~prune_audit.data.geometry.TokenGeometry` of one frame (every sampled frame has the
            same size): its ``grid`` is the (h, w) tokens of a temporal step, its pixels the original frame's.
        frames: the indices, in the given clip, of the sampled frames (``frames_per_step`` x T of them).
        sample_fps: sampled frames per second of the clip.
        frames_per_step: sampled frames joined into one temporal step: 2 on the Qwen families (their
            ``temporal_patch_size``), 1 where a family reads each frame as an image.
    """

    frame: TokenGeometry
    frames: tuple[int, ...]
    sample_fps: float
    frames_per_step: int = FRAME_FACTOR

    @property
    def steps(self) -> int:
        """T temporal steps, each ``frames_per_step`` sampled frames."""
        return len(self.frames) // self.frames_per_step

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """(T, h, w) tokens of the clip after the spatial merge."""
        return (self.steps, *self.frame.grid)

    @property
    def num_tokens(self) -> int:
        return self.steps * self.frame.num_tokens

    def token_position(self, index: int) -> tuple[int, int, int]:
        """(t, row, col) of token ``index`` (time-major, then row-major)."""
        if not 0 <= index < self.num_tokens:
            raise ValueError(f"token {index} is outside the clip's {self.num_tokens} tokens")
        step, cell = divmod(index, self.frame.num_tokens)
        return (step, *divmod(cell, self.frame.grid_cols))

    def token_index(self, step: int, row: int, col: int) -> int:
        """The inverse of :meth:`token_position`."""
        rows, cols = self.frame.grid
        if not (0 <= step < self.steps and 0 <= row < rows and 0 <= col < cols):
            raise ValueError(f"({step}, {row}, {col}) is outside the {self.steps}x{rows}x{cols} clip grid")
        return (step * rows + row) * cols + col

    def token_frames(self, index: int) -> tuple[int, ...]:
        """The sampled frames (0..len(frames)-1) token ``index`` covers: its step's ``frames_per_step``."""
        step = self.token_position(index)[0]
        return tuple(range(self.frames_per_step * step, self.frames_per_step * (step + 1)))

    def token_box(self, index: int) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) original-frame pixels token ``index`` covers, in each of its step's frames."""
        _, row, col = self.token_position(index)
        side = self.frame.token_pixels
        return (
            col * side / self.frame.scale_x,
            row * side / self.frame.scale_y,
            (col + 1) * side / self.frame.scale_x,
            (row + 1) * side / self.frame.scale_y,
        )

    def frame_cells(self, frame: int, tokens: Sequence[int]) -> list[int]:
        """The cells (r * w + c of one frame's grid) of ``tokens`` that cover sampled frame ``frame``
        (0..len(frames)-1): those of its temporal step ``frame // frames_per_step``, in the order given."""
        if not 0 <= frame < len(self.frames):
            raise ValueError(f"sampled frame {frame} is outside the clip's {len(self.frames)}")
        start = frame // self.frames_per_step * self.frame.num_tokens
        return [token - start for token in tokens if start <= token < start + self.frame.num_tokens]

    def to_dict(self) -> dict[str, Any]:
        return {
            "frame": self.frame.to_dict(),
            "frames": list(self.frames),
            "sample_fps": self.sample_fps,
            "frames_per_step": self.frames_per_step,
        }

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ClipGeometry:
        """The geometry whose :meth:`to_dict` gave ``fields`` (a clip record's ``geometry`` column; records written
        before ``frames_per_step`` was stored are Qwen2.5-VL's, two frames a step)."""
        per_step = int(fields.get("frames_per_step", FRAME_FACTOR))
        return cls(TokenGeometry(**fields["frame"]), tuple(fields["frames"]), float(fields["sample_fps"]), per_step)


@dataclass(frozen=True)
class Clip:
    """A clip's sampled frames, resized as Qwen2.5-VL reads them, and its geometry.

    Attributes:
        frames: 2T RGB ``PIL.Image`` of one size (the resized frame), in time order.
        geometry: the :class:`ClipGeometry` of the clip's tokens.
        video_fps: frames per second of the clip as given (``geometry.frames`` index it), where known: the time of
            a sampled frame is its index over this rate (Qwen3-VL's text timestamps).
    """

    frames: tuple[Any, ...]
    geometry: ClipGeometry
    video_fps: float | None = None

    @property
    def seconds_per_step(self) -> float:
        """Seconds one temporal step spans: ``second_per_grid_ts`` of the Qwen2.5-VL processor (2 / sample fps)."""
        return self.geometry.frames_per_step / self.geometry.sample_fps


def frame_files(folder: str | Path) -> list[Path]:
    """The frame files of ``folder`` (PNG or JPEG, sorted by name: the clip's frames as stored); one-line errors."""
    root = Path(folder)
    if not root.is_dir():
        raise PruneAuditError(f"{folder} is not a folder of frames; give a folder of PNG or JPEG frame images")
    paths = sorted(path for path in root.iterdir() if path.suffix.lower() in FRAME_SUFFIXES)
    if not paths:
        raise PruneAuditError(f"{folder} holds no PNG or JPEG frames; give a folder of frame images")
    return paths


def read_frames(folder: str | Path) -> list[Any]:
    """The frame images of ``folder`` (:func:`frame_files`) as RGB ``PIL.Image``; one-line errors."""
    return [open_rgb(path) for path in frame_files(folder)]


def sample_clip(
    frames: str | Path | Sequence[Any],
    video_fps: float,
    *,
    fps: float = FPS,
    min_pixels: int = VIDEO_MIN_PIXELS,
    total_pixels: int = VIDEO_TOTAL_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    patch_size: int = 14,
    merge_size: int = 2,
) -> Clip:
    """The clip of ``frames`` (a folder, or PIL images of one size) at ``video_fps``, sampled and resized as
    qwen-vl-utils reads a decoded video for Qwen2.5-VL (module docstring); ``max_pixels`` caps one frame (Qwen3-VL's
    qwen-vl-utils scales the three pixel limits to its 32-px tokens)."""
    from PIL import Image

    images = read_frames(frames) if isinstance(frames, (str, Path)) else [image.convert("RGB") for image in frames]
    if len({image.size for image in images}) > 1:
        raise PruneAuditError("the clip's frames differ in size; give frames of one size")
    count = sampled_frame_count(len(images), video_fps, fps=fps)
    chosen = sampled_frame_indices(len(images), count)
    limit = frame_pixel_limit(count, total_pixels=total_pixels, min_pixels=min_pixels, max_pixels=max_pixels)
    frame = qwen_geometry(
        images[0].size, min_pixels=min_pixels, max_pixels=limit, patch_size=patch_size, merge_size=merge_size
    )
    size = (frame.processed_width, frame.processed_height)
    resized = tuple(images[i].resize(size, Image.Resampling.BICUBIC) for i in chosen)
    geometry = ClipGeometry(frame, tuple(chosen), count / len(images) * video_fps)
    return Clip(resized, geometry, video_fps)


__all__ = [
    "FRAME_FACTOR",
    "FPS",
    "VIDEO_MIN_PIXELS",
    "VIDEO_MAX_PIXELS",
    "VIDEO_TOTAL_PIXELS",
    "Clip",
    "ClipGeometry",
    "sampled_frame_count",
    "sampled_frame_indices",
    "frame_pixel_limit",
    "frame_files",
    "read_frames",
    "sample_clip",
]
