"""User-facing errors: one line naming the cause and the fix."""


class PruneAuditError(ValueError):
    """An input or configuration problem the user can fix; the CLI prints it as one line."""
