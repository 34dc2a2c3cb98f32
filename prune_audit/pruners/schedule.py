"""Progressive pruning schedules and the layer-average budget convention.

The budget of an in-LLM selector is the average number of visual tokens in the
inputs of all decoder layers, ``avg = (1/L) sum_l n_l`` (the SparseVLM / VisionZip /
PDrop table convention, see the selectors spec). A schedule is a list of
:class:`~prune_audit.pruners.base.Stage`; before the first stage every layer sees
all ``num_visual`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from prune_audit.pruners.base import Stage


def tokens_per_layer(stages: Sequence[Stage], num_layers: int, num_visual: int) -> list[int]:
    """Visual tokens in the input of each decoder layer (length ``num_layers``)."""
    counts = []
    alive = num_visual
    pending = sorted(stages, key=lambda s: s.layer)
    for layer in range(num_layers):
        while pending and pending[0].layer <= layer:
            alive = min(alive, pending.pop(0).keep)
        counts.append(alive)
    return counts


def average_visual_tokens(stages: Sequence[Stage], num_layers: int, num_visual: int) -> float:
    """The realised layer-average number of visual tokens of a schedule."""
    return sum(tokens_per_layer(stages, num_layers, num_visual)) / num_layers


def scale_layers(reference_layers: Sequence[int], reference_depth: int, num_layers: int) -> list[int]:
    """Move reference layer positions to a model of another depth, proportionally.

    Positions stay strictly increasing and inside ``[1, num_layers - 1]``.
    """
    scaled: list[int] = []
    for layer in reference_layers:
        position = round(layer * num_layers / reference_depth)
        position = max(position, scaled[-1] + 1 if scaled else 1)
        scaled.append(min(position, num_layers - 1))
    if len(set(scaled)) != len(scaled):
        raise ValueError(
            f"a {num_layers}-layer model is too shallow for {len(reference_layers)} pruning stages"
        )
    return scaled


def solve_schedule(
    layers: Sequence[int],
    shape: Sequence[float],
    num_layers: int,
    num_visual: int,
    budget: float,
) -> list[Stage]:
    """Counts proportional to ``shape`` at ``layers`` whose layer average is ``budget``.

    ``shape`` holds non-increasing relative counts (any positive scale). The counts
    ``round(scale * shape)`` are clipped to ``[0, num_visual]`` and made
    non-increasing; ``scale`` is found by bisection and the result is then nudged
    by single tokens to the integer schedule whose average is closest to ``budget``.
    """
    if len(layers) != len(shape) or not layers:
        raise ValueError("layers and shape must be non-empty and of equal length")
    fixed = layers[0] * num_visual  # layers before the first stage see everything
    if budget * num_layers < fixed:
        min_avg = fixed / num_layers
        raise ValueError(
            f"budget {budget} is below the {min_avg:.1f} tokens the layers before layer {layers[0]} "
            f"already use; raise the budget or prune earlier"
        )
    if budget >= num_visual:
        return [Stage(layer, num_visual) for layer in layers]

    def counts_for(scale: float) -> list[int]:
        counts, previous = [], num_visual
        for value in shape:
            count = min(previous, max(0, round(scale * value)))
            counts.append(count)
            previous = count
        return counts

    def average(counts: Sequence[int]) -> float:
        return average_visual_tokens([Stage(l, c) for l, c in zip(layers, counts)], num_layers, num_visual)

    low, high = 0.0, num_visual / max(min(v for v in shape if v > 0), 1e-9) if any(shape) else 0.0
    for _ in range(100):
        middle = (low + high) / 2
        if average(counts_for(middle)) < budget:
            low = middle
        else:
            high = middle
    counts = min((counts_for(low), counts_for(high)), key=lambda c: abs(average(c) - budget))
    counts = _nudge(counts, layers, num_layers, num_visual, budget)
    return [Stage(l, c) for l, c in zip(layers, counts)]


def _nudge(counts: list[int], layers: Sequence[int], num_layers: int, num_visual: int, budget: float) -> list[int]:
    """Greedy single-token changes that bring the average closer to ``budget``."""

    def error(c: Sequence[int]) -> float:
        return abs(average_visual_tokens([Stage(l, n) for l, n in zip(layers, c)], num_layers, num_visual) - budget)

    improved = True
    while improved:
        improved = False
        for index in range(len(counts)):
            for delta in (1, -1):
                candidate = list(counts)
                candidate[index] += delta
                upper = num_visual if index == 0 else candidate[index - 1]
                lower = candidate[index + 1] if index + 1 < len(candidate) else 0
                if not lower <= candidate[index] <= upper:
                    continue
                if error(candidate) < error(counts) - 1e-12:
                    counts, improved = candidate, True
    return counts
