"""A run's selector as its manifest describes it (name, options, parts), read back for the words about its budget."""

from __future__ import annotations

from typing import Any

from prune_audit.pruners.registry import get_selector


def averages_budget(description: dict[str, Any]) -> bool:
    """The manifest's selector's ``averages_budget``: whether "(layer average)" may follow its budget. A composed
    selector's is its in-LLM part's (the last of its ``parts``); a selector not registered here (a plug-in of
    another installation) is taken to average, as most in-LLM defaults do."""
    if description.get("parts"):
        return averages_budget(description["parts"][-1])
    if "name" not in description:
        return True
    try:
        return get_selector(description["name"], **description.get("options", {})).averages_budget
    except ValueError:
        return True
