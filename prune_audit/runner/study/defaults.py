"""The default study grid; imported by the CLI at start-up, so it imports nothing."""

DEFAULT_SELECTORS = ("fastv", "divprune")
DEFAULT_BUDGETS = ("64", "96")
"""The default demo grid (five runs of the 9,000 demo questions, about ten minutes on two cores): an
in-LLM and an input-level selector at 64 and 96 of the demo's 144 visual tokens (its 3-layer language
model leaves FastV no schedule below 48)."""
