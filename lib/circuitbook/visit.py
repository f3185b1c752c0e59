"""One visit to a GPU machine that cannot download anything (`scripts/device-run.sh`).

    python3 -m circuitbook.visit visit --budget-s 480 --out $OUT [--dry-run] [--chapter SLUG]
    python3 -m circuitbook.visit groups --profile full --until UNIX_TIME --summary FILE [--chapter SLUG]

`visit` spends its budget, counted from `--started` (the script's start, so installing counts), in phases:
the machine (GPU, driver, torch, the image's packages), the CUDA tests (`pytest -m cuda
tests/test_cuda.py`), the GPU benchmarks (`benchmarks/gpu.py`), then `groups`, then packing: every
executed notebook, results file, run metrics file, benchmark result and log goes into at most
MAX_ARCHIVES gzip tar archives in --out (`circuitbook.transfer`; no weights), beside the visit's log.
Each phase gets at most its share of the budget and is stopped (SIGINT, then SIGKILL) at its end, and
packing always runs, so what was done comes back even when a phase ran over.

`groups` plans the book at the profile on this device (`circuitbook.plan`: each run's steps timed
here), chooses groups of notebooks (the notebooks that train runs and those that read them: weights
never come back) by value, largest first, while they fit the time left, and executes them one notebook
after another. It starts a notebook only if its estimate fits before --until, and the notebook's
`train()` starts no new run after it ($CIRCUITBOOK_DEADLINE), so a group stops between runs.
`--dry-run` does all of it at the smoke profile on whatever machine it is on, installing nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .runs import repo_root

MAX_ARCHIVES = 7  # $OUT returns 8 files: the visit's log and at most 7 archives
TESTS_SHARE, BENCH_SHARE, PLAN_SHARE = 0.2, 0.15, 0.25  # of the budget; planning: of the groups' time
PACK_RESERVE_S = 20.0  # left for packing at the end
GRACE_S = 15.0  # a phase past its end gets SIGINT, then this long before SIGKILL; notebooks end this much earlier


def log(msg: str) -> None:
    print(f"[device {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- the machine

def machine_info() -> dict:
    """What ran the visit: GPU, driver, CUDA, torch, Python, CPUs."""
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"not available ({type(e).__name__})"
    return info


def image_packages() -> str:
    """`pip list --format=freeze` of this interpreter (the image's versions, for scripts/device/packages.yml)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                          timeout=120)
    return proc.stdout or proc.stderr


def loaded_distributions() -> set[str]:
    """Canonical names of the installed distributions whose modules this process has imported."""
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    owners = md.packages_distributions()
    tops = {name.split(".")[0] for name, mod in list(sys.modules.items()) if getattr(mod, "__file__", None)}
    return {canonicalize_name(d) for top in tops for d in owners.get(top, [])}


# ---------------------------------------------------------------- phases with a deadline

def run_phase(name: str, cmd: list[str], seconds: float, out_file: Path, env: dict | None = None) -> dict:
    """Run cmd for at most `seconds` (SIGINT, then SIGKILL to its process group), its output teed into
    out_file and this log; return {rc, seconds, stopped}."""
    log(f"{name}: {' '.join(cmd)} (at most {seconds:.0f} s)")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    t0, stopped = time.time(), False
    with open(out_file, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                cwd=repo_root(), env={**os.environ, **(env or {})}, start_new_session=True)
        import threading

        def pump():
            for line in proc.stdout:
                sink.write(line)
                sink.flush()
                print(f"  {line}", end="", flush=True)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            stopped = True
            log(f"{name}: its {seconds:.0f} s are up; interrupting it")
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=10)
    result = {"rc": proc.returncode, "seconds": round(time.time() - t0, 1), "stopped": stopped}
    log(f"{name}: exit {proc.returncode} after {result['seconds']} s" + (" (stopped at its limit)" if stopped else ""))
    return result


def visit(a) -> int:
    """The whole visit; returns 0 when every phase ran (a failing test or notebook is a result, not an error)."""
    from . import transfer

    started = a.started or time.time()
    end = started + a.budget_s
    left = lambda: end - time.time()  # noqa: E731
    profile = "smoke" if a.dry_run else "full"
    out = Path(a.out)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="cb-visit-"))  # never under out: it all comes back
    logs, bench = work / "logs", work / "benchmarks"
    for folder in (out, logs, bench):
        folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CIRCUITBOOK_RUNS", str(work / "runs"))
    os.environ.setdefault("CIRCUITBOOK_PROGRESS", "0")
    log(f"visit: profile {profile}, budget {a.budget_s:.0f} s ({left():.0f} s left after the start), "
        f"run store {os.environ['CIRCUITBOOK_RUNS']}, output {out}")
    info = machine_info()
    log("machine: " + json.dumps(info))
    (logs / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    (logs / "packages.txt").write_text(image_packages())
    phases = {}
    phases["cuda tests"] = run_phase(
        "cuda tests", [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q", "-rs",
                       "-p", "no:cacheprovider", f"--junitxml={logs / 'pytest-cuda.xml'}"],
        min(TESTS_SHARE * a.budget_s, left() - PACK_RESERVE_S), logs / "pytest-cuda.txt")
    device_type = "cuda" if info["cuda_available"] else "cpu"
    bench_cmd = [sys.executable, "benchmarks/gpu.py", "--profile", profile, "--out", str(bench / f"gpu_{device_type}.json")]
    if a.dry_run:
        bench_cmd += ["--members", "2", "4", "--matmul-size", "256"]
    for ch in a.chapter or []:
        bench_cmd += ["--chapter", ch]
    phases["benchmarks"] = run_phase("benchmarks", bench_cmd, min(BENCH_SHARE * a.budget_s, left() - PACK_RESERVE_S),
                                     logs / "benchmarks.txt")
    until = end - PACK_RESERVE_S - GRACE_S
    groups_cmd = [sys.executable, "-m", "circuitbook.visit", "groups", "--profile", profile, "--until", str(until),
                  "--summary", str(logs / "groups.json")]
    for ch in a.chapter or []:
        groups_cmd += ["--chapter", ch]
    phases["groups"] = run_phase("groups", groups_cmd, end - PACK_RESERVE_S - time.time(), logs / "groups.txt")
    (logs / "phases.json").write_text(json.dumps(phases, indent=1) + "\n")
    extra = {f"logs/{p.name}": p for p in sorted(logs.iterdir()) if p.is_file()}
    extra.update({f"benchmarks/{p.name}": p for p in sorted(bench.iterdir()) if p.is_file()})
    packed = transfer.export_results(profile, out, extra=extra, max_archives=MAX_ARCHIVES,
                                     source={"device": info.get("gpu", "cpu"), "torch": info["torch"]})
    for archive in packed["archives"]:
        log(f"packed {archive.name}: {archive.stat().st_size / 2 ** 20:.2f} MiB")
    if packed["left_out"]:
        log("left out (over the size or file limit, or not a result this store stands behind): "
            + ", ".join(packed["left_out"]))
    summary = json.loads((logs / "groups.json").read_text()) if (logs / "groups.json").exists() else {}
    for g in summary.get("groups", []):
        log(f"group {g['name']}: {g['status']}; estimated {g['estimate_s']:.0f} s, took {g.get('seconds', 0):.0f} s")
    log(f"visit done in {time.time() - started:.0f} s of {a.budget_s:.0f}; {len(packed['notebooks'])} notebooks packed; "
        f"bring back {out} and run: circuitbook import-results {out}/circuitbook-results-{profile}-*.tar.gz")
    return 0


# ---------------------------------------------------------------- the groups

def run_groups(profile: str, until: float, chapters: list[str] | None, summary_path: Path) -> int:
    """Plan, choose and execute groups of notebooks before `until`; the summary is rewritten after each notebook.
    The notebooks' `train()` starts no run after `until` ($CIRCUITBOOK_DEADLINE, set only while this runs)."""
    from .training.runner import DEADLINE_ENV

    before = os.environ.get(DEADLINE_ENV)
    try:
        return _run_groups(profile, until, chapters, summary_path)
    finally:
        if before is None:
            os.environ.pop(DEADLINE_ENV, None)
        else:
            os.environ[DEADLINE_ENV] = before


def _run_groups(profile: str, until: float, chapters: list[str] | None, summary_path: Path) -> int:
    from . import build, plan
    from .book import book_notebooks, compute_hashes
    from .training.runner import DEADLINE_ENV

    t0 = time.time()
    summary_path.write_text(json.dumps({"profile": profile, "status": "planning", "groups": [], "skipped": []}) + "\n")
    plan_until = t0 + PLAN_SHARE * (until - t0)
    plans = plan.plan_book(profile, chapters, deadline=plan_until)
    found = plan.groups(plans, profile)
    chosen, skipped = plan.choose_groups(found, until - time.time())
    summary = {"profile": profile, "status": "executing", "planned_s": round(time.time() - t0, 1), "groups": [],
               "skipped": []}
    summary["skipped"] = [{"name": g.name, "notebooks": g.notebooks, "claims": g.claims, "estimate_s": g.seconds,
                           "why": why} for g, why in skipped]
    log(f"planned in {summary['planned_s']} s; {len(chosen)} group(s) chosen for {until - time.time():.0f} s: "
        + "; ".join(f"{g.name} ({g.claims} claims, ~{g.seconds:.0f} s)" for g in chosen))
    for g, why in skipped:
        log(f"skipped {g.name} ({g.claims} claims): {why}")
    nbs = {nb.label: nb for nb in book_notebooks()}
    compute_hashes(list(nbs.values()), profile)
    os.environ[DEADLINE_ENV] = str(until)
    stop = False

    def write_summary():
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    estimated = actual = 0.0  # of the notebooks executed so far: their ratio scales the next estimates
    for g in chosen:
        entry = {"name": g.name, "notebooks": [], "claims": g.claims, "estimate_s": g.seconds, "status": "running"}
        summary["groups"].append(entry)
        started = time.time()
        for label in g.notebooks:
            nb = nbs[label]
            scale = max(1.0, actual / estimated) if estimated else 1.0
            estimate = g.notebook_seconds[label] * scale
            if time.time() + estimate > until:
                entry["status"] = (f"stopped before {label}: ~{estimate:.0f} s needed"
                                   + (f" (the estimate x {scale:.2f}, as the notebooks so far took)" if scale > 1 else "")
                                   + f", {max(0.0, until - time.time()):.0f} s left")
                break
            record = {"notebook": label, "estimate_s": round(estimate, 1)}
            entry["notebooks"].append(record)
            build.refresh_inputs(nb, profile)  # a notebook it needs may have been executed above
            if build.cached_execution(profile, nb):
                record.update(status="cached", seconds=0.0)
                continue
            log(f"executing {label} (estimated {estimate:.0f} s, {until - time.time():.0f} s left)")
            dest = build.executed_path(profile, nb)
            build.executed_path(profile, nb).with_suffix(".json").unlink(missing_ok=True)
            t_nb = time.time()
            try:
                seconds = build.execute(nb, profile, dest, label=profile, log=log)
                build._store_execution(profile, nb, dest, seconds)
                record.update(status="ok", seconds=round(seconds, 1))
                log(f"{label}: done in {seconds:.0f} s (estimated {estimate:.0f} s)")
            except build.BuildError as e:
                record.update(status="failed", error=str(e)[:500], seconds=round(time.time() - t_nb, 1))
                log(f"{label}: FAILED: {e}")
                if "BudgetExhausted" in str(e):
                    stop = True
                    entry["status"] = f"stopped between runs in {label}: the budget ended"
                break
            finally:
                estimated += g.notebook_seconds[label]
                actual += time.time() - t_nb
                write_summary()
        entry["seconds"] = round(time.time() - started, 1)
        if entry["status"] == "running":
            failed = [r["notebook"] for r in entry["notebooks"] if r["status"] == "failed"]
            entry["status"] = f"failed at {failed[0]}" if failed else "done"
        write_summary()
        if stop or time.time() > until:
            break
    summary["status"] = "done"
    write_summary()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m circuitbook.visit", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("visit", help="the whole visit (what scripts/device-run.sh runs)")
    v.add_argument("--budget-s", type=float, default=480.0)
    v.add_argument("--started", type=float, default=None, help="unix time the visit started (default: now)")
    v.add_argument("--out", required=True, help="where the archives and the log go ($OUT)")
    v.add_argument("--work", default=None, help="run store and scratch (default: a new temporary folder)")
    v.add_argument("--dry-run", action="store_true", help="the smoke profile, on any machine")
    v.add_argument("--chapter", action="append", default=None, help="only this chapter's groups (repeatable)")
    g = sub.add_parser("groups", help="plan, choose and execute groups of notebooks before a deadline")
    g.add_argument("--profile", required=True)
    g.add_argument("--until", type=float, required=True, help="unix time by which the last notebook must end")
    g.add_argument("--summary", type=Path, required=True)
    g.add_argument("--chapter", action="append", default=None)
    a = ap.parse_args(argv)
    from . import params

    known = params.chapters() + [params.BOOK_PSEUDO_CHAPTER]
    for ch in a.chapter or []:
        if ch not in known:
            ap.error(f"--chapter {ch!r} is not a chapter; chapters: {', '.join(known)}")
    if a.command == "visit":
        if a.budget_s < 2 * PACK_RESERVE_S:
            ap.error(f"--budget-s {a.budget_s:g}: at least {2 * PACK_RESERVE_S:.0f} s")
        return visit(a)
    return run_groups(a.profile, a.until, a.chapter, a.summary)


if __name__ == "__main__":
    sys.exit(main())
