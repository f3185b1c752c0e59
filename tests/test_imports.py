"""The library's import graph: no circles, chapters apart, Ray at the edge.

Read statically from the source (every `import`, at module level or inside a function: a lazy import that
closes a circle is still a circle, it only moves the failure to the first call)."""
import ast
from pathlib import Path

import pytest

import circuitbook

PACKAGE = Path(circuitbook.__file__).parent


def _module_name(path: Path, root: Path) -> tuple[str, list[str]]:
    """(dotted name, the package its relative imports start from) of a source file under `root`."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), parts
    return ".".join(parts), parts[:-1]


def _imported(tree: ast.AST, package: list[str], top: str) -> set[str]:
    """Every module of `top` a module imports, with `from x import name` counted as x and as x.name (the
    name may be a submodule); `from . import name` counts only name (the package importing its own
    submodule does not depend on what its `__init__` imports)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == top:
                base = node.module.split(".")
            else:
                continue
            if node.module:  # `from . import x` depends on x, not on what the package's __init__ imports
                out.add(".".join(base))
            out.update(".".join(base + [a.name]) for a in node.names)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (only names that are modules of the package)."""
    names, trees = {}, {}
    for path in sorted(root.rglob("*.py")):
        name, package = _module_name(path, root)
        names[name] = package
        trees[name] = ast.parse(path.read_text(), filename=str(path))
    return {name: {d for d in _imported(trees[name], names[name], root.name) if d in names and d != name}
            for name in names}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_lazy_import_that_closes_a_circle_is_found(tmp_path):
    root = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from ..b.y import f\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from ..a import x  # lazy, still a circle\n    return x\n",
        "c.py": "from . import a\nimport pkg.b.y\n",
    })
    graph = import_graph(root)
    assert graph["pkg.c"] == {"pkg.a", "pkg.b.y"}
    assert graph["pkg.b.y"] == {"pkg.a", "pkg.a.x"}  # `from ..a import x` runs pkg.a's __init__, then x
    assert circles(graph) == [["pkg.a.x", "pkg.b.y"]]


def test_no_module_graph_without_circles_is_reported(tmp_path):
    root = _write(tmp_path / "pkg", {"__init__.py": "from . import a\n", "a.py": "import os\n"})
    assert circles(import_graph(root)) == []


def test_the_library_has_no_import_circles(graph):
    assert circles(graph) == []


def test_no_chapter_package_imports_another(graph):
    """A chapter reads another chapter's runs through `cb.chapter_runs` (that chapter's registry), never by
    importing its package, so each chapter can change alone."""
    def chapter(module):
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "experiments" else None

    crossings = {m: sorted(d for d in deps if chapter(d) not in (None, chapter(m)))
                 for m, deps in graph.items() if chapter(m)}
    assert {m: d for m, d in crossings.items() if d} == {}


def test_the_library_outside_the_chapters_imports_no_chapter(graph):
    """`plan.py`, the builder and the trainer find chapters through their registries (by name), so adding a
    chapter edits no library module outside `experiments/<chapter>/`."""
    outside = {m: sorted(d for d in deps if d.startswith("circuitbook.experiments."))
               for m, deps in graph.items() if not m.startswith("circuitbook.experiments")}
    assert {m: d for m, d in outside.items() if d} == {}


def test_training_never_imports_the_cluster(graph):
    """Ray stays at the edge: the loop, the ensemble and chunking run without `cluster.py`."""
    reached, todo = set(), [m for m in graph if m.startswith("circuitbook.training")]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(graph[m])
    assert "circuitbook.cluster" not in reached
