"""VisPruner (Theia-4869/VisPruner aefa01ad, llava_arch.py::encode_images) against a re-derivation of its official
important and diverse tokens, in float32 and half precision."""

from __future__ import annotations

import pytest
import torch
from rederivation import CASES, FIDELITY, clip_case

from prune_audit.pruners import InputSignals, get_selector


def official_vispruner(
    attentions: torch.Tensor, features: torch.Tensor, budget: int, gpu_arithmetic: bool = False, ratio: float = 0.5
) -> list[int]:
    """``encode_images`` on one image in the dtype of its inputs: attentions (H, N), features (N, Dv).

    Written from the official code: head mean, descending argsort, ``int(T * r)`` important,
    then rounds of alternate A/B matching on the unit features, dropping the ``min(8, R - T_div)``
    A tokens with the highest best match. ``argsort`` leaves exact ties unspecified: stable here
    (ties to the lower position), as documented. ``gpu_arithmetic``: the feature norms and the
    A-B cosines accumulated in float32 and rounded once, as a GPU's half reductions and GEMMs
    compute them (CPU fp16 kernels round about 1 norm in 576 and 6 cosines in 10^4 differently).
    """
    order = torch.argsort(attentions.mean(dim=0), descending=True, stable=True)
    important_count = int(budget * ratio)
    diverse_count = budget - important_count
    important, residual = order[:important_count], order[important_count:]
    norms = features.float().norm(dim=-1, keepdim=True).to(features.dtype) if gpu_arithmetic else features.norm(
        dim=-1, keepdim=True)  # fmt: skip
    normalised = features / norms
    while diverse_count > 0:
        r = min(8, residual.shape[0] - diverse_count)
        if r <= 0:
            break
        tokens = normalised[residual]
        a, b = (tokens[::2].float(), tokens[1::2].float()) if gpu_arithmetic else (tokens[::2], tokens[1::2])
        scores = (a @ b.transpose(-1, -2)).to(tokens.dtype).max(dim=-1).values
        distinct = torch.argsort(scores, descending=True, stable=True)[r:]
        residual = torch.cat([residual[::2][distinct], residual[1::2]])
    return sorted(torch.cat([important, residual]).tolist())


def vispruner_agreement(dtype: torch.dtype, gpu_arithmetic: bool = True) -> int:
    """Kept sets identical to the official forward run in ``dtype`` (half: ``score_dtype=model``), of 30."""
    selector = get_selector("vispruner", score_dtype="float32" if dtype == torch.float32 else "model")
    identical = 0
    for seed, budget, _ in CASES:
        case = clip_case(seed)
        attentions, features = case["cls_row"][:, 1:], case["hidden"][1:]
        signals = InputSignals(grid=(24, 24), cls_attention=attentions, vision_features=features, model_dtype=dtype)
        expected = official_vispruner(attentions.to(dtype), features.to(dtype), budget, gpu_arithmetic)
        identical += selector.select(signals, budget).kept.tolist() == expected
    return identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_vispruner_reproduces_the_official_important_and_diverse_tokens(dtype):
    """30 of 30 in float32, and with score_dtype=model against the official code in fp16 / bf16 (GPU arithmetic)."""
    assert vispruner_agreement(dtype) == len(CASES) == FIDELITY["vispruner"].agreement_cases


def test_vispruner_float32_scoring_misses_the_half_precision_ties():
    float32 = get_selector("vispruner")
    case = clip_case(0)
    attentions, features = case["cls_row"][:, 1:], case["hidden"][1:]
    signals = InputSignals(
        grid=(24, 24), cls_attention=attentions, vision_features=features, model_dtype=torch.bfloat16
    )
    official = official_vispruner(attentions.bfloat16(), features.bfloat16(), 64, gpu_arithmetic=True)
    assert float32.select(signals, 64).kept.tolist() != official


def test_vispruner_odd_residual_gives_the_extra_member_to_a():
    """Budgets 63/65/67 at ratio 0.5 leave an odd residual (545, 543, 543), where the official indexing fails."""
    case = clip_case(1)
    signals = InputSignals(grid=(24, 24), cls_attention=case["cls_row"][:, 1:], vision_features=case["hidden"][1:])
    for budget in (63, 65, 67):
        kept = get_selector("vispruner").select(signals, budget).kept
        assert kept.numel() == budget == torch.unique(kept).numel()
