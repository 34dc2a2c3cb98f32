"""VisionZip: the reference splits, the output layout and contextual merge, the model-dtype rounding, and the
official forward in float32 and half precision (dvlab-research/VisionZip 3151f6df)."""

from __future__ import annotations

import pytest
import torch
from rederivation import BUDGETS, CASES, FIDELITY, SEEDS, TOKENS, clip_case, top_k_sorted
from selector_cases import cls_probabilities, lower_index_top_k, random_generator

from prune_audit.pruners import InputSignals, get_selector


def test_visionzip_default_splits_match_the_reference():
    selector = get_selector("visionzip")
    assert [selector.split(b) for b in (64, 128, 192)] == [(54, 10), (108, 20), (162, 30)]


def test_visionzip_output_layout_and_contextual_merge():
    generator = random_generator(8)
    rows, cols, heads, width = 6, 6, 3, 5
    n = rows * cols
    signals = InputSignals(
        grid=(rows, cols),
        vision_features=torch.randn(n, width, generator=generator),
        cls_attention=torch.rand(heads, n, generator=generator),
        vision_keys=torch.randn(heads, n + 1, 4, generator=generator),
        cls_feature=torch.randn(width, generator=generator),
    )
    selection = get_selector("visionzip", contextual_fraction=0.25).select(signals, 16)  # D = 12, C = 4
    dominant = torch.sort(torch.topk(signals.cls_attention.sum(dim=0), 11).indices).values
    assert selection.kept.tolist() == dominant.tolist()
    assert selection.num_output_tokens == 16 and selection.vision_tokens.shape == (16, width)
    assert selection.sources[0].numel() == 0
    torch.testing.assert_close(selection.vision_tokens[0], signals.cls_feature)
    assert [s.tolist() for s in selection.sources[1:12]] == [[j] for j in dominant.tolist()]
    torch.testing.assert_close(selection.vision_tokens[1:12], signals.vision_features[dominant])

    rest = [j for j in range(n) if j not in dominant.tolist()]  # 25 patches, step 25 // 4 = 6
    targets = [rest[0], rest[6], rest[12], rest[18]]
    keys = signals.vision_keys.mean(dim=0)[1:]
    keys = keys / keys.norm(dim=1, keepdim=True)
    groups = {t: [t] for t in targets}
    for j in rest:
        if j not in targets:
            groups[targets[int(torch.argmax(keys[j] @ keys[targets].T))]].append(j)
    assert [s.tolist() for s in selection.sources[12:]] == [groups[t] for t in targets]
    for token, group in zip(selection.vision_tokens[12:], selection.sources[12:]):
        members = signals.vision_features[group[1:]]
        expected = signals.vision_features[group[0]] + (members.mean(dim=0) if len(members) else 0)
        torch.testing.assert_close(token, expected)
    # every patch is carried exactly once
    carried = torch.cat(selection.sources)
    assert sorted(carried.tolist()) == list(range(n))


def test_visionzip_model_dtype_rounds_saliency_keys_and_cosines():
    generator = random_generator(6)
    attention = cls_probabilities(2)
    signals = InputSignals(
        grid=(24, 24), cls_attention=attention, vision_features=torch.randn(576, 8, generator=generator),
        vision_keys=torch.randn(16, 577, 64, generator=generator).half().float(),
        cls_feature=torch.randn(8, generator=generator), model_dtype=torch.float16,
    )  # fmt: skip
    selection = get_selector("visionzip", score_dtype="model").select(signals, 64)  # 54 + 10
    dominant = lower_index_top_k(attention.sum(dim=0).half().float(), 53)
    assert selection.kept.tolist() == dominant
    assert get_selector("visionzip").select(signals, 64).kept.tolist() != dominant
    keys = signals.vision_keys.mean(dim=0)[1:].half().float()
    keys = keys / keys.norm(dim=1, keepdim=True)
    rest = [j for j in range(576) if j not in dominant]
    targets = rest[0 : 10 * (len(rest) // 10) : len(rest) // 10]
    members = [j for j in rest if j not in targets]
    slots = torch.argmax((keys[members] @ keys[targets].T).half().float(), dim=1).tolist()
    groups = [[t] + [j for j, slot in zip(members, slots) if slot == index] for index, t in enumerate(targets)]
    assert [group.tolist() for group in selection.sources[54:]] == groups


# --- the official forward at CLIP-L/14-336 sizes (dvlab-research/VisionZip 3151f6df) ----------------------------------


def official_visionzip(case: dict[str, torch.Tensor], dominant: int, contextual: int):
    """``CLIPVisionTower_VisionZip.forward`` on one image; ``dominant`` counts CLS (the API passes ``dominant - 1``).

    Written from the selectors spec section 4 (dvlab-research/VisionZip 3151f6df) and the same
    forward as vendored in kinredon/SCOPE ``scope/clip_encoder.py`` (read at a01b98f6).

    Returns the dominant patches (grid indices, ascending), each contextual token's
    ``[target, members...]`` (grid indices) and the (dominant + contextual, Dv) output states.
    """
    hidden = case["hidden"]  # every tensor in its own dtype, as the official code in the model's
    # torch.topk orders exact ties (frequent in half precision) arbitrarily: ties to the lower index, as documented
    top = torch.tensor(top_k_sorted(case["cls_row"][:, 1:].sum(dim=0), dominant - 1)) + 1  # CLS = 0
    chosen = torch.zeros(1 + TOKENS, dtype=torch.bool)
    chosen[0] = chosen[top] = True
    positions = torch.nonzero(~chosen).flatten()  # the remaining tokens in sequence order
    metric = case["keys"].mean(dim=0)[~chosen]
    metric = metric / metric.norm(dim=-1, keepdim=True)
    step = max(1, positions.numel() // contextual)
    target = torch.arange(0, positions.numel(), step)[:contextual]
    is_target = torch.isin(torch.arange(positions.numel()), target)
    assign = (metric[~is_target] @ metric[target].T).argmax(dim=1)
    one_hot = torch.zeros(int((~is_target).sum()), contextual, dtype=hidden.dtype)
    one_hot[torch.arange(one_hot.shape[0]), assign] = 1
    counts = one_hot.sum(dim=0).clamp(min=1)[:, None]
    rest = hidden[~chosen]
    merged = rest[target] + one_hot.T @ rest[~is_target] / counts
    groups = [[int(positions[t]) - 1] + (positions[~is_target][assign == c] - 1).tolist() for c, t in enumerate(target)]
    return sorted((top - 1).tolist()), groups, torch.cat([hidden[chosen], merged])


def visionzip_identical(seed: int, budget: int, dtype: torch.dtype = torch.float32) -> bool:
    """Same dominant set, contextual groups and output vectors as the official forward run in ``dtype``
    (float32: within 1e-5; a half dtype: ``score_dtype=model``, vectors bit for bit)."""
    case = clip_case(seed)
    selector = get_selector("visionzip", score_dtype="float32" if dtype == torch.float32 else "model")
    dominant, contextual = selector.split(budget)
    kept, groups, tokens = official_visionzip(
        {name: value.to(dtype) for name, value in case.items()}, dominant, contextual
    )
    signals = InputSignals(
        grid=(24, 24), cls_attention=case["cls_row"][:, 1:], vision_keys=case["keys"],
        vision_features=case["hidden"][1:], cls_feature=case["hidden"][0], model_dtype=dtype,
    )  # fmt: skip
    selection = selector.select(signals, budget)
    same_sets = selection.kept.tolist() == kept and [s.tolist() for s in selection.sources[dominant:]] == groups
    if dtype != torch.float32:
        return same_sets and torch.equal(selection.vision_tokens.to(dtype), tokens)
    return same_sets and torch.allclose(selection.vision_tokens, tokens, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_visionzip_reproduces_the_official_dominant_and_contextual_tokens(seed):
    """Dominant set, each contextual token's target and members, and every output vector, at 64/128/192."""
    assert [visionzip_identical(seed, budget) for budget in BUDGETS] == [True] * len(BUDGETS)
    assert FIDELITY["visionzip"].agreement_cases == len(CASES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_visionzip_model_dtype_reproduces_the_official_half_precision_forward(dtype):
    """score_dtype=model: dominant set, contextual groups and every output vector (bit for bit) as the official
    forward computes them in fp16/bf16, in 30 of 30 cases."""
    assert sum(visionzip_identical(seed, budget, dtype) for seed in SEEDS for budget in BUDGETS) == len(CASES)
