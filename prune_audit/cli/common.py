"""Shared CLI plumbing: one-line errors, the console and plain metavars in ``--help``."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar, get_args, get_origin

import typer

from prune_audit.answer_modes import MAX_NEW_TOKENS

F = TypeVar("F", bound=Callable[..., Any])

ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        min=1,
        help="CPU threads for the model (default: $OMP_NUM_THREADS if set, else the cores this process may use); "
        "one inter-op thread.",
        show_default=False,
    ),
]

QuietOption = Annotated[
    bool, typer.Option("--quiet", help="No progress display (the live bar, or the plain lines in logs).")
]
ModelOption = Annotated[
    Optional[str],
    typer.Option(
        help="Local model folder, hub id or bundled demo (demo, demo-qwen, demo-tasks, demo-qwen-tasks; "
        "default: demo for POPE, demo-tasks for the other tasks)."
    ),
]
PopeOption = Annotated[Optional[list[Path]], typer.Option(help="POPE question file(s) (JSON Lines); repeatable.")]
TaskOption = Annotated[
    str, typer.Option(help="What the questions are: pope, or another registered task (docs/tasks.md).")
]
MaxNewTokensOption = Annotated[
    Optional[int],
    typer.Option(
        help=f"Tasks that generate (gqa): most tokens per answer, 1 to {MAX_NEW_TOKENS:,} and within the "
        "model's positions (default: the task's, docs/tasks.md).",
        show_default=False,
    ),
]
ConfidenceOption = Annotated[
    Optional[str],
    typer.Option(
        help="Tasks that generate: the confidence recorded, sequence (product of the answer's token "
        "probabilities) or mean-token (their geometric mean); default the task's (docs/tasks.md).",
        show_default=False,
    ),
]
QuestionsOption = Annotated[
    Optional[list[Path]],
    typer.Option(
        help="The task's question file(s) (any task; --pope names POPE's); repeatable. Parquet files of "
        "the lmms-eval datasets embed their images: no --images."
    ),
]
SplitOption = Annotated[Optional[str], typer.Option(help="Only this split: random, popular, adversarial or all.")]
ImagesOption = Annotated[Optional[Path], typer.Option(help="Folder with the questions' images.")]
AnnotationsOption = Annotated[Optional[Path], typer.Option(help="COCO instances file (object masks for retention).")]
LimitOption = Annotated[Optional[int], typer.Option(help="Only the first N questions.")]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
DtypeOption = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")]
PromptTemplateOption = Annotated[
    Optional[str], typer.Option(help="Prompt template name (LLaVA: llava_hf or vicuna_v1).")
]
ClipTextOption = Annotated[Optional[Path], typer.Option(help="CLIP text tower folder (CDPruner relevance).")]
"""The model and question inputs shared by ``run`` and ``study`` (one definition of each option)."""

STAGE_CHOICES = (
    "first (the earliest point tokens leave the model), last (the deepest stage that still feeds visual tokens) "
    "or a stage index 0, 1, ..."
)
"""The values of every --stage (parsed by prune_audit.records.stages.parse_stage)."""
STAGE_HELP = f"Stage whose retention and lost objects are read: {STAGE_CHOICES}"
"""Help of the analysis commands' --stage."""


def parse_epsilons(text: str, option: str) -> tuple[float, ...]:
    """ "0.01, 0.05" -> (0.01, 0.05): cascade targets, each strictly between 0 and 1, each once.

    A malformed or out-of-range entry is a PruneAuditError naming ``option`` and the entry.
    """
    from prune_audit.errors import PruneAuditError

    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise PruneAuditError(f"{option} takes comma-separated numbers, got {item.strip()!r}") from None
        if not 0.0 < value < 1.0:  # also refuses nan
            raise PruneAuditError(f"{option} takes numbers strictly between 0 and 1, got {item.strip()!r}")
        if value in values:
            raise PruneAuditError(f"{option} repeats {item.strip()!r}; list each entry once")
        values.append(value)
    return tuple(values)


USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, KeyError)


def command_line(name: str, command: Callable[..., Any], arguments: dict[str, Any]) -> str:
    """``prune-audit NAME`` and every option of ``command`` whose value in ``arguments`` (its ``locals()``)
    differs from its default: the command as parsed, however the CLI was invoked."""
    import inspect
    import shlex

    words = ["prune-audit", name]
    for option, parameter in inspect.signature(command).parameters.items():
        value = arguments[option]
        if value is None or value == parameter.default or value == []:
            continue
        flag = f"--{option.replace('_', '-')}"
        if isinstance(value, bool):  # a flag set to True (defaults are False)
            words.append(flag)
            continue
        for item in value if isinstance(value, list) else [value]:
            words += [flag, str(item)]
    return shlex.join(words)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise."""
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code)


BROKEN_PIPE = 141  # 128 + SIGPIPE, the shell's code for a writer whose reader went away


def handle_errors(command: F) -> F:
    """Turn user errors raised by a command into one line on stderr and exit code 2.

    Ctrl-C ends with exit code 130 (SIGTERM 143, SIGHUP 129: they end the same way) and a
    disk full with exit code 1, each with one line saying how many questions are saved and
    that the same command resumes. Set ``PRUNE_AUDIT_DEBUG=1`` to see the traceback instead.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from prune_audit.safety import progress

        progress.forget_saved()
        try:
            with progress.stops_like_ctrl_c():
                return command(*args, **kwargs)
        except KeyboardInterrupt as interrupt:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            raise fail(progress.interrupted_message(interrupt), progress.interrupt_exit_code(interrupt)) from None
        except BrokenPipeError:  # the reader stopped (`| head`): end quietly, as a shell tool does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
            raise typer.Exit(BROKEN_PIPE) from None
        except OSError as error:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            if progress.is_disk_full(error):
                raise fail(progress.disk_full_message(error), 1) from None
            raise fail(_one_line(error)) from None
        except USER_ERRORS as error:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            raise fail(_one_line(error)) from None

    return wrapper  # type: ignore[return-value]


def _one_line(error: BaseException) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, OSError) and error.filename:
        message = f"{error.strerror or message}: {error.filename}"
    return message


PLAIN_METAVARS = {str: "TEXT", int: "INTEGER", float: "FLOAT", Path: "PATH"}
"""Metavars as click and most command-line tools print them."""


def _plain_metavar(annotation: Any) -> str:
    """PATH, INTEGER, FLOAT or TEXT for a parameter's annotation; list[X] gives X's metavar."""
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    for kind, name in PLAIN_METAVARS.items():
        if isinstance(annotation, type) and issubclass(annotation, kind):
            return name
    return "TEXT"


def _range_text(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" {low} to {high}"
    return f" >= {low}" if low is not None else f" <= {high}"


def use_plain_metavars() -> None:
    """Make Typer's help show PATH / INTEGER / TEXT (and nothing for flags), arguments as RUN_DIRS.

    Typer >= 0.16 prints Python types instead (``<list[Path]>``, ``<bool>``, ``<int range>
    [x>=1]``) and arguments in lower case, required ones in braces (``{run_dirs}...``). Its
    parameter classes are patched once, only when they have the attributes this relies on;
    older Typer already prints click's metavars.
    """
    try:
        from typer.core import TyperArgument, TyperOption, _TyperParameter
    except ImportError:
        return
    if not hasattr(_TyperParameter, "display_type") or getattr(_TyperParameter, "_plain_metavars", False):
        return
    original = _TyperParameter.display_type

    def display_type(self: Any, ctx: Any) -> str | None:
        descriptor = getattr(self, "type_descriptor", None)
        if descriptor is None or descriptor.is_choice or getattr(self, "is_flag", False):
            return None if getattr(self, "is_flag", False) else original(self, ctx)
        metavar = _plain_metavar(descriptor.annotation)
        if descriptor.is_ranged:
            metavar += _range_text(self.min, self.max)
        return metavar

    _TyperParameter.display_type = display_type
    for cls in (TyperArgument, TyperOption):
        cls._get_number_range_help_str = lambda self: None  # the range is part of the metavar
    if hasattr(TyperArgument, "_usage_display_name"):
        TyperArgument._usage_display_name = _usage_name
        TyperArgument.display_name_raw = property(lambda self: self.metavar or (self.name or "").upper())
    _TyperParameter._plain_metavars = True


def _usage_name(argument: Any) -> str:
    """An argument in the usage line as click writes it: RUN_DIRS..., [IMAGE] (Typer >= 0.2x: {run_dirs}...)."""
    name = argument.display_name_raw if argument.required else f"[{argument.display_name_raw}]"
    return name + ("..." if argument.nargs != 1 else "")


use_plain_metavars()
