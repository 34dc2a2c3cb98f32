"""A composed selector: an input-level selector, then an in-LLM selector on the tokens it fed.

``--selector visionzip+fastv --budget 128,64`` runs VisionZip on the encoder output (128 visual tokens fed to the
language model), then FastV inside the language model on those 128, its schedule solved on the reduced count at
the second budget (64, under FastV's own ``budget_rule``). Each stage is recorded: the input stage at layer 0, the
in-LLM stages at their layers, every kept set in the original grid indices.

Follows UniPruneBench's composition (TianfanPeng/VLMUniPruneBench 2f823cff, ``layer_prune.py``): the pre-LLM
method (``PRUNE_METHOD_PRE_LLM``) reduces the encoder output, then each ``INTRA_LLM_LAYER_SPECS`` entry
``layer:method[:ratio]`` prunes the visual span as it is at that layer (``_extract_context`` reads ``IMAGE_START``..
``IMAGE_END``, which ``_merge_context`` moves after every stage). Two differences: budgets are token counts (or
shares of the image's tokens) rather than ratios of the current span, and the in-LLM stage's kept tokens are
recorded as original grid indices (UniPruneBench's ``keep_idx`` indexes the reduced span).

Not a registered selector: its name is its parts', each looked up in the registry, so the registry stays the one
list of selectors. Options go to a part as ``PART.KEY=VALUE`` (``fastv.budget_rule=paper``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prune_audit.errors import PruneAuditError
from prune_audit.pruners.base import InputSelector, LayerSelector, Selector
from prune_audit.pruners.registry import selector_class, selector_from_strings

COMPOSE = "+"
"""Joins the parts of a composed selector's name: input-level part, then in-LLM part."""
COMPOSED_STAGE = "composed"
"""The ``stage`` of a composed selector in a manifest (its parts keep theirs)."""


@dataclass(frozen=True)
class ComposedSelector:
    """An input-level selector (``input``) followed by an in-LLM selector (``llm``) on the tokens it fed."""

    input: InputSelector
    llm: LayerSelector
    stage: ClassVar[str] = COMPOSED_STAGE

    @property
    def name(self) -> str:
        return f"{self.input.name}{COMPOSE}{self.llm.name}"

    @property
    def parts(self) -> tuple[InputSelector, LayerSelector]:
        return self.input, self.llm

    @property
    def averages_budget(self) -> bool:
        """Its in-LLM part's (``Selector.averages_budget``)."""
        return self.llm.averages_budget

    def options(self) -> dict[str, Any]:
        """Every part's options as ``PART.KEY`` -> value (the spelling ``--option`` takes)."""
        return {f"{part.name}.{key}": value for part in self.parts for key, value in part.options().items()}


RunSelector = Selector | ComposedSelector
"""What a run prunes with: one registered selector, or a composed one."""


def is_composed(name: str) -> bool:
    """Whether ``name`` spells a composed selector (``a+b``)."""
    return COMPOSE in name


def composed_from_strings(name: str, pairs: Sequence[str], depth: int | None = None) -> ComposedSelector:
    """The composed selector ``name`` (``input+llm``) with ``PART.KEY=VALUE`` options, each part from the registry.

    Raises:
        PruneAuditError: one line: not two parts, an unknown part, two parts of one level, the in-LLM part first,
            an option without its part, a part's refused option, or an in-LLM part running its own tower stage.
    """
    names = name.split(COMPOSE)
    if len(names) != 2 or not all(names):
        raise PruneAuditError(
            f"a composed selector names two parts, input-level then in-LLM, joined by {COMPOSE!r}; got {name!r}"
        )
    try:
        levels = [selector_class(part).stage for part in names]
    except ValueError as error:
        raise PruneAuditError(f"composed selector {name!r}: {error}") from None
    if levels[0] == levels[1]:
        where = "at the input" if levels[0] == "input" else "inside the LLM"
        raise PruneAuditError(
            f"both parts of {name!r} prune {where}; compose one input-level selector with one in-LLM selector"
        )
    if levels[0] == "llm":
        raise PruneAuditError(
            f"{name!r} puts the in-LLM part first; the input-level part runs first: {names[1]}{COMPOSE}{names[0]}"
        )
    own = _options_by_part(name, names, pairs)
    try:
        input_part, llm_part = (selector_from_strings(part, own[part], depth) for part in names)
    except PruneAuditError:
        raise
    except ValueError as error:
        raise PruneAuditError(str(error)) from None
    assert isinstance(input_part, InputSelector) and isinstance(llm_part, LayerSelector)  # levels checked above
    if llm_part.tower_stage() is not None:  # two input stages: the composed input part would replace its own
        fix = (
            f"compose it with that stage off: --option {names[1]}.{llm_part.tower_stage_off}"
            if llm_part.tower_stage_off
            else f"run {names[1]!r} alone (its stage has no off switch)"
        )
        raise PruneAuditError(
            f"{names[1]!r} runs its own vision-tower stage before the language model, which {names[0]!r} would "
            f"replace; {fix}"
        )
    return ComposedSelector(input_part, llm_part)


def parse_selector(name: str, pairs: Sequence[str], depth: int | None = None) -> RunSelector:
    """The selector ``name`` spells, registered or composed (``input+llm``), with its ``--option`` strings."""
    if is_composed(name):
        return composed_from_strings(name, pairs, depth)
    return selector_from_strings(name, pairs, depth)


def _options_by_part(name: str, names: Sequence[str], pairs: Sequence[str]) -> dict[str, list[str]]:
    """``PART.KEY=VALUE`` strings -> each part's ``KEY=VALUE`` strings; one that names no part is refused."""
    own: dict[str, list[str]] = {part: [] for part in names}
    for pair in pairs:
        part, dot, rest = pair.partition(".")
        if not dot or part not in own or "=" in part:
            raise PruneAuditError(
                f"--option {pair!r}: an option of composed selector {name!r} names its part, "
                f"{names[0]}.KEY=VALUE or {names[1]}.KEY=VALUE"
            )
        own[part].append(rest)
    return own


def selector_parts(selector: RunSelector | None) -> tuple[InputSelector | None, LayerSelector | None]:
    """(input-level part, in-LLM part) of ``selector``: one of them None for a registered selector, both for None;
    an in-LLM selector with its own tower stage (``LayerSelector.tower_stage``, MustDrop) has both."""
    if isinstance(selector, ComposedSelector):
        return selector.parts
    if isinstance(selector, InputSelector):
        return selector, None
    if isinstance(selector, LayerSelector):
        return selector.tower_stage(), selector
    return None, None


def budget_parts(selector: RunSelector | None, budget: Any) -> tuple[Any, Any]:
    """(input-level budget, in-LLM budget) of ``budget`` under ``selector`` (a composed one takes one per part; an
    in-LLM selector's own tower stage gets its one budget too, which the stage may ignore: MustDrop's merge does)."""
    if isinstance(selector, ComposedSelector):
        first, second = budget
        return first, second
    if isinstance(selector, LayerSelector):
        return (budget if selector.tower_stage() is not None else None), budget
    return (budget, None) if isinstance(selector, InputSelector) else (None, budget)


def part_count(selector: RunSelector | None) -> int:
    """How many budgets ``selector`` takes: one per part."""
    return len(selector.parts) if isinstance(selector, ComposedSelector) else 1


__all__ = [
    "COMPOSE", "COMPOSED_STAGE", "ComposedSelector", "RunSelector", "is_composed", "composed_from_strings", "parse_selector",
    "selector_parts", "budget_parts", "part_count",
]  # fmt: skip
