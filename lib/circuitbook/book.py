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
            if f"{nb.chapter}/{need}" not in seen:
                raise BookError(f"_toc.yml: {nb.label} needs {nb.chapter}/{need}, which must come before it")
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


def library_hash() -> str:
    """SHA-256 of every source file of the circuitbook package (names and bytes)."""
    pkg = Path(__file__).resolve().parent
    files = sorted(pkg.rglob("*.py"))
    stamp = tuple((f.as_posix(), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _library_hash(stamp)


@lru_cache(maxsize=8)
def _library_hash(stamp: tuple) -> str:
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    for name, _, _ in stamp:
        f = Path(name)
        h.update(f.relative_to(pkg).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def notebook_inputs(chapter: str, notebook: str, profile: str, overrides: dict | None = None,
                    _seen: tuple = ()) -> dict:
    """What a notebook's results depend on at `profile` with `overrides`, as hashes.

    The notebooks it `needs` contribute their own inputs' hashes (at the profile's values).
    """
    if notebook in _seen:
        raise BookError(f"{chapter}: notebooks need each other in a circle: {' -> '.join(_seen + (notebook,))}")
    resolved = params.resolve(chapter, notebook, profile, overrides)
    params.paper_values(chapter, notebook)  # a wrong `paper:` entry is refused before any compute too
    upstream = {n: inputs_hash(notebook_inputs(chapter, n, profile, None, _seen + (notebook,)))
                for n in params.needs(chapter, notebook)}
    # profiles.yml enters through the values it resolves to: editing another notebook's section, the
    # resources, the estimates or the paper's values and deviations changes no result
    inputs = {"notebook": _sha(notebook_path(chapter, notebook).read_bytes()),
              "params": _sha(canonical_json(dict(resolved)).encode()),
              "library": library_hash(), "upstream": upstream, "profile": profile}
    files = params.file_inputs(chapter, notebook, resolved)  # files enter by content, not by name
    if files:
        inputs["files"] = files
    return inputs


def inputs_hash(inputs: dict) -> str:
    return _sha(canonical_json(inputs).encode())


_WHAT = {"notebook": "the notebook changed", "params": "its parameters changed",
         "library": "the library code changed", "profile": "another profile"}


def what_changed(recorded: dict | None, current: dict) -> list[str]:
    """Why recorded inputs no longer match the current ones, in words ([] if they match)."""
    if not recorded:
        return ["the result records no inputs (written by an older version)"]
    out = [text for key, text in _WHAT.items() if recorded.get(key) != current.get(key)]
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
