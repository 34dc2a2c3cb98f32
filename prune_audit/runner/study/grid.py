"""The study grid: the unpruned reference plus every selector x budget, as ``run`` requests and commands.

Every cell's run directory is ``OUT/runs/<cell name>``, so the one-process study, the
planned ``run`` commands (``--plan``) and ``--report`` all meet in the same folders.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.compute.budget import (
    budget_share,
    budget_text,
    listed_budget_text,
    parse_requested_budget,
    unlist_budget,
)
from prune_audit.errors import PruneAuditError
from prune_audit.records.stages import StageChoice
from prune_audit.runner.request import RunRequest
from prune_audit.runner.sharding import Shard
from prune_audit.safety.ownership import STUDY_RUNS_FOLDER as RUNS_FOLDER  # ownership recognises a study by it

if TYPE_CHECKING:
    from prune_audit.analysis.subsets import Subset

REFERENCE = "none"


@dataclass(frozen=True)
class StudyCell:
    """One run of the grid: ``selector`` (``none`` for the reference) at ``budget`` (None for it)."""

    selector: str
    budget: str | None

    @property
    def name(self) -> str:
        """Folder name: ``dense`` or ``<selector>-<budget>`` (``%`` spelled ``pct``, a composed budget's parts
        joined by ``_``: ``visionzip+fastv-96_48``)."""
        if self.selector == REFERENCE:
            return "dense"
        return f"{self.selector}-{str(self.budget).replace('%', 'pct').replace(',', '_')}"


@dataclass(frozen=True)
class StudyGrid:
    """What the study runs and with which shared ``run`` options (``base``: everything but selector/budget/out)."""

    selectors: tuple[str, ...]
    budgets: tuple[str, ...]
    out: Path
    base: RunRequest = field(default_factory=RunRequest)
    named_by_task: bool = False  # a study of several tasks: run folders OUT/runs/<task>-<cell name>
    #: a selector's ``run --option`` pairs (KEY=VALUE, a composed one's PART.KEY=VALUE), at each of its budgets
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def cells(self) -> list[StudyCell]:
        """The reference first, then selectors (outer) x budgets (inner), in the order given: each selector at
        the budgets of its part count (a composed selector at the composed budgets, ``check_grid``)."""
        return [StudyCell(REFERENCE, None)] + [
            StudyCell(selector, budget)
            for selector in self.selectors
            for budget in self.budgets
            if selector_part_count(selector) == budget_part_count(budget)
        ]

    def run_dir(self, cell: StudyCell) -> Path:
        return self.out / RUNS_FOLDER / (f"{self.base.task}-{cell.name}" if self.named_by_task else cell.name)

    def request(self, cell: StudyCell) -> RunRequest:
        """The ``RunRequest`` that ``prune-audit run`` builds from ``command(cell)``."""
        budget = None if cell.budget is None else parse_requested_budget(cell.budget)
        request = replace(
            self.base,
            selector=cell.selector,
            budget=budget,
            out=self.run_dir(cell),
            options=list(self.options.get(cell.selector, ())),
            question_files=list(self.base.question_files),
        )
        request.command = self.command(cell)
        return request

    def command(self, cell: StudyCell) -> str:
        """The ``prune-audit run`` command line of ``cell`` (options that differ from run's defaults)."""
        base, defaults = self.base, RunRequest()
        words = ["prune-audit", "run"]
        pairs: list[tuple[str, object]] = [("--model", base.model)]
        if base.task != defaults.task:
            pairs += [("--task", base.task), *(("--questions", path) for path in base.question_files)]
            pairs += [("--max-new-tokens", base.max_new_tokens), ("--confidence", base.confidence)]
        else:
            pairs += [("--pope", path) for path in base.question_files]
        pairs += [("--split", base.split), ("--images", base.images), ("--annotations", base.annotations)]
        pairs += [("--selector", None if cell.selector == REFERENCE else cell.selector), ("--budget", cell.budget)]
        pairs += [("--option", pair) for pair in self.options.get(cell.selector, ())]
        pairs += [("--out", self.run_dir(cell)), ("--limit", base.limit)]
        for name in ("batch_size", "device", "dtype", "seed", "prompt_template", "clip_text", "threads"):
            value = getattr(base, name)
            if value != getattr(defaults, name):
                pairs.append((f"--{name.replace('_', '-')}", value))
        for option, value in pairs:
            if value is not None:
                words += [option, str(value)]
        return shlex.join(words)


def parse_selector_options(values: Sequence[str], selectors: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``--option SELECTOR:KEY=VALUE`` values (a composed selector's ``SELECTOR:PART.KEY=VALUE``) as each selector's
    ``run --option`` pairs; the selector must be one of ``selectors`` and every option is checked against its
    domain, before any run (one line otherwise)."""
    from prune_audit.pruners.composed import parse_selector

    options: dict[str, list[str]] = {}
    for value in values:
        name, separator, pair = value.partition(":")
        if not separator or "=" not in pair:
            raise PruneAuditError(
                f"--option {value}: name the selector it applies to, SELECTOR:KEY=VALUE (e.g. fastvid:merge=false)"
            )
        if name == REFERENCE or name not in selectors:
            raise PruneAuditError(f"--option {value}: selector {name!r} is not among --selectors; add it there")
        options.setdefault(name, []).append(pair)
    for name, pairs in options.items():
        parse_selector(name, pairs)  # every option against its domain
    return {name: tuple(pairs) for name, pairs in options.items()}


def inputs_by_task(
    values: Sequence[Path], tasks: Sequence[str], option: str, single: bool = False
) -> dict[str, list[Path]]:
    """``--questions`` / ``--images`` / ``--annotations`` values by task. With one task, as given (``TASK=`` may
    lead); with several, each value is ``TASK=PATH``. ``single``: at most one value per task (a folder, a file).
    A task with no value gets none (the bundled demo's inputs, where the demo has that task's questions)."""
    given: dict[str, list[Path]] = {task: [] for task in tasks}
    for value in values:
        name, separator, rest = str(value).partition("=")
        if separator and name in given:
            given[name].append(Path(rest))
        elif len(tasks) == 1:
            given[tasks[0]].append(Path(value))
        else:
            raise PruneAuditError(
                f"{option} {value}: with several --tasks, name each value's task: {option} "
                f"TASK=PATH, TASK one of {', '.join(tasks)}"
            )
    for task, paths in given.items():
        if single and len(paths) > 1:
            raise PruneAuditError(f"{option} names task {task} {len(paths)} times; pass one value per task")
    return given


def parse_tasks(task: str, tasks: str | None, max_new_tokens: int | None, confidence: str | None) -> list[str]:
    """The study's tasks (``--task``, or the ``--tasks`` list), each known; --max-new-tokens and --confidence must
    apply to one of them at least (they go to those tasks they apply to: ``task_option``)."""
    from prune_audit.tasks import get_task

    if tasks is None:
        get_task(task, max_new_tokens, confidence)
        return [task]
    if task != "pope":
        raise PruneAuditError("pass --task NAME or --tasks A,B,..., not both")
    names = list(parse_list(tasks, "--tasks"))
    for name in names:
        get_task(name)
    for option, value in (("max_new_tokens", max_new_tokens), ("confidence", confidence)):
        if value is not None and all(task_option(name, option, value) is None for name in names):
            get_task(names[0], **{option: value})  # refused in one line, naming the option
    return names


def task_option(task: str, option: str, value: int | str | None) -> int | str | None:
    """``value`` of ``--max-new-tokens`` (``option`` max_new_tokens) or ``--confidence`` for ``task``: kept where
    the task takes it (a generating task; a confidence it offers), None elsewhere."""
    from prune_audit.tasks import get_task

    kind = type(get_task(task))
    takes = kind.default_max_new_tokens is not None if option == "max_new_tokens" else value in kind.confidences
    return value if takes else None


def parse_budgets(text: str) -> tuple[str, ...]:
    """``--budgets "32, 64, 96/48"`` -> ("32", "64", "96,48"): each budget valid (``parse_requested_budget``; a
    composed selector's parts joined by ``/`` inside the list) and written the way ``run`` reads it, so ``32`` and
    ``032`` (or ``11%`` and ``11.0%``) are one budget and a repeat is refused instead of run twice."""
    given: dict[object, str] = {}  # budget (a share by its value, a composed one part by part) -> its text
    canonical = []
    for item in parse_list(text, "--budgets"):
        parsed = parse_requested_budget(unlist_budget(item))
        budget = budget_text(parsed)
        value = tuple(budget_share(part) or str(part) for part in (parsed if isinstance(parsed, tuple) else (parsed,)))
        if value in given:
            raise PruneAuditError(f"--budgets lists {given[value]!r} and {item!r}, the same budget; list it once")
        given[value] = item
        canonical.append(budget)
    return tuple(canonical)


def parse_list(text: str, option: str) -> tuple[str, ...]:
    """``"a, b"`` -> ("a", "b"); an empty list or a repeated entry is refused."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if not items:
        raise PruneAuditError(f"{option} needs at least one entry, got {text!r}")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise PruneAuditError(f"{option} repeats {repeated[0]!r}; list each entry once")
    return items


def check_stage(stage: StageChoice) -> None:
    """The study reads every run at ``stage``, its unpruned reference too, which has a single stage (index 0)."""
    if stage.index is not None and stage.index > 0:
        raise PruneAuditError(
            f"--stage {stage.name}: the study's unpruned reference has one stage (index 0); pass first, last or 0"
        )


def check_grid(selectors: Sequence[str], budgets: Sequence[str]) -> None:
    """Every selector is registered or composed of registered parts (and not ``none``, which is the reference),
    every budget valid, and each selector has budgets of its part count."""
    from prune_audit.pruners import list_selectors, selector_class
    from prune_audit.pruners.composed import composed_from_strings, is_composed

    for name in selectors:
        if name == REFERENCE:
            raise PruneAuditError("--selectors lists pruned runs; the unpruned reference is always run, drop 'none'")
        if is_composed(name):
            composed_from_strings(name, [])  # its parts, each registered, in order (one line otherwise)
            continue
        try:
            selector_class(name)
        except ValueError:
            raise PruneAuditError(
                f"unknown selector {name!r} in --selectors; choose from {', '.join(list_selectors())}"
            ) from None
    for budget in budgets:
        parse_requested_budget(budget)
    _check_part_counts(selectors, budgets)


def check_subset_budgets(subset: Subset | None, budgets: Sequence[str]) -> None:
    """``--subset`` takes each budget's questions from its baseline's run at that budget: a budget of another part
    count than the baseline selector's (a composed one beside a plain baseline) would have none, refused now."""
    if subset is None:
        return
    parts = selector_part_count(subset.baseline)
    for budget in budgets:
        if budget_part_count(budget) != parts:
            raise PruneAuditError(
                f"--subset {subset.name}: --budgets {listed_budget_text(budget)} has no {subset.baseline} run (it "
                f"takes {parts} budget part(s)); name a selector of {budget_part_count(budget)} part(s) with "
                f"--subset-baseline, or study that budget without --subset"
            )


def selector_part_count(selector: str) -> int:
    """How many budgets a ``--selectors`` entry takes: one per part of a composed name (``visionzip+fastv``: 2)."""
    from prune_audit.pruners.composed import COMPOSE

    return len(selector.split(COMPOSE))


def budget_part_count(budget: str) -> int:
    """How many parts a grid budget (``parse_budgets``' spelling: ``96,48``) has."""
    return len(budget.split(","))


def _check_part_counts(selectors: Sequence[str], budgets: Sequence[str]) -> None:
    """Each selector runs at the budgets of its part count: a selector without one, or a budget that no selector
    takes, is refused (it would be dropped from the grid unseen)."""
    counts = {budget_part_count(budget) for budget in budgets}
    for name in selectors:
        parts = selector_part_count(name)
        if parts not in counts:
            example = "/".join(str(128 >> i) for i in range(parts))
            raise PruneAuditError(
                f"--selectors {name} takes {parts} budget(s), one per part, and --budgets lists none of {parts} "
                f"part(s); add one, parts joined by '/' (e.g. --budgets {example})"
            )
    takers = {selector_part_count(name) for name in selectors}
    for budget in budgets:
        if budget_part_count(budget) not in takers:
            raise PruneAuditError(
                f"--budgets {listed_budget_text(budget)} has {budget_part_count(budget)} part(s) and no selector in "
                f"--selectors takes that many; a composed selector (input+llm) takes two, '/'-joined (96/48), "
                f"another one"
            )


def shard_commands(commands: Sequence[str], shard: Shard | None) -> list[str]:
    """Commands ``I, I+N, I+2N, ...`` for shard I/N (all without a shard)."""
    return list(commands) if shard is None else list(commands[shard.index :: shard.count])
