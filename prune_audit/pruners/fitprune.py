"""FitPrune: prune inside the LLM by a per-layer schedule fitted on calibration data.

Two parts. The selector (:class:`FitPruneSelector`) runs a fitted schedule: after the attention of
decoder layer ``l`` it removes ``removed[l]`` visual tokens, the lowest by the product of their
self-attention (from the visual rows) and cross-attention (from the text rows after the image),
both the maximum over heads. The fit (:func:`fit_schedule`) finds those per-layer counts from
attention statistics of calibration questions (:class:`AttentionStatistics`), by a binary search on
the share ``alpha`` of attention mass each layer may lose, under the budget. Schedules travel as
JSON files (:func:`schedules_json`, :func:`load_schedules`) with their provenance.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import Reference, Stage, validate_budget
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Text, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import (
    ScheduledSelector,
    average_visual_tokens,
    merge_stages,
    nearest_setting,
    scale_layers,
    solve_schedule,
)
from prune_audit.pruners.signals import LayerSignals

SCHEDULE_FORMAT = "prune-audit fitprune schedule"
SCHEDULE_VERSION = 1
#: the official LLaVA-1.5-7B schedules (``delete_scheme`` of the official modeling_llama.py), shipped as JSON
OFFICIAL_SCHEDULES = "fitprune_llava15_7b.json"
#: schedules fitted with prune-audit fitprune fit on the bundled demo's shape (12 layers x 144 tokens)
SHIPPED_SCHEDULES = ("fitprune_demo.json",)
#: the binary search on ``alpha`` stops when its interval is this narrow (the official ``0.01 + 1e-6``)
ALPHA_TOLERANCE = 0.01 + 1e-6


# ----- the score ------------------------------------------------------------------------------------------


def fitprune_scores(text_probs: Tensor, visual_probs: Tensor) -> Tensor:
    """(n,) self-attention times cross-attention of each alive visual token, heads reduced by their maximum.

    Args:
        text_probs: (H, T, n) attention probabilities of the text rows after the image to the visual tokens.
        visual_probs: (H, n, n) those of the visual rows (causal), softmax over every key.

    Self-attention: the column sums of the head-max visual block divided by ``n``; cross-attention: the column
    sums of the head-max text rows (the official code's ``attn_self_attention``, ``attn_cross_attention``).
    """
    visual = visual_probs.float().amax(dim=0)
    cross = text_probs.float().amax(dim=0).sum(dim=0)
    return cross * (visual / visual.shape[0]).sum(dim=0)


# ----- fitted schedule files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FittedSchedule:
    """One fitted schedule: ``removed[l]`` visual tokens leave after the attention of decoder layer ``l``.

    ``label`` says what it was fitted for (the official FLOP reduction, or a prune-audit budget); ``alpha`` is the
    attention share the fit settled on (None for the official tables).
    """

    label: str
    removed: tuple[int, ...]
    alpha: float | None = None

    def stages(self, num_visual: int) -> list[Stage]:
        """The schedule as stages: the tokens removed after layer ``l`` are absent from the input of ``l + 1``."""
        stages, alive = [], num_visual
        for layer, count in enumerate(self.removed[:-1]):  # removals after the last layer change no input
            if count:
                alive = max(alive - count, 0)
                stages.append(Stage(layer + 1, alive))
        return stages

    def average(self, num_visual: int) -> float:
        """The realised layer-average number of visual tokens."""
        return average_visual_tokens(self.stages(num_visual), len(self.removed), num_visual)


@dataclass(frozen=True)
class FittedSchedules:
    """The schedules of one schedule file, fitted on a model of ``num_layers`` x ``num_visual`` tokens."""

    num_layers: int
    num_visual: int
    schedules: tuple[FittedSchedule, ...]
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def by_budget(self) -> dict[int, FittedSchedule]:
        """Each schedule keyed by its realised layer average, rounded (the budget it stands for)."""
        return {round(s.average(self.num_visual)): s for s in self.schedules}


def schedules_json(fitted: FittedSchedules) -> str:
    """The JSON text of ``fitted`` (what :func:`load_schedules` reads)."""
    entries = [
        {
            "label": s.label,
            "alpha": s.alpha,
            "average": round(s.average(fitted.num_visual), 4),
            "removed": list(s.removed),
        }
        for s in fitted.schedules
    ]
    document = {
        "format": SCHEDULE_FORMAT,
        "version": SCHEDULE_VERSION,
        "num_layers": fitted.num_layers,
        "num_visual": fitted.num_visual,
        "schedules": entries,
        "provenance": dict(fitted.provenance),
    }
    return json.dumps(document, indent=1) + "\n"


def parse_schedules(document: Any, where: str) -> FittedSchedules:
    """The schedules of a parsed schedule file; ValueError (one line naming ``where``) when malformed."""

    def refuse(problem: str) -> ValueError:
        return ValueError(
            f"{where} is not a FitPrune schedule file: {problem}; write one with prune-audit fitprune fit"
        )

    if not isinstance(document, dict) or document.get("format") != SCHEDULE_FORMAT:
        raise refuse(f"'format' is not {SCHEDULE_FORMAT!r}")
    if document.get("version") != SCHEDULE_VERSION:
        raise refuse(f"version {document.get('version')!r}, this prune-audit reads version {SCHEDULE_VERSION}")
    layers, visual = document.get("num_layers"), document.get("num_visual")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (layers, visual)):
        raise refuse("num_layers and num_visual must be positive integers")
    entries = document.get("schedules")
    if not isinstance(entries, list) or not entries:
        raise refuse("'schedules' must be a non-empty list")
    schedules = []
    for index, entry in enumerate(entries):
        removed = entry.get("removed") if isinstance(entry, dict) else None
        if not isinstance(removed, list) or len(removed) != layers:
            raise refuse(f"schedule {index}'s 'removed' must list one count per layer ({layers})")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in removed) or sum(removed) > visual:
            raise refuse(f"schedule {index}'s 'removed' must be non-negative integers summing to at most {visual}")
        alpha = entry.get("alpha")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
            raise refuse(f"schedule {index}'s 'alpha' must be a number or null")
        schedules.append(FittedSchedule(str(entry.get("label", index)), tuple(removed), alpha))
    provenance = document.get("provenance", {})
    return FittedSchedules(layers, visual, tuple(schedules), provenance if isinstance(provenance, dict) else {})


_LOADED: dict[str, FittedSchedules] = {}


def load_schedules(path: str) -> FittedSchedules:
    """The schedule file at ``path``, read once per path (a one-line error when unreadable or malformed)."""
    if path not in _LOADED:
        from prune_audit.safety.inputs import loads_json, read_input

        text = read_input(path, "FitPrune schedule file", "pass a file written by prune-audit fitprune fit")
        _LOADED[path] = parse_schedules(loads_json(text, path), path)
    return _LOADED[path]


def shipped_schedules(num_layers: int, num_visual: int) -> FittedSchedules:
    """The shipped schedules for a model of this shape: the demo's fitted ones on 12 x 144, else the official
    LLaVA-1.5-7B tables."""
    for name in (*SHIPPED_SCHEDULES, OFFICIAL_SCHEDULES):
        key = f"shipped:{name}"
        if key not in _LOADED:
            text = resources.files("prune_audit.assets").joinpath(name).read_text(encoding="utf-8")
            _LOADED[key] = parse_schedules(json.loads(text), f"the shipped {name}")
        if (_LOADED[key].num_layers, _LOADED[key].num_visual) == (num_layers, num_visual):
            return _LOADED[key]
    return _LOADED[f"shipped:{OFFICIAL_SCHEDULES}"]


# ----- the selector ---------------------------------------------------------------------------------------


@register
@dataclass
class FitPruneSelector(ScheduledSelector):
    """FitPrune (Ye et al., "Fit and Prune: Fast and Training-free Visual Token Pruning for Multi-modal Large
    Language Models", AAAI 2025; ywh187/FitPrune, LLaVA_1.5 code at commit 36bb1160 read).

    Score after the attention of a pruning layer (``signal_layer="previous"``: the tokens leave from the next
    layer's input, which is the official removal after attention, before ``o_proj`` and the MLP of the same
    layer; those act per token, so the kept tokens see the same values): :func:`fitprune_scores`, the product
    of the head-max self-attention (visual rows, column sums / n) and cross-attention (text rows after the image,
    column sums); the lowest leave. Original positions are kept (the official code slices ``position_ids``).

    Schedule: a fitted schedule file (``schedule_file``; none: the shipped schedules for the model's shape: those
    fitted on the bundled demo for 12 layers x 144 tokens, else the official LLaVA-1.5-7B ``delete_scheme`` tables
    for FLOP reductions 10..90 %, realised layer averages 541..73 of 576 tokens). ``budget_rule="paper"``: the file's
    own counts, for the model shape it was fitted on, the budget naming one of its schedules by its realised
    average. ``budget_rule="average"`` (default): the schedule nearest the budget (as a share of the tokens)
    gives the shape, its layers scaled to the model's depth, counts solved so the layer average is the budget
    (the prune-audit convention, derived).

    Deviations: ties to the lower index among equal products (the official ``torch.sort`` order is unspecified);
    prefill-only (the official code prunes in the prefill too); float32 scores (the official code ranks fp16
    attention).
    """

    name: ClassVar[str] = "fitprune"
    summary: ClassVar[str] = "self x cross attention (head max) by a per-layer schedule fitted on calibration data"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "visual_probs"})
    reference: ClassVar[Reference] = Reference(
        "Fit and Prune: Fast and Training-free Visual Token Pruning for Multi-modal Large Language Models, AAAI 2025",
        "ywh187/FitPrune",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "36bb1160",
        "the shipped schedule for the model's shape (the demo's fitted, else the official LLaVA-1.5-7B) nearest the "
        "budget, counts solved to the budget average",
        ("budget_rule=paper",),
        (
            "budget_rule=average rescales the official (or fitted) schedule to the requested layer average; the "
            "official code runs its fitted tables as they are (budget_rule=paper, budgets = their realised averages)",
            "the fit (prune-audit fitprune fit) reads attention statistics of one unpruned prefill per question; "
            "the official fit recomputes each layer's attention on the pruned hidden states for every alpha, and "
            "counts FLOPs with LLaVA-1.5-7B's widths where prune-audit counts the layer-average visual tokens",
            "float32 scores, ties to the lower index (the official code sorts fp16 head-max attention)",
        ),
        random_agreement(
            30,
            "tests/pruners/test_fitprune.py::test_scores_reproduce_the_official_deletion",
            "the fit equals the official search on the same statistics "
            "(tests/pruners/test_fitprune.py::test_fit_reproduces_the_official_search)",
        ),
        30,
    )

    flops_exact: ClassVar[bool] = True  # head maxima, column sums and one product per token: no matrix products

    signal_layer = "previous"  # the attention of the layer the tokens leave after (not an option)
    schedule_file: str | None = option(
        None,
        Text(optional=True),
        "a schedule file from prune-audit fitprune fit; none: the shipped one for the model's shape",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.schedule_file is not None:  # read now: a missing or malformed file is refused before any run
            load_schedules(self.schedule_file)

    def fitted(self, num_layers: int, num_visual: int) -> FittedSchedules:
        """The schedule file, or the shipped schedules for this model shape."""
        if self.schedule_file is None:
            return shipped_schedules(num_layers, num_visual)
        return load_schedules(self.schedule_file)

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        fitted = self.fitted(num_layers, num_visual)
        if budget >= num_visual:
            return self.solved_stages(num_layers, num_visual, budget)
        if (num_layers, num_visual) != (fitted.num_layers, fitted.num_visual):
            raise ValueError(
                f"fitprune's schedules were fitted on {fitted.num_layers} layers x {fitted.num_visual} tokens, not "
                f"{num_layers} x {num_visual}; fit one on this model (prune-audit fitprune fit) or use "
                f"budget_rule='average'"
            )
        budgets = fitted.by_budget()
        if budget not in budgets:
            valid = ", ".join(f"{b} ({budgets[b].label})" for b in sorted(budgets))
            raise ValueError(
                f"fitprune with budget_rule='paper' defines budgets {valid} only on {num_layers} layers x "
                f"{num_visual} tokens; use budget_rule='average' for a budget of {budget}"
            )
        return budgets[budget].stages(num_visual)

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        fitted = self.fitted(num_layers, num_visual)
        shapes = {
            round(b * 576 / fitted.num_visual): s.stages(fitted.num_visual) for b, s in fitted.by_budget().items()
        }
        shapes = {b: stages for b, stages in shapes.items() if stages}
        if not shapes:
            raise ValueError(f"{self.schedule_file} removes no token in any schedule; fit it with a smaller budget")
        stages = nearest_setting(shapes, min(budget, num_visual - 1), num_visual)
        layers, counts = merge_stages(
            scale_layers([s.layer for s in stages], fitted.num_layers, num_layers), [s.keep for s in stages]
        )
        return solve_schedule(layers, [float(c) for c in counts], num_layers, num_visual, budget)

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        return fitprune_scores(signals.text_probs, signals.visual_probs)


# ----- the fit --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionStatistics:
    """One calibration question's attention over the unpruned prompt, per decoder layer but the last (a token
    removed after the last layer's attention leaves no later input), on a model of L layers.

    Attributes:
        cross: (L - 1, N) head-max attention of the text rows after the image to each visual token, summed over
            the rows and divided by their number (the official ``weightsum_cross`` before its sum over tokens).
        visual: (L - 1, N, N) head-max attention of the visual rows (queries) to the visual tokens (keys).
    """

    cross: Tensor
    visual: Tensor


@dataclass(frozen=True)
class FitResult:
    """The fitted counts (``removed[l]`` after the attention of layer ``l``), the ``alpha`` they come from and
    whether that last search step met the budget."""

    removed: tuple[int, ...]
    alpha: float
    reached: bool


def deletion_count(values: Tensor, full_sum: float, alpha: float) -> int:
    """How many of the smallest ``values`` may go while the rest keeps ``(1 - alpha)`` of ``full_sum``.

    The official loop: the first ``i`` (0..n) whose remainder after dropping the ``i`` smallest falls below
    ``full_sum (1 - alpha)``, minus one, at least 0. Where none does the official code reuses a stale count; here
    the loop runs on to ``i = n`` (remainder 0), which gives ``n - 1`` for a positive target.
    """
    ordered = torch.sort(values, stable=True).values
    total = values.sum()
    dropped = torch.cat([ordered.new_zeros(1), torch.cumsum(ordered, dim=0)])  # sum of the i smallest, i = 0..n
    below = torch.nonzero(total - dropped < full_sum * (1 - alpha)).flatten()
    first = int(below[0]) if below.numel() else values.numel() + 1
    return max(first - 1, 0)


def _one_layer(stats: AttentionStatistics, layer: int, alive: Tensor, alpha: float) -> Tensor:
    """(k,) the positions among ``alive`` both attention kinds agree to remove at ``layer``."""
    cross = stats.cross[layer, alive].float()
    block = stats.visual[layer][alive][:, alive].float()
    own = (block / alive.numel()).sum(dim=0)
    full_cross = float(stats.cross[layer].float().sum())
    full_self = float(stats.visual[layer].float().sum()) / stats.visual.shape[-1]
    by_cross = torch.sort(cross, stable=True).indices[: deletion_count(cross, full_cross, alpha)]
    by_self = torch.sort(own, stable=True).indices[: deletion_count(own, full_self, alpha)]
    return by_cross[torch.isin(by_cross, by_self)]


def fit_for_alpha(statistics: Sequence[AttentionStatistics], budget: float, alpha: float) -> tuple[bool, list[int]]:
    """One pass of the official ``fit_model`` at ``alpha``: (budget reached, removed per layer).

    Layer by layer, while the forecast layer average of visual tokens (inputs so far, and the current count for
    every layer left) over the questions is above ``budget``, each question removes the tokens in both of its
    deletion sets; the per-layer counts are summed over the questions and floor-divided by their number.
    """
    rows, num_visual = statistics[0].cross.shape
    num_layers = rows + 1
    alive = [torch.arange(num_visual) for _ in statistics]
    used = [0] * len(statistics)  # visual tokens in the inputs of the layers so far
    removed = [0] * num_layers
    for layer in range(num_layers):
        forecast = sum(u + (num_layers - layer) * a.numel() for u, a in zip(used, alive)) / len(statistics)
        if forecast <= budget * num_layers:
            return True, [count // len(statistics) for count in removed]
        if layer == rows:  # the last layer: its removals would change no input
            break
        for index, stats in enumerate(statistics):
            used[index] += alive[index].numel()
            gone = _one_layer(stats, layer, alive[index], alpha)
            removed[layer] += int(gone.numel())
            keep = torch.ones(alive[index].numel(), dtype=torch.bool)
            keep[gone] = False
            alive[index] = alive[index][keep]
    return False, [count // len(statistics) for count in removed]


def fit_schedule(statistics: Sequence[AttentionStatistics], budget: float) -> FitResult:
    """The official binary search: ``alpha`` in [0, 1] halved until the interval is ``ALPHA_TOLERANCE`` narrow,
    down when a pass reaches ``budget`` (layer-average visual tokens), up when not; the last pass's counts.

    Raises ValueError for no statistics, statistics of different shapes, or a budget outside (0, N).
    """
    if not statistics:
        raise ValueError("no attention statistics to fit on; give at least one calibration question")
    shape = statistics[0].cross.shape
    for stats in statistics:
        if stats.cross.shape != shape or stats.visual.shape != (*shape, shape[1]):
            raise ValueError("attention statistics of different model shapes; fit each model on its own")
    if not 0 < budget < shape[1]:
        raise ValueError(f"budget {budget} must lie between 0 and the {shape[1]} visual tokens, exclusive")
    low, high = 0.0, 1.0
    reached, removed, middle = False, [0] * (shape[0] + 1), 0.5
    while high - low > ALPHA_TOLERANCE:
        middle = (low + high) / 2
        reached, removed = fit_for_alpha(statistics, budget, middle)
        low, high = (low, middle) if reached else (middle, high)
    return FitResult(tuple(removed), middle, reached)


def budget_for_fit(budget: int, num_visual: int) -> int:
    """``budget`` checked for a fit on ``num_visual`` tokens (ValueError naming the fix)."""
    budget = validate_budget(budget)
    if budget >= num_visual:
        raise ValueError(f"budget {budget} keeps all {num_visual} visual tokens; fit a budget below {num_visual}")
    return budget


def statistics_from_probs(text_probs: Tensor, visual_probs: Tensor) -> tuple[Tensor, Tensor]:
    """One layer's statistics from its attention: ((N,) cross, (N, N) visual), heads reduced by their maximum.

    Args:
        text_probs: (H, T, N) attention of the text rows after the image to the visual tokens.
        visual_probs: (H, N, N) attention of the visual rows to the visual tokens.
    """
    cross = text_probs.float().amax(dim=0).sum(dim=0) / text_probs.shape[1]
    return cross, visual_probs.float().amax(dim=0)
