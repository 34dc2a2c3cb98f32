"""The import graph of ``prune_audit``: no cycle anywhere, and no module of a lower layer imports a higher one.

The graph is read from the source with ``ast``, over every module of the package. Imports inside functions count
(they run, so they are real dependencies, and a cycle hidden in one breaks as soon as the two functions run in the
other order); ``if TYPE_CHECKING:`` ones do not (they never run). ``from x import y`` is an import of the module
``x.y`` when ``y`` is a module, of the submodule a lazy package (``prune_audit.lazy.lazy_exports``) serves ``y``
from, else of ``x``; ``import_module(f"x.{name}")`` (a package importing its built-in plugins) imports each module
of ``x`` whose name the file spells, and ``import_module(f"{__name__}.{name}")`` (a package discovering its modules
with ``pkgutil``) each of the package's own modules.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prune_audit"

LAYERS = (
    "(root)",
    "safety",
    "pruners",
    "compute",
    "data",
    "tasks",
    "records",
    "analysis",
    "models",
    "demo",
    "runner",
    "api",
    "cli",
)
"""Bottom to top (docs/architecture.md): ``(root)`` is ``errors.py``, ``__init__.py``, ``lazy.py``, ``integers.py``,
``threads.py``, ``plugins.py``, ``answer_modes.py``, ``record_columns.py`` and ``flop_convention.py``; ``safety``
(atomic writes, locks, ownership) needs only ``errors``; ``pruners`` are pure tensor code; ``compute`` is the
arithmetic of a question's cost; ``data`` the readers; ``tasks`` sits below ``records``, whose run schema is
assembled from the task registry (each task declares its own columns); ``analysis`` reads records and never the
runner; ``models`` is the only code touching transformers; ``api`` (the Python API and the lmms-eval plugin) sits
beside ``cli`` above the runner."""

TRANSFORMERS_OUTSIDE_MODELS = {"prune_audit.records.manifest"}
"""Modules outside ``models/`` that import transformers, each for a named reason: the manifest records its
version."""


# ----- reading the graph ------------------------------------------------------------------------------------------


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` by dotted name (a package by its own name); folders without an
    ``__init__.py`` (``assets/``) hold data, not modules."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if all((folder / "__init__.py").is_file() for folder in path.parents if folder.is_relative_to(root)):
            parts = path.relative_to(root.parent).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def run_time_tree(path: Path) -> ast.Module:
    """The file's syntax tree without its ``if TYPE_CHECKING:`` bodies (imports for annotations only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = [ast.Pass()]
    return tree


def lazy_exports_of(tree: ast.Module, package: str) -> dict[str, str]:
    """``name -> submodule`` of a package whose ``__init__`` serves names through ``lazy_exports`` (empty when
    it does not)."""
    constants = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            table = node.args[1]
            table = constants.get(table.id, table) if isinstance(table, ast.Name) else table
            assert isinstance(table, ast.Dict), f"{package}: lazy_exports needs a literal dict to be read"
            return {key.value: f"{package}.{value.value}" for key, value in zip(table.keys, table.values)}
    return {}


def imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every import in ``tree`` (relative ones resolved): ``name`` is what ``from module
    import name`` takes, None for ``import module``; ``import_module(f"prefix{...}")`` gives ``(prefix, *)``
    for each string constant of the file."""
    package = module if is_package else module.rpartition(".")[0]
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            found += [(source, alias.name) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.JoinedStr)
            and isinstance(node.args[0].values[0], ast.Constant)
        ):
            prefix = node.args[0].values[0].value
            found += [(f"{prefix}{text}", None) for text in strings]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.JoinedStr)
            and getattr(getattr(node.args[0].values[0], "value", None), "id", None) == "__name__"
        ):
            found.append((module, EVERY_MODULE))  # import_module(f"{__name__}.{m.name}") over pkgutil.iter_modules
    return found


EVERY_MODULE = "*"
"""The name ``imported_names`` gives a package's import of each of its own modules (``pkgutil`` discovery)."""


@functools.cache
def import_graph(root: Path = PACKAGE) -> Mapping[str, frozenset[str]]:
    """Each module of the package at ``root`` -> the package's modules it imports when it runs."""
    modules = package_modules(root)
    trees = {module: run_time_tree(path) for module, path in modules.items()}
    lazy = {
        module: lazy_exports_of(tree, module) for module, tree in trees.items() if modules[module].name == "__init__.py"
    }
    graph = {}
    for module, tree in trees.items():
        targets = set()
        for source, name in imported_names(tree, module, modules[module].name == "__init__.py"):
            if name == EVERY_MODULE:
                targets |= {other for other in modules if other.rpartition(".")[0] == source}
                continue
            submodule = f"{source}.{name}"
            targets.add(submodule if submodule in modules else lazy.get(source, {}).get(name, source))
        graph[module] = frozenset(target for target in targets if target in modules and target != module)
    return graph


def import_cycles(graph: Mapping[str, frozenset[str]]) -> list[list[str]]:
    """One shortest cycle (its path, first module repeated at the end) through each group of modules that import
    each other, directly or through others."""
    reach = {module: _reachable(graph, module) for module in graph}
    cycles, seen = [], set()
    for module in sorted(graph):
        group = {other for other in reach[module] if module in reach[other]}
        if module in seen or not group:
            continue
        seen |= group
        cycles.append(_shortest_cycle(graph, module))
    return cycles


def _reachable(graph: Mapping[str, frozenset[str]], start: str) -> set[str]:
    found, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in found:
            found.add(module)
            todo += graph[module]
    return found


def _shortest_cycle(graph: Mapping[str, frozenset[str]], start: str) -> list[str]:
    """Breadth first from ``start`` back to it."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def layer_of(module: str) -> str:
    """``prune_audit.x.y`` -> ``x`` when ``x`` is a subpackage, else ``(root)``."""
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "(root)"


# ----- the package ------------------------------------------------------------------------------------------------


def test_the_import_graph_has_no_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_every_package_is_placed_in_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(LAYERS) - {"(root)"}


@pytest.mark.parametrize("module", sorted(package_modules(PACKAGE)))
def test_no_module_imports_a_higher_layer(module):
    own = layer_of(module)
    upward = sorted(name for name in import_graph()[module] if LAYERS.index(layer_of(name)) > LAYERS.index(own))
    assert not upward, f"{module} ({own}) imports higher layers: {upward}"


def test_only_models_import_transformers():
    """The rest of the package runs without transformers' code paths (``models`` adapts it)."""
    importers = set()
    for module, path in package_modules(PACKAGE).items():
        names = imported_names(run_time_tree(path), module, path.name == "__init__.py")
        if any(source.split(".")[0] == "transformers" for source, _ in names) and layer_of(module) != "models":
            importers.add(module)
    assert importers == TRANSFORMERS_OUTSIDE_MODELS


def test_the_graph_reads_every_kind_of_import_the_package_uses():
    """Edges the reader must see (a missed kind of import would hide cycles): one inside a function, one of a
    submodule by ``from package import module``, one by ``import_module``."""
    graph = import_graph()
    assert "prune_audit.models.context" in graph["prune_audit.runner.questions"]  # inside check_prompts_fit
    assert "prune_audit.data.captions" in graph["prune_audit.demo.scene_questions"]  # from ... import captions
    assert "prune_audit.pruners.fastv" in graph["prune_audit.pruners"]  # import_module(f"{__name__}.{_}") discovery
    assert "prune_audit.tasks.gqa" in graph["prune_audit.tasks"]  # import_module(f"prune_audit.tasks.{_}")


def test_a_cycle_hidden_inside_functions_is_found_with_its_path(tmp_path):
    """The reader on a package of its own: ``a -> b`` at module level, ``b -> c`` and ``c -> a`` inside functions,
    ``c -> d`` only for type checking; ``e`` takes a name the lazy package serves from ``d``."""
    root = tmp_path / "pkg"
    root.mkdir()
    files = {
        "__init__.py": "__getattr__, __dir__ = lazy_exports(__name__, {'h': 'd'})\n",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from pkg.c import g\n",
        "c.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
            "def g():\n    from . import a\n"
        ),
        "d.py": "import pkg.c\nh = 1\n",
        "e.py": "def k():\n    from pkg import h\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    graph = import_graph(root)
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.c"} and graph["pkg.e"] == {"pkg.d"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_runner_annotations_name_real_types():
    """``Any`` only as the value type of JSON-like dicts (manifests, reports); everything else is typed."""
    loose = []
    for path in sorted((PACKAGE / "runner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            annotations = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                annotations = [a.annotation for a in (*node.args.args, *node.args.kwonlyargs) if a.annotation]
                annotations += [node.returns] if node.returns else []
            elif isinstance(node, ast.AnnAssign):
                annotations = [node.annotation]
            for annotation in annotations:
                text = ast.unparse(annotation).replace("dict[str, Any]", "")
                if "Any" in text:
                    loose.append(f"{path.relative_to(PACKAGE)}:{annotation.lineno} {ast.unparse(annotation)}")
    assert not loose, loose


def test_no_private_model_method_is_called_from_outside_its_class():
    """The prefill's assembly, the accounting and the runner use the model's public surface: a ``_name`` method of
    ``VisionLanguageModel`` or a family adapter is reached only through ``self``/``cls``/``super()`` (the hooks
    the prefill reads, such as ``full_positions`` and ``input_row``, are public)."""
    private = set()
    for path in sorted((PACKAGE / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any("Model" in ast.unparse(base) for base in node.bases):
                private |= {
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef)
                    and item.name.startswith("_")
                    and not item.name.startswith("__")
                }
    assert {"_vision", "_layer_positions"} <= private  # the reader finds the family hooks
    outside = []
    for module, path in package_modules(PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = ast.unparse(node.value)
                if owner not in ("self", "cls") and not owner.startswith("super("):
                    outside.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert not outside, outside
