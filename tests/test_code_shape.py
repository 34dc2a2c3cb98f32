"""The shape of the code: what the old 400-line module counter was meant to protect.

Modules are split by concept, never by a line counter; what stays bounded is the length of a function
(one that does one thing reads at once) and the name of a module (it names its concept, not its version).
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prune_audit"

MAX_FUNCTION_LINES = 60
"""From the ``def`` line to the last line of the body (``end_lineno - lineno + 1``): the docstring counts,
decorators do not. ``cli/`` is exempt: a Typer command spells out its options in its signature."""

EXEMPT_FOLDERS = ("cli",)

LONG_FUNCTIONS = {
    "models/build.py::build_llava": "one transformers config literal per tiny-model part, then save",
    "models/build.py::build_qwen2_5_vl": "one transformers config literal per tiny-model part, then save",
    "models/internvl.py::build_internvl": "one transformers config literal per tiny-model part, then save",
    "models/llava_next.py::build_llava_next": "one transformers config literal per tiny-model part, then save",
    "models/llava_onevision.py::build_llava_onevision": "one transformers config literal per tiny-model part, then save",
    "models/qwen2_vl.py::build_qwen2_vl": "one transformers config literal per tiny-model part, then save",
    "models/qwen3_vl.py::build_qwen3_vl": "one transformers config literal per tiny-model part, then save",
    "models/loading.py::load_vlm": "one loading path (folder or hub id, family, dtype, device, attention) with its refusals",
    "models/base.py::VisionLanguageModel.prefill": "the pruned prefill's three phases (vision, selection, LLM) on one clock",
    "runner/plan.py::plan_run": "the run's checks in their one order: every refusal before anything loads or is written",
    "analysis/figures.py::reliability_diagram": "one figure laid out element by element (ruff format's layout)",
    "analysis/study_figures.py::lost_objects": "one figure laid out element by element (ruff format's layout)",
    "models/accounting.py::question_cost": "one question's cost: every field of QuestionTokens filled in one place",
    "models/layer_signals.py::layer_signals": "one LayerSignals filled field by field from what the plan requires",
    "pruners/similarity.py::facility_location_greedy": "one greedy loop with its incremental gains; its docstring "
    "states the algorithm",
    "pruners/fidelity.py::fidelity_markdown": "docs/fidelity.md's prose, verbatim, then its table",
    "data/geometry.py::clip_geometry": "one pipeline (pad, resize, crop) as transformers' PilBackend runs it",
    "safety/ownership.py::check_output_dir": "one ordered list of refusals of an output folder",
}
"""Functions over the bound today, each one concept, with why (``module path::qualified name``)."""

VERSIONED_NAME = re.compile(r"(^|_)(v\d+|new|old|final|copy|tmp|backup)(_|$)|(^|_)\d{4,}(_|$)")
"""A version, a date or a stage of editing in a module's or folder's name (``pope_v2``, ``new_runner``,
``plan_2026``); a name carrying its concept's own number (``qwen2_vl``, ``v2drop``, ``sparsevlm2``) passes."""


def function_lengths(path: Path) -> dict[str, int]:
    """``qualified name -> lines`` of every function and method in ``path`` (nested ones as ``f.<locals>.g``)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return lengths


def bounded_modules() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).parts[0] not in EXEMPT_FOLDERS]


def all_lengths() -> dict[str, int]:
    return {
        f"{path.relative_to(PACKAGE).as_posix()}::{name}": lines
        for path in bounded_modules()
        for name, lines in function_lengths(path).items()
    }


def test_no_function_outside_cli_is_over_60_lines_but_the_named_exceptions():
    long = {
        name: lines
        for name, lines in all_lengths().items()
        if lines > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS
    }
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines: {long}; split them by concept, or name one that "
        f"is one concept in LONG_FUNCTIONS with its reason"
    )


def test_every_named_long_function_still_exists_and_is_still_long():
    lengths = all_lengths()
    stale = {name: lengths.get(name) for name in LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES}
    assert not stale, f"delete these LONG_FUNCTIONS entries (gone, or now within the bound): {stale}"


def test_function_lengths_count_from_def_to_the_last_line_without_decorators(tmp_path):
    source = tmp_path / "shape.py"
    source.write_text(
        '@decorator\ndef f():\n    """Doc."""\n    def g():\n        return 1\n    return g\n\n\n'
        "class C:\n    def m(self):\n        pass\n"
    )
    assert function_lengths(source) == {"f": 5, "f.<locals>.g": 2, "C.m": 2}


def test_no_module_or_package_name_is_versioned_or_dated():
    versioned = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if any(VERSIONED_NAME.search(part.removesuffix(".py")) for part in path.relative_to(PACKAGE).parts)
    ]
    assert not versioned, f"name the concept, not its version: {versioned}"


def test_the_versioned_name_pattern_tells_a_version_from_a_concept_number():
    for name in (
        "pope_v2",
        "v3",
        "new_runner",
        "runner_new",
        "plan_old",
        "fidelity_final",
        "scores_2026",
        "20261205_plan",
    ):
        assert VERSIONED_NAME.search(name), name
    for name in (
        "qwen2_vl",
        "qwen3_vl",
        "v2drop",
        "sparsevlm2",
        "llava_next",
        "newline",
        "renewal",
        "tome",
        "e2s",
        "scope",
    ):
        assert not VERSIONED_NAME.search(name), name
