"""Published results: what a build or a GPU visit executed, kept with the sources in `published/`.

    circuitbook publish --profile P      this store's current results at P -> published/P/ (signed)
    circuitbook build                     the book from published/ (full over cpu over smoke), executing only
                                          what no published result covers (`publish.build_published`)

`published/<profile>/` holds, for each notebook whose result this store would grade (an `ok` record sealed
here, its inputs the current ones), the form `export-results` makes: `results/<chapter>/<notebook>.json`, the
executed notebook and its cache record under `executed/`, and the metrics, configs and manifests of the runs
it names under `metrics/` (never weights). `index.json` lists every notebook with its status, input hash,
provenance (the machine, the environment as installed, the commit, the date, the seconds it took) and the
SHA-256 of each of its files; `index.sig.json` is the publishing store's Ed25519 signature of the index
(`signing`; its public key in `published/publishers.json`). Publishing replaces the entries its results
supersede and keeps the others, so a GPU visit's full results and a CPU machine's add up.

Reading (`load`) checks the signature against the listed publishers and every file against the index before
anything is written, then places each notebook's files in the run store exactly as `import-results` does
(`transfer._place`): sealed again by this store, never over a current local result; a result whose inputs
changed since it was published is placed but `stale`, and never graded. A folder whose index does not verify is
refused whole, saying why; a notebook whose files do not match the index is refused alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import book, claims, context, pages, params, presentation, seal, signing, transfer
from .book import book_notebooks, compute_hashes
from .build import (SCORECARD_MARKER, BuildError, _add_rerun_box, _check_claims, _stage_stored, _stage_unexecuted,
                    _store_execution, build_lock, cached_execution, check_store, executed_path, refresh_inputs,
                    render, stage)
from .execute import execute
from .runs import atomic_write_bytes, atomic_write_json, repo_root, runs_root

FORMAT = 1
FOLDER = "published"
INDEX, SIGNATURE = "index.json", "index.sig.json"
# published/ travels with the checkout to a GPU machine (64 MiB in all with the carried wheels, ~21 MiB) and
# is cloned by every reader: tests/test_publish.py checks the whole folder against this
BUDGET_MIB = 32
ORDER = ("full", "cpu", "smoke")  # a page shows the largest profile whose published result is current


class PublishError(RuntimeError):
    """A published folder that cannot be used, or nothing to publish; the message names the file."""


def folder(profile: str | None = None) -> Path:
    base = repo_root() / FOLDER
    return base / profile if profile else base


def publishers_file() -> Path:
    return folder() / signing.PUBLISHERS


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def folder_bytes() -> int:
    base = folder()
    return sum(p.stat().st_size for p in base.rglob("*") if p.is_file()) if base.is_dir() else 0


# ---------------------------------------------------------------- publishing

@dataclass
class Published:
    profile: str
    added: list[str] = field(default_factory=list)  # notebooks published now
    kept: list[str] = field(default_factory=list)  # published before, not superseded
    skipped: dict[str, str] = field(default_factory=dict)  # notebook -> why this store's result is not published
    removed: list[str] = field(default_factory=list)  # files no entry names any more
    size_mib: float = 0.0
    new_publisher: str | None = None


RUN_FILES = ("config.json", "metrics.jsonl", "manifest.json")


def _run_files_dir(name: str, key: str, label: str) -> Path | None:
    """Where this store keeps a run's metrics: the run itself if it trained here, else where `load` (published
    results) or a visit's import placed them. Without the fallback, publishing again from a store that only
    loaded a notebook's result would drop that notebook's metrics from published/."""
    for d in (runs_root() / name / key, _loaded_metrics(label) / name / key,
              runs_root() / "imported" / "metrics" / name / key):  # the last: transfer's import of a visit
        if any((d / f).is_file() for f in RUN_FILES):
            return d
    return None


def _loaded_metrics(label: str) -> Path:
    """Where `load` places the run metrics of published/<label>/ in this store."""
    return runs_root() / "imported" / "metrics" / label


def _current_files(nb, label: str) -> tuple[dict[str, bytes], dict] | str:
    """(relative path -> bytes, entry) of a notebook's result this store would grade now, or why not."""
    try:
        results = context.read_results(nb.chapter, nb.name, label)
    except context.DamagedResultsError as e:
        return str(e)
    if results is None:
        return "not executed here"
    if results.get("status") != "ok":
        return f"its result here is {results.get('status')!r}"
    problem = context.check_record(nb.chapter, nb.name, label, results)
    if problem:
        return problem
    stale = transfer._why_stale(nb, results, label)
    if stale:
        return "stale: " + book.describe_stale(stale)
    executed = context.executed_notebook_path(nb.chapter, nb.name, label)
    files = {f"results/{nb.chapter}/{nb.name}.json": context.results_path(nb.chapter, nb.name, label).read_bytes(),
             f"executed/{nb.path}": executed.read_bytes(),
             f"executed/{Path(nb.path).with_suffix('.json').as_posix()}": executed.with_suffix(".json").read_bytes()}
    runs = []
    for ref in results.get("runs") or []:
        run_dir = _run_files_dir(ref["name"], ref["key"], label)
        for name in RUN_FILES if run_dir is not None else ():
            if (run_dir / name).is_file():
                files[f"metrics/{ref['name']}/{ref['key']}/{name}"] = (run_dir / name).read_bytes()
        runs.append(f"{ref['name']}/{ref['key']}")
    provenance = results.get("provenance") if isinstance(results.get("provenance"), dict) else {}
    entry = {"status": "ok", "input_hash": results.get("input_hash"), "provenance": provenance,
             "runs": runs, "files": {rel: _sha(data) for rel, data in files.items()}}
    return files, entry


def publish(profile: str, log=print) -> Published:
    """Publish this store's current results at `profile` (see the module docstring)."""
    params.check_profile(profile)
    nbs = book_notebooks()
    book.compute_hashes(nbs, profile)
    out = Published(profile)
    target = folder(profile)
    old = _read_index(profile, verify=False) if (target / INDEX).exists() else {"notebooks": {}}
    entries = dict(old.get("notebooks") or {})
    writes: dict[str, bytes] = {}
    for nb in nbs:
        found = _current_files(nb, profile)
        if isinstance(found, str):
            out.skipped[nb.label] = found
            if nb.label in entries:
                out.kept.append(nb.label)
            continue
        files, entry = found
        entries[nb.label] = entry
        writes.update(files)
        out.added.append(nb.label)
    if not out.added:
        raise PublishError(f"nothing to publish at {profile}: no notebook has a current result in this store "
                           f"({runs_root()}); execute them first (`circuitbook build --profile {profile}`)")
    for rel, data in writes.items():
        atomic_write_bytes(target / rel, data)
    named = {rel for e in entries.values() for rel in e["files"]}
    for path in sorted(p for p in target.rglob("*") if p.is_file()):
        rel = path.relative_to(target).as_posix()
        if rel not in named and rel not in (INDEX, SIGNATURE):
            path.unlink()
            out.removed.append(rel)
    for d in sorted((p for p in target.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    index = {"format": FORMAT, "profile": profile, "published": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "notebooks": {k: entries[k] for k in sorted(entries)}}
    data = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    out.new_publisher = signing.add_publisher(publishers_file())
    atomic_write_bytes(target / INDEX, data)
    atomic_write_json(target / SIGNATURE, signing.sign(data))
    out.size_mib = folder_bytes() / 2 ** 20
    log(f"published {len(out.added)} notebook(s) at {profile} into {target}"
        + (f"; kept {len(out.kept)} published before" if out.kept else "")
        + (f"; removed {len(out.removed)} file(s) nothing names any more" if out.removed else "")
        + f"; published/ is {out.size_mib:.1f} MiB (budget {BUDGET_MIB} MiB)")
    for label, why in out.skipped.items():
        if label not in out.kept:
            log(f"  not published: {label}: {why}")
    if out.new_publisher:
        log(f"  this store's publishing key {out.new_publisher} was added to {publishers_file()}: commit it with the "
            "results (readers trust the keys listed there)")
    if out.size_mib > BUDGET_MIB:
        log(f"  WARNING: published/ is over its budget of {BUDGET_MIB} MiB")
    return out


# ---------------------------------------------------------------- reading

def profiles() -> list[str]:
    """The profiles published, largest first."""
    return [p for p in ORDER if (folder(p) / INDEX).exists()]


def _read_index(profile: str, verify: bool = True) -> dict:
    path = folder(profile) / INDEX
    try:
        data = path.read_bytes()
        index = json.loads(data)
    except (OSError, ValueError) as e:
        raise PublishError(f"{path} cannot be read as an index ({type(e).__name__}: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("profile") != profile \
            or not isinstance(index.get("notebooks"), dict):
        raise PublishError(f"{path} is not an index of published results at {profile} (format {FORMAT})")
    if verify:
        try:
            sig = json.loads((folder(profile) / SIGNATURE).read_text())
            signing.verify(data, sig, signing.read_publishers(publishers_file()), str(path))
        except (OSError, ValueError) as e:
            raise PublishError(f"{folder(profile) / SIGNATURE} cannot be read ({type(e).__name__})") from None
        except signing.SignatureError as e:
            raise PublishError(str(e)) from None
    return index


@dataclass
class Loaded:
    profile: str
    current: list[str] = field(default_factory=list)
    stale: dict[str, list[str]] = field(default_factory=dict)
    kept_local: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def load(profile: str, log=print) -> Loaded:
    """Place published/<profile>/ in this run store (see the module docstring); PublishError if its index
    does not verify."""
    index = _read_index(profile)
    base = folder(profile)
    known = {nb.label: nb for nb in book_notebooks()}
    out, imported = Loaded(profile), transfer.Imported(label=profile)
    order = list(known)
    for label in sorted(index["notebooks"], key=lambda k: order.index(k) if k in order else len(order)):
        entry, nb = index["notebooks"][label], known.get(label)
        if nb is None:
            out.refused[label] = "not a notebook of this book"
            continue
        problem, files = _read_files(base, entry)
        if problem is None:
            problem, unit, results = _as_unit(nb, profile, files)
        if problem:
            out.refused[label] = problem
            log(f"published {profile}: {label} refused: {problem}")
            continue
        transfer._place(nb, unit, files_as_archive(nb, profile, files), results, profile, imported)
        for rel, data in files.items():
            if rel.startswith("metrics/"):
                atomic_write_bytes(_loaded_metrics(profile) / rel[len("metrics/"):], data)
    out.current, out.stale, out.kept_local = imported.current, imported.stale, imported.kept_local
    return out


def _read_files(base: Path, entry: dict) -> tuple[str | None, dict[str, bytes]]:
    files = {}
    for rel, sha in (entry.get("files") or {}).items():
        path = base / rel
        if ".." in Path(rel).parts or not path.is_file() or path.is_symlink():
            return f"{path} is missing", {}
        data = path.read_bytes()
        if _sha(data) != sha:
            return f"{path} does not match the SHA-256 the signed index holds (edited after it was published)", {}
        files[rel] = data
    return None, files


def files_as_archive(nb, label: str, files: dict[str, bytes]) -> dict[str, bytes]:
    """The notebook's files under the names an `export-results` archive gives them (`transfer._place`)."""
    out = {}
    for rel, data in files.items():
        head, _, rest = rel.partition("/")
        if head in ("results", "executed"):
            out[f"{head}/{label}/{rest}"] = data
    return out


def _as_unit(nb, label: str, files: dict[str, bytes]):
    """(problem, archive entry, results) of a notebook's published files: the same checks as an import's, the
    signature standing in for a visit key's seal."""
    arch = files_as_archive(nb, label, files)
    results_name = f"results/{label}/{nb.chapter}/{nb.name}.json"
    executed = f"executed/{label}/{nb.path}"
    record = f"executed/{label}/{Path(nb.path).with_suffix('.json').as_posix()}"
    if not {results_name, executed, record} <= set(arch):
        return "its results, executed notebook or cache record is missing", None, None
    try:
        results = context.parse_record(arch[results_name])
        cache = json.loads(arch[record])
    except ValueError as e:
        return f"a file of it is not JSON ({e})", None, None
    if not isinstance(results, dict):
        return "its results file is not a results record", None, None
    if results.get("input_hash") != (results.get("inputs") and book.inputs_hash(results["inputs"])):
        return "its recorded input hash is not the hash of its recorded inputs", None, None
    # the signature vouches for who made it; check_record checks what it is (its notebook, label, values and
    # the chain to its executed notebook) with a one-off key in place of the publisher's seal
    once = os.urandom(seal.KEY_BYTES)
    resealed = seal.apply(results, _sha(arch[executed]), once)
    problem = context.check_record(nb.chapter, nb.name, label, resealed, executed=arch[executed], cache=cache,
                                   keys={seal.key_id(once): once}, where=results_name)
    if problem:
        return problem, None, None
    return None, {"executed": executed, "record": record, "results": results_name}, results


def published_notebooks(profile: str) -> dict[str, dict]:
    """{notebook: index entry} published at `profile` whose index verifies ({} if none or it does not)."""
    try:
        return _read_index(profile)["notebooks"] if (folder(profile) / INDEX).exists() else {}
    except PublishError:
        return {}


def current_published(profile: str) -> set[str]:
    """Notebooks whose published result at `profile` is current: its index verifies and its recorded input
    hash is the notebook's input hash now (what a GPU visit need not execute again)."""
    entries = published_notebooks(profile)
    if not entries:
        return set()
    nbs = [nb for nb in book_notebooks() if nb.label in entries]
    book.compute_hashes(nbs, profile)
    return {nb.label for nb in nbs if entries[nb.label].get("input_hash") == nb.input_hash}


# ---------------------------------------------------------------- the book from published results

PUBLISHED_BOOK = "book"  # _build/book: the book from published results (`build_published`)


def build_published(keep_going: bool = False, log=print, execute_missing: bool = True,
                    default_profile: str = "cpu") -> Path:
    """The book as a reader gets it (`make book`): every notebook page from the largest profile whose result is
    current (full over cpu over smoke) after what `published/` holds is placed in the store (`publish.load`);
    the rest executed at `default_profile` as a build at that profile would (or, with execute_missing=False,
    shown stale or as code). Each page says which profile, machine and commit its numbers came from; the
    scorecard shows full beside cpu for every claim. HTML in _build/book/html."""
    nbs = book_notebooks()
    book.check_notebooks(nbs)
    _check_claims()
    check_store()
    params.check_profile(default_profile)
    for profile in profiles():
        try:
            got = load(profile, log=log)
        except PublishError as e:
            log(f"published/{profile} is not used: {e}")
            continue
        log(f"published/{profile}: {len(got.current)} current, {len(got.stale)} stale (not graded), "
            f"{len(got.kept_local)} kept from this store, {len(got.refused)} refused")
    by_profile = {p: {nb.label: nb for nb in book_notebooks()} for p in ORDER}
    for p, table in by_profile.items():
        compute_hashes(list(table.values()), p)  # validates every notebook's parameters at every profile
    shown, failures, timing = {}, [], {}
    with build_lock(PUBLISHED_BOOK, log):
        src = stage(PUBLISHED_BOOK)
        for i, nb0 in enumerate(nbs, 1):
            dest = src / nb0.path
            choice = _current_profile(nb0.label, by_profile)
            if choice is None and execute_missing:
                nb = by_profile[default_profile][nb0.label]
                log(f"[{i}/{len(nbs)}] {nb.path}: no current result published or stored; executing at "
                    f"{default_profile} ...")
                executed_path(default_profile, nb).with_suffix(".json").unlink(missing_ok=True)
                try:
                    secs = execute(nb, default_profile, dest, log=log, label=default_profile)
                    _store_execution(default_profile, nb, dest, secs)
                    choice, timing[nb.label] = default_profile, secs
                except BuildError as e:
                    failures.append(str(e))
                    log(f"FAILED: {e}")
                    if not keep_going:
                        raise
            if choice is None:
                profile = next((p for p in ORDER if executed_path(p, nb0).exists()), default_profile)
                nb = by_profile[profile][nb0.label]
                log(f"[{i}/{len(nbs)}] {nb.path}: {_stage_unexecuted(nb, profile, dest)} (at {profile})")
                shown[nb0.label] = (profile, None)
                continue
            nb = by_profile[choice][nb0.label]
            results = context.read_results(nb.chapter, nb.name, choice) or {}
            _stage_stored(choice, nb, dest, banner=pages.provenance_banner(choice, results))
            shown[nb0.label] = (choice, results)
            timing.setdefault(nb.label, (results.get("provenance") or {}).get("seconds"))
            log(f"[{i}/{len(nbs)}] {nb.path}: {choice} ({claims_provenance(results)})")
        write_published_pages(src, shown, timing)
        html = render(src, PUBLISHED_BOOK, log)
    log(f"HTML: {html / 'index.html'}")
    if failures:
        raise BuildError(f"{len(failures)} notebook(s) failed (the book was rendered with --keep-going):\n"
                         + "\n".join(failures))
    return html


def claims_provenance(results: dict) -> str:
    from .claims import provenance_text

    return provenance_text(results.get("provenance")) or "no provenance recorded"


def _current_profile(label: str, by_profile: dict) -> str | None:
    """The largest profile at which the store holds a current, verified execution of `label`."""
    for profile in ORDER:
        nb = by_profile[profile][label]
        refresh_inputs(nb, profile)  # the identity of the results it needs, as placed above
        if cached_execution(profile, nb) is not None:
            return profile
    return None


def write_published_pages(src: Path, shown: dict, seconds: dict) -> None:
    """The published book's generated pages: the scorecard with full beside cpu for every claim, each chapter's
    header (which profile, machine and commit each page shows) and claims, each page's re-run box."""
    page = src / "book" / "scorecard.md"
    text = page.read_text() if page.exists() else SCORECARD_MARKER
    rows = {p: claims.scorecard(p) for p in pages.BESIDE}
    page.write_text(text.replace(SCORECARD_MARKER, pages.scorecard_beside(rows)))
    built = time.strftime("%Y-%m-%d %H:%M")
    for chapter in claims.claim_chapters():
        if chapter == params.BOOK_PSEUDO_CHAPTER:
            continue
        index = src / "chapters" / chapter / "index.md"
        if not index.exists():
            continue
        ch_rows = {p: [r for r in rs if r["chapter"] == chapter] for p, rs in rows.items()}

        def page_row(r0):  # the row of the profile its notebook's page shows (cpu's for a smoke page)
            profile = shown.get(f"{chapter}/{r0['notebook']}", ("cpu", None))[0]
            return next((r for r in ch_rows.get(profile, []) if r["id"] == r0["id"]), r0)
        page_rows = [page_row(r0) for r0 in ch_rows["cpu"]]
        presentation.summary_figure(chapter, page_rows, index.parent / "_generated" / "summary.png")
        index.write_text(pages.place_published_header(index.read_text(), chapter, shown, seconds, built, ch_rows,
                                                      figure="_generated/summary.png"))
    for nb in book_notebooks(repo_root()):
        staged = src / nb.path
        if staged.exists():
            _add_rerun_box(staged, nb, shown.get(nb.label, ("cpu",))[0])
