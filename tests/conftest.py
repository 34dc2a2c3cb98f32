"""Shared test fixtures: paths to the real data beside the checkout, a tiny offline LLaVA workspace, a tiny LLaVA
that spells option letters (the scienceqa runs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# At one intra-op thread records agree across batch sizes, shards and resumes to float rounding
# (about 1e-12; the tiny test models bit for bit); with several, torch splits float reductions by
# batch shape and probabilities move in the 7th digit. So every in-process and child run uses one thread
# unless a test sets OMP_NUM_THREADS itself (tests/test_threads.py does).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PRUNE_AUDIT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
LLAVA_EVAL = SHARED_DATA / "llava_eval"
SHARED_ABSENT = "needs ../shared/data/llava_eval (LLaVA's question files), absent here"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (real COCO + POPE files); tests using it skip when it is absent."""
    if not (SHARED_DATA / "coco").is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (set PRUNE_AUDIT_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> dict[str, Path]:
    """A tiny LLaVA (16 visual tokens, 4 decoder layers) and a 3-split POPE set over 14 synthetic scenes."""
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope_build import build_pope, write_pope_files
    from prune_audit.data.scenes import CATEGORIES, export_coco
    from prune_audit.models.llava import LlavaModel

    root = tmp_path_factory.mktemp("run")
    coco_dir = root / "scenes"
    instances = export_coco(coco_dir, seed=5, count=14, image_size=64)
    questions = build_pope(CocoInstances.load(instances), sample_images=None, seed=0)
    pope_files = write_pope_files(questions, root / "pope", prefix="scenes")
    words = ["Is", "there", "a", "an", "in", "the", "image", *CATEGORIES]
    model = LlavaModel.build_tiny(root / "model", words=words, image_size=56, patch_size=14, text_layers=4, seed=0)
    return {
        "root": root,
        "model": model,
        "instances": instances,
        "images": coco_dir / "images",
        "pope": pope_files,
    }


@pytest.fixture(scope="module")
def letters_model(workspace, tmp_path_factory) -> Path:
    """A tiny LLaVA whose vocabulary spells the option letters A-D as single tokens."""
    from prune_audit.data.scenes import CATEGORIES
    from prune_audit.models.llava import LlavaModel

    words = ["Is", "there", "in", "the", "image", "Which", "shape", "A", "B", "C", "D", *CATEGORIES]
    return LlavaModel.build_tiny(
        tmp_path_factory.mktemp("letters") / "model", words=words, image_size=56, patch_size=14, text_layers=2, seed=1
    )
