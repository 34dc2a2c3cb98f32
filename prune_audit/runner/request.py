"""``prune-audit run``'s request: what the user asked for, as given on the command line (``plan`` checks it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.runner.sharding import Shard
from prune_audit.tasks.registry import DEFAULT_TASK

if TYPE_CHECKING:
    from prune_audit.records.interchange import KeptSets


@dataclass
class RunRequest:
    """What the user asked for, as given on the command line."""

    model: str | None = None
    selector: str = "none"
    budget: int | str | None = None  # tokens, or "all"
    options: list[str] = field(default_factory=list)  # KEY=VALUE strings
    question_files: list[Path] = field(default_factory=list)  # the task's question files (--pope, or --questions)
    task: str = DEFAULT_TASK
    max_new_tokens: int | None = None  # generating tasks only; None: the task's default
    confidence: str | None = None  # generating tasks only (Task.confidences); None: the task's default
    split: str | None = None
    images: Path | None = None
    annotations: Path | None = None
    out: Path | None = None
    limit: int | None = None
    batch_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    shard: Shard | None = None
    prompt_template: str | None = None
    clip_text: Path | None = None
    threads: int | None = None
    command: str = ""
    kept_sets: KeptSets | None = None  # ``import``: the answers' kept sets (questions restricted to the file's)
    reanswer: bool = False  # ``import --model``: the model answers under the imported kept sets
