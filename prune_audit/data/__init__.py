"""COCO instances, POPE question files and token geometry: what object-area retention needs.

>>> from prune_audit.data import CocoInstances, ObjectAreaCache, geometry_from_processor, load_pope, retention_batch

Names are imported on first use; none of them imports torch.
"""

from prune_audit.lazy import lazy_exports

_EXPORTS = {
    # POPE question files, answers and scores
    "POPE_SPLITS": "pope",
    "PopeQuestion": "pope",
    "load_pope": "pope",
    "attach_labels": "pope",
    "file_sha256": "pope",
    "summarize_questions": "pope",
    "pope_metrics": "pope",
    "load_answers": "pope_score",
    "score_files": "pope_score",
    "build_pope": "pope_build",
    "write_pope_files": "pope_build",
    "question_text": "pope_build",
    # COCO instances and the token geometry of an image
    "CocoInstances": "coco",
    "TokenGeometry": "geometry",
    "geometry_from_processor": "geometry",
    "clip_geometry": "geometry",
    "qwen_geometry": "geometry",
    "mask_area_per_token": "geometry",
    # object-area retention (the single-question ``retention`` shares its module's name: import it from there)
    "ObjectArea": "retention",
    "ObjectAreaCache": "retention",
    "object_area": "retention",
    "RetentionBatch": "retention",
    "retention_batch": "retention",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
