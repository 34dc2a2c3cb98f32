"""Signals, selections and the two selector base classes.

Selectors are pure tensor code: they never import transformers. Model adapters
(``prune_audit.models``) compute the signals a selector declares in ``requires``
and apply the returned selection. Following NVIDIA/kvpress, a method usually only
*scores* tokens; the base classes own validation, float32 promotion, top-k with
ties broken by the lower index, and the ascending order of the result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from prune_audit.pruners.options import Choice, check_options, option
from prune_audit.pruners.precision import MODEL_ATTENTIONS, as_float32, cls_probabilities, rounded_to
from prune_audit.pruners.ranking import TOP_K_TIES, ranked_indices, top_k_indices


# InputSignals an in-LLM selector may read, per token (with their model-dtype twins where the adapter has them)
VISION_LAYER_SIGNALS = frozenset({"layer_cls_attention", "layer_attention"})
VISION_TOWER_FACTS = frozenset({"vision_tower", "full_attention_layers"})  # InputSignals that travel with them

#: where a selector acts: before the language model or inside it
SelectorLevel = Literal["input", "llm"]
PositionMode = Literal["keep_original", "compact"]


@dataclass(frozen=True)
class Reference:
    """Where a selector comes from: paper and public repository."""

    paper: str
    repository: str
    note: str = ""


@dataclass
class InputSignals:
    """Signals for one image before the language model (no batch dimension).

    Attributes:
        grid: (rows, cols) of the visual token grid; N = rows * cols, row-major.
        features: (N, D) projector outputs (LLM input space).
        vision_features: (N, Dv) vision features at the feature layer (pre-projector).
        cls_attention: (H, N) CLS-token attention probabilities to the patches at the
            feature layer, not renormalised.
        cls_logits: (H, N + 1) the CLS row's attention logits as the official code forms
            them in the model dtype (query scaled in it, CLS at index 0); with a half
            ``model_dtype``, ``score_dtype="model"`` takes the probabilities from these
            (:func:`cls_probabilities`).
        vision_keys: (H, N + 1, d) that layer's keys, CLS at index 0.
        cls_feature: (Dv,) the CLS hidden state at the feature layer.
        text_relevance: (N,) CDPruner relevance before normalisation.
        model_text_relevance: (N,) the same as the official code computes it in the model dtype (unit
            embeddings, cosines and their mean each rounded to it; a float32 tensor); with a half
            ``model_dtype``, ``score_dtype="model"`` normalises this one (adapters of half models pass it).
        demand: (N,) demand weights for coverage selection (first-layer probe).
        layer_attention: (Lv, N) per encoder layer run (the feature layer's last): attention each patch gets,
            mean over heads and all 1 + N query rows (HiPrune); layer_cls_attention: the CLS row's (VScan).
            On Qwen2.5-VL every block, each merged token's mean over its 4 patches (``models.qwen``).
        model_layer_attention, model_layer_cls_attention: the same as the official code forms them in a half
            model's dtype (softmax and each mean rounded to it; float32 tensors), passed by half LLaVA adapters;
            ``score_dtype="model"`` reads these (HiPrune, VScan).
        vision_tower: the tower the per-layer signals come from (``"clip"`` or ``"qwen2_5_vl"``): which
            official layer numbers a per-layer selector uses (HiPrune).
        full_attention_layers: rows of ``layer_attention`` of full-attention blocks (Qwen's ``fullatt_block_indexes``).
        merging_tower: ``f(merge) -> (states (1 + M, Dv), sources)``: the tower rerun to the feature layer with
            ``merge`` between attention and MLP of each layer (ToMe's :class:`~prune_audit.pruners.tome.TowerMerging`).
        model_dtype: the dtype the model computes the signals in (the adapters pass the
            model's dtype; float32 for hand-built signals); ``score_dtype="model"`` rounds to it.
    """

    grid: tuple[int, int]
    features: Tensor | None = None
    vision_features: Tensor | None = None
    cls_attention: Tensor | None = None
    cls_logits: Tensor | None = None
    vision_keys: Tensor | None = None
    cls_feature: Tensor | None = None
    text_relevance: Tensor | None = None
    model_text_relevance: Tensor | None = None
    demand: Tensor | None = None
    layer_attention: Tensor | None = None
    layer_cls_attention: Tensor | None = None
    model_layer_attention: Tensor | None = None
    model_layer_cls_attention: Tensor | None = None
    vision_tower: str = "clip"
    full_attention_layers: tuple[int, ...] = ()
    merging_tower: Callable[[Any], tuple[Tensor, list[Tensor]]] | None = None
    model_dtype: torch.dtype = torch.float32

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def subset(self, tokens: Tensor, grid: tuple[int, int] | None = None) -> InputSignals:
        """The signals of the visual tokens ``tokens`` ((M,) ascending indices) alone, laid on ``grid``
        ((rows, cols) with rows x cols = M, row-major; default one (1, M) row).

        Per-token tensors are sliced along their token axis (``cls_logits`` and ``vision_keys`` keep the CLS
        at index 0); image-level ones (``cls_feature``, the tower facts) stay. The merging tower reruns the
        whole image, so it does not come along.
        """
        with_cls = torch.cat([tokens.new_zeros(1), tokens + 1])
        token_axis = {  # signal -> (its token axis, the indices along it)
            **dict.fromkeys(("features", "vision_features", "text_relevance", "model_text_relevance", "demand"),
                            (0, tokens)),
            **dict.fromkeys(("cls_attention", "layer_attention", "layer_cls_attention", "model_layer_attention",
                             "model_layer_cls_attention"), (1, tokens)),
            **dict.fromkeys(("cls_logits", "vision_keys"), (1, with_cls)),
        }
        sliced = {}
        for name, (axis, index) in token_axis.items():
            value = getattr(self, name)
            sliced[name] = None if value is None else value.index_select(axis, index.to(value.device))
        grid = grid or (1, int(tokens.numel()))
        if grid[0] * grid[1] != tokens.numel():
            raise ValueError(f"a {grid[0]}x{grid[1]} grid cannot hold {tokens.numel()} tokens")
        return dataclasses.replace(self, grid=grid, merging_tower=None, **sliced)


@dataclass
class LayerSignals:
    """Signals at the input of one decoder layer, for the visual tokens still alive.

    Attention and key signals (``text_logits``, ``text_probs``, ``key_norms``,
    ``text_key_norms``) come from layer ``layer`` itself, or from layer ``layer - 1``
    on its own input when the selector's ``signal_layer`` is ``"previous"`` (what that
    layer computed: the token set is the same). ``n`` alive visual tokens, ``T`` text
    tokens after the image span (the question and the chat-template suffix; the last
    one is the last prompt position), ``H`` query heads.

    Attributes:
        alive: (n,) original grid indices of the alive visual tokens, ascending; tokens a
            merging selector inserted at an earlier stage follow them, as negative codes
            (their sources are in the records, not here).
        grid: (rows, cols) of the original token grid.
        layer: index of the decoder layer whose input this is.
        num_layers: decoder depth.
        text_logits: (H, T, n) pre-softmax logits q_t . k_n / sqrt(d) of the text rows
            to the alive visual keys, RoPE applied as the layer applies it.
        text_probs: (H, T, n) attention probabilities of the text rows, softmax in
            float32 over every key the row sees, sliced to the visual columns.
        hidden_states: (n, D) layer input of the alive visual tokens.
        previous_hidden_states: (n, D) input of the previous layer for the same tokens.
        text_hidden_states: (T, D) layer input of the text tokens.
        normed_hidden_states: (n, D) the model's final norm applied to ``hidden_states``.
        text_normed_hidden_states: (T, D) the same for the text tokens.
        key_norms: (n,) L1 norm of the post-RoPE keys (all heads concatenated).
        text_key_norms: (T,) the same for the text tokens.
        embeddings: (n, D) LLM input embeddings of the alive visual tokens.
        text_embeddings: (T, D) LLM input embeddings of the text tokens.
        sequence_index: (n,) index of each alive visual token in the unpruned prompt.
        text_sequence_index: (T,) the same for the text tokens.
        layer_cls_attention: (Lv, n) ``InputSignals.layer_cls_attention`` of each alive token's cell (NaN: merged);
            model_layer_cls_attention: its twin; layer_attention, vision_tower, full_attention_layers: as such.
        rope_ones_logits: (T, n) ``q.k / sqrt(d)`` of all-ones q and k under the layer's RoPE there (SparseVLM v2).
        model_dtype: the dtype the model computes in (None: float32).
    """

    alive: Tensor
    grid: tuple[int, int]
    layer: int
    num_layers: int
    text_logits: Tensor | None = None
    text_probs: Tensor | None = None
    hidden_states: Tensor | None = None
    previous_hidden_states: Tensor | None = None
    text_hidden_states: Tensor | None = None
    normed_hidden_states: Tensor | None = None
    text_normed_hidden_states: Tensor | None = None
    key_norms: Tensor | None = None
    text_key_norms: Tensor | None = None
    embeddings: Tensor | None = None
    text_embeddings: Tensor | None = None
    sequence_index: Tensor | None = None
    text_sequence_index: Tensor | None = None
    layer_cls_attention: Tensor | None = None
    model_layer_cls_attention: Tensor | None = None
    layer_attention: Tensor | None = None
    vision_tower: str = "clip"
    full_attention_layers: tuple[int, ...] = ()
    rope_ones_logits: Tensor | None = None
    model_dtype: torch.dtype | None = None

    @property
    def num_alive(self) -> int:
        return int(self.alive.numel())

    def rounded(self) -> LayerSignals:
        """A copy whose float signals are rounded to ``model_dtype`` (kept as float32 tensors)."""
        if self.model_dtype is None:
            return self
        rounded = {
            f.name: value.to(self.model_dtype).float()
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), Tensor) and value.is_floating_point()
        }
        return dataclasses.replace(self, **rounded)


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
    """

    kept: Tensor
    sources: list[Tensor] | None = None
    vision_tokens: Tensor | None = None
    llm_tokens: Tensor | None = None

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
    summary: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def requires_on(cls, available: frozenset[str]) -> frozenset[str]:
        """``requires`` on a model whose input signals are ``available`` (missing ones substituted where possible)."""
        swap = {name: cls.substitutes[name] for name in cls.requires - available if cls.substitutes.get(name) in available}
        return frozenset(swap.get(name, name) for name in cls.requires)

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def ranking_dtype(self, model_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the official code ranks the scores in: the model's half dtype under ``score_dtype="model"``."""
        model = getattr(self, "score_dtype", "float32") == "model" and model_dtype not in (None, torch.float32)
        return model_dtype if model else None

    def _check_signals(self, signals: Any) -> None:
        given = {r for r in self.requires if getattr(signals, self.substitutes.get(r, r), None) is not None}
        missing = sorted(r for r in self.requires - given if getattr(signals, r, None) is None)
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
    image is several crops (LLaVA-NeXT's base view and tiles), the budget is split evenly over the crops
    and the selector runs on each crop's tokens alone (:func:`~prune_audit.pruners.crop_scope.select_per_crop`),
    the official LLaVA-NeXT convention of VisionZip, CDPruner and FasterVLM; refused on one-crop families.
    """

    budget_scope: str = option("image", Choice(BUDGET_SCOPES),
                               "one budget over the image's tokens, or split evenly over its crops (LLaVA-NeXT)")


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
    ties: str = "lower"  # top-k selectors declare it as an option (TOP_K_TIES)
    score_dtype: str = "float32"

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """Choose ``budget`` output tokens out of ``signals.num_tokens``."""
        budget = validate_budget(budget)
        self._check_signals(signals)
        n = signals.num_tokens
        if budget >= n:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        return self._select(signals, budget, generator)

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

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """Stages in increasing layer order with non-increasing ``keep``."""
        raise NotImplementedError

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
    "SelectorLevel", "Reference", "Selector", "InputSelector", "LayerSelector", "top_k_indices", "TOP_K_TIES",
    "MODEL_ATTENTIONS", "ranked_indices", "validate_budget", "option_defaults", "as_float32", "cls_probabilities", "rounded_to",
]  # fmt: skip
