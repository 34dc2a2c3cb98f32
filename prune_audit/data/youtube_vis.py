"""Object tracks in the YouTube-VIS layout: per video its frames, per track one segmentation per frame.

The file (YouTube-VIS 2019/2021 ``instances.json``, OVIS, and any export in that layout)::

    {"videos": [{"id", "file_names": ["<video>/<frame>.jpg", ...], "width", "height", "length"}],
     "annotations": [{"id", "video_id", "category_id", "segmentations": [RLE | polygons | null per frame]}],
     "categories": [{"id", "name"}]}

A video is named by the folder of its frame files (``file_names``' parent), the name questions give (``x.mp4`` and
``x`` both name ``x``). Each frame becomes one image of a :class:`~prune_audit.data.coco.CocoInstances` and each
non-null segmentation one of its annotations, so segmentations are validated and decoded exactly as COCO's are
(pycocotools; polygons and uncompressed RLE merged through ``frPyObjects``), and an object's mask in a frame is the
union of its category's tracks there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.data.coco import CocoInstances, read_json
from prune_audit.errors import PruneAuditError

FIX = "pass the YouTube-VIS layout instances JSON (videos, annotations with segmentations, categories)"


def _video_name(entry: dict[str, Any], where: str) -> str:
    names = entry.get("file_names")
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise PruneAuditError(f"{where}.file_names must be a non-empty list of frame file names; {FIX}")
    folder = Path(names[0]).parent.name
    if not folder or any(Path(name).parent.name != folder for name in names):
        raise PruneAuditError(f"{where}.file_names must all lie in one folder named after the video; {FIX}")
    return folder


def _frame_images(videos: list[Any], source: str) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """One COCO image per (video, frame), ids numbered in file order, and each video's (id, frame count) by name."""
    images: list[dict[str, Any]] = []
    named: dict[str, tuple[int, int]] = {}
    for index, entry in enumerate(videos):
        where = f"{source}: videos[{index}]"
        if not isinstance(entry, dict) or not {"id", "width", "height"} <= set(entry):
            raise PruneAuditError(f"{where} needs id, file_names, width and height; {FIX}")
        if isinstance(entry["id"], bool) or not isinstance(entry["id"], int):
            raise PruneAuditError(f"{where}.id must be an integer, got {entry['id']!r}; {FIX}")
        name = _video_name(entry, where)
        if name in named:
            raise PruneAuditError(f"{where} repeats the video {name!r}; list each video once")
        named[name] = (entry["id"], len(entry["file_names"]))
        for frame in range(len(entry["file_names"])):
            file_name = f"{entry['id']}#{frame}"  # unique per (video, frame): frame files repeat across videos
            images.append(
                {"id": len(images), "file_name": file_name, "width": entry["width"], "height": entry["height"]}
            )
    return images, named


def _track_annotations(tracks: list[Any], frames_of: dict[int, tuple[int, int]], source: str) -> list[dict[str, Any]]:
    """One COCO annotation per track and frame with a segmentation (null: the object is not in that frame)."""
    annotations: list[dict[str, Any]] = []
    for index, track in enumerate(tracks):
        where = f"{source}: annotations[{index}]"
        if not isinstance(track, dict) or not isinstance(track.get("segmentations"), list):
            raise PruneAuditError(f"{where} needs video_id, category_id and a segmentations list; {FIX}")
        video_id = track.get("video_id")
        if isinstance(video_id, bool) or not isinstance(video_id, int) or video_id not in frames_of:
            raise PruneAuditError(f"{where} refers to unknown video {video_id!r}; {FIX}")
        first, length = frames_of[video_id]
        if len(track["segmentations"]) != length:
            raise PruneAuditError(
                f"{where} has {len(track['segmentations'])} segmentations for a video of {length} frames; {FIX}"
            )
        for frame, segmentation in enumerate(track["segmentations"]):
            if segmentation is not None:
                annotations.append(
                    {"id": len(annotations), "image_id": first + frame, "category_id": track.get("category_id"),
                     "segmentation": segmentation}
                )  # fmt: skip
    return annotations


class VideoTracks:
    """A YouTube-VIS layout annotations file, read and validated whole.

    Args:
        data: the parsed JSON.
        source: where it came from, for error messages.
    """

    def __init__(self, data: Any, source: str = "<tracks>") -> None:
        if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("videos", "annotations")):
            raise PruneAuditError(f"{source}: expected a JSON object with videos, annotations and categories; {FIX}")
        images, self.videos = _frame_images(data["videos"], source)
        # video id -> (image id of its first frame, frame count): the frames are numbered video after video
        self._frames_of: dict[int, tuple[int, int]] = {}
        start = 0
        for video_id, count in self.videos.values():
            if video_id in self._frames_of:
                raise PruneAuditError(f"{source}: two videos have the id {video_id}; give each video its own id")
            self._frames_of[video_id] = (start, count)
            start += count
        annotations = _track_annotations(data["annotations"], self._frames_of, source)
        coco = {"images": images, "annotations": annotations, "categories": data.get("categories")}
        self.frames = CocoInstances(coco, source)
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> VideoTracks:
        return cls(read_json(path, "annotations file", FIX + " with --annotations"), source=str(path))

    def _key(self, name: str) -> str:
        """The annotated video named ``name`` (the folder, or a file name whose suffix is dropped)."""
        for key in (name, Path(name).stem):
            if key in self.videos:
                return key
        raise PruneAuditError(f"video {name!r} is not in {self.source}; pass the annotations of the run's videos")

    def video_id(self, name: str) -> int:
        """The id of the video whose frames lie in folder ``name``."""
        return self.videos[self._key(name)][0]

    def check_clip(self, name: str, frames: int, size: tuple[int, int], path: Path) -> None:
        """Refuse a frame folder whose frame count or (width, height) is not the annotated video's."""
        first_image, count = self._frames_of[self.video_id(name)]
        first = self.frames.image(first_image)
        if frames != count:
            raise PruneAuditError(
                f"{path} holds {frames} frames but {self.source} annotates {count}; pass the frames and annotations "
                "that belong together"
            )
        self.frames.check_image_size(first.id, size, path)

    def category_masks(self, name: str, category: str, frames: Sequence[int]) -> list[np.ndarray]:
        """(H, W) bool union mask of ``category``'s tracks in each of ``frames`` (stored indices) of video ``name``."""
        first = self._frames_of[self.video_id(name)][0]
        return [self.frames.category_mask(first + frame, category) for frame in frames]


__all__ = ["VideoTracks"]
