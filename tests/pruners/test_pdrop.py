"""PDrop: FastV's score at each of its stages, and the paper's schedule."""

from __future__ import annotations

import pytest
import torch
from selector_cases import signals

from prune_audit.pruners import Stage, get_selector
from prune_audit.pruners.schedule import average_visual_tokens


def test_pdrop_scores_like_fastv_at_each_stage():
    probs = torch.rand(4, 5, 8, generator=torch.Generator().manual_seed(1))
    layer = signals(8, text_probs=probs)
    pdrop, fastv = get_selector("pdrop"), get_selector("fastv")
    assert torch.equal(pdrop.prune(Stage(8, 3), layer, {}), fastv.prune(Stage(8, 3), layer, {}))


# --- the paper's schedule ---------------------------------------------------------------------------------------------


def test_pdrop_paper_schedule_realises_the_published_averages():
    realised = {
        budget: average_visual_tokens(get_selector("pdrop", budget_rule="paper").schedule(32, 576, budget), 32, 576)
        for budget in (192, 128, 64)
    }
    assert realised == pytest.approx({192: 191.0, 128: 126.25, 64: 62.125})
