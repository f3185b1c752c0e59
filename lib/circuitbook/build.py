"""Building the book: stage, execute with papermill, scorecard, jupyter-book.

`build(profile)` copies the sources to `_build/<profile>/src`, executes every
notebook of `_toc.yml` in order with papermill (parameters: the profile),
writes the scorecard page and the chapters' claims tables, and renders the
staged tree with `jupyter-book build` (execution off). The HTML lands in
`_build/<profile>/html`.

An executed notebook is cached under `<runs>/executed/<profile>/` with a hash
of its inputs: the notebook file, its resolved parameters, the library's
source, and the hashes of the notebooks it needs. Unchanged inputs are not
executed again. A failed notebook is never cached and never rendered as if
it were fresh: papermill's error banner stays at its top and its results
are marked failed, so the scorecard says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import yaml

from . import claims, context, params
from .runs import atomic_write_bytes, atomic_write_json, canonical_json, read_json, repo_root, runs_root

SCORECARD_MARKER = "<!-- scorecard -->"
CLAIMS_MARKER = "<!-- claims-table -->"
STAGED_SOURCES = ("_config.yml", "_toc.yml", "book", "chapters")


class BuildError(RuntimeError):
    """A notebook failed, or the book could not be rendered."""


@dataclass
class Notebook:
    path: str  # relative to the repo, with .ipynb
    chapter: str
    name: str  # file stem
    input_hash: str = ""
    needs: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.chapter}/{self.name}"


def toc_files(root: Path | None = None) -> list[str]:
    """Every `file:` of _toc.yml in reading order (root first)."""
    root = root or repo_root()
    toc = yaml.safe_load((root / "_toc.yml").read_text())
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
                raise BuildError(f"_toc.yml: {nb.label} needs {nb.chapter}/{need}, which must come before it")
        seen.add(nb.label)


def library_hash() -> str:
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def compute_hashes(nbs: list[Notebook], profile: str) -> None:
    root, lib = repo_root(), library_hash()
    by_label: dict[str, Notebook] = {}
    for nb in nbs:
        resolved = params.resolve(nb.chapter, nb.name, profile)
        upstream = [by_label[f"{nb.chapter}/{n}"].input_hash for n in nb.needs]
        blob = canonical_json({"notebook": hashlib.sha256((root / nb.path).read_bytes()).hexdigest(),
                               "params": dict(resolved), "profiles": _profiles_hash(nb.chapter),
                               "library": lib, "upstream": upstream, "profile": profile})
        nb.input_hash = hashlib.sha256(blob.encode()).hexdigest()[:20]
        by_label[nb.label] = nb


def _profiles_hash(chapter: str) -> str:
    return hashlib.sha256((params.chapter_dir(chapter) / "profiles.yml").read_bytes()).hexdigest()[:16]


def executed_path(profile: str, nb: Notebook) -> Path:
    return runs_root() / "executed" / profile / nb.path


def cached_execution(profile: str, nb: Notebook) -> dict | None:
    meta_path = executed_path(profile, nb).with_suffix(".json")
    if not meta_path.exists() or not executed_path(profile, nb).exists():
        return None
    try:
        meta = read_json(meta_path)
    except Exception:
        return None
    return meta if meta.get("input_hash") == nb.input_hash and meta.get("status") == "ok" else None


def estimate(nbs: list[Notebook], profile: str, force: bool) -> tuple[float, int]:
    """(seconds to execute what is not cached, number cached)."""
    total, cached = 0.0, 0
    for nb in nbs:
        if not force and cached_execution(profile, nb):
            cached += 1
            continue
        meta_path = executed_path(profile, nb).with_suffix(".json")
        last = read_json(meta_path).get("seconds") if meta_path.exists() else None
        total += last or params.estimate_seconds(nb.chapter, nb.name, profile) or 60
    return total, cached


def _fmt_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def execute(nb: Notebook, profile: str, dest: Path, overrides: dict | None = None, log=print) -> float:
    """Execute one notebook with papermill into `dest`; return seconds. Raises BuildError."""
    import papermill as pm

    root = repo_root()
    label = context.results_label(profile, overrides or {})
    tmp = dest.with_name(f".{dest.name}.running.ipynb")
    dest.parent.mkdir(parents=True, exist_ok=True)
    parameters = {"profile": profile}
    if overrides:
        parameters["params"] = overrides
    env_before = dict(os.environ)
    os.environ.setdefault("CIRCUITBOOK_ROOT", str(root))
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    t0 = time.time()
    try:
        pm.execute_notebook(str(root / nb.path), str(tmp), parameters=parameters, kernel_name="python3",
                            cwd=str((root / nb.path).parent), progress_bar=False, log_output=False,
                            start_timeout=300)  # a loaded machine can take long to start a kernel
    except pm.PapermillExecutionError as e:
        index, first_line = _failing_cell(tmp, root / nb.path)
        _finish_failed(tmp, dest)
        context.mark(nb.chapter, nb.name, label, "failed", f"{e.ename}: {e.evalue}")
        raise BuildError(f"notebook {nb.path} failed at cell {index} (In [{e.exec_count}]: {first_line!r}) "
                         f"with {e.ename}: {e.evalue}") from None
    except Exception as e:  # kernel died, bad parameters cell, ...
        _finish_failed(tmp, dest)
        context.mark(nb.chapter, nb.name, label, "failed", f"{type(e).__name__}: {e}")
        raise BuildError(f"notebook {nb.path} could not be executed: {type(e).__name__}: {e}") from None
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    context.mark(nb.chapter, nb.name, label, "ok")
    seconds = time.time() - t0
    _strip_metadata(tmp)
    os.replace(tmp, dest)
    return seconds


def _failing_cell(executed: Path, source: Path) -> tuple[int | str, str]:
    """(index of the failing cell in the source notebook, its first line)."""
    try:
        failed = next(c for c in nbformat.read(executed, as_version=4).cells
                      if c.cell_type == "code" and any(o.get("output_type") == "error" for o in c.outputs))
        sources = [c.source for c in nbformat.read(source, as_version=4).cells]
        index = sources.index(failed.source) if failed.source in sources else "?"
        return index, (failed.source.strip().splitlines() or [""])[0][:80]
    except (StopIteration, OSError, ValueError):
        return "?", "?"


def _finish_failed(tmp: Path, dest: Path) -> None:
    """Keep the partial output (papermill put its error banner at the top)."""
    if tmp.exists():
        nb = nbformat.read(tmp, as_version=4)
        banner = nbformat.v4.new_markdown_cell(
            "```{error}\nThis notebook **failed** during this build; the outputs below stop at the failing "
            "cell and are not a result.\n```")
        nb.cells.insert(0, banner)
        nbformat.write(nb, dest)
        tmp.unlink()


def _strip_metadata(path: Path) -> None:
    """Drop papermill's per-cell timing noise; keep outputs."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


_GLUE_ROLE = re.compile(r"\{glue(?::\w+)?\}`([^`]+)`")


def _not_executed(src: Path, dest: Path, profile: str) -> None:
    """Stage a notebook that this build does not execute: code only, clearly marked.

    Its glue references have no values, so they are shown as named placeholders
    instead of failing the build as unresolved keys.
    """
    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _GLUE_ROLE.sub(lambda m: f"*[{m.group(1).split(':')[0]}: not computed in this build]*",
                                         cell.source)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(
        f"```{{note}}\nThis notebook was not executed in this build (profile `{profile}`); it shows code only. "
        f"Build its chapter to see results: `circuitbook build --profile {profile} --chapter <slug>`.\n```"))
    nbformat.write(nb, dest)


def stage(profile: str) -> Path:
    root = repo_root()
    src = root / "_build" / profile / "src"
    for name in STAGED_SOURCES:
        target = src / name
        if target.is_dir():
            shutil.rmtree(target)
        if (root / name).is_dir():
            shutil.copytree(root / name, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, target)
    return src


def write_generated_pages(src: Path, profile: str) -> None:
    """The scorecard page and every chapter landing page's claims table."""
    page = src / "book" / "scorecard.md"
    text = page.read_text() if page.exists() else SCORECARD_MARKER
    page.write_text(text.replace(SCORECARD_MARKER, claims.scorecard_markdown(profile)))
    for chapter in claims.claim_chapters():
        if chapter == params.BOOK_PSEUDO_CHAPTER:
            continue
        index = src / "chapters" / chapter / "index.md"
        if index.exists():
            index.write_text(index.read_text().replace(CLAIMS_MARKER, claims.claims_table_markdown(chapter)))


def render(src: Path, profile: str, log=print) -> Path:
    """jupyter-book build of the staged tree; returns the HTML folder.

    An unresolved glue key renders as empty text, so it is an error here
    rather than a silent gap in a sentence.
    """
    out = src.parent / "html"
    exe = Path(sys.executable).parent / "jupyter-book"
    cmd = [str(exe) if exe.exists() else "jupyter-book", "build", str(src), "--builder", "html"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    if proc.returncode != 0:
        raise BuildError("jupyter-book build failed:\n" + (proc.stdout + proc.stderr)[-4000:])
    warnings = [_strip_ansi(line) for line in proc.stderr.splitlines() if "WARNING" in line]
    (src.parent / "jupyter-book-warnings.txt").write_text("\n".join(warnings) + "\n")
    if warnings:
        log(f"jupyter-book: {len(warnings)} warnings (see {src.parent / 'jupyter-book-warnings.txt'})")
    unresolved = [w for w in warnings if "found in glue data" in w]
    if unresolved:
        raise BuildError("unresolved glue keys (the text would show nothing):\n" + "\n".join(unresolved))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src / "_build" / "html", out)
    return out


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text).replace(str(repo_root()), ".")


def build(profile: str, chapters: list[str] | None = None, force: bool = False, keep_going: bool = False,
          log=print) -> Path:
    """Build the whole book at `profile`; return the HTML folder."""
    params.check_profile(profile)
    nbs = book_notebooks()
    known = sorted({nb.chapter for nb in nbs} | set(params.chapters()))
    for ch in chapters or []:
        if ch not in known:
            raise params.ParameterError(f"--chapter {ch!r} is not a chapter; chapters: {', '.join(known)}")
    compute_hashes(nbs, profile)  # validates every notebook's parameters before anything runs
    selected = [nb for nb in nbs if not chapters or nb.chapter in chapters]
    seconds, cached = estimate(selected, profile, force)
    log(f"circuitbook build: profile {profile}, {len(selected)} notebooks ({cached} cached), "
        f"estimated {_fmt_seconds(seconds)}")
    src = stage(profile)
    failures = []
    for i, nb in enumerate(nbs, 1):
        dest = src / nb.path
        hit = cached_execution(profile, nb)
        if nb not in selected:
            if hit:
                shutil.copy2(executed_path(profile, nb), dest)
            else:
                _not_executed(dest, dest, profile)
            continue
        if hit and not force:
            log(f"[{i}/{len(nbs)}] {nb.path}: unchanged, cached ({hit['seconds']:.0f} s when executed)")
            shutil.copy2(executed_path(profile, nb), dest)
            continue
        log(f"[{i}/{len(nbs)}] {nb.path}: executing ...")
        try:
            secs = execute(nb, profile, dest, log=log)
        except BuildError as e:
            failures.append(str(e))
            log(f"FAILED: {e}")
            executed_path(profile, nb).with_suffix(".json").unlink(missing_ok=True)
            if not keep_going:
                raise
            continue
        target = executed_path(profile, nb)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, dest.read_bytes())
        atomic_write_json(target.with_suffix(".json"), {"input_hash": nb.input_hash, "status": "ok",
                                                        "seconds": round(secs, 1), "profile": profile})
        log(f"[{i}/{len(nbs)}] {nb.path}: done in {secs:.1f} s")
    write_generated_pages(src, profile)
    html = render(src, profile, log)
    log(f"HTML: {html / 'index.html'}")
    if failures:
        raise BuildError(f"{len(failures)} notebook(s) failed (the book was rendered with --keep-going):\n"
                         + "\n".join(failures))
    return html


def run_one(notebook: str, profile: str, overrides: dict, log=print) -> Path:
    """Execute one notebook with parameter overrides; return the executed copy's path."""
    root = repo_root()
    nb = _find_notebook(notebook, root)
    params.resolve(nb.chapter, nb.name, profile, overrides)  # fail before compute
    label = context.results_label(profile, overrides)
    dest = runs_root() / "executed" / label / nb.path
    log(f"circuitbook run: {nb.path}, profile {profile}, overrides {overrides or 'none'}")
    secs = execute(nb, profile, dest, overrides, log)
    log(f"done in {secs:.1f} s; executed notebook: {dest}")
    return dest


def _find_notebook(notebook: str, root: Path) -> Notebook:
    """Accept a path (chapters/x/02_y.ipynb) or CHAPTER/NOTEBOOK (x/02_y)."""
    nbs = book_notebooks(root)
    candidate = Path(notebook)
    if candidate.suffix == ".ipynb":
        try:
            rel = candidate.resolve().relative_to(root).as_posix()
        except ValueError:
            rel = candidate.as_posix()
        for nb in nbs:
            if nb.path == rel:
                return nb
    else:
        for nb in nbs:
            if nb.label == notebook.strip("/"):
                return nb
    raise params.ParameterError(f"unknown notebook {notebook!r}; give a path such as {nbs[0].path if nbs else '?'} "
                                f"or CHAPTER/NOTEBOOK; notebooks: {', '.join(nb.label for nb in nbs)}")
