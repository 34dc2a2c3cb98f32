"""HoliTom's inner-LLM merge against a loop-by-loop float64 transcription of the official one (cokeshao/HoliTom
e9b2972f, ``holitom/modeling_qwen2.py``, ``Qwen2Model_holitom.forward`` at ``layer_idx == HOLITOM_k``): the kept
set, each kept token's state after the folds and its members; its schedule under both budget rules; its counted
FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import LayerSignals, Stage, get_selector
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.schedule import average_visual_tokens

# (visual tokens n, hidden width D, heads H); 45: round(22.5) keeps 22, as the official Python round
SHAPES = [(45, 64, 4), (96, 128, 8), (150, 96, 12)]
PREFIX, TEXT = 7, 9  # tokens before the image span and after it (the last one the prompt's last)


def sequence_case(n: int, width: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, S) the last prompt row's attention over the whole sequence of ``PREFIX + n + TEXT`` keys and (n, D)
    states of the image span: a few shared directions so that folds gather several tokens."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.softmax(3 * torch.randn(heads, PREFIX + n + TEXT, generator=generator, dtype=torch.float64), dim=-1)
    directions = torch.randn(6, width, generator=generator, dtype=torch.float64)
    pick = torch.randint(0, 6, (n,), generator=generator)
    states = 2 * directions[pick] + torch.randn(n, width, generator=generator, dtype=torch.float64)
    return row, states


def official_merge(row: torch.Tensor, states: torch.Tensor, ratio: float = 0.5):
    """The official forward's merge, transcribed: (kept span positions ascending, their states, their members)."""
    n = states.shape[0]
    image = [sum(float(row[h, PREFIX + i]) for h in range(row.shape[0])) / row.shape[0] for i in range(n)]
    top = sorted(range(n), key=lambda i: -image[i])[: round(n * (1 - ratio))]  # torch.topk's descending order
    hidden = [states[i].clone() for i in range(n)]
    members = {t: [t] for t in top}
    for i in (i for i in range(n) if i not in top):  # ascending, as non_topk_indices
        sims = [float(states[i] @ states[t]) / (float(states[i].norm()) * float(states[t].norm())) for t in top]
        target = top[sims.index(max(sims))]  # torch.max: the first maximum in top-k order
        hidden[target] = (hidden[target] + hidden[i]) / 2
        members[target].append(i)
    kept = sorted(top)
    return kept, torch.stack([hidden[t] for t in kept]), [sorted(members[t]) for t in kept]


def stage_signals(row: torch.Tensor, states: torch.Tensor) -> LayerSignals:
    """The stage's signals: the row's visual columns as the last text row of ``text_probs``, the states as float32."""
    n = states.shape[0]
    probs = torch.zeros(row.shape[0], 2, n)
    probs[:, -1] = row[:, PREFIX : PREFIX + n].float()
    return LayerSignals(
        alive=torch.arange(n), grid=(1, n), layer=18, num_layers=28, text_probs=probs, hidden_states=states.float()
    )


def run_stage(selector, signals: LayerSignals, stage: Stage):
    """(kept positions, their states after the stage, their members) as the executor applies the selection."""
    kept = selector.prune(stage, signals, {})
    merge = selector.merge(stage, signals, {}, kept)
    states = signals.hidden_states.clone()
    members = {int(k): [int(k)] for k in kept}
    if merge is not None:
        for index, target in enumerate(merge.replaces.tolist()):
            states[target] = merge.hidden[index]
            members[target] = merge.members[index].tolist()
    return kept.tolist(), states[kept], [members[int(k)] for k in kept]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("n, width, heads", SHAPES)
def test_the_stage_equals_the_rederived_official_merge(seed, n, width, heads):
    row, states = sequence_case(n, width, heads, seed)
    selector = get_selector("holitom_llm")
    (stage,) = selector.schedule(28, n, 16)
    assert stage == Stage(18, round(n * 0.5))
    kept, merged, members = run_stage(selector, stage_signals(row, states), stage)
    expected_kept, expected_states, expected_members = official_merge(row, states)
    assert kept == expected_kept and members == expected_members
    assert sum(len(group) for group in members) == n  # every token folded into exactly one kept token
    torch.testing.assert_close(merged, expected_states.float(), atol=1e-5, rtol=1e-5)


def test_keep_all_and_without_merging():
    row, states = sequence_case(45, 64, 4, 0)
    signals = stage_signals(row, states)
    selector = get_selector("holitom_llm")
    (stage,) = selector.schedule(28, 45, 45)
    assert stage == Stage(18, 45)
    assert selector.prune(stage, signals, {}).tolist() == list(range(45))
    assert selector.merge(stage, signals, {}, torch.arange(45)) is None
    (cut,) = selector.schedule(28, 45, 10)
    plain = get_selector("holitom_llm", merge_pruned=False)
    kept = plain.prune(cut, signals, {})
    assert torch.equal(kept, selector.prune(cut, signals, {})) and plain.merge(cut, signals, {}, kept) is None


def test_the_official_rule_ignores_the_budget_and_the_average_rule_solves_it():
    official = get_selector("holitom_llm")
    assert not official.averages_budget and get_selector("holitom_llm", budget_rule="average").averages_budget
    for budget in (64, 128, 400):
        assert official.schedule(28, 576, budget) == [Stage(18, 288)]
        assert official.schedule(32, 576, budget) == [Stage(21, 288)]
    average = get_selector("holitom_llm", budget_rule="average")
    for budget in (371, 450, 500):
        (stage,) = average.schedule(28, 576, budget)
        assert stage.layer == 18 and average_visual_tokens([stage], 28, 576) == pytest.approx(budget, abs=0.5)
    assert average.schedule(28, 576, 576) == [Stage(18, 576)]


def test_an_unreachable_average_is_refused_naming_the_smallest_reachable_budget():
    smallest = math.ceil(18 * 576 / 28)  # layers 0..17 hold all 576 tokens: 370.3 on average
    with pytest.raises(ValueError, match=f"at least {smallest}; raise the budget to {smallest}") as refusal:
        get_selector("holitom_llm", budget_rule="average").schedule(28, 576, smallest - 1)
    assert "\n" not in str(refusal.value)
    (stage,) = get_selector("holitom_llm", budget_rule="average").schedule(28, 576, smallest)
    assert stage.keep == 2 and average_visual_tokens([stage], 28, 576) == pytest.approx(smallest, abs=0.5)


@pytest.mark.parametrize("merge_pruned", [True, False])
def test_the_counted_flops_are_the_formula(merge_pruned):
    n, width = 96, 128
    row, states = sequence_case(n, width, 8, 3)
    signals = stage_signals(row, states)
    selector = get_selector("holitom_llm", merge_pruned=merge_pruned)
    (stage,) = selector.schedule(28, n, 16)
    kept = selector.prune(stage, signals, {})
    with FlopCounterMode(display=False) as counter:
        selector.merge(stage, signals, {}, kept)
    work = SelectorWork(hidden=width, stages=((n, stage.keep),), options=selector.options())
    assert counter.get_total_flops() == type(selector).flops(work)
    assert (counter.get_total_flops() > 0) == merge_pruned
