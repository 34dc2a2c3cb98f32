"""cls_attn (FasterVLM): the top-k of the head-mean CLS attention, its ties and its model-dtype rounding."""

from __future__ import annotations

import torch
from selector_cases import cls_probabilities, lower_index_top_k, random_generator

from prune_audit.pruners import InputSignals, get_selector


def test_cls_attn_is_top_k_of_head_mean():
    attention = torch.rand(5, 48, generator=random_generator(9))
    expected = sorted(torch.topk(attention.mean(dim=0), 10).indices.tolist())
    signals = InputSignals(grid=(6, 8), cls_attention=attention)
    assert get_selector("cls_attn").select(signals, 10).kept.tolist() == expected
    assert get_selector("cls_attn", head_aggregation="sum").select(signals, 10).kept.tolist() == expected


def test_cls_attn_breaks_ties_by_lower_index():
    attention = torch.zeros(2, 12)
    attention[:, 9] = 1.0
    signals = InputSignals(grid=(3, 4), cls_attention=attention)
    assert get_selector("cls_attn").select(signals, 3).kept.tolist() == [0, 1, 9]


def test_cls_attn_model_dtype_ranks_the_rounded_head_mean():
    """FasterVLM in fp16: the head mean is an fp16 value; its ties go to the lower index."""
    attention = cls_probabilities(1)
    signals = InputSignals(grid=(24, 24), cls_attention=attention, model_dtype=torch.float16)
    expected = lower_index_top_k(attention.mean(dim=0).half().float(), 64)
    assert get_selector("cls_attn", score_dtype="model").select(signals, 64).kept.tolist() == expected
    assert get_selector("cls_attn").select(signals, 64).kept.tolist() != expected  # float32 ranks unrounded means
