"""Visual-token budgets in one place: parse ``--budget``, check it against the selector, resolve it per
image, and solve (and remember) an in-LLM selector's schedule for it.

A budget is requested as a number of visual tokens, a share of each image's tokens (``11%``,
rounded half up per image, at least 1) or ``all``; ``None`` is the unpruned run. A composed selector
(``visionzip+fastv``) takes one budget per part, comma-separated (``128,64``), each below the one before; inside a
comma-separated list of budgets (``study --budgets``, lmms-eval's ``model_args``) its parts are joined by ``/``. The runner
resolves it per image (``resolve_budget``), the model solves an in-LLM selector's schedule
through ``Schedules`` (the manifest's schedule comes from the same one), and the realised
token counts, FLOPs and KV bytes of each question follow from that (``compute.cost``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prune_audit.errors import PruneAuditError
from prune_audit.integers import parse_integer

if TYPE_CHECKING:  # torch loads only with the model: the CLI checks OMP_NUM_THREADS before it does
    from prune_audit.pruners.base import LayerSelector, Stage

BUDGET_ALL = "all"
LISTED_PART_SEPARATOR = "/"
"""Between a composed budget's parts inside a comma-separated list of budgets (``study --budgets 32,96/48``,
lmms-eval's ``budget=96/48``), where ``--budget``'s comma would split the list."""

PartBudget = int | str
"""One budget: visual tokens, a share ``"N%"`` or ``"all"``."""
Budget = PartBudget | tuple[PartBudget, ...] | None
"""A requested budget: one budget, one per part of a composed selector (``(128, 64)``), or None (unpruned)."""
ResolvedBudget = int | tuple[int, ...] | None
"""A budget resolved for one image (``resolve_budget``): its tokens, one count per composed part, or None."""


def parse_budget(text: str | None) -> Budget:
    """``--budget``: a number of visual tokens, a share of each image's tokens (``11%``), or ``all``; for a
    composed selector one of these per part, comma-separated (``128,64``)."""
    if text is not None and "," in text:
        texts = [part.strip() for part in text.split(",")]
        if not all(texts):  # an empty part ("128,")
            raise PruneAuditError(f"--budget {text}: give one budget per part, e.g. 128,64")
        return tuple(parse_budget(part) for part in texts)  # type: ignore[misc]  # each part holds no comma
    if text is None or text == BUDGET_ALL:
        return text
    if text.endswith("%"):
        budget_share(text)  # checks the domain
        return text
    try:
        return parse_integer(text)
    except ValueError:
        raise PruneAuditError(
            f"--budget takes a number of visual tokens, a share such as 11%, or {BUDGET_ALL}; got {text!r}"
        ) from None


def budget_text(budget: Budget | list) -> str:
    """A budget as ``--budget`` spells it: ``64``, ``11%``, ``all``; a composed one comma-separated (``128,64``)."""
    return ",".join(str(part) for part in budget) if isinstance(budget, (tuple, list)) else str(budget)


def unlist_budget(text: str) -> str:
    """A budget written inside a comma-separated list (``96/48``) as ``--budget`` spells it (``96,48``)."""
    return text.replace(LISTED_PART_SEPARATOR, ",")


def parse_listed_budget(value: object) -> object:
    """A budget given in a comma-separated list of settings (lmms-eval's ``model_args``: ``budget=96/48``, a
    composed budget's parts joined by ``/``): None for none (absent, empty, ``none``), a whole number of tokens
    from digits, a string parsed as ``--budget`` (``96/48`` -> ``(96, 48)``); anything else as given, for the
    Python API to check."""
    if value in (None, "", "none", "None"):
        return None
    if not isinstance(value, str):
        return value
    return parse_budget(unlist_budget(value))


def listed_budget_text(budget: Budget | list) -> str:
    """A budget as a comma-separated list of budgets spells it: ``64``; a composed one ``96/48``."""
    return budget_text(budget).replace(",", LISTED_PART_SEPARATOR)


def has_share(budget: Budget) -> bool:
    """Whether ``budget`` (or one of its parts) is a share, which each image resolves to its own count."""
    parts = budget if isinstance(budget, tuple) else (budget,)
    return any(budget_share(part) is not None for part in parts)


def budget_share(budget: Budget) -> float | None:
    """The share of each image's visual tokens a ``N%`` budget keeps (0 < share <= 1); None otherwise."""
    if not isinstance(budget, str) or not budget.endswith("%"):
        return None
    try:
        share = float(budget[:-1]) / 100
    except ValueError:
        share = float("nan")
    if not 0.0 < share <= 1.0:
        raise PruneAuditError(f"--budget {budget}: a share must lie in (0%, 100%], e.g. 11%")
    return share


def tokens_for_share(share: float, num_visual: int) -> int:
    """A share of an image's ``num_visual`` tokens, rounded half up, at least 1."""
    return max(1, int(share * num_visual + 0.5))


def check_positive(budget: Budget) -> None:
    """Refuse a count of zero or fewer visual tokens (shares and ``all`` are checked where they are read)."""
    if isinstance(budget, tuple):
        for part in budget:
            check_positive(part)
    elif isinstance(budget, int) and budget <= 0:
        raise PruneAuditError(f"--budget must be a positive number of visual tokens, got {budget}")


def parse_requested_budget(text: str) -> PartBudget | tuple[PartBudget, ...]:
    """A budget a selector runs at (``--budget``, the study's ``--budgets``, the Python API, lmms-eval): parsed
    and checked positive here, the one place; None (unpruned) is not a budget to parse."""
    budget = parse_budget(text)
    check_positive(budget)
    assert budget is not None  # parse_budget returns None only for None
    return budget


def check_budget_for(selector: str, budget: Budget) -> None:
    """A budget goes with a selector and only with one (``selector`` "none": the unpruned run)."""
    if selector == "none" and budget is not None:
        raise PruneAuditError(
            f"--budget {budget} needs --selector NAME (see prune-audit selectors); the unpruned run keeps every "
            f"visual token, so drop --budget for it"
        )
    if selector != "none" and budget is None:
        raise PruneAuditError(f"selector {selector!r} needs --budget N (visual tokens to keep)")
    check_positive(budget)


def check_budget_parts(budget: Budget, parts: int, selector: str) -> None:
    """A composed selector of ``parts`` parts takes one budget per part, each below the one before (where they
    compare before an image resolves them: two counts, two shares, ``all`` first); another takes one budget."""
    given = len(budget) if isinstance(budget, tuple) else 1
    if budget is None or given == parts:
        if isinstance(budget, tuple):
            _check_descending(budget, selector)
        return
    spelled = budget_text(budget)
    raise PruneAuditError(
        f"--budget {spelled} gives {given} budget(s) for selector {selector!r} of {parts} part(s); "
        f"give one per part, comma-separated, e.g. {','.join(str(128 >> i) for i in range(parts))}"
    )


def _check_descending(budget: tuple[PartBudget, ...], selector: str) -> None:
    spelled = budget_text(budget)
    for earlier, later in zip(budget, budget[1:]):
        shares = budget_share(earlier), budget_share(later)
        if later == BUDGET_ALL or (earlier != BUDGET_ALL and (shares[0] is None) != (shares[1] is None)):
            raise PruneAuditError(
                f"--budget {spelled}: after {earlier} give a smaller count, or a smaller share after a share, "
                f"so each part of {selector!r} keeps fewer tokens than the one before"
            )
        if earlier == BUDGET_ALL:
            continue
        before, after = shares if shares[0] is not None else (earlier, later)
        if not after < before:  # type: ignore[operator]  # two counts or two shares, checked above
            raise PruneAuditError(
                f"--budget {spelled}: {later} is not below {earlier}; each part of {selector!r} keeps fewer "
                f"tokens than the one before"
            )


def resolve_budget(budget: Budget, num_visual: int) -> ResolvedBudget:
    """The budget in tokens for an image of ``num_visual`` tokens: ``all`` is every visual token, ``N%``
    that share (rounded per image); more than the model has is refused. A composed budget resolves part by
    part, each share of the image's own tokens."""
    if budget is None:
        return None
    if isinstance(budget, tuple):
        return tuple(_resolve_one(part, num_visual) for part in budget)
    return _resolve_one(budget, num_visual)


def _resolve_one(budget: PartBudget, num_visual: int) -> int:
    if budget == BUDGET_ALL:
        return num_visual
    share = budget_share(budget)
    if share is not None:
        return tokens_for_share(share, num_visual)
    if int(budget) > num_visual:
        raise PruneAuditError(
            f"--budget {budget} is more than the model's {num_visual} visual tokens; pass at most {num_visual}, "
            f"or --budget {BUDGET_ALL} to keep every token"
        )
    return int(budget)


class Schedules:
    """In-LLM schedules solved once per (selector options, layers, token count, budget): solving takes milliseconds."""

    def __init__(self) -> None:
        self._solved: dict[tuple, list[Stage]] = {}

    def solve(self, selector: LayerSelector, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """The stages of ``selector`` keeping ``budget`` visual tokens on average; one-line error when none fits."""
        key = (selector.name, repr(selector.options()), num_layers, num_visual, budget)
        if key not in self._solved:
            try:
                self._solved[key] = selector.schedule(num_layers, num_visual, budget)
            except ValueError as error:
                from prune_audit.pruners.schedule import scaled_layer_note

                note = scaled_layer_note(selector, num_layers)
                raise PruneAuditError(
                    f"selector {selector.name!r} has no schedule for budget {budget} (a layer "
                    f"average{'; ' + note if note else ''}): {error}"
                ) from None
        return self._solved[key]


__all__ = [
    "BUDGET_ALL", "LISTED_PART_SEPARATOR", "Budget", "unlist_budget", "parse_listed_budget", "listed_budget_text", "PartBudget", "ResolvedBudget", "parse_budget", "check_budget_parts", "budget_text", "has_share", "parse_requested_budget", "budget_share", "tokens_for_share", "check_positive", "check_budget_for",
    "resolve_budget", "Schedules",
]  # fmt: skip
