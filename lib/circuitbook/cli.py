"""The `circuitbook` command: build, run, release, params, scorecard, export-results, import-results, visit-key."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

from . import build as build_mod
from . import claims, context, params, settings
from .runs import DamagedRunError, runs_root
from .transfer import TransferError


def default_profile() -> str:
    """`full` where a CUDA GPU is present, else `cpu`."""
    try:
        import torch

        return "full" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _parse_value(text: str):
    """A -p value: YAML scalar or list (`3`, `0.5`, `1e-3`, `true`, `[1, 2]`, `adamw`).

    YAML 1.1 reads `1e-3` (no dot) as a string; a value written as a number is a number here.
    """
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
        return float(value.strip().replace(".", "", 1) if value.strip().startswith((".", "-.", "+.")) else value)
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        number = float(value)
        return int(number) if number.is_integer() and re.fullmatch(r"[-+]?\d+", value.strip()) else number
    if isinstance(value, list):
        return [_parse_value(v) if isinstance(v, str) else v for v in value]
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="circuitbook",
        description="Build and query the circuitbook Jupyter Book: execute its notebooks with papermill at a "
                    "profile (smoke: CI, seconds; cpu: a laptop; full: the papers' scale on a GPU), render the "
                    "book, list parameters, and print the claims scorecard.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    profile_help = "smoke | cpu | full (default: full with a CUDA GPU, else cpu)"

    b = sub.add_parser("build", help="render the book (from published results, or executed at a profile)",
                       description="Without --profile: the published book, what `make book` builds: the results in "
                                   "published/ are placed in the run store, every page shows the largest profile whose "
                                   "result is current (full over cpu over smoke), the rest is executed at this "
                                   "machine's default profile; HTML in _build/book/html. With --profile: stage the "
                                   "sources under _build/PROFILE/src, execute every notebook of _toc.yml in order with "
                                   "papermill (unchanged notebooks come from the cache), generate the scorecard and "
                                   "render HTML to _build/PROFILE/html.")
    b.add_argument("--profile", choices=params.PROFILES, default=None,
                   help="smoke | cpu | full: execute the book at this profile (default: the published book, executing "
                        "what is not published at full with a CUDA GPU, else at cpu)")
    b.add_argument("--chapter", action="append", metavar="SLUG", default=None,
                   help="execute only this chapter (repeatable); others use cached outputs if any")
    b.add_argument("--force", action="store_true", help="re-execute notebooks even if their inputs are unchanged")
    b.add_argument("--keep-going", action="store_true",
                   help="render the book even if a notebook fails (the failure is shown on its page); exit 1")
    b.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS", help=RAY_HELP)
    b.add_argument("--no-execute", action="store_true",
                   help="execute nothing: render cached and imported executions (`import-results`), imported ones "
                        "of other sources under a stale banner, the rest as code only")
    b.add_argument("--plan", action="store_true",
                   help="train nothing: print every notebook's runs at the profile (parameters, FLOPs, time on this "
                        "device from a short calibration) and the resources each notebook asks for")

    r = sub.add_parser("run", help="execute one notebook with parameter overrides",
                       description="Execute one notebook with papermill; print the executed notebook's path. "
                                   "Results of a run with overrides are kept apart from the profile's own.")
    r.add_argument("notebook", metavar="NOTEBOOK", help="path (chapters/assign_add/02_training.ipynb) or CHAPTER/NOTEBOOK")
    r.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                   help="override a parameter (value parsed as YAML: 3, 0.5, true, [1, 2])")
    r.add_argument("--profile", choices=params.PROFILES, default=None, help=profile_help)
    r.add_argument("--label", default=None, help="name the results label of a run with overrides "
                                                 "(PROFILE+LABEL; default PROFILE+<hash of the overrides>)")
    r.add_argument("--force", action="store_true", help="execute even if a verified cached execution exists")
    r.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                   help="execute here, training the chunks of this notebook's runs on the Ray cluster at ADDRESS too "
                        "(no ADDRESS: the cluster started on this machine, else a local one)")

    e = sub.add_parser("release", help="judge a released training run by a chapter's rules",
                       description="Execute every notebook of CHAPTER that can read a released run on PATH (a folder "
                                   "of step checkpoints, e.g. checkpoint_step_5301.pth, with or without the final "
                                   "model_state_dict.pth; or one state dict), all under one results label, then print "
                                   "the label and the chapter's scorecard for it.")
    e.add_argument("chapter", metavar="CHAPTER", help="a chapter slug (e.g. assign_add)")
    e.add_argument("path", metavar="PATH", help="the released run: a folder of step checkpoints or one state dict")
    e.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                   help="override a parameter of the notebooks that read it (e.g. -p pair_split authors)")
    e.add_argument("--profile", choices=params.PROFILES, default=None,
                   help="the evaluation sizes (pools, probes): " + profile_help)
    e.add_argument("--label", default=None, help="name the results label (PROFILE+LABEL; default the folder's name "
                                                 "and a hash of the path and overrides)")
    e.add_argument("--json", action="store_true", help="print the scorecard rows as JSON")

    q = sub.add_parser("params", help="list parameters, their values per profile, types and ranges",
                       description="List every parameter of the book, a chapter or a notebook with its value at "
                                   "each profile, its type and its allowed range.")
    q.add_argument("target", nargs="?", metavar="CHAPTER[/NOTEBOOK]", help="a chapter slug or CHAPTER/NOTEBOOK")
    q.add_argument("--profile", choices=params.PROFILES, default=None, help="show only this profile's values")

    s = sub.add_parser("scorecard", help="every claim with paper value, measured value and status",
                       description="Print every claim id of PAPERS.md with statement, the paper's value, the value "
                                   "measured at PROFILE, status and the run it came from.")
    s.add_argument("--profile", choices=params.PROFILES, default=None, help=profile_help)
    s.add_argument("--label", default=None, help="grade the results recorded under this label (what `circuitbook "
                                                 "run` printed, e.g. cpu+3fa2c1d0) with the same rules")
    s.add_argument("--json", action="store_true", help="print a JSON list of {id, status, paper, measured, profile, ...}")

    e = sub.add_parser("export-results", help="pack a label's executed notebooks, results and run metrics into archives",
                       description="Pack every notebook's results under LABEL, its executed notebook and cache record, "
                                   "and the metrics (no weights) of the runs they name into gzip tar archives of at "
                                   "most 15 MiB each (OUT/circuitbook-results-LABEL-N.tar.gz).")
    e.add_argument("--label", required=True, help="a profile (full) or a results label (full+3fa2c1d0)")
    e.add_argument("--out", required=True, type=Path, help="folder for the archives")

    i = sub.add_parser("import-results", help="place archived results (from a GPU machine) in this run store",
                       description="Check every archive (sizes, digests, input hashes, notebooks of this book, and the "
                                   "seal of every finished result: by a key of `circuitbook visit-key` or this store's), "
                                   "then place its executed notebooks and results in the run store, sealed again by "
                                   "this store, so that `circuitbook build --profile PROFILE` uses them instead of "
                                   "executing. Results computed from other sources than the current ones, or in an "
                                   "undeclared environment, are imported as stale (never graded); a GPU's benchmark "
                                   "results go to benchmarks/results/.")
    i.add_argument("archives", nargs="+", type=Path, metavar="ARCHIVE")

    u = sub.add_parser("publish", help="copy this store's current results at a profile into published/ (signed)",
                       description="Publish every notebook whose result at PROFILE this store would grade (executed "
                                   "notebook, results, run metrics; never weights) into published/PROFILE/, replacing "
                                   "what it supersedes, with a signed index; prints what was added and removed and the "
                                   "folder's size. Commit published/ (and published/publishers.json) afterwards.")
    u.add_argument("--profile", choices=params.PROFILES, required=True)

    sub.add_parser("visit-key", help="make a key for a GPU visit and print it (CIRCUITBOOK_SEAL_KEY=...)",
                   description="Make a fresh key under RUNS/.keys/visits/ and print CIRCUITBOOK_SEAL_KEY=<hex> for the "
                               "command that starts a GPU visit: the visit seals its results with it, and "
                               "import-results here accepts them (results sealed by no key this store knows are "
                               "refused). The key is a secret: it is never packed into an archive.")
    return p


RAY_HELP = ("execute notebooks whose inputs are ready concurrently as Ray tasks on the cluster at ADDRESS "
            "(HOST:PORT of `ray start --head`; no ADDRESS: $RAY_ADDRESS, the cluster started on this machine, else "
            "a local one), each asking for the resources its profiles.yml declares; split sweeps train there too")


def cmd_build(a) -> int:
    profile = a.profile or default_profile()
    if a.plan:
        from . import plan

        if a.ray:
            raise params.ParameterError("--plan trains nothing; it takes no --ray")
        plan.print_plan(profile, a.chapter)
        return 0
    if a.profile is None and not (a.chapter or a.force or a.ray):
        from . import publish as publish_mod

        publish_mod.build_published(keep_going=a.keep_going, execute_missing=not a.no_execute,
                                  default_profile=profile)
        return 0
    build_mod.build(profile, a.chapter, force=a.force, keep_going=a.keep_going, ray=a.ray,
                    execute_missing=not a.no_execute)
    return 0


def cmd_publish(a) -> int:
    from . import publish

    try:
        publish.publish(a.profile)
    except publish.PublishError as e:
        raise params.ParameterError(str(e)) from None
    return 0


def cmd_run(a) -> int:
    overrides = _overrides(a.param)
    out, label = build_mod.run_one(a.notebook, a.profile or default_profile(), overrides, label=a.label,
                                   force=a.force, ray=a.ray)
    print(f"results label: {label}")
    print(out)
    return 0


def _overrides(pairs) -> dict:
    overrides = {}
    for name, value in pairs:
        if name in overrides:
            raise params.ParameterError(f"-p {name} is given twice")
        overrides[name] = _parse_value(value)
    return overrides


def cmd_release(a) -> int:
    profile = a.profile or default_profile()
    label, done, failures = build_mod.release(a.chapter, a.path, profile, _overrides(a.param), label=a.label,
                                              log=(lambda m: print(m, file=sys.stderr)) if a.json else print)
    rows = [r for r in claims.scorecard(profile, label) if r["chapter"] == a.chapter]
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"\nresults label: {label} ({len(done)} notebooks executed: {', '.join(done) or 'none'})\n")
        print_rows(rows, label)
        print(f"(again: circuitbook scorecard --label {label})")
    if failures:
        print(f"circuitbook release: {len(failures)} notebook(s) failed:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


def cmd_params(a) -> int:
    targets: list[tuple[str, str | None]]
    if a.target:
        chapter, _, notebook = a.target.strip("/").partition("/")
        params.chapter_dir(chapter)
        targets = [(chapter, notebook or None)]
    else:
        targets = [(c, None) for c in params.chapters()]
    profiles = [a.profile] if a.profile else list(params.PROFILES)
    for chapter, notebook in targets:
        rows = params.table(chapter, notebook)
        print(f"\n{chapter}{'/' + notebook if notebook else ''}")
        if not rows:
            print("  (no parameters)")
            continue
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            values = "  ".join(f"{p}={r[p]!r}" for p in profiles)
            print(f"  {r['name']:<{width}}  {values}  [{r['allowed']}]  {r['help']}")
    return 0


def resolve_label(label: str, profile: str | None) -> str:
    """A results label as a user may type it: `PROFILE`, `PROFILE+NAME`, or NAME alone (what `release` and
    `run --label NAME` print after the profile), resolved to the one `PROFILE+NAME` of the store (at
    `profile`, when given); ambiguous or unknown names are refused with the labels there are."""
    if "+" in label or label in params.PROFILES:
        return label
    try:
        settings.check_label_name(label)
    except settings.SettingError as e:
        raise params.ParameterError(str(e)) from None
    root = runs_root() / "results"
    known = sorted(p.name for p in root.glob("*")) if root.is_dir() else []
    matches = [k for k in known if k.partition("+")[2] == label and (profile is None or k.partition("+")[0] == profile)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise params.ParameterError(f"--label {label}: no results label {'PROFILE' if profile is None else profile}"
                                    f"+{label} under {root}; labels: {', '.join(known) or '(none)'}")
    raise params.ParameterError(f"--label {label} is ambiguous: {', '.join(matches)}; give one of them in full "
                                "(or --profile)")


def cmd_scorecard(a) -> int:
    label = resolve_label(a.label, a.profile) if a.label is not None else None
    if label is not None:
        try:
            settings.check_label(label)
        except settings.SettingError as e:
            raise params.ParameterError(f"--label {label!r}: {e}") from None
        profile = context.label_profile(label)
        if a.profile and a.profile != profile:
            raise params.ParameterError(f"--label {label} holds results of profile {profile}, not {a.profile}")
        params.check_profile(profile)
        if not (runs_root() / "results" / label).is_dir():
            known = sorted(p.name for p in (runs_root() / "results").glob("*")) if (runs_root() / "results").is_dir() else []
            raise params.ParameterError(f"--label {label}: no results under {runs_root() / 'results' / label}; "
                                        f"labels: {', '.join(known) or '(none)'}")
    else:
        profile = a.profile or default_profile()
    build_mod.check_store(write=False)
    empty = _empty_store(label or profile)
    if empty:
        print(f"circuitbook scorecard: warning: {empty}: every row below is 'not run'", file=sys.stderr)
    rows = claims.scorecard(profile, label)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print_rows(rows, label or profile)
    return 0


def print_rows(rows: list[dict], title: str) -> None:
    """Scorecard rows as text, then the count of each status."""
    for r in rows:
        print(f"{r['id']:<6} {r['status']}")
        print(f"       paper: {r['paper']}")
        print(f"       measured: {r['measured'] or '-'}" + (f"  (run {', '.join(r['runs'])})" if r["runs"] else ""))
        for extra in ("release", "baselines", "seeds", "provenance"):
            if r.get(extra):
                print(f"       {extra}: {r[extra]}")
        if r["deviations"]:
            print(f"       deviations: {'; '.join(r['deviations'])}")
    counts = claims.counts(rows)
    print(f"\n{title}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))


def _empty_store(label: str) -> str | None:
    """Why the store holds nothing to grade at `label` (missing, a dangling link, empty), or None."""
    root, named = runs_root(), Path(os.environ.get("CIRCUITBOOK_RUNS") or runs_root()).expanduser()
    where = f"the run store {named} ($CIRCUITBOOK_RUNS, else <book>/runs)"
    if named.is_symlink() and not named.exists():
        return f"{where} is a dangling link to {os.readlink(named)}"
    if not root.exists():
        return f"{where} does not exist"
    results = root / "results" / label
    if not results.is_dir() or not any(results.rglob("*.json")):
        return f"{where} holds no results at {label}"
    return None


def cmd_export_results(a) -> int:
    from . import transfer

    build_mod.check_store(write=False)
    summary = transfer.export_results(a.label, a.out)
    if not summary["notebooks"] and summary["left_out"]:
        raise params.ParameterError(f"--label {a.label}: no result this store stands behind; left out: "
                                    + "; ".join(summary["left_out"]))
    if not summary["notebooks"]:
        raise params.ParameterError(f"--label {a.label}: no results under {runs_root() / 'results' / a.label}")
    for archive in summary["archives"]:
        print(f"{archive}  ({archive.stat().st_size / 2 ** 20:.1f} MiB)")
    print(f"{len(summary['notebooks'])} notebooks of {a.label} in {len(summary['archives'])} archive(s)"
          + (f"; left out: {', '.join(summary['left_out'])}" if summary["left_out"] else ""))
    return 0


def cmd_import_results(a) -> int:
    from . import transfer

    build_mod.check_store()
    done = transfer.import_results(a.archives)
    profile = context.label_profile(done.label)
    print(f"imported {len(done.current) + len(done.stale) + len(done.failed)} notebooks of {done.label}: "
          f"{len(done.current)} current, {len(done.stale)} stale, {len(done.failed)} failed; "
          f"{done.metrics} run metrics files")
    for nb, changed in done.stale.items():
        print(f"  stale: {nb} ({'; '.join(changed)}): imported, never graded")
    for nb in done.failed:
        print(f"  failed there: {nb} (its page shows the failure; the scorecard says not run)")
    for nb in done.kept_local:
        print(f"  kept the local result of {nb}: it is current, the imported one is not")
    for path in done.files:
        print(f"  benchmark results: {path}")
    for name, why in done.not_placed:
        print(f"  not placed in benchmarks/results: {name} ({why}); kept under {runs_root() / 'imported'}")
    print(f"render: circuitbook build --profile {profile} --no-execute   (or make book PROFILE={profile} NO_EXECUTE=1)")
    return 0


def cmd_visit_key(a) -> int:
    from . import seal

    build_mod.check_store()
    key = seal.new_visit_key()
    print(f"circuitbook visit-key: {seal.visits_dir() / (seal.key_id(key) + '.key')} (key {seal.key_id(key)}); start "
          "the visit with this in its environment (a secret: it seals results this store accepts):", file=sys.stderr)
    print(f"{seal.KEY_ENV}={key.hex()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # as a command: die quietly when piped into `head`
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = make_parser()
    a = parser.parse_args(argv)
    try:
        settings.check_environment()  # a bad CIRCUITBOOK_* variable is refused before anything runs
        commands = {"build": cmd_build, "run": cmd_run, "release": cmd_release, "params": cmd_params, "scorecard": cmd_scorecard,
                    "export-results": cmd_export_results, "import-results": cmd_import_results,
                    "visit-key": cmd_visit_key, "publish": cmd_publish}
        return commands[a.command](a)
    except (params.ParameterError, ValueError) as e:  # bad input: nothing was computed
        return _fail(a.command, str(e), 2)
    except TransferError as e:  # an archive that cannot be imported: nothing was written
        return _fail(a.command, str(e), 2)
    except (build_mod.BuildError, build_mod.StoreError, build_mod.BookError, DamagedRunError) as e:
        return _fail(a.command, str(e), 1)
    except KeyboardInterrupt:
        return _fail(a.command, "interrupted", 130)
    except OSError as e:  # a full disk, a read-only folder, ...
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return _fail(a.command, f"{e.strerror or e}{where}", 1)
    except Exception as e:  # noqa: BLE001 - anything else: one line here, the traceback in a file
        log = _write_traceback(a.command)
        return _fail(a.command, f"{type(e).__name__}: {e} (full traceback in {log})", 1)


def _fail(command: str, message: str, code: int) -> int:
    print(f"circuitbook {command}: error: {message}", file=sys.stderr)
    return code


def _write_traceback(command: str) -> Path:
    """Write the current exception's traceback where it can be written; return the path."""
    name = f"circuitbook-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for folder in (runs_root() / "logs", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.write_text(traceback.format_exc())
            return path
        except OSError:
            continue
    return Path("(nowhere: no writable folder)")


if __name__ == "__main__":
    sys.exit(main())
