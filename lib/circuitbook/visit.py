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
from .training.capture import CAPTURE_ENV

MAX_ARCHIVES = 7  # $OUT returns 8 files: the visit's log and at most 7 archives
TESTS_SHARE, BENCH_SHARE, PLAN_SHARE = 0.25, 0.1, 0.35  # of the budget; planning: of the groups' time (every notebook planned)
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
    capture, why = captured_step_verified(logs / "pytest-cuda.xml")
    log(f"training step in the notebooks: {'captured (CUDA graph)' if capture else 'eager'}: {why}")
    device_type = "cuda" if info["cuda_available"] else "cpu"
    bench_cmd = [sys.executable, "benchmarks/gpu.py", "--profile", profile, "--out", str(bench / f"gpu_{device_type}.json")]
    if a.dry_run:
        bench_cmd += ["--members", "2", "4", "--matmul-size", "256"]
    for ch in a.chapter or []:
        bench_cmd += ["--chapter", ch]
    bench_s = min(BENCH_SHARE * a.budget_s, left() - PACK_RESERVE_S)
    phases["benchmarks"] = run_phase("benchmarks", bench_cmd, bench_s / 2, logs / "benchmarks.txt")
    data_cmd = [sys.executable, "benchmarks/data.py", "--profile", profile, "--out", str(bench / f"data_{device_type}.json")]
    phases["data benchmark"] = run_phase("data benchmark", data_cmd, min(bench_s / 2, left() - PACK_RESERVE_S),
                                         logs / "benchmark-data.txt")
    until = end - PACK_RESERVE_S - GRACE_S
    groups_cmd = [sys.executable, "-m", "circuitbook.visit", "groups", "--profile", profile, "--until", str(until),
                  "--summary", str(logs / "groups.json"), "--plan-json", str(bench / f"plan_{device_type}.json")]
    for ch in a.chapter or []:
        groups_cmd += ["--chapter", ch]
    if a.redo_all:
        groups_cmd += ["--redo-all"]
    phases["groups"] = run_phase("groups", groups_cmd, end - PACK_RESERVE_S - time.time(), logs / "groups.txt",
                                 env={CAPTURE_ENV: "1" if capture else "0"})
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
        log(f"group {g['name']}: {g['status']}; estimated {g['estimate_s']:.0f} s alone, took {g.get('seconds', 0):.0f} s")
        for n in g.get("notebooks", []):
            if n.get("status") == "ok" and n.get("estimate_s"):
                log(f"  {n['notebook']}: planned {n['estimate_s']:.0f} s, took {n['seconds']:.0f} s "
                    f"({n['seconds'] / n['estimate_s']:.2f}x the plan)")
    log(f"visit done in {time.time() - started:.0f} s of {a.budget_s:.0f}; {len(packed['notebooks'])} notebooks packed; "
        f"bring back {out} and run: circuitbook import-results {out}/circuitbook-results-{profile}-*.tar.gz")
    return 0


CAPTURED_TESTS = "captured"  # the CUDA tests of the captured step have this in their names (tests/test_cuda.py)


def captured_step_verified(junit: Path) -> tuple[bool, str]:
    """(use the captured step?, why): only where this machine's CUDA tests of it ran and all passed."""
    import xml.etree.ElementTree as ET

    try:
        cases = ET.parse(junit).getroot().iter("testcase")
    except (OSError, ET.ParseError) as e:
        return False, f"the CUDA tests left no readable report ({type(e).__name__})"
    captured = [c for c in cases if CAPTURED_TESTS in c.get("name", "")]
    ran = [c for c in captured if c.find("skipped") is None]
    failed = [c.get("name") for c in ran if c.find("failure") is not None or c.find("error") is not None]
    if not ran:
        return False, "no CUDA test of the captured step ran here"
    if failed:
        return False, f"CUDA tests of the captured step failed here: {', '.join(failed)}"
    return True, f"{len(ran)} CUDA tests of the captured step passed on this machine"


# ---------------------------------------------------------------- the groups

def run_groups(profile: str, until: float, chapters: list[str] | None, summary_path: Path,
               plan_json: Path | None = None, redo_all: bool = False) -> int:
    """Plan, choose and execute groups of notebooks before `until`; the summary is rewritten after each notebook.
    The notebooks' `train()` starts no run after `until` ($CIRCUITBOOK_DEADLINE, set only while this runs)."""
    from .training.runner import DEADLINE_ENV

    before = os.environ.get(DEADLINE_ENV)
    try:
        return _run_groups(profile, until, chapters, summary_path, plan_json, redo_all)
    finally:
        if before is None:
            os.environ.pop(DEADLINE_ENV, None)
        else:
            os.environ[DEADLINE_ENV] = before


def _run_groups(profile: str, until: float, chapters: list[str] | None, summary_path: Path,
                plan_json: Path | None = None, redo_all: bool = False) -> int:
    """Plan, choose, then execute the chosen groups side by side: each group is one process (`group`
    below) executing its notebooks in book order; as many run at once as `plan.slots_for` allows (their
    GPU shares and CPUs), a group starts once the notebooks it reads values from are current, and only if
    its estimate (scaled by how much slower than planned the groups so far ran) fits before `until`."""
    from . import plan

    t0 = time.time()
    summary_path.write_text(json.dumps({"profile": profile, "status": "planning", "groups": [], "skipped": []}) + "\n")
    plan_until = t0 + PLAN_SHARE * (until - t0)
    current = set() if redo_all else continue_published(profile)
    plans = plan.plan_book(profile, chapters, deadline=plan_until, skip=current | cpu_only(profile))
    found = plan.groups(plans, profile)
    device_type = _device_type()
    slots = plan.slots_for([g for g in found if not g.problems], device_type)
    chosen, skipped = plan.choose_groups(found, until - time.time(), slots, device_type)
    times = plan.print_groups(found, plan.default_device(), out=lambda line: print(line, flush=True))
    if plan_json:
        from .runs import atomic_write_json
        atomic_write_json(plan_json, {**times, "profile": profile, "planned_in_s": round(time.time() - t0, 1),
                                      "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    summary = {"profile": profile, "status": "executing", "planned_s": round(time.time() - t0, 1), "slots": slots,
               "plan": times, "groups": [], "skipped": [{"name": g.name, "notebooks": g.notebooks, "claims": g.claims,
                                                        "estimate_s": g.seconds, "why": why} for g, why in skipped]}
    log(f"planned in {summary['planned_s']} s; {len(chosen)} group(s) chosen for {until - time.time():.0f} s, "
        f"{slots} side by side: " + "; ".join(f"{g.name} ({g.claims} claims, ~{g.seconds:.0f} s)" for g in chosen))
    for g, why in skipped:
        log(f"skipped {g.name} ({g.claims} claims): {why}")
    return execute_side_by_side(chosen, profile, until, slots, summary, summary_path)


def continue_published(profile: str) -> set[str]:
    """Place what is published at `profile` in this visit's store (`publish.load`) and return the notebooks
    whose results are current there: a visit continues the last one instead of executing them again."""
    from . import publish
    from .book import book_notebooks
    from .build import cached_execution, refresh_inputs

    if profile not in publish.profiles():
        log(f"nothing published at {profile} yet: every group is a candidate")
        return set()
    try:
        loaded = publish.load(profile, log=log)
    except publish.PublishError as e:
        log(f"published/{profile} is not used ({e}): every group is a candidate")
        return set()
    current = set()
    for nb in book_notebooks():  # in book order: a notebook's upstreams are decided before it
        refresh_inputs(nb, profile)
        if cached_execution(profile, nb) is not None:
            current.add(nb.label)
    log(f"published/{profile}: {len(current)} notebook(s) current, not executed again"
        + (f" ({', '.join(sorted(current))})" if current else "")
        + (f"; {len(loaded.stale)} stale, executed again" if loaded.stale else ""))
    return current


def cpu_only(profile: str) -> set[str]:
    """Notebooks `runs_on: cpu` (profiles.yml): they need files that cannot travel, and run on a CPU machine."""
    from . import params
    from .book import book_notebooks

    return {nb.label for nb in book_notebooks() if params.runs_on(nb.chapter, nb.name) == "cpu"}


def _device_type() -> str:
    from .training import default_device

    return default_device().type


def execute_side_by_side(chosen: list, profile: str, until: float, slots: int, summary: dict, summary_path: Path,
                         python: str | None = None) -> int:
    """Run the groups, at most `slots` at once, each in its own process; rewrite the summary as they end."""
    from .book import book_notebooks, compute_hashes
    from .build import cached_execution, refresh_inputs

    nbs = {nb.label: nb for nb in book_notebooks()}
    compute_hashes(list(nbs.values()), profile)
    work = summary_path.parent / "groups"
    work.mkdir(parents=True, exist_ok=True)
    todo, running, finished = list(chosen), {}, set()
    device_type = _device_type()
    estimated = actual = 0.0  # of the groups that ended: their ratio scales the next estimates
    t_start = time.time()

    def current(label: str) -> bool:
        refresh_inputs(nbs[label], profile)  # what it needs may have been executed since
        return label in finished or cached_execution(profile, nbs[label]) is not None

    def write_summary():
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    while todo or running:
        scale = max(1.0, actual / estimated) if estimated else 1.0
        for g in list(todo):
            if len(running) >= slots:
                break
            if not all(current(a) for a in g.after):
                coming = {n for r in running.values() for n in r["group"].notebooks} | {n for o in todo for n in o.notebooks}
                if any(a in coming for a in g.after):
                    continue  # it reads values a running or later group makes: once that group has ended
                todo.remove(g)
                summary["groups"].append({"name": g.name, "notebooks": [], "claims": g.claims, "estimate_s": g.seconds,
                                          "status": "not run: it reads values of notebooks with no current result: "
                                                    + ", ".join(a for a in g.after if not current(a))})
                continue
            # it shares the device with the groups running and, while others wait, with as many as the slots hold
            # (the first group of a visit is not alone for long)
            sharing = min(slots, len(running) + len(todo))
            slowdown = sharing / plan_throughput(sharing, device_type)
            estimates = {label: shared_estimate(s, scale, slowdown) for label, s in g.notebook_seconds.items()}
            wall = sum(estimates.values())
            if time.time() + wall > until:
                todo.remove(g)
                summary["groups"].append({"name": g.name, "notebooks": [], "claims": g.claims, "estimate_s": g.seconds,
                                          "status": f"not started: ~{wall:.0f} s needed side by side, "
                                                    f"{max(0.0, until - time.time()):.0f} s left"})
                continue
            todo.remove(g)
            running[g.name] = _start_group(g, profile, until, estimates, work, python)
            running[g.name]["entry"] = {"name": g.name, "notebooks": [], "claims": g.claims, "estimate_s": g.seconds,
                                        "status": "running", "started_s": round(time.time() - t_start, 1)}
            summary["groups"].append(running[g.name]["entry"])  # in the order they started
            write_summary()
            log(f"started group {g.name} ({len(running)} running; estimated {g.seconds * scale:.0f} s alone)")
        if not running:
            break
        time.sleep(0.5)
        for name, r in list(running.items()):
            if r["proc"].poll() is None:
                continue
            del running[name]
            entry = r["entry"]
            entry.update(_read_group_summary(r))
            entry.update(ended_s=round(time.time() - t_start, 1), seconds=round(time.time() - r["started"], 1))
            finished.update(n["notebook"] for n in entry["notebooks"] if n.get("status") in ("ok", "cached"))
            estimated += sum(n.get("estimate_s", 0) for n in entry["notebooks"] if n.get("status") == "ok")
            actual += sum(n.get("seconds", 0) for n in entry["notebooks"] if n.get("status") == "ok")
            log(f"group {name}: {entry['status']} after {entry['seconds']:.0f} s (estimated {r['group'].seconds:.0f} s alone)")
            write_summary()
    summary["status"] = "done"
    write_summary()
    return 0


def plan_throughput(n: int, device_type: str) -> float:
    from .plan import throughput

    return throughput(n, device_type)


def shared_estimate(seconds: float, scale: float, slowdown: float) -> float:
    """A notebook's planned seconds alone (`plan.Group.notebook_seconds`: its runs' training and evaluation, then
    the allowance for a kernel's start, imports and analysis) as it will run beside other groups: its runs share
    the device (`slowdown`); the allowance is host work of one process, which sharing does not slow. `scale`: how
    much slower than planned the visit's notebooks ran so far."""
    from .plan import NOTEBOOK_OVERHEAD_S

    host = min(seconds, NOTEBOOK_OVERHEAD_S)
    return ((seconds - host) * slowdown + host) * scale


def _start_group(g, profile: str, until: float, estimates: dict, work: Path, python: str | None) -> dict:
    spec = work / f"{abs(hash(g.name)):x}.json"
    out = spec.with_suffix(".summary.json")
    spec.write_text(json.dumps({"name": g.name, "notebooks": g.notebooks, "claims": g.claims,
                                "estimates": estimates}))
    cmd = [python or sys.executable, "-m", "circuitbook.visit", "group", "--profile", profile, "--until", str(until),
           "--spec", str(spec), "--summary", str(out)]
    log_file = open(spec.with_suffix(".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=repo_root())
    return {"group": g, "proc": proc, "summary": out, "log": log_file, "started": time.time()}


def _read_group_summary(r: dict) -> dict:
    r["log"].close()
    text = Path(r["log"].name).read_text()
    for line in text.splitlines():
        print(f"  [{r['group'].name}] {line}", flush=True)
    try:
        return json.loads(r["summary"].read_text())
    except (OSError, ValueError):
        return {"name": r["group"].name, "notebooks": [], "claims": r["group"].claims,
                "estimate_s": r["group"].seconds, "status": f"failed: its process ended with {r['proc'].returncode} "
                                                            "and no summary (its log is above)"}


def run_group(profile: str, until: float, spec_path: Path, summary_path: Path) -> int:
    """Execute one group's notebooks in book order (`execute_side_by_side` starts one process per group)."""
    from . import build
    from .book import book_notebooks, compute_hashes
    from .training.runner import DEADLINE_ENV

    spec = json.loads(spec_path.read_text())
    nbs = {nb.label: nb for nb in book_notebooks()}
    compute_hashes(list(nbs.values()), profile)
    os.environ[DEADLINE_ENV] = str(until)
    entry = {"name": spec["name"], "notebooks": [], "claims": spec["claims"],
             "estimate_s": round(sum(spec["estimates"].values()), 1), "status": "running"}
    estimated = actual = 0.0
    for label in spec["notebooks"]:
        nb = nbs[label]
        scale = max(1.0, actual / estimated) if estimated else 1.0
        estimate = spec["estimates"][label] * scale
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
        dest.with_suffix(".json").unlink(missing_ok=True)
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
                entry["status"] = f"stopped between runs in {label}: the budget ended"
            break
        finally:
            estimated += spec["estimates"][label]
            actual += time.time() - t_nb
            summary_path.write_text(json.dumps(entry, indent=1) + "\n")
    if entry["status"] == "running":
        failed = [r["notebook"] for r in entry["notebooks"] if r["status"] == "failed"]
        entry["status"] = f"failed at {failed[0]}" if failed else "done"
    summary_path.write_text(json.dumps(entry, indent=1) + "\n")
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
    v.add_argument("--redo-all", action="store_true", help="execute every group, also those current in published/")
    g = sub.add_parser("groups", help="plan, choose and execute groups of notebooks before a deadline")
    g.add_argument("--profile", required=True)
    g.add_argument("--until", type=float, required=True, help="unix time by which the last notebook must end")
    g.add_argument("--summary", type=Path, required=True)
    g.add_argument("--chapter", action="append", default=None)
    g.add_argument("--redo-all", action="store_true")
    g.add_argument("--plan-json", type=Path, default=None, help="write the whole book's planned time here")
    one = sub.add_parser("group", help="execute one group's notebooks (started by `groups`, one process per group)")
    one.add_argument("--profile", required=True)
    one.add_argument("--until", type=float, required=True)
    one.add_argument("--spec", type=Path, required=True)
    one.add_argument("--summary", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.command == "group":
        return run_group(a.profile, a.until, a.spec, a.summary)
    from . import params

    known = params.chapters() + [params.BOOK_PSEUDO_CHAPTER]
    for ch in a.chapter or []:
        if ch not in known:
            ap.error(f"--chapter {ch!r} is not a chapter; chapters: {', '.join(known)}")
    if a.command == "visit":
        if a.budget_s < 2 * PACK_RESERVE_S:
            ap.error(f"--budget-s {a.budget_s:g}: at least {2 * PACK_RESERVE_S:.0f} s")
        return visit(a)
    return run_groups(a.profile, a.until, a.chapter, a.summary, a.plan_json, a.redo_all)


if __name__ == "__main__":
    sys.exit(main())
