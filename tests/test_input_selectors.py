"""What the input-level selectors share, on small hand-checkable cases: the score-dtype rule on hand-built signals,
the similarity blocks and unit rows, the peak memory of the row-on-demand and facility-location greedies, signal
subsets and per-grid budgets. Each selector's own cases are in ``tests/pruners/test_<name>.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from selector_cases import cls_probabilities, random_generator, small_blocks  # noqa: F401 (small_blocks: fixture)

from prune_audit.pruners import InputSignals, get_selector, similarity
from prune_audit.pruners.similarity import unit_rows

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "selectors.py"


def test_score_dtype_model_is_float32_on_hand_built_signals():
    attention = cls_probabilities(5)
    signals = InputSignals(grid=(24, 24), cls_attention=attention)
    assert signals.model_dtype == torch.float32
    for name in ("cls_attn", "visionzip"):
        if name == "visionzip":
            signals = InputSignals(grid=(24, 24), cls_attention=attention, vision_features=torch.randn(576, 8),
                                   vision_keys=torch.randn(16, 577, 4), cls_feature=torch.randn(8))  # fmt: skip
        model, default = (get_selector(name, score_dtype=d).select(signals, 64) for d in ("model", "float32"))
        assert torch.equal(model.kept, default.kept)


# --- shared similarity code -----------------------------------------------------------------------


def test_similarity_blocks_cover_the_matrix_within_the_block_size(small_blocks):
    unit = unit_rows(torch.randn(9, 3, generator=random_generator(10)))
    blocks = list(similarity.similarity_blocks(unit))
    assert all(block.numel() <= 9 for _, block in blocks)  # one row of 9 > 7 entries at the least
    torch.testing.assert_close(torch.cat([b for _, b in blocks]), unit @ unit.T)


def test_unit_rows_computes_in_float32_and_keeps_zero_rows_zero():
    rows = unit_rows(torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.bfloat16))
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, torch.tensor([[0.6, 0.8], [0.0, 0.0]]))


def peak_extra_mib(name: str, tokens: int) -> float:
    """Peak extra RSS of one selection, measured by the benchmark in a fresh process.

    Features are (tokens, 128) float32 and similarity blocks 1 MiB, so a dense
    tokens x tokens float32 matrix dwarfs everything a chunked method may hold.
    """
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    command = [
        sys.executable,
        str(BENCHMARK),
        "--measure",
        name,
        "--tokens",
        str(tokens),
        "--dim",
        "128",
        "--budget",
        "64",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--block-elements",
        str(1 << 18),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["peak_extra_mib"]


TOKENS = 4096
DENSE_MIB = TOKENS**2 * 4 / 2**20  # 64 MiB


@pytest.mark.parametrize("name", ["divprune", "cdpruner"])
def test_row_on_demand_selectors_hold_no_dense_matrix(name):
    assert peak_extra_mib(name, TOKENS) < DENSE_MIB / 4


@pytest.mark.parametrize("name", ["scope", "coverage"])
def test_facility_location_holds_exactly_one_dense_matrix(name):
    extra = peak_extra_mib(name, TOKENS)
    assert DENSE_MIB * 0.9 < extra < DENSE_MIB * 1.25


def test_gprune_holds_exactly_one_dense_matrix():
    """Its transition matrix is built, softmaxed and counted in place, block by block."""
    extra = peak_extra_mib("gprune", TOKENS)
    assert DENSE_MIB * 0.9 < extra < DENSE_MIB * 1.25


def test_signals_subset_slices_every_per_token_signal_and_keeps_the_cls_first():
    """``InputSignals.subset`` (per-crop budgets): per-token signals along their token axis, CLS columns kept at 0."""
    generator = torch.Generator().manual_seed(0)
    signals = InputSignals(
        grid=(2, 3),
        features=torch.randn(6, 4, generator=generator),
        cls_attention=torch.rand(2, 6, generator=generator),
        cls_logits=torch.randn(2, 7, generator=generator),
        vision_keys=torch.randn(2, 7, 5, generator=generator),
        layer_attention=torch.rand(3, 6, generator=generator),
        cls_feature=torch.ones(4),
    )
    tokens = torch.tensor([1, 2, 4, 5])
    part = signals.subset(tokens, (2, 2))
    assert part.grid == (2, 2) and part.num_tokens == 4
    torch.testing.assert_close(part.features, signals.features[tokens])
    torch.testing.assert_close(part.cls_attention, signals.cls_attention[:, tokens])
    torch.testing.assert_close(part.layer_attention, signals.layer_attention[:, tokens])
    torch.testing.assert_close(part.cls_logits, signals.cls_logits[:, [0, 2, 3, 5, 6]])
    torch.testing.assert_close(part.vision_keys, signals.vision_keys[:, [0, 2, 3, 5, 6]])
    assert part.cls_feature is signals.cls_feature and part.demand is None
    assert signals.subset(tokens).grid == (1, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        signals.subset(tokens, (3, 2))


# ---------------------------------------------------------------- per grid (LLaVA-NeXT's base view and tile grid)


def test_grid_budgets_split_in_proportion_by_largest_remainder():
    from prune_audit.pruners.crop_scope import grid_budgets

    assert grid_budgets(100, [576, 2304]) == [20, 80]
    assert grid_budgets(11, [4, 8]) == [4, 7]  # 3.67 and 7.33: the leftover token to the larger fraction
    assert grid_budgets(3, [4, 8]) == [1, 2] and grid_budgets(1, [1, 1]) == [1, 0]  # tie: the earlier grid
    assert grid_budgets(50, [4, 8]) == [4, 8]
