"""``prune-audit study``: the grid of runs (reference + selectors x budgets), executed or planned."""
