"""PruMerge and PruMerge+ (issue 41) against an independent re-derivation of the official code.

The re-derivation follows 42Shawn/LLaVA-PruMerge (1ca8b2ba) ``clip_encoder.py``: ``outlier_dectection`` (numpy
percentiles), ``token_prune_merge_advanced`` and ``token_prune_merge_advanced_plus`` (``if_adaptive=True``), with
their per-centre loop, from the raw full-width CLS query, keys and features at LLaVA-1.5's shapes (576 patches +
CLS, 1024 wide, 16 heads of 64). The selectors see the same tensors as an adapter gives them: per-head CLS logits,
per-head keys and the patch features. The official q / k are CLIP layer 23's (the last), given as the
``last_layer_`` signals; the feature layer's (22) are another case's, so reading the wrong layer cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prune_audit.pruners import InputSignals, get_selector, selector_class
from prune_audit.pruners.arithmetic import SelectorWork

GRID, HEADS, HEAD_DIM = (24, 24), 16, 64
N, WIDTH = GRID[0] * GRID[1], HEADS * HEAD_DIM
SEEDS, BUDGETS = range(10), (64, 128, 192)


def clip_case(seed: int) -> dict[str, torch.Tensor]:
    """A random CLIP-shaped case: full-width CLS query (1024,), keys (577, 1024) and patch features (576, 1024).

    A few patches get keys aligned with the query (the high-attention "artifact" tokens of CLIP), so the CLS
    attention has the outliers the IQR rule counts.
    """
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(WIDTH, generator=generator)
    keys = torch.randn(1 + N, WIDTH, generator=generator)
    artifacts = 1 + torch.randperm(N, generator=generator)[:12]
    keys[artifacts] += 0.15 * query
    features = torch.randn(N, WIDTH, generator=generator)
    return {"query": query, "keys": keys, "features": features}


def per_head(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, 1 + N) per-head CLS logits q_h . k_h / sqrt(d) and (H, 1 + N, d) per-head keys of a case's q / k."""
    heads_q = case["query"].view(HEADS, HEAD_DIM)
    heads_k = case["keys"].view(1 + N, HEADS, HEAD_DIM).permute(1, 0, 2)
    return torch.einsum("hd,hnd->hn", heads_q * HEAD_DIM**-0.5, heads_k), heads_k


def adapter_signals(case: dict[str, torch.Tensor], feature_layer: dict[str, torch.Tensor]) -> InputSignals:
    """The signals an adapter passes: the last layer's per-head CLS logits and keys from ``case``, the feature
    layer's from ``feature_layer``, and ``case``'s patch features."""
    last_logits, last_keys = per_head(case)
    logits, keys = per_head(feature_layer)
    return InputSignals(
        grid=GRID,
        cls_logits=logits,
        cls_attention=torch.softmax(logits, dim=-1)[:, 1:],
        vision_keys=keys,
        last_layer_cls_logits=last_logits,
        last_layer_vision_keys=last_keys,
        vision_features=case["features"],
    )


def signals_of(seed: int) -> InputSignals:
    """Seed ``seed``'s case at the last layer, seed ``seed + 100``'s q / k at the feature layer."""
    return adapter_signals(clip_case(seed), clip_case(seed + 100))


# --- the official code, re-derived ---------------------------------------------------------------------------------


def official_attention(case) -> torch.Tensor:
    """(576,) CLS row of softmax(q K^T * C^-0.5) over one full-width head, patch columns."""
    attention = torch.softmax(case["keys"] @ case["query"] * WIDTH**-0.5, dim=0)
    return attention[1:]


def official_ratio(attention: torch.Tensor) -> float:
    values = attention.to(torch.float32).numpy().flatten()
    q1, q3 = np.percentile(values, 25), np.percentile(values, 75)
    return len(np.where(values > q3 + 1.5 * (q3 - q1))[0]) / len(values)


def official_merge(case, index: torch.Tensor):
    """The official per-centre loop: centre i merges its 32 key-nearest among the other centres (index order) and
    the non-centres (ascending), weighted by CLS attention; then one token of all non-centres.

    Returns ``(centres, [neighbour grid indices by decreasing cosine], tokens (C + 1, 1024), non-centres)``.
    """
    attention, keys, x = official_attention(case), case["keys"][1:], case["features"]
    complement = torch.tensor(sorted(set(range(N)) - set(index.tolist())), dtype=torch.long)
    unit = F.normalize(keys, p=2, dim=-1)
    neighbours, tokens = [], []
    for i in range(index.numel()):
        rest = torch.cat([index[:i], index[i + 1 :], complement])  # grid indices in the official rest order
        cosines = unit[index[i]][None] @ unit[rest].T
        _, cluster = torch.topk(cosines, k=32, dim=1, largest=True)
        members = rest[cluster[0]]
        neighbours.append(members.tolist())
        tokens.append(x[index[i]] + torch.sum(x[members] * attention[members][:, None], dim=0))
    tokens.append(torch.sum(x[complement] * attention[complement][:, None], dim=0))
    return index.tolist(), neighbours, torch.stack(tokens), complement


def official_prumerge(case, count: int | None):
    """``token_prune_merge_advanced``: ``count`` centres (None: the adaptive IQR count)."""
    attention = official_attention(case)
    if count is None:
        count = int(N * official_ratio(attention))
    return official_merge(case, torch.topk(attention, count).indices)


def official_plus(case, budget: int | None):
    """``token_prune_merge_advanced_plus``: adaptive (``budget`` None) as the official code; with a budget, a quarter
    of ``budget - 1`` by attention and the rest at ``R[i |R| // S]`` of the other patches (prune-audit's fill)."""
    attention = official_attention(case)
    if budget is None:
        ratio = official_ratio(attention)
        index = torch.topk(attention, int(N * ratio)).indices
        sequence = torch.arange(0, 575, int(int(1 / ratio) / 3))
        samples = torch.tensor([s for s in sequence.tolist() if s not in index.tolist()], dtype=torch.long)
    else:
        index = torch.topk(attention, round((budget - 1) / 4)).indices
        others = [j for j in range(N) if j not in set(index.tolist())]
        wanted = budget - 1 - index.numel()
        samples = torch.tensor([others[i * len(others) // wanted] for i in range(wanted)], dtype=torch.long)
    return official_merge(case, torch.cat([index, samples]))


def assert_same_merge(selection, official) -> None:
    centres, neighbours, tokens, complement = official
    assert selection.kept.numel() == 0  # every output token is merged
    assert [int(s[0]) for s in selection.sources[:-1]] == centres
    # the same neighbours; their order may swap within float rounding of the cosines (row by row officially)
    assert [sorted(s[1:].tolist()) for s in selection.sources[:-1]] == [sorted(group) for group in neighbours]
    assert torch.equal(selection.sources[-1], complement)
    torch.testing.assert_close(selection.vision_tokens, tokens, rtol=1e-5, atol=1e-5)
    merged = selection.merged_sources()  # the records' merged_stages: every token, grid cells ascending
    assert len(merged) == len(centres) + 1 and merged[-1] == complement.tolist()


# --- agreement -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_prumerge_reproduces_the_official_merge(seed):
    case = clip_case(seed)
    signals = signals_of(seed)
    for budget in BUDGETS:
        selection = get_selector("prumerge").select(signals, budget)
        assert selection.num_output_tokens == budget
        assert_same_merge(selection, official_prumerge(case, budget - 1))
    adaptive = get_selector("prumerge", count="adaptive", ties="topk").select(signals, 192)
    assert_same_merge(adaptive, official_prumerge(case, None))


@pytest.mark.parametrize("seed", SEEDS)
def test_prumerge_plus_reproduces_the_official_merge(seed):
    case = clip_case(seed)
    signals = signals_of(seed)
    for budget in BUDGETS:
        selection = get_selector("prumerge_plus").select(signals, budget)
        assert selection.num_output_tokens == budget
        assert_same_merge(selection, official_plus(case, budget))
    adaptive = get_selector("prumerge_plus", count="adaptive", ties="topk").select(signals, 192)
    assert_same_merge(adaptive, official_plus(case, None))


def test_the_cases_have_outliers_and_the_adaptive_count_ignores_the_budget():
    """The IQR rule finds a handful of outliers here (the paper's about 32 on real images); count=adaptive feeds
    them + 1 whatever the budget, PruMerge+ about four times as many."""
    counts = [int(N * official_ratio(official_attention(clip_case(seed)))) for seed in SEEDS]
    assert all(8 <= count <= 120 for count in counts), counts
    signals = signals_of(0)
    plain = [get_selector("prumerge", count="adaptive").select(signals, b).num_output_tokens for b in BUDGETS]
    assert plain == [counts[0] + 1] * 3
    plus = get_selector("prumerge_plus", count="adaptive").select(signals, 64).num_output_tokens
    assert 3 * counts[0] < plus < 5 * counts[0] + 2


def test_full_width_attention_is_the_official_single_head():
    """sum_h l_h / sqrt(H) of the per-head logits is the unsplit q . k / sqrt(H d) of the official hooks."""
    from prune_audit.pruners.prumerge import full_width_attention, full_width_keys

    case = clip_case(3)
    signals = signals_of(3)
    attention = full_width_attention(signals.last_layer_cls_logits)
    torch.testing.assert_close(attention, official_attention(case), rtol=1e-5, atol=1e-8)
    assert torch.equal(full_width_keys(signals.last_layer_vision_keys), case["keys"][1:])


@pytest.mark.parametrize("name", ["prumerge", "prumerge_plus"])
def test_signal_layer_feature_reads_the_feature_layer_as_before(name):
    """signal_layer=feature (the earlier behaviour) merges by the feature layer's q / k: the official merge of those,
    with the same features; the default reads the last layer's and so merges otherwise."""
    from prune_audit.pruners.base import Selector

    official = official_prumerge if name == "prumerge" else official_plus
    for seed in (0, 1):
        signals, feature_layer = signals_of(seed), clip_case(seed + 100)
        as_before = {**feature_layer, "features": clip_case(seed)["features"]}
        selection = get_selector(name, signal_layer="feature").select(signals, 64)
        assert_same_merge(selection, official(as_before, 63 if name == "prumerge" else 64))
        default = get_selector(name).select(signals, 64)
        assert [int(s[0]) for s in default.sources] != [int(s[0]) for s in selection.sources]
    everything = frozenset(InputSignals.__dataclass_fields__)
    assert Selector.requires_on(get_selector(name), everything) == {
        "last_layer_cls_logits", "last_layer_vision_keys", "vision_features"
    } == selector_class(name).requires  # fmt: skip
    feature = get_selector(name, signal_layer="feature")
    assert Selector.requires_on(feature, everything) == {"cls_logits", "vision_keys", "vision_features"}
    with pytest.raises(ValueError, match="last_layer_cls_logits"):  # the signals it reads, named
        get_selector(name).select(InputSignals(grid=GRID, cls_logits=signals.cls_logits), 64)


def test_a_subset_keeps_the_last_layer_cls_column():
    """``InputSignals.subset`` slices the last layer's logits and keys as their feature-layer twins, CLS first."""
    signals = signals_of(0)
    subset = signals.subset(torch.tensor([3, 7]))
    columns = torch.tensor([0, 4, 8])
    assert torch.equal(subset.last_layer_cls_logits, signals.last_layer_cls_logits[:, columns])
    assert torch.equal(subset.last_layer_vision_keys, signals.last_layer_vision_keys[:, columns])


# --- its own cases -------------------------------------------------------------------------------------------------


def test_a_small_grid_merges_every_other_patch_and_a_budget_of_one_is_the_remainder():
    """Fewer than 32 other patches: each centre merges all of them; budget 1: no centre, one remainder token."""
    generator = torch.Generator().manual_seed(0)
    signals = InputSignals(
        grid=(3, 3),
        last_layer_cls_logits=torch.randn(2, 10, generator=generator),
        last_layer_vision_keys=torch.randn(2, 10, 4, generator=generator),
        vision_features=torch.randn(9, 5, generator=generator),
    )
    selection = get_selector("prumerge").select(signals, 3)
    assert [sorted(s.tolist()) for s in selection.sources[:2]] == [list(range(9))] * 2
    single = get_selector("prumerge_plus").select(signals, 1)
    assert len(single.sources) == 1 and single.sources[0].tolist() == list(range(9))
    weights = torch.softmax(signals.last_layer_cls_logits.sum(0) / 2**0.5, dim=0)[1:]
    torch.testing.assert_close(single.vision_tokens[0], weights @ signals.vision_features)


def test_plus_samples_spread_over_the_grid_and_fill_the_budget():
    signals = signals_of(1)
    selection = get_selector("prumerge_plus").select(signals, 65)
    centres = [int(s[0]) for s in selection.sources[:-1]]
    attention_ranked, samples = centres[:16], centres[16:]
    assert len(samples) == 48 and samples == sorted(samples) and not set(samples) & set(attention_ranked)
    assert max(np.diff([0, *samples, N])) <= 2 * N // 48  # no gap much wider than the even spacing
    only_attention = get_selector("prumerge_plus", attention_fraction=1.0).select(signals, 65)
    plain = get_selector("prumerge").select(signals, 65)
    assert all(torch.equal(a, b) for a, b in zip(only_attention.sources, plain.sources, strict=True))


def test_options_are_validated():
    for name, options in [
        ("prumerge", {"count": "iqr"}),
        ("prumerge", {"neighbours": 0}),
        ("prumerge", {"signal_layer": "penultimate"}),
        ("prumerge_plus", {"attention_fraction": 1.5}),
    ]:
        with pytest.raises(ValueError):
            get_selector(name, **options)


def test_flops_formula_counts_the_cosines_and_the_weighted_sums():
    work = SelectorWork(tokens=N, kept=64, vision_width=WIDTH)
    expected = 2 * 63 * WIDTH * N + 63 * 2 * 32 * WIDTH + 2 * (N - 63) * WIDTH
    for name in ("prumerge", "prumerge_plus"):
        assert selector_class(name).flops(work) == expected and selector_class(name).flops_exact
        assert selector_class(name).flops(SelectorWork(tokens=N, kept=N, vision_width=WIDTH)) == 0
