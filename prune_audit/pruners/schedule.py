"""Progressive pruning schedules and the layer-average budget convention.

The budget of an in-LLM selector is the average number of visual tokens in the
inputs of all decoder layers, ``avg = (1/L) sum_l n_l`` (the SparseVLM / VisionZip /
PDrop table convention, see the selectors spec). A schedule is a list of
:class:`~prune_audit.pruners.base.Stage`; before the first stage every layer sees
all ``num_visual`` tokens.

Rule shared by the in-LLM selectors (``budget_rule="average"``, the default): the
reference layer positions, given for the 32-layer LLaVA-1.5-7B, are moved to the
model's depth with :func:`scale_layers`; the reference counts, given for 576 visual
tokens, serve only as a *shape* whose scale :func:`solve_schedule` chooses so that
the realised average matches the budget. With several reference settings the one
whose budget is nearest, as a fraction of the visual tokens, gives the shape
(:func:`nearest_setting`). ``budget_rule="paper"`` instead takes the reference's own
counts (:func:`paper_schedule`). A budget of at least ``num_visual`` keeps everything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, get_args

from prune_audit.pruners.base import TOP_K_TIES, LayerSelector, PositionMode, Stage, validate_budget
from prune_audit.pruners.options import Choice, Integer, option, option_domains

T = TypeVar("T")

REFERENCE_DEPTH = 32
"""Decoder layers of LLaVA-1.5-7B, the model the reference layer positions are given for."""
REFERENCE_VISUAL = 576
"""Visual tokens of LLaVA-1.5 (24 x 24), the count the reference schedules are given for."""
BUDGET_RULES = ("average", "paper")
"""``average``: the budget is the realised layer average; ``paper``: the reference's own counts."""
OFFICIAL_RULES = (*BUDGET_RULES, "official")
"""With ``official``: the official code's default schedule, for selectors whose code differs from the paper."""
SIGNAL_LAYERS = ("previous", "current")
"""Whose attention/keys score a stage at the input of layer l: layer l-1 (as computed there) or layer l's probe."""
SCORE_DTYPES = ("float32", "model")
"""Scores in float32, or rounded to the model's dtype where the official code computes in it."""


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

    Positions are non-decreasing inside ``[1, num_layers - 1]`` and strictly increasing
    while the depth allows; on a model too shallow to give every stage its own layer
    the deepest stages share the last layer (:func:`merge_stages` then merges them).
    """
    if num_layers < 2:
        raise ValueError(f"a {num_layers}-layer model has no layer after the first to prune at")
    scaled: list[int] = []
    for layer in reference_layers:
        position = round(layer * num_layers / reference_depth)
        position = max(position, scaled[-1] + 1 if scaled else 1)
        scaled.append(min(position, num_layers - 1))
    return scaled


@dataclass(frozen=True)
class ReferenceLayer(Integer):
    """A pruning layer given on the 32-layer reference; :func:`scale_layers` moves it to the model's depth."""

    def describe_for(self, depth: int | None, value: Any = None) -> str:
        """E.g. ``an integer in [1, 31] on the 32-layer reference, scaled to the model's depth: on its 12
        layers, decoder layers 1 to 11 (2 prunes at layer 1)``."""
        text = f"{self.describe_all()} on the {REFERENCE_DEPTH}-layer reference, scaled to the model's depth"
        if depth is None or depth < 2 or self.low is None or self.high is None:
            return text
        low, high = (scale_layers([layer], REFERENCE_DEPTH, depth)[0] for layer in (self.low, self.high))
        text = f"{text}: on its {depth} layers, decoder layers {low} to {high}"
        if isinstance(value, int) and self.contains(value):
            text += f" ({value} prunes at layer {scale_layers([value], REFERENCE_DEPTH, depth)[0]})"
        return text


def scaled_layer_note(selector: Any, num_layers: int) -> str:
    """Each reference-layer option of ``selector`` in the model's own layers, e.g. ``layer=20 of the 32-layer
    reference is decoder layer 8 of the model's 12``; "" for a selector without one."""
    notes = [
        f"{name}={getattr(selector, name)} of the {REFERENCE_DEPTH}-layer reference is decoder layer "
        f"{scale_layers([getattr(selector, name)], REFERENCE_DEPTH, num_layers)[0]} of the model's {num_layers}"
        for name, domain in option_domains(type(selector), strict=False).items()
        if isinstance(domain, ReferenceLayer) and num_layers >= 2
    ]
    return "; ".join(notes)


def merge_stages(layers: Sequence[int], values: Sequence[T]) -> tuple[list[int], list[T]]:
    """Stages that land on one layer become one, keeping the deepest reference stage's value.

    The deepest stage's count is what that layer would see after all of them, so a
    shallow model keeps the reference's final count at the shared layer.
    """
    merged_layers: list[int] = []
    merged_values: list[T] = []
    for layer, value in zip(layers, values):
        if merged_layers and merged_layers[-1] == layer:
            merged_values[-1] = value
        else:
            merged_layers.append(layer)
            merged_values.append(value)
    return merged_layers, merged_values


def nearest_setting(settings: Mapping[int, T], budget: int, num_visual: int) -> T:
    """The reference setting whose budget is nearest ``budget``, both as fractions of the visual tokens.

    ``settings`` maps reference budgets (out of 576 tokens) to anything; ties go to the smaller budget.
    """
    relative = budget * REFERENCE_VISUAL / num_visual
    return settings[min(settings, key=lambda reference: (abs(reference - relative), reference))]


def progressive_schedule(
    reference_layers: Sequence[int],
    shapes: Mapping[int, Sequence[float]],
    num_layers: int,
    num_visual: int,
    budget: int,
) -> list[Stage]:
    """The default rule: scaled reference layers, nearest reference shape, counts solved to the budget average."""
    layers, shape = merge_stages(
        scale_layers(reference_layers, REFERENCE_DEPTH, num_layers), nearest_setting(shapes, budget, num_visual)
    )
    return solve_schedule(layers, shape, num_layers, num_visual, budget)


def scale_reference_counts(counts: Sequence[int], num_visual: int) -> list[int]:
    """Counts given for 576 tokens, scaled by ``num_visual / 576`` (rounded, at most ``num_visual``)."""
    return [min(num_visual, round(count * num_visual / REFERENCE_VISUAL)) for count in counts]


def paper_schedule(
    reference_layers: Sequence[int],
    settings: Mapping[int, T],
    num_layers: int,
    num_visual: int,
    budget: int,
    method: str,
    counts_for: Callable[[T, int], Sequence[int]] = scale_reference_counts,  # type: ignore[assignment]
) -> list[Stage]:
    """The reference's own counts for the setting named by ``budget``; layers scaled to the depth.

    ``settings`` maps the reference budgets to what ``counts_for(setting, num_visual)``
    turns into counts: by default counts given for 576 tokens, scaled to ``num_visual``.
    Budgets the reference does not define raise a ValueError naming the valid ones and
    the layer average each realises on this model.
    """
    layers = sorted(set(scale_layers(reference_layers, REFERENCE_DEPTH, num_layers)))
    if budget >= num_visual:
        return [Stage(layer, num_visual) for layer in layers]

    def stages_for(setting: T) -> list[Stage]:
        merged, counts = merge_stages(
            scale_layers(reference_layers, REFERENCE_DEPTH, num_layers), counts_for(setting, num_visual)
        )
        return [Stage(layer, count) for layer, count in zip(merged, counts)]

    if budget not in settings:
        valid = ", ".join(
            f"{b} (average {average_visual_tokens(stages_for(settings[b]), num_layers, num_visual):.2f})"
            for b in sorted(settings)
        )
        raise ValueError(
            f"{method} with budget_rule='paper' defines budgets {valid} only on {num_layers} layers x "
            f"{num_visual} tokens; use budget_rule='average' for a budget of {budget}"
        )
    return stages_for(settings[budget])


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

    def counts_for(scale: float) -> list[int]:
        counts, previous = [], num_visual
        for value in shape:
            count = min(previous, max(0, round(scale * value)))
            counts.append(count)
            previous = count
        return counts

    smallest = min((v for v in shape if v > 0), default=0.0)
    high = num_visual / smallest if smallest else 0.0
    return _solve(counts_for, high, layers, num_layers, num_visual, budget)


def solve_geometric_schedule(layers: Sequence[int], num_layers: int, num_visual: int, budget: float) -> list[Stage]:
    """Counts ``int(num_visual * ratio**s)`` for stages ``s = 1..S`` whose layer average is ``budget``.

    PyramidDrop's structure (one ratio ``lambda`` applied once more at every stage,
    ``int`` as in its code); ``ratio`` in ``[0, 1]`` is found by bisection, then the
    counts are nudged by single tokens to the closest average.
    """
    if not layers:
        raise ValueError("layers must be non-empty")

    def counts_for(ratio: float) -> list[int]:
        return [int(num_visual * ratio**stage) for stage in range(1, len(layers) + 1)]

    return _solve(counts_for, 1.0, layers, num_layers, num_visual, budget)


def _solve(
    counts_for: Callable[[float], list[int]],
    high: float,
    layers: Sequence[int],
    num_layers: int,
    num_visual: int,
    budget: float,
) -> list[Stage]:
    """Bisect the parameter of ``counts_for`` (average non-decreasing in it) on ``[0, high]``."""
    fixed = layers[0] * num_visual  # layers before the first stage see everything
    if budget * num_layers < fixed:
        min_avg = fixed / num_layers
        raise ValueError(
            f"budget {budget} is below the {min_avg:.1f} tokens the layers before layer {layers[0]} "
            f"already use; raise the budget or prune earlier"
        )
    if budget >= num_visual:
        return [Stage(layer, num_visual) for layer in layers]

    def average(counts: Sequence[int]) -> float:
        return average_visual_tokens([Stage(l, c) for l, c in zip(layers, counts)], num_layers, num_visual)

    low = 0.0
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


@dataclass
class ScheduledSelector(LayerSelector):
    """An in-LLM selector whose schedule follows its reference, with the options every such selector has.

    Options: ``budget_rule`` (``"average"``: the budget is the realised layer average;
    ``"paper"``: the reference's own counts) and ``positions`` (``"keep_original"`` or
    ``"compact"`` position ids after pruning, as the reference does).

    Subclasses set ``reference_layers`` (pruning layers on the 32-layer reference) and
    ``reference_counts`` (reference budget -> tokens alive after each stage, for 576
    tokens). By default the average rule is :func:`progressive_schedule` and the paper
    rule :func:`paper_schedule` of these; override :meth:`solved_stages` or
    :meth:`paper_stages` where the reference's rule differs.
    """

    reference_layers: ClassVar[tuple[int, ...]] = ()
    reference_counts: ClassVar[Mapping[int, Sequence[int]]] = {}

    budget_rule: str = option(
        "average", Choice(BUDGET_RULES), "average: budget = realised layer average; paper: reference counts"
    )
    positions: PositionMode = option("keep_original", Choice(get_args(PositionMode)), "position ids after pruning")
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or the model dtype as the official code")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        budget = validate_budget(budget)
        if self.budget_rule == "paper":
            return self.paper_stages(num_layers, num_visual, budget)
        if self.budget_rule == "official":
            return self.checked_official_stages(num_layers, num_visual, budget)
        return self.solved_stages(num_layers, num_visual, budget)

    def official_stages(self, num_layers: int, num_visual: int) -> list[Stage]:
        """The official code's default schedule (only selectors offering ``budget_rule="official"``)."""
        raise NotImplementedError(f"{self.name} has no official default schedule")

    def checked_official_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """:meth:`official_stages`, refused unless its realised average rounds to ``budget``.

        The official schedule is fixed, so it honours one budget only; a budget of at
        least ``num_visual`` keeps everything, as under the other rules.
        """
        stages = self.official_stages(num_layers, num_visual)
        if budget >= num_visual:
            return [Stage(stage.layer, num_visual) for stage in stages]
        average = average_visual_tokens(stages, num_layers, num_visual)
        if round(average) != budget:
            raise ValueError(
                f"{self.name} with budget_rule='official' realises an average of {average:.2f} visual tokens "
                f"on {num_layers} layers x {num_visual} tokens, not {budget}; use budget {round(average)} "
                f"or budget_rule='average'"
            )
        return stages

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """Stages whose realised layer average matches ``budget``."""
        return progressive_schedule(self.reference_layers, self.reference_counts, num_layers, num_visual, budget)

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """The reference's own stages for the setting named by ``budget``."""
        return paper_schedule(self.reference_layers, self.reference_counts, num_layers, num_visual, budget, self.name)


@dataclass
class SingleStageSelector(ScheduledSelector):
    """An in-LLM selector that prunes once, at the input of decoder layer ``layer``.

    ``layer`` is given on the 32-layer reference and scaled to the model's depth.
    Average rule: the kept count is solved so the layer average is the budget,
    ``k ~ (L B - K N) / (L - K)``. Paper rule: :meth:`paper_keep` tokens survive
    (capped at ``num_visual``).
    """

    layer: int = option(2, ReferenceLayer(1, REFERENCE_DEPTH - 1), "the decoder layer whose input is pruned")

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        return solve_schedule(self._layers(num_layers), [1.0], num_layers, num_visual, budget)

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        return [Stage(layer, min(self.paper_keep(budget), num_visual)) for layer in self._layers(num_layers)]

    def paper_keep(self, budget: int) -> int:
        """Tokens kept under the paper rule: the budget itself unless the reference says otherwise."""
        return budget

    def _layers(self, num_layers: int) -> list[int]:
        return scale_layers([self.layer], REFERENCE_DEPTH, num_layers)
