"""FrameFusion against a re-derivation of the official ``FrameFusion.forward`` (thu-nics/FrameFusion fbec1d2e,
``framefusion/main.py``) run once per stage on random clips: each stage's merged groups, merged states and kept
set, and the pruning stage's kept set; the cost model, keep-all, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from prune_audit.pruners import get_selector
from prune_audit.pruners.framefusion import pruning_ratio
from prune_audit.pruners.signals import LayerSignals

TEXT, IGNORE = -1, -2  # the official patch type of a text token; the similarity of a chain's first token
LAYERS, HEADS, BEFORE, AFTER = 28, 4, 3, 6  # a Qwen2.5-VL-7B-like depth; text tokens before and after the clip
SEEDS = [0, 1, 2]
GRIDS = [(4, 6, 6, 64), (6, 7, 7, 96), (8, 8, 10, 128)]  # (T, h, w, D)
SHARES = [0.2, 0.3, 0.5, 0.8]  # budget / N: the official cost


class OfficialFrameFusion:
    """``FrameFusion.forward`` on one prompt (batch 1), line by line in fp32: ``call`` is one invocation with the
    (1, q_len, D) states and, while pruning is due, the (1, H, 4, q_len) last-rows attention."""

    def __init__(self, patch_type, patch_num, start, image_length, cost, similarity, ratio, num_layers):
        self.patch_type, self.patch_num, self.start = patch_type, patch_num, start
        self.image_length, self.original_length = image_length, patch_type.shape[1]
        self.cost, self.similarity_lower_bound, self.ratio_lower_bound = cost, similarity, ratio
        self.num_layers, self.sparsity_list = num_layers, []
        self.finish_merging = self.finish_pruning = False

    def ratio(self):
        s, total = 1, 0
        for sparsity in self.sparsity_list:
            s *= 1 - sparsity
            total += s
        remain = self.num_layers * self.cost - total
        if remain < 0:
            raise ValueError("The cost is too small")
        if remain / ((self.num_layers - len(self.sparsity_list)) * s) > 1:
            return 0
        return 1 - remain / ((self.num_layers - len(self.sparsity_list)) * s)

    def call(self, hidden, weights=None):
        """Returns the new states and the kept sequence indices (a bool mask or sorted indices)."""
        q_len = hidden.shape[1]
        if self.finish_merging and not self.finish_pruning:
            length = self.image_length - (self.original_length - q_len)
            average = weights.mean(dim=(1, 2))[0][self.start : self.start + length]
            top = average.topk(round(length * (1 - self.ratio()))).indices + self.start
            keep = torch.cat([torch.arange(self.start), top, torch.arange(self.start + length, q_len)]).sort().values
            self.finish_pruning = True
            self.patch_type = self.patch_type[:, keep]
            return hidden[:, keep], keep
        if self.finish_merging:
            return hidden, torch.arange(q_len)
        bound = self.ratio()
        similarity, index = self.similarity_by_patch(hidden)
        frames = int((self.patch_type != TEXT).sum())
        merge = torch.where(similarity >= self.similarity_lower_bound)[1]
        above = merge.shape[0] / frames
        if above < bound:
            self.sparsity_list.append(above)
            self.finish_merging = above < self.ratio_lower_bound
        else:
            merge = torch.sort(torch.topk(similarity, int(bound * frames)).indices).values[0]
            self.finish_merging = self.finish_pruning = True
        hidden, mask = self.merge(hidden.clone(), similarity, index, merge)
        self.patch_type = self.patch_type[mask].reshape(1, -1)
        return hidden[mask].reshape(1, -1, hidden.shape[-1]), torch.nonzero(mask[0]).flatten()

    def similarity_by_patch(self, hidden):
        types, index = torch.where(self.patch_type == torch.arange(self.patch_num)[:, None])
        types, index = types[None], index[None]
        a, b = hidden[0, index[0, :-1]][None], hidden[0, index[0, 1:]][None]
        similarity = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        similarity[types[:, :-1] != types[:, 1:]] = -2
        return torch.cat([torch.full((1, 1), float(IGNORE)), similarity], dim=1), index

    @staticmethod
    def merge(hidden, similarity, index, merge):
        mask = torch.ones(hidden.shape[:-1], dtype=torch.bool)
        if merge.shape[0] == 0:
            return hidden, mask
        flags = torch.zeros(1, similarity.shape[1])
        flags[0, merge] = 1
        before = torch.cat([torch.zeros(1, 1), flags[:, :-1]], dim=1)
        after = torch.cat([flags[:, 1:], torch.zeros(1, 1)], dim=1)
        starts = torch.nonzero((flags == 1) & (before == 0), as_tuple=True)[1]
        ends = torch.nonzero((flags == 1) & (after == 0), as_tuple=True)[1]
        last = torch.zeros_like(flags)
        last[0, ends] = (ends - starts + 1).float()
        mask[0, index[0, merge]] = False
        lengths = torch.unique(last.long()).sort().values
        lengths = lengths[1:] if lengths[0] == 0 else lengths
        which, position = torch.where(last == lengths[:, None])
        counts = lengths[which]
        head = position - counts
        member = torch.repeat_interleave(head, counts) + torch.cat([torch.arange(1, int(c) + 1) for c in counts])
        hidden.index_add_(1, index[0, torch.repeat_interleave(head, counts)], hidden[0, index[0, member]][None])
        hidden[0, index[0, head]] /= counts[:, None] + 1
        return hidden, mask


def random_clip(seed: int, grid: tuple[int, int, int, int]) -> torch.Tensor:
    """(T * h * w, D) time-major states: each position's base vector plus per-step noise of a per-token scale, so
    the previous-step cosines spread around the 0.6 threshold."""
    steps, rows, cols, width = grid
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(rows * cols, width, generator=generator)
    scale = 0.2 + 1.3 * torch.rand(steps, rows * cols, 1, generator=generator)
    return (base + scale * torch.randn(steps, rows * cols, width, generator=generator)).reshape(-1, width)


def layer(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A fixed stand-in for a decoder layer between stages (the states change, the tokens stay)."""
    return hidden + 0.3 * torch.tanh(hidden @ weight)


def run_both(seed: int, grid: tuple[int, int, int, int], share: float):
    """Both through every stage; asserts each stage's kept set and merged states agree. Returns the selector's
    visual count per layer and the official's final sparsity list."""
    steps, rows, cols, width = grid
    n = steps * rows * cols
    generator = torch.Generator().manual_seed(100 + seed)
    weight = torch.randn(width, width, generator=generator) / math.sqrt(width)
    visual = random_clip(seed, grid)
    sequence = torch.cat([torch.randn(BEFORE, width, generator=generator), visual, torch.randn(AFTER, width)])
    patch = torch.cat([torch.full((BEFORE,), TEXT), torch.arange(n) % (rows * cols), torch.full((AFTER,), TEXT)])
    budget = round(share * n)
    official = OfficialFrameFusion(patch[None], rows * cols, BEFORE, n, budget / n, 0.6, 0.1, LAYERS)
    selector, state, alive, hidden, counts = get_selector("framefusion"), {}, torch.arange(n), sequence[None], []
    for stage in selector.schedule(LAYERS, n, budget):
        image = slice(BEFORE, BEFORE + alive.numel())
        probs = torch.softmax(torch.randn(HEADS, AFTER, hidden.shape[1], generator=generator), dim=-1)
        weights = probs[None, :, -4:]  # the official's last 4 query rows
        signals = LayerSignals(
            alive=alive, grid=(steps * rows, cols), layer=stage.layer, num_layers=LAYERS, video_grid=(steps, rows, cols),
            hidden_states=hidden[0, image], text_probs=probs[:, :, image],
        )  # fmt: skip
        kept = selector.prune(stage, signals, state)
        merge = selector.merge(stage, signals, state, kept)
        hidden_new, keep = official.call(hidden, weights)
        assert torch.equal(keep[BEFORE : BEFORE + kept.numel()] - BEFORE, kept)
        ours = hidden[0, image].clone()
        if merge is not None:
            ours[merge.replaces] = merge.hidden
        torch.testing.assert_close(ours[kept], hidden_new[0, BEFORE : BEFORE + kept.numel()], rtol=1e-5, atol=1e-5)
        alive = alive[kept]
        hidden = layer(hidden_new, weight)
        counts.append(kept.numel())
    return counts, official.sparsity_list


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("share", SHARES)
def test_framefusion_equals_the_rederived_official_forward(seed, grid, share):
    counts, _ = run_both(seed, grid, share)
    n = grid[0] * grid[1] * grid[2]
    average = sum(counts) / LAYERS  # the stage at layer l sets layer l's count
    assert average <= round(share * n) + 1  # the cost model spends at most the budget (rounding aside)


def test_the_cost_model_spends_the_budget_when_it_prunes():
    counts, sparsity = run_both(0, GRIDS[0], 0.3)
    assert len(sparsity) < LAYERS and counts[-1] < counts[len(sparsity) - 1]  # merged, then pruned
    assert sum(counts) / LAYERS == pytest.approx(0.3 * 144, abs=1)


def test_pruning_ratio_is_the_official_formula():
    assert pruning_ratio([], 0.3, 28) == pytest.approx(0.7)
    assert pruning_ratio([0.5], 0.3, 28) == pytest.approx(1 - (28 * 0.3 - 0.5) / (27 * 0.5))
    assert pruning_ratio([0.0], 1.0, 28) == 0.0  # every token affordable
    assert pruning_ratio([0.1, 0.1], 0.02, 28) == 1.0  # the cost is spent (the official raises)


@pytest.mark.parametrize("grid", GRIDS)
def test_a_budget_of_every_token_keeps_every_token_unmerged(grid):
    steps, rows, cols, width = grid
    n = steps * rows * cols
    selector, state = get_selector("framefusion"), {}
    for stage in selector.schedule(LAYERS, n, n):
        signals = LayerSignals(
            alive=torch.arange(n), grid=(steps * rows, cols), layer=stage.layer, num_layers=LAYERS,
            hidden_states=random_clip(0, grid), text_probs=torch.full((HEADS, AFTER, n), 1 / n),
            video_grid=(steps, rows, cols),
        )  # fmt: skip
        assert selector.prune(stage, signals, state).tolist() == list(range(n))
        assert selector.merge(stage, signals, state, torch.arange(n)) is None


def test_the_schedule_carries_the_budget_at_every_layer():
    stages = get_selector("framefusion").schedule(LAYERS, 391, 128)
    assert [(s.layer, s.keep) for s in stages] == [(layer, 128) for layer in range(LAYERS)]
    assert get_selector("framefusion", budget_rule="paper").schedule(LAYERS, 391, 128) == stages


def test_a_still_image_and_a_wrong_grid_are_refused():
    selector = get_selector("framefusion")
    signals = LayerSignals(
        alive=torch.arange(12), grid=(3, 4), layer=0, num_layers=4, hidden_states=torch.randn(12, 8),
        text_probs=torch.full((2, 3, 12), 1 / 12),
    )  # fmt: skip
    with pytest.raises(ValueError, match="video_grid"):
        selector.prune(selector.schedule(4, 12, 6)[0], signals, {})
    signals.video_grid = (2, 2, 4)
    with pytest.raises(ValueError, match="does not hold"):
        selector.prune(selector.schedule(4, 12, 6)[0], signals, {})
