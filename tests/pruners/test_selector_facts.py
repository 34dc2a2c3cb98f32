"""Issue 39 item 1: the selector class is the one place a selector is described.

Its FLOP formula (``flops``, ``flops_exact``), its fidelity row (``fidelity``, next to ``reference``) and its layout
traits (``layout_need``, ``per_crop_grid``, ``per_grid``) live on the class; the FLOP accounting, the fidelity
table and the families' support tables are computed from the registry, so no module outside ``prune_audit/pruners/``
spells a registered selector's name (``test_no_module_outside_pruners_names_a_selector``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from prune_audit.models.families import adapter_for, family_names
from prune_audit.pruners import list_selectors, selector_class
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, Reference
from prune_audit.pruners.fidelity import fidelity_entries, fidelity_rows
from prune_audit.pruners.layout import ONE_CLS, ONE_GRID, PADDED_CROP_GRID, PRE_PROJECTOR_FEATURES

PACKAGE = Path(__file__).resolve().parents[2] / "prune_audit"

#: modules outside pruners/ that may spell a registered selector's name, and why: user-facing data whose order
#: or choice is the module's own (a default grid, a reproduced study), or the same word for something else
NAMED_EXCEPTIONS = {
    "analysis/reproduce.py": (
        {"fastv", "cls_attn", "coverage", "cdpruner", "divprune", "random"},
        "the reproduced study's grid and timing selector, and POPE's random split",
    ),
    "runner/study/defaults.py": (
        {"fastv", "divprune", "downsample"},
        "the default study grid and --subset difficult's baseline (imports nothing: CLI start-up)",
    ),
    "runner/visualize.py": (
        {"fastv", "sparsevlm", "visionzip", "divprune", "cdpruner", "random"},
        "the selectors visualize draws by default, in its drawing order",
    ),
    "data/pope.py": ({"random"}, "POPE's random split, not the selector"),
    "cli/intervene.py": ({"random"}, "intervene's random control swaps, not the selector"),
    "cli/main.py": ({"fitprune"}, "the command group fitting FitPrune's schedule (imports nothing: CLI start-up)"),
    "runner/intervene/plan.py": ({"random"}, "intervene's random control swaps, not the selector"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants in ``tree`` (their examples may name a selector, as a user would)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def selector_names_spelled(path: Path, names: set[str]) -> set[str]:
    """The registered names ``path`` holds as string literals outside docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
    }


def test_no_module_outside_pruners_names_a_selector():
    names = set(list_selectors())
    spelled = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("pruners/"):
            continue
        found = selector_names_spelled(path, names) - NAMED_EXCEPTIONS.get(module, (set(), ""))[0]
        if found:
            spelled[module] = sorted(found)
    assert not spelled, f"move these facts onto the selector classes (or name the exception and why): {spelled}"


def test_the_scan_sees_a_selector_name_but_not_a_docstring(tmp_path):
    source = tmp_path / "module.py"
    source.write_text('"""Run ``fastv``: fastv"""\nGRID = ("fastv", "tome")\nWORD = "fastv is fast"\n')
    assert selector_names_spelled(source, set(list_selectors())) == {"fastv", "tome"}


@dataclass
class _Plugin(InputSelector):
    """A selector as a plugin might write it: no formula, no fidelity row, no layout traits."""

    name: ClassVar[str] = "plugin_like"
    reference: ClassVar[Reference] = Reference("-", "-")


def test_a_selector_without_declared_facts_counts_zero_nominal_flops_and_has_no_row():
    assert _Plugin.flops(SelectorWork(tokens=576, kept=64, feature_width=4096)) == 0
    assert _Plugin.flops_exact is False and _Plugin.fidelity is None
    assert (_Plugin.layout_need, _Plugin.per_crop_grid, _Plugin.per_grid) == ("", False, "")


def test_every_builtin_selector_carries_its_fidelity_row_and_the_table_reads_it():
    entries = fidelity_entries()
    assert list(entries) == list_selectors()
    for name, entry in entries.items():
        assert vars(selector_class(name))["fidelity"] is entry  # on the class itself, not inherited
    assert [row["selector"] for row in fidelity_rows()] == list_selectors()


def test_a_selector_flops_formula_is_its_own_arithmetic():
    work = SelectorWork(tokens=576, kept=64, feature_width=4096, vision_width=1024)
    assert selector_class("scope").flops(work) == 2 * 576 * 1024 * 576 and selector_class("scope").flops_exact
    assert selector_class("fastv").flops(work) == 0 and selector_class("fastv").flops_exact
    assert selector_class("cdpruner").flops_exact is False  # nominal: the speculative rows vary with the data


LAYOUT_NEEDS = {
    "hiprune": ONE_GRID,
    "visionzip": ONE_CLS,
    "vscan": PADDED_CROP_GRID,
    "pool": PRE_PROJECTOR_FEATURES,
    "downsample": PRE_PROJECTOR_FEATURES,
}
FAMILY_REFUSALS = {
    "llava_next": {"hiprune": ONE_GRID, "visionzip": ONE_CLS, "vscan": PADDED_CROP_GRID},
    "llava_onevision": {
        "hiprune": ONE_GRID,
        "visionzip": ONE_CLS,
        "vscan": PADDED_CROP_GRID,
        "pool": PRE_PROJECTOR_FEATURES,
        "downsample": PRE_PROJECTOR_FEATURES,
    },
}
PER_GRID = {
    "llava_next": {"downsample", "e2s", "pool", "tome", "uniform"},
    "llava_onevision": {"e2s", "tome", "uniform"},
    "internvl": {"downsample", "e2s", "pool", "tome", "uniform"},
}


def test_selectors_declare_their_layout_needs():
    assert {
        name: selector_class(name).layout_need for name in list_selectors() if selector_class(name).layout_need
    } == LAYOUT_NEEDS
    assert {name for name in list_selectors() if selector_class(name).per_crop_grid} == {
        "hiprune",
        "visionzip",
        "vscan",
    }


@pytest.mark.parametrize("family", family_names())
def test_family_support_tables_are_the_match_of_selector_and_family_traits(family):
    adapter = adapter_for(family, "test")
    lacks = getattr(adapter, "lacks", frozenset())
    assert dict(adapter.refused_selectors) == FAMILY_REFUSALS.get(family, {})
    assert dict(adapter.refused_selectors) == {name: need for name, need in LAYOUT_NEEDS.items() if need in lacks}
    assert adapter.crop_grid_selectors == {
        name
        for name in FAMILY_REFUSALS.get(family, {})
        if LAYOUT_NEEDS[name] != PRE_PROJECTOR_FEATURES  # no per-crop run of it
    }
    assert set(adapter.per_grid_selectors) == PER_GRID.get(family, set())
    for how in adapter.per_grid_selectors.values():  # the family's prose for the selector's kind
        assert how.startswith("per tile: " if family == "internvl" else "per grid: ")


@pytest.mark.parametrize(
    ("document", "heading"),
    [("docs/models.md", "## Selectors per family")],
)
def test_docs_support_tables_are_generated_from_the_traits(document, heading):
    """The families x selectors table in each document is ``support_table()`` byte for byte (regenerate it with
    ``python -c "from prune_audit.models.families import support_table; print(support_table(), end='')"``)."""
    from prune_audit.models.families import support_table

    section = (PACKAGE.parent / document).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    table = "".join(line + "\n" for line in section.splitlines() if line.startswith("|"))
    assert table == support_table()
