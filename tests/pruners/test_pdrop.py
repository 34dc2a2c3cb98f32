"""PDrop: FastV's score at each of its stages."""

from __future__ import annotations

import torch
from selector_cases import signals

from prune_audit.pruners import Stage, get_selector


def test_pdrop_scores_like_fastv_at_each_stage():
    probs = torch.rand(4, 5, 8, generator=torch.Generator().manual_seed(1))
    layer = signals(8, text_probs=probs)
    pdrop, fastv = get_selector("pdrop"), get_selector("fastv")
    assert torch.equal(pdrop.prune(Stage(8, 3), layer, {}), fastv.prune(Stage(8, 3), layer, {}))
