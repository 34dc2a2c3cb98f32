"""Signals, selections and the two selector base classes.

Selectors are pure tensor code: they never import transformers. Model adapters
(``prune_audit.models``) compute the signals a selector declares in ``requires``
and apply the returned selection. Following NVIDIA/kvpress, a method usually only
*scores* tokens; the base classes own validation, float32 promotion, top-k with
ties broken by the lower index, and the ascending order of the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.options import Choice, check_options, option
from prune_audit.pruners.precision import MODEL_ATTENTIONS, as_float32, cls_probabilities, rounded_to
from prune_audit.pruners.ranking import TOP_K_TIES, ranked_indices, top_k_indices
from prune_audit.pruners.signals import VISION_LAYER_SIGNALS, VISION_TOWER_FACTS, InputSignals, LayerSignals

if TYPE_CHECKING:  # the fidelity table reads the registry, which imports this module
    from prune_audit.pruners.fidelity import Fidelity


#: where a selector acts: before the language model or inside it
SelectorLevel = Literal["input", "llm"]
PositionMode = Literal["keep_original", "compact"]


@dataclass(frozen=True)
class Reference:
    """Where a selector comes from: paper and public repository."""

    paper: str
    repository: str
    note: str = ""


#: the stage state's kinds of the tokens an input-level selection fed, in output order (a kept cell's own token: the
#: cell; another: its merged kind), which the prefill adds beside a non-empty ``Selection.llm_state``: positions
#: among the tokens fed name the alive tokens carrying those kinds (whose order in the sequence may differ)
FED_KINDS = "fed_kinds"


@dataclass
class Selection:
    """Result of an input-level selector for one image.

    Attributes:
        kept: (k,) ascending unique grid indices whose own token is passed on.
        sources: for merging methods, one LongTensor per output token: the grid
            indices that token carries (empty for a token without grid location,
            such as VisionZip's CLS). ``None`` means output tokens are ``kept``.
        vision_tokens: for merging methods, (M, Dv) pre-projector tokens that replace
            the kept vision features, in output order (M == len(sources)).
        llm_tokens: for merging methods that merge after the projector, (M, D) tokens in the
            language model's input space instead of ``vision_tokens`` (exactly one of the two
            is set when ``sources`` is).
        in_output_order: the output tokens are laid out in their order, without the family's own image
            layout (row newlines): VisionZip's per-crop arrangement (``pruners.crop_merge``).
        tower_stages: for a selector that cuts inside the vision tower, ``(stage layer, kept cells)`` of each cut
            in order, the stage layer ``l - Lv`` (< 0) for a cut after tower layer ``l`` of the ``Lv`` run; the
            record's stages, before ``kept`` at the input (stage 0).
        tower_crop_merges: for a selector that cuts inside a tower run on each crop alone, every crop cutting as
            many (FlowCut's anyres stage), the patches each crop loses in each tower layer of the run (empty: no
            such run); the accounting's, as ``tower_stages`` record the visible cells only.
        llm_state: what an in-LLM selector's own tower stage (``LayerSelector.tower_stage``) hands its in-LLM
            stages: the opening of the row's stage state (MustDrop's key set, as positions among the tokens fed).
        work_sizes: the data-dependent sizes the selector's own arithmetic ran on, one tuple per unit of its work
            in the layout its ``flops`` names (FastVID: ``(candidates, context, others)`` of each frame with
            context tokens); the accounting hands them to ``flops`` as ``SelectorWork.sizes``. Empty where the
            arithmetic follows from the budget and the grid alone.
    """

    kept: Tensor
    sources: list[Tensor] | None = None
    vision_tokens: Tensor | None = None
    llm_tokens: Tensor | None = None
    in_output_order: bool = False
    tower_stages: list[tuple[int, Tensor]] = field(default_factory=list)
    tower_crop_merges: tuple[int, ...] = ()
    llm_state: dict[str, Any] = field(default_factory=dict)
    work_sizes: tuple[tuple[int, ...], ...] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.sources) if self.sources is not None else int(self.kept.numel())

    def merged_sources(self) -> list[list[int]]:
        """Ascending grid indices of each output token that is not a kept cell's own token, in output order.

        These are the merged tokens (a VisionZip contextual token: its target and members; one
        without members carries its target alone); tokens without grid location (CLS) are left
        out. Empty when output tokens are ``kept``.
        """
        if self.sources is None:
            return []
        kept = set(self.kept.tolist())
        groups = [sorted(s.tolist()) for s in self.sources if s.numel()]
        return [group for group in groups if not (len(group) == 1 and group[0] in kept)]

    def covered(self) -> Tensor:
        """(m,) ascending grid indices carried by any output token."""
        if self.sources is None:
            return self.kept
        parts = [s for s in self.sources if s.numel()] + [self.kept]
        return torch.unique(torch.cat(parts)) if parts else self.kept


@dataclass
class TokenMerge:
    """Tokens a merging in-LLM selector adds at a stage, inserted after the kept visual tokens.

    Attributes:
        hidden: (M, D) float32 hidden states of the merged tokens, in output order.
        members: M LongTensors: the positions among the stage's alive tokens (0..n-1)
            that each merged token stands for; the executor turns them into grid sources
            (a member that is itself a merged token contributes its own sources).
        replaces: None (inserted after the kept tokens), or (M,) positions among the alive tokens, each
            a kept one, whose layout slot and position ids each merged token takes instead (VScan).
    """

    hidden: Tensor
    members: list[Tensor]
    replaces: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Stage:
    """Prune at the input of decoder layer ``layer`` down to ``keep`` visual tokens."""

    layer: int
    keep: int


def option_defaults(cls: type) -> dict[str, Any]:
    """The declared options of a selector class with their defaults."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def validate_budget(budget: int) -> int:
    if isinstance(budget, bool) or int(budget) != budget or budget < 1:
        raise ValueError(f"budget must be a positive integer number of visual tokens, got {budget!r}")
    return int(budget)


class Selector:
    """Common metadata and signal checking for every selector.

    Subclasses are dataclasses whose fields are their options, each made with
    :func:`~prune_audit.pruners.options.option` (type and domain declared once,
    checked on construction), and set the class attributes below. Register them
    with :func:`prune_audit.pruners.registry.register`.
    """

    name: ClassVar[str] = ""
    stage: ClassVar[SelectorLevel]
    requires: ClassVar[frozenset[str]] = frozenset()
    #: a required signal -> the one it reads instead on a model without it (VScan: received attention on Qwen)
    substitutes: ClassVar[dict[str, str]] = {}
    reference: ClassVar[Reference]
    #: how closely it follows its official code: its row of docs/fidelity.md (None: no row, as a plugin may have)
    fidelity: ClassVar[Fidelity | None] = None
    summary: ClassVar[str] = ""
    #: what it needs of an image's token layout besides its signals (``pruners.layout``; "": nothing); a family that
    #: lacks it refuses it (``models.selector_support``)
    layout_need: ClassVar[str] = ""
    #: whether its official multi-crop code selects in each crop's own grid: refused on the whole image for its
    #: ``layout_need``, it runs there under ``budget_scope=crop``
    per_crop_grid: ClassVar[bool] = False
    #: how it runs on each regular grid of an image of several (``pruners.layout.GRID_*``; "": it does not)
    per_grid: ClassVar[str] = ""
    #: whether :meth:`flops` counts every product the implementation runs (``pruners.arithmetic``); a selector
    #: that states no formula (a plugin) counts zero and is reported as nominal
    flops_exact: ClassVar[bool] = False
    #: whether it is part of a video method though it reads no clip's temporal grid (DyCoke's decode-time KV
    #: pruning): ``run`` takes it on clips, as the selectors that read the grid (``signals.VIDEO_GRID``) and the image
    #: selectors with a per-frame run (``per_frame``); any other is refused there
    clip_method: ClassVar[bool] = False
    #: whether an input selector's algorithm is defined on one frame's tokens and its signals exist on a clip
    #: (features, the layer-0 demand; not the CLS or per-layer vision attention, not the CLIP text space): on a video
    #: clip it runs on each temporal step's h x w tokens alone at an even share of the clip's budget
    #: (``pruners.frame_scope``), a project convention (no official per-frame code), as ``budget_scope=crop`` over
    #: crops. Plain tokens only (a merging selector would merge within a step: none declares it). In-LLM selectors
    #: prune the whole sequence and declare none.
    per_frame: ClassVar[bool] = False

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """FLOPs of the selector's own arithmetic on ``work`` (``select`` / ``prune`` / ``merge``, not its signals)."""
        return 0

    def __post_init__(self) -> None:
        check_options(self)

    @staticmethod
    def requires_on(selector: Selector | type[Selector], available: frozenset[str]) -> frozenset[str]:
        """``selector.requires`` on a model whose input signals are ``available`` (missing ones substituted where
        possible); an instance's own ``requires`` where its options set them (ToMe ``location=tower``)."""
        requires, substitutes = selector.requires, selector.substitutes
        swap = {name: substitutes[name] for name in requires - available if substitutes.get(name) in available}
        return frozenset(swap.get(name, name) for name in requires)

    @property
    def averages_budget(self) -> bool:
        """Whether its in-LLM stages keep the budget as an average over the decoder layers (what "(layer average)"
        beside the budget says); False where an option keeps exactly the budget after a cut or ignores it."""
        return True

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}  # type: ignore[arg-type]  # registered selectors are dataclasses

    def ranking_dtype(self, model_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the official code ranks the scores in: the model's half dtype under ``score_dtype="model"``."""
        model = getattr(self, "score_dtype", "float32") == "model" and model_dtype not in (None, torch.float32)
        return model_dtype if model else None

    def _check_signals(self, signals: Any, requires: frozenset[str] | None = None) -> None:
        """Raise a one-line ValueError naming the signals of ``requires`` (default ``self.requires``) missing."""
        requires = self.requires if requires is None else requires
        given = {r for r in requires if getattr(signals, self.substitutes.get(r, r), None) is not None}
        missing = sorted(r for r in requires - given if getattr(signals, r, None) is None)
        if missing:
            raise ValueError(
                f"selector {self.name!r} needs the signal(s) {', '.join(missing)}, "
                f"which the model did not provide; choose a selector that needs only available signals"
            )


BUDGET_SCOPES = ("image", "crop")


@dataclass
class BudgetScoped:
    """The budget scope every input selector shares (one option, declared once).

    ``image`` (default): one budget over all of an image's visual tokens. ``crop``: on a family whose
    image is several crops (LLaVA-NeXT's base view and tiles, InternVL's tiles and thumbnail), the budget is split evenly over the crops
    and the selector runs on each crop's tokens alone (:func:`~prune_audit.pruners.crop_scope.select_per_crop`),
    the official LLaVA-NeXT convention of VisionZip, CDPruner and FasterVLM; refused on one-crop families.
    """

    budget_scope: str = option(
        "image",
        Choice(BUDGET_SCOPES),
        "one budget over the image's tokens, or split evenly over its crops (LLaVA-NeXT, InternVL tiles)",
    )


class InputSelector(Selector, BudgetScoped):
    """A selector that runs before the language model, once per image.

    ``fills_budget``: whether it feeds exactly ``min(budget, N)`` tokens; False for one that
    feeds at most the budget by construction (pooling feeds the largest pooled grid within it).
    ``merges``: whether it feeds merged tokens (``Selection.sources``), which only a model that
    renumbers positions after selection can place.
    """

    stage: ClassVar[SelectorLevel] = "input"
    fills_budget: ClassVar[bool] = True
    merges: ClassVar[bool] = False
    #: whether, on a family that resizes images for it (``VisionLanguageModel.resizes_images``), it acts on the
    #: image before the processor (:meth:`resized_image_size`) rather than on the tower's tokens
    resizes_image: ClassVar[bool] = False
    ties: str = "lower"  # top-k selectors declare it as an option (TOP_K_TIES)
    score_dtype: str = "float32"

    def _checked_clip(self, signals: InputSignals, budget: int) -> tuple[int, tuple[int, int, int]]:
        """(budget, (T, h, w)) of a video selector's request: the budget validated, its signals present, and the
        clip's ``video_grid`` holding exactly ``signals.num_tokens`` tokens (one-line ValueError otherwise)."""
        budget = validate_budget(budget)
        self._check_signals(signals)
        steps, rows, cols = signals.video_grid  # checked present above
        if steps * rows * cols != signals.num_tokens:
            raise ValueError(f"video grid {steps}x{rows}x{cols} does not hold the clip's {signals.num_tokens} tokens")
        return budget, (steps, rows, cols)

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """Choose ``budget`` output tokens out of ``signals.num_tokens``."""
        budget = validate_budget(budget)
        self._check_signals(signals)
        n = signals.num_tokens
        if budget >= n:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        return self._select(signals, budget, generator)

    def resized_image_size(
        self, image_size: tuple[int, int], budget: int, tokens_of: Callable[[tuple[int, int]], int]
    ) -> tuple[int, int]:
        """(width, height) to resize an image of ``image_size`` to before the processor, so that its token count
        ``tokens_of((width, height))`` fits ``budget`` (selectors with ``resizes_image``)."""
        raise NotImplementedError(f"{type(self).__name__} does not act on the image")

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        scores = self.score(signals, generator)
        return Selection(kept=top_k_indices(scores, budget, self.ties, self.ranking_dtype(signals.model_dtype)))

    def score(self, signals: InputSignals, generator: torch.Generator | None) -> Tensor:
        """(N,) float32 importance; higher is kept first. Greedy methods override ``_select``."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() or _select()")


class LayerSelector(Selector):
    """A selector that prunes inside the language model at the stages of its schedule."""

    stage: ClassVar[SelectorLevel] = "llm"
    positions: PositionMode = "keep_original"
    signal_layer: str = "current"  # "previous": attention/keys of layer l-1 score a stage at layer l
    score_dtype: str = "float32"  # "model": attention formed in, other inputs and scores rounded to the model dtype
    ties: str = "lower"  # top-k selectors declare it as an option (TOP_K_TIES)
    model_attention: str = "eager"  # the attention recipe under score_dtype="model" (MODEL_ATTENTIONS)
    attention_rope: str = "applied"  # "skipped": attention signals from unrotated q and k (VScan's Qwen code)
    #: whether decoding attends, from the first stage's scoring layer on, only to the visual tokens the last stage
    #: keeps (MustDrop's decode stage: its KV cache of those layers sliced to them), not to those each layer ran on
    decode_keeps_final: ClassVar[bool] = False
    #: with ``decode_keeps_final``: from the first decoder layer on (PruneVid's cache of every layer up to the
    #: stage sliced to its survivors), not from the first stage's scoring layer
    decode_keeps_final_everywhere: ClassVar[bool] = False
    #: the option that turns :meth:`tower_stage` off (``KEY=VALUE``), named where a composed selector refuses it
    tower_stage_off: ClassVar[str] = ""

    @property
    def schedule_follows_tower(self) -> bool:
        """Whether its schedule is solved on what its own tower stage feeds each image, which planning does not know
        (FlowCut's: none where that stage holds the budget; MustDrop's merged windows): no schedule is planned ahead,
        each record holds its stages."""
        return False

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """Stages in increasing layer order with non-increasing ``keep``."""
        raise NotImplementedError

    def tower_stage(self) -> InputSelector | None:
        """The input-level stage this selector runs itself before the language model, inside the vision tower
        (MustDrop's window merge), as the input part of a composed selector runs; None (the default): none."""
        return None

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(keep,) ascending positions among the alive tokens (0..n-1) that survive ``stage``."""
        self._check_signals(signals)
        n = signals.num_alive
        if stage.keep >= n:
            return torch.arange(n, dtype=torch.long)
        if stage.keep <= 0:
            return torch.zeros(0, dtype=torch.long)
        scores = self.model_precision(self.score(stage, self.inputs(signals), state), signals)
        return top_k_indices(scores, stage.keep, self.ties, self.ranking_dtype(signals.model_dtype))

    def merge(self, stage: Stage, signals: LayerSignals, state: dict[str, Any], kept: Tensor) -> TokenMerge | None:
        """Tokens to add after ``kept`` (positions among the alive tokens) survive ``stage``; None: none.

        Only merging selectors (SparseVLM with ``recycle=true``) override this; the
        executor calls it right after :meth:`prune` with the same signals and state.
        """
        return None

    def inputs(self, signals: LayerSignals) -> LayerSignals:
        """The signals as the scores see them: rounded to the model dtype under ``score_dtype="model"``."""
        return signals.rounded() if self.score_dtype == "model" else signals

    def model_precision(self, scores: Tensor, signals: LayerSignals) -> Tensor:
        """``scores`` rounded to the model dtype under ``score_dtype="model"`` (ties then go to the lower index)."""
        if self.score_dtype == "model" and signals.model_dtype is not None:
            return scores.to(signals.model_dtype).float()
        return scores

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(n,) float32 importance of the alive tokens; higher survives."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() or prune()")


__all__ = [
    "InputSignals", "LayerSignals", "VISION_LAYER_SIGNALS", "VISION_TOWER_FACTS", "Selection", "Stage", "TokenMerge",
    "SelectorLevel", "Reference", "Selector", "FED_KINDS", "InputSelector", "LayerSelector", "top_k_indices", "TOP_K_TIES",
    "MODEL_ATTENTIONS", "ranked_indices", "validate_budget", "option_defaults", "as_float32", "cls_probabilities", "rounded_to",
]  # fmt: skip
