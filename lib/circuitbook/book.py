"""The book's structure and what each notebook's results depend on.

`_toc.yml` gives the notebooks in reading order; `profiles.yml` says which
notebooks each one reads runs from (`needs`). A notebook's *inputs* at a
profile are the hashes of its file, its resolved parameters, the library's
source, the environment the book declares, and, for each notebook it needs,
that notebook's inputs and the identity of its recorded results (so a notebook
that read another's values is executed again when that one is).
The build caches an execution under the hash of these inputs, the results a
notebook records carry them, and the scorecard grades a result only while
they still match the current sources and it was recorded in a declared
environment (otherwise the row is `stale`, `stale_reasons`).
"""
from __future__ import annotations

import hashlib
import json
import platform
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from . import params
from .runs import canonical_json, repo_root, runs_root
from .settings import check_label


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
SCHEDULING = ("cluster.py", "log.py", "training/chunks.py", "training/planning.py", "training/device.py",
              "training/capture.py")


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
        # its inputs, and which of its executions is on record (what `claims.recorded_values` would read)
        upstream[key] = {"inputs": inputs_hash(notebook_inputs(other, name, profile, None,
                                                               _seen + (f"{chapter}/{notebook}",))),
                         "results": results_identity(other, name, profile)}
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


# ---------------------------------------------------------------- recorded results

def results_file(chapter: str, notebook: str, label: str) -> Path:
    """Where a notebook's results under `label` are kept (`context.results_path`)."""
    return runs_root() / "results" / check_label(label) / chapter / f"{notebook}.json"


SEALED_LATER = ("seal", "provenance")  # added when the record is sealed, after its notebook was written


def results_digest(data: dict) -> str:
    """SHA-256 of a results record as its execution wrote it (canonical JSON, without the seal and the
    provenance added when it is stored): its executed notebook carries it, and it stays the same when an
    imported record is sealed again by this store."""
    body = {k: v for k, v in data.items() if k not in SEALED_LATER}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def results_identity(chapter: str, notebook: str, label: str) -> str:
    """Which execution of a notebook is on record under `label`: `not executed`, `damaged`, or its status
    and the digest of its record. It enters the inputs of the notebooks that need this one, so they are
    executed again when it is (they may have read its values); re-sealing on import leaves it unchanged."""
    path = results_file(chapter, notebook, label)
    if not path.exists():
        return "not executed"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return "damaged"
    if not isinstance(data, dict):
        return "damaged"
    return f"{data.get('status')}:{results_digest(data)[:20]}"


# ---------------------------------------------------------------- the environment

LOCK_FILE = "requirements.lock"
DEVICE_PACKAGES = "scripts/device/packages.yml"


@dataclass(frozen=True)
class Declared:
    """An environment the book declares: a name, the file that declares it, the Python it asks for
    (major.minor, or None) and {canonical package name: version}."""
    name: str
    source: str
    says: str  # how a difference is worded: "requirements.lock says", "the device image declares"
    python: str | None
    versions: dict


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    """The version of a distribution as installed here (importlib.metadata), None if it is not."""
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def python_version() -> str:
    return platform.python_version()


def declared_environments() -> list[Declared]:
    """The environments the book declares: the locked one (requirements.lock: what `make setup` installs,
    every package pinned) and, when scripts/device/packages.yml exists, the GPU image's (the carried wheels
    and the image's packages of known version; null entries are not compared)."""
    root = repo_root()
    lock = root / LOCK_FILE
    pins = {}
    if lock.exists():
        for line in lock.read_text().splitlines():
            name, sep, version = line.split("#", 1)[0].strip().partition("==")
            if sep:  # `name==version`; the lock holds nothing else (`make lock` writes it)
                pins[canonical_name(name.strip())] = version.strip()
    out = [Declared("the locked environment", LOCK_FILE if lock.exists() else f"no {LOCK_FILE}",
                    f"{LOCK_FILE} says", None, pins)]
    device = _device_declaration(root / DEVICE_PACKAGES)
    if device is not None:
        out.append(device)
    return out


def _device_declaration(path: Path) -> Declared | None:
    if not path.exists():
        return None
    st = path.stat()
    return _device_cached(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _device_cached(path: str, _mtime: int, _size: int) -> Declared:
    spec = params.load_yaml(Path(path)) or {}
    if not isinstance(spec, dict):
        raise params.ParameterError(f"{path}: needs a mapping with python, carried and image")
    versions = {}
    for section in ("carried", "image"):
        for name, version in (spec.get(section) or {}).items():
            if version is not None:
                versions[canonical_name(str(name))] = str(version)
    python = str(spec["python"]) if spec.get("python") is not None else None
    return Declared("device image", DEVICE_PACKAGES, "the device image declares", python, versions)


def installed_environment() -> dict[str, str | None]:
    """{package: version installed here, or None} for every package a declared environment names, and
    `python`: the environment as installed, not as locked."""
    names = sorted({n for d in declared_environments() for n in d.versions})
    out = {name: installed_version(name) for name in names}
    out["python"] = python_version()
    return out


def _same_version(installed: str | None, declared: str | None) -> bool:
    """Equal public versions: torch 2.11.0+cu130 is the image's torch 2.11.0."""
    return installed is not None and declared is not None and installed.split("+")[0] == declared.split("+")[0]


def _differences(d: Declared, installed: dict) -> list[str]:
    out = []
    python = installed.get("python") or "?"
    if d.python and not (python == d.python or python.startswith(d.python + ".")):
        out.append(f"python {python} installed, {d.says} {d.python}")
    for name, version in sorted(d.versions.items()):
        have = installed.get(name)
        if not _same_version(have, version):
            out.append(f"{name} {have or 'not'} installed, {d.says} {version}")
    return out


def environment_verdict(installed: dict | None = None) -> str:
    """The environment as installed, in words: `declared: NAME (FILE; python X, torch Y)` when it is one
    the book declares, else `undeclared (the differences from the closest declaration)`."""
    installed = installed if installed is not None else installed_environment()
    best = None
    for d in declared_environments():
        found = _differences(d, installed)
        if not found:
            shown = ["python " + (installed.get("python") or "?")]
            shown += [f"{n} {installed[n]}" for n in ("torch", "numpy") if installed.get(n)]
            return f"declared: {d.name} ({d.source}; {', '.join(shown)})"
        if best is None or len(found) < len(best):
            best = found
    more = f" and {len(best) - 4} more" if len(best) > 4 else ""
    return f"undeclared ({', '.join(best[:4])}{more})"


def environment_hash() -> str:
    """The identity of the environments the book declares (the lock's pins and the device image's
    versions), not of what is installed: a result of the CPU environment and one of the GPU image are both
    current while these declarations stand; each result says which one it was recorded in (its provenance,
    `stale_reasons`)."""
    return _sha(canonical_json([[d.name, d.python, d.versions] for d in declared_environments()]).encode())


UNDECLARED = "recorded in an undeclared environment"


def stale_reasons(record: dict, current: dict) -> list[str]:
    """Why a recorded result is not current, in words ([] if it is): the environment it was recorded in, if
    the book does not declare it, then what changed in its inputs (`what_changed`)."""
    environment = (record.get("provenance") or {}).get("environment") if isinstance(record, dict) else None
    out = []
    if isinstance(environment, str) and environment.startswith("undeclared"):
        out.append(UNDECLARED + environment[len("undeclared"):])
    return out + what_changed(record.get("inputs") if isinstance(record, dict) else None, current)


def describe_stale(reasons: list[str]) -> str:
    """`stale_reasons` as one phrase: `recorded in an undeclared environment (...); the notebook changed,
    upstream x changed since this result was recorded`."""
    environment = [r for r in reasons if r.startswith(UNDECLARED)]
    changed = [r for r in reasons if not r.startswith(UNDECLARED)]
    return "; ".join(environment + ([", ".join(changed) + " since this result was recorded"] if changed else []))


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
    for n in sorted(set(old_up) | set(new_up)):
        old, new = old_up.get(n), new_up.get(n)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict) and old.get("inputs") == new.get("inputs"):
            out.append(f"upstream {n} was executed again")
        else:
            out.append(f"upstream {n} changed")
    return out


def compute_hashes(nbs: list[Notebook], profile: str) -> None:
    """Fill every notebook's inputs and input hash (validates every notebook's parameters)."""
    for nb in nbs:
        nb.inputs = notebook_inputs(nb.chapter, nb.name, profile)
        nb.input_hash = inputs_hash(nb.inputs)
