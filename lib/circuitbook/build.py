"""Building the book: stage, execute with papermill, scorecard, jupyter-book.

`build(profile)` copies the sources to `_build/<profile>/src`, executes every
notebook of `_toc.yml` in order with papermill (parameters: the profile),
writes the scorecard page and the chapters' "what was run" headers, and
renders the staged tree with `jupyter-book build` (execution off). The HTML
lands in `_build/<profile>/html`. One build per checkout and profile at a
time: a second one waits for the first (`_build/<profile>/.lock`).

An executed notebook is cached under `<runs>/executed/<profile>/` with the
hash of its inputs (`book.notebook_inputs`: the notebook, its parameters,
profiles.yml, the library's source, the notebooks it needs). A cache entry is
used only when its record, its executed notebook (by SHA-256) and the
notebook's results file (status `ok`, same inputs) all verify; anything else is
reported by path and executed again. A failed notebook is never cached and
never rendered as if it were fresh: papermill's error banner stays at its top
and its results are marked failed, so the scorecard says so.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from . import book, context, pages, params, presentation, sanitize, settings
from .book import BookError, Notebook, book_notebooks, compute_hashes, toc_files  # noqa: F401
from .execute import BuildError, execute
from .runs import (DamagedRunError, atomic_write_bytes, atomic_write_json, canonical_json, read_json, repo_root,
                   runs_root)

SCORECARD_MARKER = "<!-- scorecard -->"
CLAIMS_MARKER = "<!-- claims-table -->"
STAGED_SOURCES = ("_config.yml", "_toc.yml", "_static", "book", "chapters")
LABEL_CHARS = settings.LABEL_NAME  # the characters a results label may hold after `PROFILE+` (one rule: settings)


class StoreError(RuntimeError):
    """The artifact store ($CIRCUITBOOK_RUNS) cannot be used."""


def check_store(write: bool = True) -> Path:
    """The run store's root, after checking that it is a folder this process can use."""
    root = runs_root()
    if root.exists() and not root.is_dir():
        raise StoreError(f"the run store {root} ($CIRCUITBOOK_RUNS) is a file, not a folder")
    if not write:
        if root.exists() and not os.access(root, os.R_OK | os.X_OK):
            raise StoreError(f"the run store {root} ($CIRCUITBOOK_RUNS) cannot be read (permissions)")
        return root
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise StoreError(f"the run store {root} ($CIRCUITBOOK_RUNS) is not writable: {e.strerror or e}") from None
    return root


@contextlib.contextmanager
def build_lock(label: str, log=print):
    """One build (or `circuitbook run` of the profile's own execution) per checkout and label at a time."""
    path = repo_root() / "_build" / label / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another circuitbook build of {label} in this checkout to finish ({path}) ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------- the execution cache

def executed_path(label: str, nb: Notebook) -> Path:
    return context.executed_notebook_path(nb.chapter, nb.name, label)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cached_execution(label: str, nb: Notebook, log=None) -> dict | None:
    """The cache record of `nb` if every part of the entry verifies, else None (damage is logged)."""
    nb_path, meta_path = executed_path(label, nb), executed_path(label, nb).with_suffix(".json")
    if not meta_path.exists():
        return None
    problem = _cache_problem(label, nb, nb_path, meta_path)
    if problem is None:
        return read_json(meta_path)
    if problem and log:
        log(f"{nb.path}: not using its cached execution: {problem}; executing it again")
    return None


def _cache_problem(label: str, nb: Notebook, nb_path: Path, meta_path: Path) -> str | None:
    """None if the entry is usable; '' if it is merely out of date; else what is wrong, naming the file."""
    try:
        meta = read_json(meta_path)
    except DamagedRunError as e:
        return str(e)
    if not isinstance(meta, dict) or meta.get("status") != "ok":
        return f"{meta_path} is damaged (not a cache record)"
    if meta.get("input_hash") != nb.input_hash:
        return ""  # the inputs changed: an ordinary re-execution
    if not nb_path.exists():
        return f"{nb_path} is missing"
    if meta.get("sha256") != _sha256(nb_path):
        return f"{nb_path} does not match its recorded SHA-256 (truncated or overwritten)"
    try:
        nbformat.read(nb_path, as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is damage
        return f"{nb_path} is not a readable notebook ({type(e).__name__})"
    try:
        results = context.read_results(nb.chapter, nb.name, label)
    except context.DamagedResultsError as e:
        return str(e)
    if results is None:
        return f"its results file {context.results_path(nb.chapter, nb.name, label)} is missing"
    problem = context.check_record(nb.chapter, nb.name, label, results)
    if problem:
        return problem
    if results.get("status") != "ok":
        return (f"its results file {context.results_path(nb.chapter, nb.name, label)} says "
                f"{results.get('status')!r} (an interrupted or failed execution)")
    if results.get("input_hash") != nb.input_hash:
        return f"its results file {context.results_path(nb.chapter, nb.name, label)} belongs to other inputs"
    stale = [r for r in book.stale_reasons(results, nb.inputs) if r.startswith(book.UNDECLARED)]
    return f"its results were {stale[0]}" if stale else None


def _store_execution(label: str, nb: Notebook, executed: Path, seconds: float) -> None:
    """Keep an execution that ran to the end: the executed notebook, its cache record (under the inputs its
    results record, which the kernel computed), and its results sealed by this store's key with their
    provenance (`context.seal_stored`)."""
    target = executed_path(label, nb)
    atomic_write_bytes(target, executed.read_bytes())
    try:
        results = context.read_results(nb.chapter, nb.name, label) or {}
    except context.DamagedResultsError:
        results = {}
    atomic_write_json(target.with_suffix(".json"), {
        "input_hash": results.get("input_hash") or nb.input_hash, "status": "ok", "seconds": round(seconds, 1),
        "label": label, "sha256": _sha256(target), "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if results.get("status") == "ok":
        context.seal_stored(nb.chapter, nb.name, label, seconds)


def refresh_inputs(nb: Notebook, profile: str) -> None:
    """Compute a notebook's inputs again: the notebooks it needs may have been executed since (in this
    build), which changes the identity of their results in its inputs."""
    nb.inputs = book.notebook_inputs(nb.chapter, nb.name, profile)
    nb.input_hash = book.inputs_hash(nb.inputs)


def _stage_stored(label: str, nb: Notebook, dest: Path, banner: str | None = None) -> None:
    """Stage an executed notebook from the store without active content (`sanitize`), whoever produced it."""
    sanitize.stage_executed(executed_path(label, nb), dest, repo_root() / nb.path, banner)


def _last_seconds(label: str, nb: Notebook) -> float | None:
    try:
        meta = read_json(executed_path(label, nb).with_suffix(".json"))
        return float(meta["seconds"]) if isinstance(meta, dict) else None
    except (DamagedRunError, KeyError, TypeError, ValueError):
        return None


def estimate(nbs: list[Notebook], profile: str, force: bool) -> tuple[float, int]:
    """(seconds to execute what is not cached, number cached)."""
    total, cached = 0.0, 0
    for nb in nbs:
        if not force and cached_execution(profile, nb):
            cached += 1
            continue
        total += _last_seconds(profile, nb) or params.estimate_seconds(nb.chapter, nb.name, profile) or 60
    return total, cached


def fmt_seconds(s: float) -> str:
    """A duration for a reader: '4m 05s', '1h 32m', '2.0 d'."""
    s = int(round(s))
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


_GLUE_ROLE = re.compile(r"\{glue(?::\w+)?\}`([^`]+)`")


def glued_keys(notebook) -> set[str]:
    """The glue keys an executed notebook's outputs hold (myst-nb's `glue` marks each output with its name)."""
    keys = set()
    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            name = ((output.get("metadata") or {}).get("scrapbook") or {}).get("name")
            if isinstance(name, str):
                keys.add(name)
    return keys


def placeholder_missing_glue(path: Path, why: str) -> int:
    """In a staged notebook that stopped before recording everything its text quotes (a failed execution),
    show each glue key it never recorded as a named placeholder instead of failing the whole book; returns
    how many references were replaced."""
    notebook = nbformat.read(path, as_version=4)
    have, replaced = glued_keys(notebook), 0

    def sub(m):
        nonlocal replaced
        key = m.group(1).split(":")[0]
        if key in have:
            return m.group(0)
        replaced += 1
        return f"*[{key}: {why}]*"
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = _GLUE_ROLE.sub(sub, cell.source)
    if replaced:
        nbformat.write(notebook, path)
    return replaced


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


def _stage_unexecuted(nb: Notebook, profile: str, dest: Path) -> str:
    """Stage a notebook that has no usable cached execution in a build that executes nothing; say how.

    An execution of other sources (an imported one, say) is shown under a banner naming what changed;
    a failed one as it failed (papermill's banner is on it); with neither, the code only."""
    executed = executed_path(profile, nb)
    if not executed.exists():
        _not_executed(dest, dest, profile)
        return "not executed: code only"
    try:
        results = context.read_results(nb.chapter, nb.name, profile)
    except context.DamagedResultsError:
        results = None
    if results and results.get("status") == "failed":
        _stage_stored(profile, nb, dest)
        placeholder_missing_glue(dest, "not computed: the notebook failed")
        return "its failed execution"
    changed = _unverified(profile, nb, results)
    _stage_stored(profile, nb, dest, banner=(
        f"```{{warning}}\nThese outputs are **stale**: they were computed from other sources than this book's, or "
        f"cannot be checked ({'; '.join(changed)}), so its claims are not graded. Execute it again to update them.\n```"))
    return f"stale execution ({'; '.join(changed)})"


def _unverified(label: str, nb: Notebook, results: dict | None) -> list[str]:
    """Why a stored execution is not a current result, in words (for its stale banner)."""
    if not results:
        return ["its results file is missing or damaged"]
    problem = context.check_record(nb.chapter, nb.name, label, results)
    if problem:
        return [problem]
    return book.stale_reasons(results, nb.inputs) or ["its cache record does not verify"]


# ---------------------------------------------------------------- staging and rendering

def stage(profile: str) -> Path:
    root = repo_root()
    src = root / "_build" / profile / "src"
    for name in STAGED_SOURCES:
        target = src / name
        if target.is_dir():
            shutil.rmtree(target)
        if not (root / name).exists():
            continue  # an optional source (e.g. _static) this book does not have
        if (root / name).is_dir():
            shutil.copytree(root / name, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, target)
    return src


def write_generated_pages(src: Path, profile: str, seconds: dict | None = None) -> None:
    """The scorecard page and every chapter landing page's header (what was run, the verdicts)."""
    from . import claims

    page = src / "book" / "scorecard.md"
    text = page.read_text() if page.exists() else SCORECARD_MARKER
    page.write_text(text.replace(SCORECARD_MARKER, pages.scorecard_markdown(profile)))
    built = time.strftime("%Y-%m-%d %H:%M")
    scorecard = claims.scorecard(profile)  # once: every chapter's header, table and figure read these rows
    for chapter in claims.claim_chapters():
        if chapter == params.BOOK_PSEUDO_CHAPTER:
            continue
        index = src / "chapters" / chapter / "index.md"
        if index.exists():
            ch_seconds = {nb: (seconds or {}).get(f"{chapter}/{nb}") for nb in params.notebooks(chapter)}
            rows = [r for r in scorecard if r["chapter"] == chapter]
            presentation.summary_figure(chapter, rows, index.parent / "_generated" / "summary.png")
            index.write_text(pages.place_chapter_header(index.read_text(), chapter, profile, ch_seconds, built,
                                                        figure="_generated/summary.png", rows=rows))
    for nb in book_notebooks(repo_root()):
        staged = src / nb.path
        if staged.exists():
            _add_rerun_box(staged, nb, profile)


def _add_rerun_box(path: Path, nb: Notebook, profile: str) -> None:
    """The notebook page's "Re-run this page" box, right under its title (`presentation.rerun_box`)."""
    notebook = nbformat.read(path, as_version=4)
    cell = nbformat.v4.new_markdown_cell(presentation.rerun_box(nb.chapter, nb.name, profile, path.name))
    cell.metadata["tags"] = ["cb-rerun"]
    first = next((i for i, c in enumerate(notebook.cells) if c.cell_type == "markdown"
                  and c.source.lstrip().startswith("# ")), -1)
    notebook.cells.insert(first + 1, cell)
    nbformat.write(notebook, path)


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


# ---------------------------------------------------------------- the build

def build(profile: str, chapters: list[str] | None = None, force: bool = False, keep_going: bool = False,
          log=print, ray: str | bool | None = None, execute_missing: bool = True) -> Path:
    """Build the whole book at `profile`; return the HTML folder.

    ray: None/False builds here, one notebook after another. An address (or True: the cluster of this
    machine, else a new local one) executes the notebooks whose inputs are ready concurrently as Ray
    tasks, each with the resources its profiles.yml declares; cache, order and output stay the same.
    execute_missing=False (`--no-execute`) executes nothing: cached executions (those `circuitbook
    import-results` placed among them) render as they are, an imported execution of other sources
    renders under a "stale" banner, the rest as code only.
    """
    if not execute_missing and (force or ray):
        raise params.ParameterError("--no-execute executes nothing; it takes neither --force nor --ray")
    params.check_profile(profile)
    nbs = book_notebooks()
    known = sorted({nb.chapter for nb in nbs} | set(params.chapters()))
    for ch in chapters or []:
        if ch not in known:
            raise params.ParameterError(f"--chapter {ch!r} is not a chapter; chapters: {', '.join(known)}")
    book.check_notebooks(nbs)  # a damaged notebook anywhere is named before anything runs
    compute_hashes(nbs, profile)  # validates every notebook's parameters before anything runs
    _check_claims()
    check_store()
    selected = [nb for nb in nbs if not chapters or nb.chapter in chapters]
    resources = {nb.label: params.resources(nb.chapter, nb.name, profile) for nb in selected}
    address = None
    if ray:
        from . import cluster

        address = cluster.connect(None if ray is True else ray)  # unreachable: an error before any compute
        log(f"circuitbook build: Ray cluster at {address}")
    with build_lock(profile, log):
        seconds, cached = estimate(selected, profile, force)
        log(f"circuitbook build: profile {profile}, {len(selected)} notebooks ({cached} cached), "
            + (f"estimated {fmt_seconds(seconds)}" if execute_missing else "nothing is executed (--no-execute)"))
        environment = book.environment_verdict()
        if environment.startswith("undeclared"):
            log(f"circuitbook build: WARNING: the environment installed here is {environment}: what this build "
                "executes is stale (never graded) until it is the environment requirements.lock declares")
        src = stage(profile)
        failures, timing, todo = [], {}, []
        for i, nb in enumerate(nbs, 1):
            dest = src / nb.path
            refresh_inputs(nb, profile)  # a notebook it needs may have been executed above
            waiting = [need for need in nb.needs if need in {t.label for t in todo}]  # on the cluster, below
            hit = None if waiting else cached_execution(profile, nb, log if nb in selected and not force else None)
            if nb not in selected:
                if hit:
                    _stage_stored(profile, nb, dest)
                    timing[nb.label] = hit.get("seconds")
                else:
                    _not_executed(dest, dest, profile)
                continue
            if hit and not force:
                log(f"[{i}/{len(nbs)}] {nb.path}: unchanged, cached ({hit['seconds']:.0f} s when executed)")
                _stage_stored(profile, nb, dest)
                timing[nb.label] = hit.get("seconds")
                continue
            if not execute_missing:
                log(f"[{i}/{len(nbs)}] {nb.path}: {_stage_unexecuted(nb, profile, dest)} (--no-execute)")
                continue
            if address:
                todo.append(nb)
                continue
            log(f"[{i}/{len(nbs)}] {nb.path}: executing ...")
            executed_path(profile, nb).with_suffix(".json").unlink(missing_ok=True)
            try:
                secs = execute(nb, profile, dest, log=log, label=profile)
            except BuildError as e:
                failures.append(str(e))
                log(f"FAILED: {e}")
                if not keep_going:
                    raise
                _stage_failed(dest, profile, nb)
                continue
            _store_execution(profile, nb, dest, secs)
            timing[nb.label] = secs
            log(f"[{i}/{len(nbs)}] {nb.path}: done in {secs:.1f} s")
        if todo:
            _execute_on_cluster(todo, profile, src, address, resources, keep_going, failures, timing, log)
        write_generated_pages(src, profile, timing)
        html = render(src, profile, log)
    log(f"HTML: {html / 'index.html'}")
    if failures:
        raise BuildError(f"{len(failures)} notebook(s) failed (the book was rendered with --keep-going):\n"
                         + "\n".join(failures))
    return html


def _stage_failed(dest: Path, profile: str, nb: Notebook) -> None:
    """A notebook that failed in this build renders as it failed (papermill's banner on top), the values it
    never recorded as placeholders; with no partial output, its code only."""
    if dest.exists():
        try:
            placeholder_missing_glue(dest, "not computed: the notebook failed")
            return
        except Exception:  # noqa: BLE001 - a torn notebook: show the code instead
            pass
    shutil.copy2(repo_root() / nb.path, dest)
    _not_executed(dest, dest, profile)


def _execute_on_cluster(todo: list[Notebook], profile: str, src: Path, address: str, resources: dict,
                        keep_going: bool, failures: list, timing: dict, log) -> None:
    """The notebooks a Ray build executes: as Ray tasks once their needs are done; each result is
    cached, staged and reported exactly as the local build does."""
    from . import cluster

    for nb in todo:
        executed_path(profile, nb).with_suffix(".json").unlink(missing_ok=True)

    def on_done(nb: Notebook, result: dict) -> None:
        dest = src / nb.path
        if result.get("notebook") is not None:
            atomic_write_bytes(dest, result["notebook"])
        if not result["ok"]:
            failures.append(result["error"])
            log(f"FAILED: {result['error']}")
            if not keep_going:
                raise BuildError(result["error"])
            return
        _store_execution(profile, nb, dest, result["seconds"])
        timing[nb.label] = result["seconds"]
        log(f"{nb.path}: done in {result['seconds']:.1f} s on {result.get('node', '?')}")

    cluster.execute_notebooks(todo, profile, address, lambda nb: resources[nb.label], on_done, keep_going, log)


def _check_claims() -> None:
    """Every claims.yml loads (a broken ledger is refused before any compute)."""
    from . import claims

    for chapter in claims.claim_chapters():
        claims.load_claims(chapter)


def run_one(notebook: str, profile: str, overrides: dict, log=print, label: str | None = None,
            force: bool = False, ray: str | bool | None = None) -> tuple[Path, str]:
    """Execute one notebook; return (executed notebook, results label).

    Without overrides (and no label) this *is* the build's execution of the notebook at the
    profile: the same cache entry and rules (a verified cached execution is reused unless
    `force`). With `ray` (an address, or True) the notebook executes here and the runs it splits
    into chunks of members train on that Ray cluster too. With overrides the results go under `PROFILE+<hash of the overrides>` (or `label`),
    apart from the profile's own, and the executed notebook under runs/executed/<label>/.
    """
    nb = _find_notebook(notebook, repo_root())
    params.resolve(nb.chapter, nb.name, profile, overrides)  # fail before compute
    overrides = params.absolute_paths(nb.chapter, nb.name, overrides)
    check_pair_file(overrides, nb.label)
    book.check_notebooks([nb])
    check_store()
    if label is not None:
        settings.check_label_name(label)
    own = not overrides and label is None
    label = profile if own else f"{profile}+{label}" if label else context.results_label(profile, overrides)
    nb.inputs = book.notebook_inputs(nb.chapter, nb.name, profile, overrides)
    nb.input_hash = book.inputs_hash(nb.inputs)
    env = None
    if ray:
        from . import cluster

        address = cluster.connect(None if ray is True else ray)
        env = {cluster.ADDRESS_ENV: address,
               cluster.RESOURCES_ENV: json.dumps(params.resources(nb.chapter, nb.name, profile))}
    log(f"circuitbook run: {nb.path}, profile {profile}, overrides {overrides or 'none'}; results label {label}")
    dest = executed_path(label, nb)
    with build_lock(label, log) if own else contextlib.nullcontext():
        if own and not force and cached_execution(label, nb, log):
            log(f"unchanged since its last execution at {profile}: cached ({dest})")
            return dest, label
        dest.with_suffix(".json").unlink(missing_ok=True)
        try:
            secs = execute(nb, profile, dest, overrides, log, label=label, env=env)
        except BuildError:
            log(f"results label {label} (the failure is recorded there)")
            raise
        _store_execution(label, nb, dest, secs)
    log(f"done in {secs:.1f} s; executed notebook: {dest}; results label: {label}")
    return dest, label


def release(chapter: str, path: str, profile: str, overrides: dict, label: str | None = None,
            log=print) -> tuple[str, list[str], list[str]]:
    """Judge a released training run by the chapter's rules: execute every notebook that reads one
    (those with the chapter's `release.parameter`, e.g. `checkpoint_path`) on `path`, all under one
    results label, `PROFILE+NAME` (NAME: `label`, default the folder's name and a hash of the path
    and overrides). Returns (label, notebooks executed, failures); a failing notebook is reported
    and the others still run, so the label's scorecard shows what could be judged.

    Everything is checked before any compute: the chapter reads releases, `path` exists and is a
    readable release (a folder of step checkpoints, `models.loading.read_release`, or one state
    dict), every override is a parameter of some notebook that reads it. A single file skips the
    notebooks that need a training history (`release.history`), saying so. Rerunning it with the same
    folder (same content) and overrides reuses each notebook's verified cached execution under the label.
    """
    from .models.loading import read_release, read_state_dict

    params.chapter_dir(chapter)  # an unknown chapter: named, with the chapters
    spec = params.release_spec(chapter)
    if spec is None:
        readers = [c for c in params.chapters() if params.release_spec(c)]
        raise params.ParameterError(f"chapter {chapter!r} has no notebook that reads a released run (no `release:` in "
                                    f"its profiles.yml); chapters that do: {', '.join(readers) or '(none)'}")
    target = Path(path).expanduser().resolve()
    if not target.exists():
        raise params.ParameterError(f"release {path!r} does not exist; give a folder of step checkpoints "
                                    f"(checkpoint_step_5301.pth ..., optionally a final model_state_dict.pth) or one "
                                    f"state dict")
    if target.is_dir():
        read_release(target)  # names, steps and configurations: a ValueError naming the file
    else:
        read_state_dict(target)
    name = spec["parameter"]
    if name in overrides:
        raise params.ParameterError(f"-p {name}: the release's path is the PATH argument; do not give it again")
    known = {nb: params.specs(chapter, nb) for nb in spec["notebooks"]}
    unknown = [k for k in overrides if not any(k in s for s in known.values())]
    if unknown:
        allowed = sorted(set().union(*known.values()) - {name})
        raise params.ParameterError(f"-p {unknown[0]}: not a parameter of the notebooks that read a release "
                                    f"({', '.join(spec['notebooks'])}){params._suggest(unknown[0], allowed)}; "
                                    f"parameters: {', '.join(allowed)}")
    if label is not None:
        settings.check_label_name(label)
    todo, skipped = [], []
    for nb in spec["notebooks"]:
        if not target.is_dir() and nb in spec["history"]:
            skipped.append(nb)
            continue
        nb_overrides = {name: str(target), **{k: v for k, v in overrides.items() if k in known[nb]}}
        params.resolve(chapter, nb, profile, nb_overrides)  # every notebook's values, before any compute
        check_pair_file(params.absolute_paths(chapter, nb, nb_overrides), f"{chapter}/{nb}")
        todo.append((nb, nb_overrides))
    if label is None:
        stem = "-".join(LABEL_CHARS.findall(target.stem)) or "release"
        digest = hashlib.sha256(canonical_json({"path": str(target), **overrides}).encode()).hexdigest()[:8]
        label = f"{stem}-{digest}"
    full = f"{profile}+{label}"
    log(f"circuitbook release: {target} judged by {chapter}'s rules at profile {profile}; results label {full}")
    for nb in skipped:
        log(f"{chapter}/{nb}: skipped, it reads a training history and {target.name} is one checkpoint")
    done, failures = [], []
    for nb, nb_overrides in todo:
        if _release_cached(chapter, nb, profile, nb_overrides, full, log):
            done.append(nb)
            continue
        try:
            run_one(f"{chapter}/{nb}", profile, nb_overrides, log=log, label=label)
            done.append(nb)
        except BuildError as e:
            failures.append(str(e))
            log(f"FAILED: {e}")
    return full, done, failures


PAIR_FILE_MAX_BYTES = 1024 * 1024  # 3,481 pairs take about 30 KB
PAIR_SPLIT_FORMS = ("pair_split is 'authors', 'book', or a file of training pairs (one 'n1 n2' per line, or a "
                    ".json list of [n1, n2])")


def check_pair_file(overrides: dict, where: str) -> None:
    """`-p pair_split FILE` (Assign and Add's training pairs): the file is parsed here, before any kernel
    starts (`tasks.assign_add.read_pair_file`), so that a file of something else is refused with the allowed
    forms, and nothing of its content reaches a message or a results record."""
    value = overrides.get("pair_split")
    if not isinstance(value, str) or value in ("authors", "book"):
        return
    import inspect

    from .tasks.assign_add import AssignAddTask, read_pair_file

    path = Path(value).expanduser()
    if not path.is_file():
        raise params.ParameterError(f"{where}: -p pair_split {value!r} is not a file; {PAIR_SPLIT_FORMS}")
    if path.stat().st_size > PAIR_FILE_MAX_BYTES:
        raise params.ParameterError(f"{where}: -p pair_split {value!r} is {path.stat().st_size / 2 ** 20:.1f} MiB, "
                                    f"not a file of training pairs (at most 1 MiB); {PAIR_SPLIT_FORMS}")
    modulus = inspect.signature(AssignAddTask).parameters["modulus"].default
    try:
        read_pair_file(path, modulus)
    except ValueError as e:  # its message may quote a line of the file: only where it failed is said
        text, at = str(e), re.search(r"\b(line|item) \d+", str(e))
        if isinstance(e, UnicodeDecodeError):
            detail = "it is not text"
        elif "JSON" in text or not at:
            detail = re.sub(r",? got .*$|: .*$", "", text.replace(f"pair_split file {str(path)!r}", "the file"),
                            flags=re.S)
        else:
            detail = f"{at.group(0)} is not two integers n1 n2 in [0, {modulus - 1}]" if "listed twice" not in text \
                else f"{at.group(0)} repeats a pair"
        raise params.ParameterError(f"{where}: -p pair_split {value!r} is not a file of training pairs ({detail}); "
                                    f"{PAIR_SPLIT_FORMS}") from None


def _release_cached(chapter: str, name: str, profile: str, overrides: dict, label: str, log) -> bool:
    """Whether `release` may reuse the execution of chapter/name it recorded under `label` before: the
    build's cache record verifies (`cached_execution`) for the same inputs - the notebook, its parameters
    (the release's path among them), the library, and the content of every file and folder a parameter
    names, so the release folder's content hash: an edited release executes again."""
    nb = _find_notebook(f"{chapter}/{name}", repo_root())
    nb.inputs = book.notebook_inputs(chapter, name, profile, params.absolute_paths(chapter, name, overrides))
    nb.input_hash = book.inputs_hash(nb.inputs)
    if not cached_execution(label, nb, log):
        return False
    log(f"{chapter}/{name}: unchanged since its last execution under {label}: cached ({executed_path(label, nb)})")
    return True


def _find_notebook(notebook: str, root: Path) -> Notebook:
    """Accept a path (chapters/x/02_y.ipynb, with or without .ipynb) or CHAPTER/NOTEBOOK (x/02_y)."""
    nbs = book_notebooks(root)
    candidate = Path(notebook)
    rel = candidate.as_posix()
    with contextlib.suppress(ValueError, OSError):
        rel = candidate.resolve().relative_to(root).as_posix()
    rel = rel.removesuffix(".ipynb")
    for nb in nbs:
        if nb.path.removesuffix(".ipynb") == rel or nb.label == notebook.strip("/").removesuffix(".ipynb"):
            return nb
    raise params.ParameterError(f"unknown notebook {notebook!r}; give a path such as {nbs[0].path if nbs else '?'} "
                                f"or CHAPTER/NOTEBOOK; notebooks: {', '.join(nb.label for nb in nbs)}")
