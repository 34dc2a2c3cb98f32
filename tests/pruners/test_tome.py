"""ToMe (facebookresearch/ToMe af95e4b1): per-grid merging, its demo records, the official merging rounds at the
projector, merging in the vision tower against the official blocks (merge.py, patch/timm.py), and the serving need of a
tower-merging instance."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch
from rederivation import BUDGETS, CASES, FIDELITY, SEEDS, TOKENS, VISION_LAYERS, features_of
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import InputSignals, get_selector
from prune_audit.pruners.fidelity import RANDOM_CASES
from prune_audit.pruners.serving import serving_need
from prune_audit.pruners.tome import ToMeSelector


def test_tome_merges_within_each_grid_and_keeps_a_whole_grid_in_the_projected_space():
    """ToMe per grid: no output token mixes the grids; a grid kept whole passes its projected ``features``."""
    from prune_audit.pruners.crop_scope import select_per_grid

    features = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
    signals = InputSignals(grid=(1, 12), features=features)
    grids = [(torch.arange(4), (2, 2)), (torch.arange(4, 12), (2, 4))]
    tome = get_selector("tome")
    selection = select_per_grid(tome, signals, grids, 6)  # shares 2 and 4
    assert all(bool((group < 4).all()) or bool((group >= 4).all()) for group in selection.sources)
    assert sorted(int(cell) for group in selection.sources for cell in group) == list(range(12))
    assert len(selection.sources) == 6 and selection.llm_tokens.shape == (6, 6)
    whole = select_per_grid(tome, signals, grids, 11)  # shares 4 and 7: the base grid kept whole
    assert [group.tolist() for group in whole.sources[:4]] == [[0], [1], [2], [3]]
    assert torch.equal(whole.llm_tokens[:4], features[:4])


@pytest.mark.parametrize("order", ["official", "raster"])
def test_tome_demo_run_records_its_merged_tokens(tmp_path, order):
    """ToMe@16 on the LLaVA demo: 16 tokens whose cells partition the grid; kept cells are the unmerged ones."""
    out = tmp_path / order
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--selector",
            "tome",
            "--budget",
            "16",
            "--option",
            f"order={order}",
            "--limit",
            "4",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        kept, merged = record["kept_stages"][0], record["merged_stages"][0]
        assert len(kept) + len(merged) == 16
        assert sorted(kept + [cell for group in merged for cell in group]) == list(range(144))


# --- in the vision tower ----------------------------------------------------------------------------------------------


def official_tower_merges(states: list[torch.Tensor], metrics: list[torch.Tensor], schedule: list[int]):
    """``ToMeBlock``'s merge, layer after layer: ``bipartite_soft_matching(metric, r, class_token=True)``,
    ``merge_wavg`` and ``merge_source`` (one-hot rows, ``amax``). ``states[l]`` (the residual stream after layer
    l's attention) and ``metrics[l]`` are given for the token count the layer sees; returns the last merged states
    and each token's cells."""
    size, source, x = torch.ones(1, 577, 1), torch.eye(577)[None], None
    for state, metric, r in zip(states, metrics, schedule):
        x = state[None]
        r = min(r, (x.shape[1] - 1) // 2)
        metric = metric[None] / metric[None].norm(dim=-1, keepdim=True)
        scores = metric[..., ::2, :] @ metric[..., 1::2, :].transpose(-1, -2)
        scores[..., 0, :] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx, src_idx = edge_idx[..., r:, :].sort(dim=1)[0], edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

        def merge(values: torch.Tensor, mode: str) -> torch.Tensor:
            src, dst = values[..., ::2, :], values[..., 1::2, :]
            n, t1, c = src.shape
            unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
            src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
            return torch.cat([unm, dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)], dim=1)

        x, size, source = merge(x * size, "sum"), merge(size, "sum"), merge(source, "amax")
        x = x / size
    return x[0], [torch.nonzero(row[1:]).flatten().tolist() for row in source[0]]


def test_tome_tower_merging_reproduces_the_official_blocks():
    """30 cases: 10 seeds x budgets 64/128/192 through 23 layers of (1 + 576)-token CLIP-L states (1024 wide,
    64-dim head-mean keys), each layer's states and metric drawn for the token count it sees."""
    from prune_audit.pruners.tome import TowerMerging, tower_schedule

    identical = 0
    for seed in SEEDS:
        for budget in BUDGETS:
            generator = torch.Generator().manual_seed(seed)
            schedule, count = tower_schedule(TOKENS, budget, VISION_LAYERS), TOKENS + 1
            states, metrics = [], []
            for r in schedule:
                states.append(torch.randn(count, 1024, generator=generator))
                metrics.append(torch.randn(count, 64, generator=generator))
                count -= r
            merge = TowerMerging(budget, proportional=True)
            size, sources = (
                torch.ones(TOKENS + 1),
                [torch.zeros(0, dtype=torch.long)] + [torch.tensor([c]) for c in range(TOKENS)],
            )
            for layer, (state, metric) in enumerate(zip(states, metrics)):
                hidden, size, sources = merge(layer, VISION_LAYERS, state, metric, size, sources)
            tokens, cells = official_tower_merges(states, metrics, schedule)
            same = [group.tolist() for group in sources] == cells and torch.allclose(hidden, tokens, atol=1e-5)
            identical += same and hidden.shape[0] == budget + 1
    assert identical == RANDOM_CASES


def test_tower_schedule_is_even_and_falls_back_to_halving():
    from prune_audit.pruners.tome import tower_schedule

    assert tower_schedule(576, 64, 23) == [23] * 6 + [22] * 17
    assert tower_schedule(144, 64, 3) == [27, 27, 26]
    assert tower_schedule(144, 32, 3) == [72, 36, 4]  # an even share fails the halving cap in layer 3
    with pytest.raises(ValueError, match="raise the budget or use location=projector"):
        tower_schedule(144, 16, 3)


def demo_llava():
    from prune_audit.demo import DEMO_MODELS
    from prune_audit.models import load_vlm

    return load_vlm(str(DEMO_MODELS["demo"]), device="cpu")


def test_proportional_attention_adds_log_size_to_every_keys_logits():
    """``clip_attention_block`` against the official ``ToMeAttention`` written out on a demo CLIP layer."""
    from prune_audit.models.probe import clip_attention_block

    layer = demo_llava().vision_tower.encoder.layers[0]
    generator = torch.Generator().manual_seed(0)
    hidden, size = torch.randn(40, 128, generator=generator), torch.randint(1, 9, (40,), generator=generator).float()
    attention, normed = layer.self_attn, layer.layer_norm1(hidden)
    q, k, v = (
        p(normed).view(40, 4, 32).transpose(0, 1) for p in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    weights = (q @ k.transpose(-2, -1) * attention.scale + size.log()[None, None, :]).softmax(dim=-1)
    official = attention.out_proj((weights @ v).transpose(0, 1).reshape(40, 128))
    attended, heads = clip_attention_block(layer, hidden, size.log())
    assert torch.allclose(attended, official, atol=1e-5) and torch.allclose(heads.keys.mean(dim=0), k.mean(dim=0))
    assert torch.allclose(heads.cls_probs, weights[:, 0]) and torch.equal(heads.values, v)


def test_merging_tower_without_merges_is_the_stock_tower():
    """No merge and no sizes: the rerun tower gives the feature layer's states of the stock forward."""
    vlm = demo_llava()
    pixels = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(0))

    def no_merge(layer, num_layers, hidden, metric, size, sources):
        return hidden, size, sources

    no_merge.proportional, no_merge.metric = True, lambda cls_probs, keys, values: keys.mean(dim=0)
    states, sources = vlm._merging_tower(pixels[0], no_merge)
    assert torch.allclose(states, vlm._tower_states(pixels)[vlm.feature_index][0], atol=1e-5) and len(sources) == 145


def test_tome_in_the_tower_runs_on_the_demo_and_is_refused_on_qwen(tmp_path):
    out = tmp_path / "tower"
    result = CliRunner().invoke(app, ["run", "--selector", "tome", "--option", "location=tower", "--budget", "32",
                                      "--limit", "3", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        kept, merged = record["kept_stages"][0], record["merged_stages"][0]
        assert len(kept) + len(merged) == 32 and sorted(kept + [c for g in merged for c in g]) == list(range(144))
    result = CliRunner().invoke(app, ["run", "--model", "demo-qwen", "--selector", "tome", "--option", "location=tower",
                                      "--budget", "16", "--limit", "1", "--out", str(tmp_path / "q")])  # fmt: skip
    assert result.exit_code != 0 and "selector 'tome' needs" in result.output and "Traceback" not in result.output


# --- the official merging rounds (facebookresearch/ToMe af95e4b1, tome/merge.py) --------------------------------------


def official_tome(features: torch.Tensor, budget: int) -> tuple[list[list[int]], torch.Tensor]:
    """Rounds of ``bipartite_soft_matching`` + ``merge_wavg`` + ``merge_source`` on one image (batch of 1).

    Written from the official functions: metric normalised, A = even / B = odd positions, ``r``
    capped at half the tokens, the A tokens with the highest best score merge into their best B
    by ``scatter_reduce(sum)`` of ``x * size`` over the summed sizes, output ``[unmerged, B]``; the
    source matrix (one-hot rows, merged with ``amax``) says which cells each token carries.
    ``argsort`` is stable here (ties to the lower position), as documented.
    """
    x, size = features[None], torch.ones(1, features.shape[0], 1)
    source = torch.eye(features.shape[0])[None]
    while x.shape[1] > budget:
        r = min(x.shape[1] - budget, x.shape[1] // 2)
        metric = x / x.norm(dim=-1, keepdim=True)
        scores = metric[..., ::2, :] @ metric[..., 1::2, :].transpose(-1, -2)
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True, stable=True)[..., None]
        unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

        def merge(values: torch.Tensor, mode: str) -> torch.Tensor:
            src, dst = values[..., ::2, :], values[..., 1::2, :]
            n, t1, c = src.shape
            unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
            src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
            return torch.cat([unm, dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)], dim=1)

        x, size, source = merge(x * size, "sum"), merge(size, "sum"), merge(source, "amax")
        x = x / size
    groups = [torch.nonzero(row).flatten().tolist() for row in source[0]]
    return groups, x[0]


def tome_identical(seed: int, budget: int, dim: int) -> bool:
    features = features_of(seed, dim)
    groups, tokens = official_tome(features, budget)
    selection = get_selector("tome").select(InputSignals(grid=(24, 24), features=features), budget)
    same_groups = [group.tolist() for group in selection.sources] == groups
    return same_groups and torch.allclose(selection.llm_tokens, tokens, rtol=1e-5, atol=1e-5)


def test_tome_reproduces_the_official_merging_rounds():
    """Every output token's cells and vector (within 1e-5) as the official rounds, at 64/128/192."""
    assert sum(tome_identical(seed, budget, dim) for seed, budget, dim in CASES) == len(CASES)
    assert FIDELITY["tome"].agreement_cases == len(CASES)


# --- serving ----------------------------------------------------------------------------------------------------------


def test_an_instance_that_merges_in_the_tower_needs_the_towers_forward():
    assert serving_need(ToMeSelector()) == "encoder"
    assert serving_need(ToMeSelector(location="tower")) == "tower"
