"""Layering: no module of a lower layer imports a higher one (read from the import statements).

Lazy imports inside functions count too: they run, so they are real dependencies.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prune_audit"

LAYERS = (
    "(root)", "safety", "pruners", "compute", "data", "tasks", "records", "analysis", "models", "demo", "runner",
    "api", "cli",
)
"""Bottom to top (docs: /work/shared/specs/architecture.md): ``(root)`` is ``errors.py``, ``__init__.py``,
``lazy.py``, ``integers.py``, ``threads.py``, ``answer_modes.py``, ``plugins.py`` and ``record_columns.py``; ``tasks`` sits below
``records``, whose run schema is assembled from the task registry (each task declares its own columns); ``api`` (the Python API and the lmms-eval
plugin) sits beside ``cli`` above the runner; ``safety`` (atomic writes, locks, ownership) needs only ``errors``."""


def layer_of(module: str) -> str:
    """``prune_audit.x.y`` -> ``x`` when ``x`` is a subpackage, else ``(root)``."""
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "(root)"


def imported_modules(path: Path) -> list[str]:
    """Every ``prune_audit`` module imported anywhere in the file (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.append(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.append(node.module)
    return [name for name in found if name == "prune_audit" or name.startswith("prune_audit.")]


def test_every_package_is_placed_in_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(LAYERS) - {"(root)"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    own = layer_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    upward = [name for name in imported_modules(path) if LAYERS.index(layer_of(name)) > LAYERS.index(own)]
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports higher layers: {upward}"


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


def test_models_import_graph_has_no_cycle():
    """No import cycle among ``prune_audit.models`` modules (lazy imports count; ``TYPE_CHECKING`` ones do not:
    they never run)."""
    import graphlib

    models = PACKAGE / "models"
    graph = {}
    for path in sorted(models.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # drop ``if TYPE_CHECKING:`` bodies before reading the imports
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
        own = f"prune_audit.models.{path.stem}"
        graph[own] = {name for name in _imports_in(tree, own) if name.startswith("prune_audit.models.")} - {own}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def _imports_in(tree: ast.AST, module: str) -> set[str]:
    """Absolute ``prune_audit`` module names imported in ``tree`` (``from x import y`` also as ``x.y``, which
    may be a module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if (PACKAGE.parent / (name.replace(".", "/") + ".py")).is_file()}
