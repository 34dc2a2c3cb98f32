"""Which registered selectors a family runs, from its class-level declarations alone (no checkpoint read).

``SelectorSupport`` is a base of :class:`~prune_audit.models.base.VisionLanguageModel`: it reads the family's
declarations there (``input_signals``, ``refused_selectors``, ``crop_grid_selectors``, ``input_positions``,
``missing_signals_reason``, ``family``), so `prune-audit selectors --model FAMILY`, the docs tables and
``check_selector`` give the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from prune_audit.pruners.base import Selector
from prune_audit.pruners.registry import list_selectors, registered_classes, selector_class
from prune_audit.pruners.serving import TOWER_HOOK_SIGNALS
from prune_audit.pruners.signals import LAST_LAYER_CLS_SIGNALS, VIDEO_GRID, VISION_LAYER_SIGNALS

MERGED_POSITIONS = "positions for merged tokens"  # what a keep-original-positions family lacks for merging selectors
#: input signals computed by a part loaded only on request (``clip_text``), so not there by default
ON_REQUEST_SIGNALS = frozenset({"text_relevance"})


def refused_for(lacks: frozenset[str]) -> Mapping[str, str]:
    """``refused_selectors`` of a family lacking the layout facts ``lacks`` (``pruners.layout``): each registered
    selector whose ``layout_need`` is one of them -> that need."""
    return MappingProxyType({cls.name: cls.layout_need for cls in registered_classes() if cls.layout_need in lacks})


def crop_grid_for(lacks: frozenset[str]) -> frozenset[str]:
    """``crop_grid_selectors`` of a family lacking ``lacks``: those it refuses on the whole image whose official
    multi-crop code selects in each crop's own grid (``Selector.per_crop_grid``)."""
    return frozenset(cls.name for cls in registered_classes() if cls.per_crop_grid and cls.layout_need in lacks)


def per_grid_for(how: Mapping[str, str], lacks: frozenset[str]) -> Mapping[str, str]:
    """``per_grid_selectors`` of a family whose grids run each ``Selector.per_grid`` kind as ``how`` says: every
    registered selector of such a kind that the family does not refuse -> how it runs (for messages)."""
    return MappingProxyType(
        {
            cls.name: how[cls.per_grid]
            for cls in registered_classes()
            if cls.per_grid in how and cls.layout_need not in lacks
        }
    )


class SelectorSupport:
    """The class-level answer to "does selector S run on this family, and if not, why"."""

    family: str
    input_signals: frozenset[str]
    crop_grid_selectors: frozenset[str]
    refused_selectors: Mapping[str, str]
    missing_signals_reason: str
    input_positions: str
    resizes_images: bool

    @classmethod
    def selector_support(cls) -> dict[str, str | None]:
        """Each registered selector -> None when it runs on this family, else the reason it does not
        (from the class-level declarations alone: no checkpoint is read)."""
        available = cls.input_signals - ON_REQUEST_SIGNALS
        return {name: cls.refusal(selector_class(name), available) for name in list_selectors()}

    @classmethod
    def support_words(cls) -> dict[str, str]:
        """Each registered selector -> its cell in the families x selectors tables of docs/models.md and README.md:
        ``yes``, ``with --clip-text``, ``with budget_scope=crop`` or ``no``."""
        available = cls.input_signals - ON_REQUEST_SIGNALS
        words = {}
        for name, refusal in cls.selector_support().items():
            selector = selector_class(name)
            words[name] = (
                "yes"
                if refusal is None
                else "with --clip-text"
                if cls.refusal(selector, cls.input_signals) is None
                else "with budget_scope=crop"
                if cls.runs_per_crop(selector, available)
                else "no"
            )
        return words

    @classmethod
    def refusal(cls, selector: Selector | type[Selector], available: frozenset[str]) -> str | None:
        """Why ``selector`` (a class, or an instance whose options change its signals) cannot run on this family
        with input signals ``available`` (None: it can)."""
        missing = cls.missing_for(selector, available)
        if not missing:
            return None
        if VIDEO_GRID in missing:  # a video selector on still images: the input lacks it, whatever the family
            return (
                f"needs a video clip's temporal token grid ({VIDEO_GRID}), which a still image does not give; "
                "run it on clips (prepare_video of a family that takes them)"
            )
        if missing == {"text_relevance"} and "text_relevance" in cls.input_signals:
            return (
                "needs a CLIP text tower for its text relevance: pass clip_text=PATH (--clip-text PATH) "
                "to a CLIP checkpoint matching the vision tower"
            )
        if missing <= LAST_LAYER_CLS_SIGNALS <= cls.input_signals:  # the family has them, this checkpoint not
            return (
                f"needs {', '.join(sorted(missing))}, the vision tower's last layer on the feature layer's output, "
                f"which this {cls.family} checkpoint does not reach (its vision_feature_layer is not -2 or -1); "
                "--option signal_layer=feature reads the feature layer's"
            )
        reason = (
            "it keeps every token's original position" if missing == {MERGED_POSITIONS} else cls.missing_signals_reason
        )
        per_crop = (
            "; it runs per crop with --option budget_scope=crop" if cls.runs_per_crop(selector, available) else ""
        )
        return f"needs {', '.join(sorted(missing))}, which {cls.family} does not provide ({reason}){per_crop}"

    @classmethod
    def runs_per_crop(cls, selector: Selector | type[Selector], available: frozenset[str]) -> bool:
        """Whether ``selector``, refused on the whole image, runs on each crop's grid (``budget_scope="crop"``)."""
        refused = cls.refused_selectors.get(selector.name)
        return selector.name in cls.crop_grid_selectors and cls.missing_for(selector, available) == {refused}

    @classmethod
    def missing_for(cls, selector: Selector | type[Selector], available: frozenset[str]) -> set[str]:
        """What the family lacks for ``selector`` given input signals ``available``: input signals, positions
        for the merged tokens it feeds, or what ``refused_selectors`` names."""
        refused = {cls.refused_selectors[selector.name]} if selector.name in cls.refused_selectors else set()
        if selector.stage == "input" and getattr(selector, "resizes_image", False) and cls.resizes_images:
            return refused  # it acts on the image (``prepare_for``): it reads no signal and feeds no merged token
        if selector.stage == "llm":  # in-LLM selectors read the language model, and some the vision tower or clip
            # too; one with its own tower stage (MustDrop's merge) the tower hook
            from_input = VISION_LAYER_SIGNALS | {VIDEO_GRID} | TOWER_HOOK_SIGNALS
            return set(Selector.requires_on(selector, available) & from_input) - available | refused
        missing = set(Selector.requires_on(selector, available)) - available | refused
        if selector.merges and cls.input_positions != "compact":
            missing.add(MERGED_POSITIONS)
        return missing
