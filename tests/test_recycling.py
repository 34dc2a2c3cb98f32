"""Merged tokens through the executor and the records: the executor's insertion of merged tokens (tiny LLaVA and tiny
Qwen), SparseVLM's token recycling (``recycle=true``) batched and in a run's records, intervene's refusal.

SparseVLM's recycling itself (against the official cluster-and-merge, its schedules) is tested in
``tests/pruners/test_sparsevlm.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from test_intervene import assert_one_line_failure, intervene
from test_run_cli import base_args, invoke, read_records
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import TokenGeometry
from prune_audit.data.retention import object_area, retention
from prune_audit.models import load_vlm
from prune_audit.models.llava import LlavaModel
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector
from prune_audit.pruners.base import LayerSelector, Reference, Stage, TokenMerge
from prune_audit.pruners.signals import LayerSignals
from prune_audit.pruners.sparsevlm import (
    recycled_tokens_per_layer,
)

# --- the executor inserts merged tokens (tiny LLaVA and tiny Qwen) ----------------------------------------------


@dataclass
class ReinsertingSelector(LayerSelector):
    """Stages at layers 1 and 2; keeps the top ``keep`` by hidden norm and merges the pruned tokens.

    ``group=1``: every pruned token becomes its own merged token with its own hidden state
    (a pure move to after the kept tokens); ``group=0``: all pruned tokens merge into one
    (their mean). Records the alive kinds it sees.
    """

    name: ClassVar[str] = "reinserting"
    reference: ClassVar[Reference] = Reference("test", "-")
    requires: ClassVar[frozenset[str]] = frozenset({"hidden_states"})
    keeps: tuple[int, ...] = (6, 3)
    group: int = 0
    positions: str = "compact"
    seen: list[list[int]] = field(default_factory=list)

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        return [Stage(layer + 1, keep) for layer, keep in enumerate(self.keeps)]

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> torch.Tensor:
        self.seen.append(signals.alive.tolist())
        return signals.hidden_states.norm(dim=-1)

    def merge(
        self, stage: Stage, signals: LayerSignals, state: dict[str, Any], kept: torch.Tensor
    ) -> TokenMerge | None:
        pruned = torch.tensor([i for i in range(signals.num_alive) if i not in set(kept.tolist())], dtype=torch.long)
        if not pruned.numel():
            return None
        if self.group:
            return TokenMerge(signals.hidden_states[pruned], [p[None] for p in pruned])
        return TokenMerge(signals.hidden_states[pruned].mean(dim=0, keepdim=True), [pruned])


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    path = LlavaModel.build_tiny(tmp_path_factory.mktemp("recycle") / "llava", words=WORDS, text_layers=4, seed=1)
    vlm = load_vlm(path, device="cpu")
    return vlm, [vlm.prepare(random_image(seed), question) for seed, question in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = QwenModel.build_tiny(
        tmp_path_factory.mktemp("recycle") / "qwen", words=WORDS, image_size=168, text_layers=4, seed=2
    )
    vlm = load_vlm(path, device="cpu")
    sizes = [(130, 100), (120, 120)]
    return vlm, [vlm.prepare(random_image(seed, size), q) for seed, (size, q) in enumerate(zip(sizes, QUESTIONS))]


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_merged_tokens_are_visual_for_the_next_stage_and_carry_their_sources(family, request):
    vlm, items = request.getfixturevalue(f"tiny_{family}")
    selector, lengths = ReinsertingSelector(), []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
        for layer in vlm.loop.stack.layers
    ]
    try:
        prefill, _ = vlm.prefill([items[0]], selector, 10)
    finally:
        for hook in hooks:
            hook.remove()
    num_visual = items[0].num_visual
    first, second = selector.seen
    assert len(first) == num_visual and min(first) >= 0
    # stage 2 sees the 6 kept grid tokens, then the merged token (a negative kind) after them
    assert len(second) == 7 and min(second[:6]) >= 0 and second[6] < 0
    kept, merged = prefill.kept_stages[0], prefill.merged_stages[0]
    assert merged[0] == [sorted(set(range(num_visual)) - set(kept[0]))]
    assert len(kept[1]) + len(merged[1]) == 4  # 3 kept of the 7, and the new merged token
    all_sources = [sorted(set(range(num_visual)) - set(kept[0]))]
    covered = set(kept[1]).union(*merged[1])
    assert covered <= set(kept[0]).union(*all_sources)
    assert prefill.tokens_per_layer[0] == [num_visual, 7, 4, 4]
    # the sequence: all tokens, then minus the pruned plus the merged ones at every stage
    text = prefill.prefill_tokens[0] - num_visual
    assert lengths == [text + count for count in prefill.tokens_per_layer[0]]


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_a_merged_token_that_is_its_own_member_equals_keeping_it(family, request):
    """Pruning the last visual tokens and reinserting each as itself must leave the model's output unchanged.

    They land exactly where they were, with the same hidden state and (compact on LLaVA,
    its own mean position on Qwen's M-RoPE) the same position.
    """
    vlm, items = request.getfixturevalue(f"tiny_{family}")
    item = items[0]
    last = [[index] for index in range(item.num_visual - 4, item.num_visual)]

    class KeepFirst(ReinsertingSelector):
        def score(self, stage, signals, state):
            return -torch.arange(signals.num_alive, dtype=torch.float32)  # the earliest tokens survive

    selector = KeepFirst(keeps=(item.num_visual - 4,), group=1)
    merged, _ = vlm.prefill([item], selector, 10)
    plain, _ = vlm.prefill([item])
    assert merged.merged_stages[0] == [last]
    assert merged.tokens_per_layer[0] == plain.tokens_per_layer[0]
    assert (merged.logits - plain.logits).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_sparsevlm_recycling_runs_batched_and_decodes(family, request):
    vlm, items = request.getfixturevalue(f"tiny_{family}")
    selector = get_selector("sparsevlm", recycle=True)
    budget = 24 if family == "llava" else 30
    together, _ = vlm.prefill(items, selector, budget)
    for b, item in enumerate(items):
        alone, _ = vlm.prefill([item], selector, budget)
        assert together.kept_stages[b] == alone.kept_stages[0]
        assert together.merged_stages[b] == alone.merged_stages[0]
        assert together.tokens_per_layer[b] == alone.tokens_per_layer[0]
        assert (together.logits[b] - alone.logits[0]).abs().max() <= 1e-4
        stages = vlm.schedule(selector, item.num_visual, budget)
        assert together.tokens_per_layer[b] == recycled_tokens_per_layer(stages, vlm.num_layers, item.num_visual)
        assert any(together.merged_stages[b])
    assert isinstance(vlm.generate(items[0], selector=selector, budget=budget, max_new_tokens=3), str)
    plain, _ = vlm.prefill(items, get_selector("sparsevlm"), budget)
    assert all(merged == [[]] * len(merged) for merged in plain.merged_stages)


# --- records and retention ---------------------------------------------------------------------------------------


def test_recycling_run_records_merged_sources_and_their_retention(workspace, tmp_path):
    out = tmp_path / "recycle"
    args = ("--selector", "sparsevlm", "--option", "recycle=true", "--budget", "8", "--limit", "24")
    result = invoke(base_args(workspace, out, *args))
    assert result.exit_code == 0, result.output
    records = read_records(out)
    manifest = json.loads((out / "manifest.json").read_text())
    stages = [Stage(layer, keep) for layer, keep in manifest["selector"]["schedule"]]
    expected = sum(recycled_tokens_per_layer(stages, manifest["num_layers"], 16)) / manifest["num_layers"]
    assert records["visual_tokens_avg"].tolist() == [expected] * len(records)
    assert manifest["realised_visual_tokens_avg"] == pytest.approx(expected)
    assert abs(expected - 8) <= 0.5
    coco, masked, footprint = CocoInstances.load(workspace["instances"]), 0, 0
    for row in records.itertuples():
        kept = [list(k) for k in row.kept_stages]
        merged = [[list(sources) for sources in stage] for stage in row.merged_stages]
        assert len(merged) == len(kept) and merged[0]
        covered = [set(k).union(*m) for k, m in zip(kept, merged)]
        assert all(a >= b for a, b in zip(covered, covered[1:]))  # still nested: retention never grows
        if row.lost is None:
            continue
        masked += 1
        geometry = TokenGeometry(**json.loads(row.geometry))
        area = object_area(coco.category_mask(row.image_id, row.object), geometry)
        for stage, cells in enumerate(covered):
            retained, tokens, lost = retention(area.area_per_token, area.total_area, sorted(cells))
            assert row.retention_stages[stage] == pytest.approx(retained)
            assert (row.object_tokens_kept_stages[stage], row.lost_stages[stage]) == (tokens, lost)
            own_retained, _, own_lost = retention(area.area_per_token, area.total_area, kept[stage])
            assert row.diluted_stages[stage] is (own_lost and not lost)
            footprint += retained > own_retained
    assert masked and footprint  # merged sources added object area somewhere
    plain = tmp_path / "plain"
    result = invoke(base_args(workspace, plain, "--selector", "sparsevlm", "--budget", "8", "--limit", "24"))
    assert result.exit_code == 0, result.output
    assert all(len(stage) == 0 for row in read_records(plain)["merged_stages"] for stage in row)


def test_intervene_refuses_a_run_with_merged_tokens(workspace, tmp_path):
    run = tmp_path / "recycle"
    args = ("--selector", "sparsevlm", "--option", "recycle=true", "--budget", "8", "--limit", "6")
    assert invoke(base_args(workspace, run, *args)).exit_code == 0
    out = tmp_path / "out"
    assert_one_line_failure(intervene(run, "--mode", "remove", "--out", str(out)), out, "merged tokens")


def test_a_batch_where_only_one_row_merges_equals_one_at_a_time(tiny_qwen):
    vlm, items = tiny_qwen
    assert items[0].num_visual != items[1].num_visual

    class MergeFirstOnly(ReinsertingSelector):
        def merge(self, stage, signals, state, kept):
            return super().merge(stage, signals, state, kept) if signals.grid == items[0].grid else None

    selector = MergeFirstOnly(keeps=(20, 10))
    together, _ = vlm.prefill(items, selector, 10)
    assert any(together.merged_stages[0]) and not any(together.merged_stages[1])
    for b, item in enumerate(items):
        alone, _ = vlm.prefill([item], selector, 10)
        assert together.kept_stages[b] == alone.kept_stages[0]
        assert together.merged_stages[b] == alone.merged_stages[0]
        assert together.tokens_per_layer[b] == alone.tokens_per_layer[0]
        assert (together.logits[b] - alone.logits[0]).abs().max() <= 1e-4
