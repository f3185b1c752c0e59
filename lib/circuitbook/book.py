"""The book's structure and what each notebook's results depend on.

`_toc.yml` gives the notebooks in reading order; `profiles.yml` says which
notebooks each one reads runs from (`needs`). A notebook's *inputs* at a
profile are the hashes of its file, its resolved parameters, the library's
source and the inputs of the notebooks it needs.
The build caches an execution under the hash of these inputs, the results a
notebook records carry them, and the scorecard grades a result only while
they still match the current sources (otherwise the row is `stale`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from . import params
from .runs import canonical_json, repo_root


class BookError(RuntimeError):
    """The book's table of contents or notebook order is wrong."""


class NotebookError(params.ParameterError):
    """A notebook of the book that cannot be executed as it is (unreadable, or without its parameters cell)."""


@dataclass
class Notebook:
    path: str  # relative to the repo, with .ipynb
    chapter: str
    name: str  # file stem
    input_hash: str = ""
    needs: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.chapter}/{self.name}"


def toc_files(root: Path | None = None) -> list[str]:
    """Every `file:` of _toc.yml in reading order (root first)."""
    root = root or repo_root()
    toc = params.load_yaml(root / "_toc.yml")
    if not isinstance(toc, dict) or "root" not in toc:
        raise BookError(f"{root / '_toc.yml'}: needs a mapping with 'root' (and 'parts' or 'chapters')")
    out = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                out.append(node["file"])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key, []) or []:
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(toc)
    return out


def book_notebooks(root: Path | None = None) -> list[Notebook]:
    """The notebooks of the book in _toc.yml order, with their chapters."""
    root = root or repo_root()
    nbs = []
    for f in toc_files(root):
        path = Path(f).with_suffix(".ipynb")
        if not (root / path).exists():
            continue
        parts = path.parts
        chapter = parts[1] if parts[0] == "chapters" else params.BOOK_PSEUDO_CHAPTER
        nbs.append(Notebook(path.as_posix(), chapter, path.stem, needs=params.needs(chapter, path.stem)))
    _check_order(nbs)
    return nbs


def _check_order(nbs: list[Notebook]) -> None:
    seen: set[str] = set()
    for nb in nbs:
        for need in nb.needs:
            if need not in seen:
                raise BookError(f"_toc.yml: {nb.label} needs {need}, which must come before it")
        seen.add(nb.label)


def check_notebooks(nbs: list[Notebook], root: Path | None = None) -> None:
    """Every notebook is readable and has its `parameters` cell (the notebook contract), checked before
    any of them runs: a damaged notebook is named here, whichever chapter a build executes."""
    import ast

    import nbformat

    root = root or repo_root()
    for nb in nbs:
        try:
            cells = nbformat.read(root / nb.path, as_version=4).cells
        except Exception as e:  # noqa: BLE001 - truncated JSON, not a notebook, unreadable file
            raise NotebookError(f"{nb.path} is not a readable notebook ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:120] if str(e) else 'no message'}); restore it "
                                "from git (git checkout -- FILE)") from None
        tagged = [c for c in cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
        names = set()
        for cell in tagged:
            try:
                names |= {t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)
                          for t in node.targets if isinstance(t, ast.Name)}
            except SyntaxError:
                pass
        if not {"profile", "params"} <= names:
            raise NotebookError(f"{nb.path} has no code cell tagged 'parameters' that sets profile and params "
                                "(the notebook contract, CONTRIBUTING.md): papermill would have nowhere to put "
                                "the profile; restore the cell")


def notebook_path(chapter: str, notebook: str) -> Path:
    return params.chapter_dir(chapter) / f"{notebook}.ipynb"


PACKAGE = Path(__file__).resolve().parent
# How and where work runs, never what it computes (chunking changes no number beyond float rounding):
# like a run's key, a notebook's inputs leave these out.
SCHEDULING = ("cluster.py", "log.py", "training/chunks.py", "training/planning.py", "training/device.py")


def library_hash(chapter: str, notebook: str) -> dict[str, str]:
    """{module file: `runs.source_digest`} of every library module the notebook's code can run: the
    modules its cells import and, transitively, what those import (read from the source, function-level
    imports included). Editing another module, or a comment or docstring, leaves its results fresh."""
    from .runs import source_digest

    roots = _notebook_imports(notebook_path(chapter, notebook))
    return {rel: _cached(source_digest, PACKAGE / rel) for rel in sorted(_import_closure(roots))}


def _cached(fn, path: Path):
    st = path.stat()
    return _cached_call(fn, str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4096)
def _cached_call(fn, path: str, _mtime: int, _size: int):
    return fn(Path(path))


def _library_imports(path: Path) -> tuple[str, ...]:
    """The circuitbook modules one library file imports (at any depth)."""
    import ast

    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    package = ".".join(parts if rel.name == "__init__" else parts[:-1])
    found = _imports_of(ast.parse(path.read_text()), package)
    return tuple(sorted(m for m in found if m == "circuitbook" or m.startswith("circuitbook.")))


def _notebook_imports(path: Path) -> set[str]:
    """The circuitbook modules the code cells of a notebook import (dotted names)."""
    import ast

    import nbformat

    found = set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))))
        except SyntaxError:
            continue
        found |= _imports_of(tree, package=None)
    return {m for m in found if m == "circuitbook" or m.startswith("circuitbook.")}


def _imports_of(tree, package: str | None) -> set[str]:
    """Dotted module names an AST imports (relative ones resolved against `package`); `from X import y`
    counts X and X.y (y may be a submodule)."""
    import ast

    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _module_file(name: str) -> Path | None:
    """The source file of a circuitbook module (package: its __init__.py), None if it is not one."""
    parts = name.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _import_closure(roots: set[str]) -> set[str]:
    """Files (relative to the package) of the modules `roots` import, transitively, with the
    `__init__.py` of every package on the way (importing a.b.c runs a and a.b first)."""
    todo, seen = [r for r in roots], set()
    while todo:
        name = todo.pop()
        chain = name.split(".")
        for i in range(1, len(chain) + 1):
            mod = ".".join(chain[:i])
            f = _module_file(mod)
            if f is None or f in seen:
                continue
            seen.add(f)
            if f.relative_to(PACKAGE).as_posix() not in SCHEDULING:  # what scheduling code imports is its business
                todo.extend(_cached(_library_imports, f))
    return {f.relative_to(PACKAGE).as_posix() for f in seen} - set(SCHEDULING)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def notebook_inputs(chapter: str, notebook: str, profile: str, overrides: dict | None = None,
                    _seen: tuple = ()) -> dict:
    """What a notebook's results depend on at `profile` with `overrides`, as hashes.

    The notebooks it `needs` contribute their own inputs' hashes (at the profile's values).
    """
    if f"{chapter}/{notebook}" in _seen:
        raise BookError(f"notebooks need each other in a circle: {' -> '.join(_seen + (f'{chapter}/{notebook}',))}")
    resolved = params.resolve(chapter, notebook, profile, overrides)
    params.paper_values(chapter, notebook)  # a wrong `paper:` entry is refused before any compute too
    upstream = {}
    for label in params.needs(chapter, notebook):
        other, name = label.split("/", 1)
        key = name if other == chapter else label  # another chapter's notebook by its full label
        upstream[key] = inputs_hash(notebook_inputs(other, name, profile, None, _seen + (f"{chapter}/{notebook}",)))
    # profiles.yml enters through the values it resolves to: editing another notebook's section, the
    # resources, the estimates or the paper's values and deviations changes no result
    inputs = {"notebook": _sha(notebook_path(chapter, notebook).read_bytes()),
              "params": _sha(canonical_json(dict(resolved)).encode()),
              "library": library_hash(chapter, notebook), "upstream": upstream, "profile": profile,
              "environment": environment_hash()}
    files = params.file_inputs(chapter, notebook, resolved)  # files enter by content, not by name
    if files:
        inputs["files"] = files
    return inputs


def inputs_hash(inputs: dict) -> str:
    return _sha(canonical_json(inputs).encode())


_WHAT = {"notebook": "the notebook changed", "params": "its parameters changed", "profile": "another profile",
         "environment": "the environment changed"}
LOCK_FILE = "requirements.lock"


def environment_hash() -> str:
    """SHA-256 of the environment's lock file (`requirements.lock`: every package and version `make`
    installs), so a results file graded fresh was produced with the environment the book declares."""
    path = repo_root() / LOCK_FILE
    return _sha(path.read_bytes()) if path.exists() else "no lock file"


def what_changed(recorded: dict | None, current: dict) -> list[str]:
    """Why recorded inputs no longer match the current ones, in words ([] if they match)."""
    if not recorded:
        return ["the result records no inputs (written by an older version)"]
    out = [text for key, text in _WHAT.items() if recorded.get(key) != current.get(key)]
    old_lib, new_lib = recorded.get("library"), current.get("library")
    if old_lib != new_lib:
        if isinstance(old_lib, dict) and isinstance(new_lib, dict):
            changed = sorted(m for m in set(old_lib) | set(new_lib) if old_lib.get(m) != new_lib.get(m))
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            out.append(f"the library code changed ({shown})")
        else:
            out.append("the library code changed")
    old_up, new_up = recorded.get("upstream") or {}, current.get("upstream") or {}
    old_files, new_files = recorded.get("files") or {}, current.get("files") or {}
    out += [f"the file {n} names changed" for n in sorted(set(old_files) | set(new_files))
            if old_files.get(n) != new_files.get(n)]
    out += [f"upstream {n} changed" for n in sorted(set(old_up) | set(new_up)) if old_up.get(n) != new_up.get(n)]
    return out


def compute_hashes(nbs: list[Notebook], profile: str) -> None:
    """Fill every notebook's inputs and input hash (validates every notebook's parameters)."""
    for nb in nbs:
        nb.inputs = notebook_inputs(nb.chapter, nb.name, profile)
        nb.input_hash = inputs_hash(nb.inputs)
