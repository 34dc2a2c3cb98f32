"""What a selector needs of an image's token layout besides its signals, and how it runs on an image of several
grids: the selector traits a family's support is matched against (``models.selector_support``).

A selector declares ``layout_need`` (one of the facts below, or none), ``per_crop_grid`` and ``per_grid`` on its
class; a family declares the facts it lacks (``lacks``) and how each ``per_grid`` kind runs on its grids, so no
family names a selector.
"""

from __future__ import annotations

#: layout facts a selector may need, as refusals name them ("needs <fact>, which <family> does not provide")
ONE_GRID = "one regular token grid"
ONE_CLS = "one CLS token per image"
#: VScan's official LLaVA-NeXT code (Tencent/SelfEvolvingAgent a82450e, ``VScan/llava/model/llava_arch.py``
#: ``encode_images`` on every crop, then ``unpad_image`` of the index mask) scans and merges in each crop's
#: padded grid, which ``budget_scope=crop`` does (docs/models.md)
PADDED_CROP_GRID = "each crop's padded grid for its scans (as its official LLaVA-NeXT code)"
PRE_PROJECTOR_FEATURES = "pre-projector features of each token"

#: ``per_grid`` kinds: how a selector that needs only a grid layout runs on each of an image's regular grids
GRID_SPLIT = "split"  # the budget split over the grids (uniform's lattice)
GRID_MERGE = "merge"  # merged within a grid (pooling, ToMe)
GRID_BLOCKS = "blocks"  # its blocks lie within a grid (E2S's novelty blocks)

__all__ = [
    "ONE_GRID",
    "ONE_CLS",
    "PADDED_CROP_GRID",
    "PRE_PROJECTOR_FEATURES",
    "GRID_SPLIT",
    "GRID_MERGE",
    "GRID_BLOCKS",
]
