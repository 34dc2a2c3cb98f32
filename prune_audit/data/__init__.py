"""COCO instances, question files (POPE, GQA, ScienceQA, captions) and token geometry.

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
    "summarize_questions": "pope",
    "pope_metrics": "pope",
    "load_answers": "pope_score",
    "score_files": "pope_score",
    "build_pope": "pope_build",
    "write_pope_files": "pope_build",
    "question_text": "pope_build",
    # GQA, ScienceQA-IMG and caption questions, their answer rules and scores
    "GqaQuestion": "gqa",
    "SceneGraph": "gqa",
    "load_gqa": "gqa",
    "load_scene_graphs": "gqa",
    "evidence_mask": "gqa",
    "score_gqa_answers": "gqa",
    "ScienceQaQuestion": "scienceqa",
    "load_scienceqa": "scienceqa",
    "parse_letter": "scienceqa",
    "score_scienceqa_answers": "scienceqa",
    "CaptionQuestion": "captions",
    "caption_questions": "captions",
    "read_coco_captions": "captions",
    "score_caption_answers": "captions",
    "score_caption": "chair",
    "chair_metrics": "chair",
    "load_llava_answers": "answers",
    # the lmms-eval datasets' Parquet files (questions + embedded images)
    "ParquetQuestions": "lmms_parquet",
    "read_pope_parquet": "lmms_parquet",
    "read_gqa_parquet": "lmms_parquet",
    "read_scienceqa_parquet": "lmms_parquet",
    # every task's input files: JSON Lines, content hashes
    "read_json_lines": "files",
    "file_sha256": "files",
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
