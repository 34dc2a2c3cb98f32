"""Shared test fixtures: paths to the real data beside the checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PRUNE_AUDIT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (real COCO + POPE files); tests using it skip when it is absent."""
    if not (SHARED_DATA / "coco").is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (set PRUNE_AUDIT_SHARED_DATA)")
    return SHARED_DATA
