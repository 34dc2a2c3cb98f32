"""The default study grid; imported by the CLI at start-up, so it imports nothing."""

DEFAULT_SELECTORS = ("fastv", "divprune")
DEFAULT_BUDGETS = ("32", "64")
"""The default demo grid (five runs of the 9,000 demo questions, about ten minutes on two cores): an
in-LLM and an input-level selector at 32 and 64 of the demo's 144 visual tokens, where the demo's
12-layer language model shows FastV losing objects and DivPrune keeping them."""
DEFAULT_SUBSET_BASELINE = "downsample"
"""The selector whose wrong answers make ``study --subset difficult`` (VTC-Bench filters by image downsampling at the
same budget); ``--subset-baseline`` names another."""
