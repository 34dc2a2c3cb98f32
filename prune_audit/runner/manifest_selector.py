"""A run's selector as its manifest describes it (name, options, parts), read back for the words about its budget."""

from __future__ import annotations

from typing import Any

from prune_audit.pruners.registry import get_selector


def averages_budget(description: dict[str, Any]) -> bool:
    """The manifest's selector's ``averages_budget``: whether "(layer average)" may follow its budget. A composed
    selector's in-LLM part averages (its budgets are spelled per part); a selector not registered here (a plug-in
    of another installation) is taken to average, as every in-LLM default does."""
    if description.get("parts") or "name" not in description:
        return True
    try:
        return get_selector(description["name"], **description.get("options", {})).averages_budget
    except ValueError:
        return True
