"""``study --plan``: the grid's ``run`` commands as lines, a shell script or a SLURM array script.

A scheduler executes the commands (each is an ordinary, resumable ``prune-audit run``);
``prune-audit study --report --out OUT`` then builds the summary from their run folders.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from prune_audit.errors import PruneAuditError

PLAN_FORMATS = ("lines", "shell", "slurm")


def render_plan(commands: Sequence[str], plan_format: str, out: Path) -> str:
    """The commands in ``plan_format``; the scripts end by pointing at ``study --report``."""
    if plan_format not in PLAN_FORMATS:
        raise PruneAuditError(f"--plan-format must be one of {', '.join(PLAN_FORMATS)}, got {plan_format!r}")
    report = f"prune-audit study --report --out {shlex.quote(str(out))}"
    if plan_format == "lines":
        return "".join(f"{command}\n" for command in commands)
    if plan_format == "shell":
        lines = ["#!/usr/bin/env bash", "# the study's runs, one after another; then: " + report, "set -euo pipefail"]
        return "\n".join([*lines, *commands, ""])
    return _slurm(commands, report)


def _slurm(commands: Sequence[str], report: str) -> str:
    """A SLURM array script: task i runs command i (``sbatch --array`` indices from 0)."""
    if not commands:
        raise PruneAuditError("this shard of the plan holds no run; use fewer shards")
    quoted = "\n".join(f"  {shlex.quote(command)}" for command in commands)
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            "#SBATCH --job-name=prune-audit-study",
            f"#SBATCH --array=0-{len(commands) - 1}",
            f"# after every task has finished: {report}",
            "set -euo pipefail",
            "COMMANDS=(",
            quoted,
            ")",
            'eval "${COMMANDS[$SLURM_ARRAY_TASK_ID]}"',
            "",
        ]
    )
