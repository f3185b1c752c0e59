"""The plan's time for each notebook beside what the notebook then took, on the device at hand (issue 36, item 4).

    python benchmarks/plan_vs.py --profile cpu --chapter inductive_manifold --chapter leading_terms --minutes 40
    python benchmarks/plan_vs.py --summary logs/groups.json      # tabulate what a visit already wrote

Runs what a GPU visit runs after its benchmarks (`python -m circuitbook.visit groups`: plan every notebook here,
choose the groups that fit, execute them side by side as the device allows) in a fresh run store, every group
executed again (`--redo-all`), then tabulates the summary it wrote: per notebook, the plan's estimate when it started
(its share of the device included, as the visit scheduled it) and the seconds it took, plan / took, and whether the
plan is within +-30% of what the notebook took; for the whole run, the plan's time side by side against the wall time.
Writes results/plan_vs_notebooks_<device type>.json (rows: notebook, group, estimate_s, seconds, plan_over_took,
within) and .txt.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.3  # the plan within +-30% of what the notebook took (issue 36, item 4)


def table(summary: dict) -> tuple[list[dict], dict]:
    """(one row per notebook a group executed to the end, the whole run) from a `visit groups` summary."""
    rows = []
    for g in summary.get("groups", []):
        for n in g.get("notebooks", []):
            if n.get("status") != "ok" or not n.get("seconds"):
                continue
            ratio = n["estimate_s"] / n["seconds"]
            rows.append({"notebook": n["notebook"], "group": g["name"], "estimate_s": n["estimate_s"],
                         "seconds": n["seconds"], "plan_over_took": round(ratio, 3),
                         "within": abs(ratio - 1) <= TOLERANCE})
    ended = [g["ended_s"] for g in summary.get("groups", []) if "ended_s" in g]
    plan = summary.get("plan", {})
    complete = bool(ended) and not summary.get("skipped") and all(
        g.get("status") == "done" for g in summary.get("groups", []))
    whole = {"planned_side_by_side_s": plan.get("seconds_side_by_side"),
             "planned_one_at_a_time_s": plan.get("seconds_one_at_a_time"), "side_by_side": plan.get("side_by_side"),
             "wall_s": round(max(ended), 1) if ended else None, "every_group_done": complete,
             "within": sum(r["within"] for r in rows), "notebooks": len(rows)}
    if complete and plan.get("seconds_side_by_side"):
        whole["plan_over_wall"] = round(plan["seconds_side_by_side"] / max(ended), 3)
    return rows, whole


def report(rows: list[dict], whole: dict, header: str) -> str:
    lines = [header, f"plan = the visit's estimate for a notebook when it started (its share of the device included); "
                     f"within: plan / took in [{1 - TOLERANCE:.1f}, {1 + TOLERANCE:.1f}]",
             f"{'notebook':42s} {'group':40s} {'plan s':>8s} {'took s':>8s} {'plan/took':>9s}  within"]
    for r in rows:
        lines.append(f"{r['notebook']:42s} {r['group'][:40]:40s} {r['estimate_s']:8.1f} {r['seconds']:8.1f} "
                     f"{r['plan_over_took']:9.2f}  {'yes' if r['within'] else 'NO'}")
    lines.append(f"\n{whole['within']} of {whole['notebooks']} notebooks within +-{TOLERANCE:.0%}")
    if "plan_over_wall" in whole:
        lines.append(f"whole run: planned {whole['planned_side_by_side_s']:.0f} s with {whole['side_by_side']} side by "
                     f"side ({whole['planned_one_at_a_time_s']:.0f} s one at a time), took {whole['wall_s']:.0f} s: "
                     f"plan / took {whole['plan_over_wall']:.2f}")
    else:
        lines.append("whole run: not compared (a group was skipped, stopped or failed; see the summary)")
    return "\n".join(lines) + "\n"


def run_visit_groups(profile: str, chapters: list[str], minutes: float, work: Path) -> Path:
    """`visit groups` at `profile` in a fresh store under `work`; returns its summary's path."""
    summary = work / "groups.json"
    cmd = [sys.executable, "-m", "circuitbook.visit", "groups", "--profile", profile, "--redo-all",
           "--until", str(time.time() + 60 * minutes), "--summary", str(summary)]
    for ch in chapters:
        cmd += ["--chapter", ch]
    env = {**os.environ, "CIRCUITBOOK_RUNS": str(work / "runs"), "CIRCUITBOOK_PROGRESS": "0"}
    with open(work / "groups.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent, check=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="cpu", help="smoke, cpu or full (default: cpu)")
    ap.add_argument("--chapter", action="append", default=[], help="only this chapter's groups (repeatable)")
    ap.add_argument("--minutes", type=float, default=40.0, help="the visit's deadline, from now (default: 40)")
    ap.add_argument("--summary", type=Path, default=None, help="tabulate this summary instead of running a visit")
    ap.add_argument("--work", type=Path, default=None, help="run store and logs (default: a new temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/plan_vs_notebooks_<device type>.json")
    a = ap.parse_args(argv)
    from circuitbook import params
    from circuitbook.training import default_device, device_name

    try:
        params.check_profile(a.profile)  # a wrong profile is refused before anything runs
    except params.ParameterError as e:
        ap.error(f"--profile: {e}")
    if a.minutes <= 0:
        ap.error(f"--minutes {a.minutes:g}: must be positive")
    if a.summary is not None and not a.summary.is_file():
        ap.error(f"--summary {a.summary}: no such file")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    load = os.getloadavg()[0]
    ran_here = a.summary is None
    if ran_here:
        work = a.work or Path(tempfile.mkdtemp(prefix="cb-plan-vs-"))
        work.mkdir(parents=True, exist_ok=True)
        a.summary = run_visit_groups(a.profile, a.chapter, a.minutes, work)
    try:
        summary = json.loads(a.summary.read_text())
    except (OSError, ValueError) as e:
        ap.error(f"{a.summary}: not a readable summary of `visit groups` ({type(e).__name__}: {e})")
    rows, whole = table(summary)
    device = default_device()
    ran = ", ".join(a.chapter) or ("every chapter" if ran_here else "those of the summary")
    when = (f"{started}  {device_name(device)}, load {load:.2f} -> {os.getloadavg()[0]:.2f}" if ran_here else
            f"{started}  tabulated from a summary written earlier (its visit's times, not this machine's now)")
    header = (f"{when}; profile "
              f"{summary.get('profile')}, {summary.get('slots')} side by side, chapters: {ran}; summary {a.summary}")
    out = a.out or HERE / "results" / f"plan_vs_notebooks_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = report(rows, whole, header)
    out.write_text(json.dumps({"date": started, "device": device_name(device), "profile": summary.get("profile"),
                               "chapters": a.chapter, "rows": rows, "whole": whole}, indent=1) + "\n")
    out.with_suffix(".txt").write_text(text)
    print(text, end="")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
