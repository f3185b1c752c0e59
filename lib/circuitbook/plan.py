"""`circuitbook build --plan`: what the book would train at a profile, before anything is trained.

Each notebook's runs come from its chapter's registry, `notebook_runs(cfg)` (the chapter contract,
`circuitbook.chapters`), the very function the notebook's training cell calls, here with the notebook's
resolved parameters inside `training.planning()`, where `train()` trains nothing and returns a
`PlannedRun` with the run's name, key, model and training configs. So the plan enumerates the very
runs, with the very keys, that the notebooks train (`tests/test_plan.py` checks that against the runs
an executed notebook recorded); this module imports no chapter and types no training call.

For every run the plan gives its parameters per member, FLOPs (torch's FlopCounterMode on one
training step, scaled to the run's batch, members and steps), and the time on the current device from
a calibration step measured on the spot (with the chunk size `train()` would choose), and for every
notebook the resources it asks a Ray cluster for. Evaluation callbacks are not timed: they add to the
training time (at most about a tenth for the book's evaluation schedules on a CPU).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from . import chapters, params
from .build import fmt_seconds
from .book import book_notebooks
from .training import (PlannedRun, RunSpec, best_chunk, calibrate, chunk_candidates, count_parameters,
                       default_device, device_name, step_flops)
from .training.chunks import whole_ensemble_on
from .training.planning import planning


PLAN_BUDGET_S = 300  # a notebook whose setup takes longer is reported, not planned


@dataclass
class RunCost:
    run: PlannedRun
    params_per_member: int
    flops: float
    seconds: float  # training: every step, its batch made as training makes it
    chunk: int
    note: str = ""
    eval_seconds: float = 0.0  # the run's evaluation callback, at every evaluation step

    @property
    def total_seconds(self) -> float:
        return self.seconds + self.eval_seconds


def planned_runs(chapter: str, notebook: str, profile: str) -> list[PlannedRun]:
    """The runs the notebook's code would train at `profile`, in order (nothing is trained): its
    chapter's registry (`chapters.notebook_runs`) called with its resolved parameters inside `planning()`.
    A run gets `note`, what the registry said about how it was planned (`training.planning.note`)."""
    cfg = params.resolve(chapter, notebook, profile)
    with planning() as plan:
        chapters.notebook_runs(cfg)
    for run in plan.runs:
        run.note = plan.notes.get(run.dir.name, "")
    return plan.runs


PLAN_STEP_FLOPS = 2e10  # a timed calibration step does at most about this much work (seconds on a CPU)
PLAN_MAX_CHUNK = {"cpu": 16, "cuda": 256}  # larger chunks are not timed for a plan (a CPU is compute-bound by then)
# A CPU step that does more than this even at batch 1 (a one-hot model over a 10,000-token vocabulary: 7e8
# parameters, 6e11 FLOPs) is not timed: building and stepping it would take minutes and gigabytes (the
# plan's 300 s and this machine's memory). Its time is its FLOPs at this CPU's measured matrix-product rate:
# a lower bound, since a real step also moves its weights and activations through memory.
PLAN_UNTIMED_FLOPS = 10 * PLAN_STEP_FLOPS


def cost(run: PlannedRun, device: torch.device) -> RunCost:
    """Parameters, FLOPs and time on `device` of one planned run.

    Time: one training step at chunk sizes 1, 2, 4, ... up to K (at most PLAN_MAX_CHUNK members at once,
    so that a 150-member sweep is planned in seconds), the fastest of two after a warm-up, times the steps,
    for the chunk size with the least time (the one train() would pick given the same measurements).
    """
    spec = RunSpec(run.dir, {}, run.model_config, run.tasks, run.train_config)
    steps = run.train_config.steps - run.start
    K = run.n_members
    flops_per_step = step_flops(spec)
    cap = PLAN_MAX_CHUNK.get(device.type, 16)
    sizes = [c for c in chunk_candidates(K) if c <= cap] or [1]
    if getattr(run.model_config, "dropout", 0) or whole_ensemble_on(device):
        sizes = [K]  # members that share a random stream train as one ensemble; a GPU trains them together
    # a step too big to time in seconds here (a 3000-token vocabulary at batch 2048 on a CPU) is timed at
    # a smaller batch and scaled by the batch: such steps are compute-bound, so time grows with the batch
    batch = run.train_config.batch_size
    small = max(1, min(batch, int(batch * PLAN_STEP_FLOPS / max(flops_per_step / K * max(sizes), 1.0))))
    note = getattr(run, "note", "")
    timed_flops = flops_per_step / K * max(sizes) * small / batch
    if device.type == "cpu" and timed_flops > PLAN_UNTIMED_FLOPS:
        rate = matmul_rate(device)
        note = (note + "; " if note else "") + (f"a step at batch 1 is {timed_flops / max(sizes):.1e} FLOPs, too "
                                                f"big to time here: time = FLOPs / this CPU's matrix-product rate "
                                                f"({rate / 1e9:.0f} GFLOP/s)")
        return RunCost(run, count_parameters(run.model_config), flops_per_step * steps, flops_per_step * steps / rate,
                       1, note)
    if small < batch:
        tc = replace(run.train_config, batch_size=small,
                     micro_batch_size=min(run.train_config.micro_batch_size or small, small))
        spec = RunSpec(run.dir, {}, run.model_config, run.tasks, tc)
        note = (note + "; " if note else "") + f"step timed at batch {small} and scaled to {batch}"
    cal = calibrate(spec, sizes, device, repeats=2)
    times = {c: t * batch / small for c, t in cal.step_s.items()}
    per_step = {c: t * math.ceil(K / c) for c, t in times.items()}
    chunk = best_chunk(K, steps, times, 1, cal.setup_s)
    evals = steps // run.train_config.eval_every + 1
    eval_s = evaluation_seconds(run, min(K, max(sizes)), device) * evals
    return RunCost(run, count_parameters(run.model_config), flops_per_step * steps, per_step[chunk] * steps, chunk, note,
                   eval_s)


def evaluation_seconds(run: PlannedRun, members: int, device: torch.device) -> float:
    """Seconds of one call of the run's evaluation callback for all its members, timed on an ensemble of
    `members` (its first members, fresh weights) on `device` and scaled to the run's K (0 without one)."""
    if run.evaluate is None:
        return 0.0
    from .training import Ensemble

    tc = run.train_config
    with torch.random.fork_rng(devices=[]):
        ens = Ensemble(run.model_config, tc.seeds[:members], None, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.no_grad():
        for _ in range(2):  # the first call builds the callback's caches (pools on the device)
            sync()
            t0 = time.perf_counter()
            run.evaluate(ens, 0)
            sync()
            best = min(best, time.perf_counter() - t0)
    return best * run.n_members / members


_rates: dict[str, float] = {}


def matmul_rate(device: torch.device, n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of an n x n float32 matrix product on `device`, the best of `repeats` (measured once per process)."""
    key = f"{device}:{n}"
    if key not in _rates:
        a = torch.rand(n, n, generator=torch.Generator().manual_seed(0)).to(device)  # the global RNG untouched
        best = float("inf")
        for _ in range(repeats + 1):  # the first product warms the kernels up
            t0 = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t0)
        _rates[key] = 2 * n ** 3 / best
    return _rates[key]


class PlanTimeout(RuntimeError):
    pass


@contextlib.contextmanager
def _budget(seconds: float):
    """Stop a notebook's planning after `seconds` (its setup, not training, is that slow)."""
    def stop(*_):
        raise PlanTimeout(f"its setup takes more than {seconds:.0f} s at this profile")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class NotebookPlan:
    """One notebook's part of the plan: the runs its code trains or reads (RunCosts shared between the
    notebooks that use the same run), or why it could not be planned."""

    label: str
    resources: dict
    runs: list[RunCost]
    error: str = ""


def plan_book(profile: str, chapters: list[str] | None = None, out=print,
              deadline: float | None = None, skip: set[str] | None = None) -> list[NotebookPlan]:
    """Plan every notebook of the book (of `chapters`) at `profile` on this device, printing as it goes.

    deadline: a unix time after which the remaining notebooks are not planned (their plan says so).
    skip: notebooks left out (a visit's: current in what is published, or to run on a CPU machine).
    """
    params.check_profile(profile)
    device = default_device()
    nbs = [nb for nb in book_notebooks() if (not chapters or nb.chapter in chapters) and nb.label not in (skip or ())]
    out(f"circuitbook plan: profile {profile} on {device_name(device)}, load {os.getloadavg()[0]:.1f}; "
        "nothing is trained (times: a calibration step, its batch and one evaluation measured now)")
    seen: dict[tuple[str, str], RunCost] = {}
    plans = []
    for nb in nbs:
        res = params.resources(nb.chapter, nb.name, profile)
        out(f"\n{nb.label}  [resources: {', '.join(f'{k}={v}' for k, v in res.items())}]")
        if deadline is not None and time.time() > deadline:
            plans.append(NotebookPlan(nb.label, res, [], "not planned: the planning budget is spent"))
            out("  ? not planned: the planning budget is spent")
            continue
        try:
            with _budget(PLAN_BUDGET_S if deadline is None else max(1.0, min(PLAN_BUDGET_S, deadline - time.time()))):
                planned = planned_runs(nb.chapter, nb.name, profile)
                costs = []
                for run in planned:
                    ident = (run.dir.name, run.key)
                    if ident in seen:
                        out(f"  reads {run.dir.name}, trained above")
                    else:
                        seen[ident] = cost(run, device)
                        _print_run(seen[ident], out)
                    costs.append(seen[ident])
        except params.ParameterError:
            raise  # a wrong profiles.yml: the same one-line error as a build
        except Exception as e:  # noqa: BLE001 - missing data etc.: say so for this notebook, plan the rest
            why = e.args[0] if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            out(f"  ? cannot plan it: {why}")
            plans.append(NotebookPlan(nb.label, res, [], f"cannot plan it: {why}"))
            continue
        if not planned:
            out("  trains nothing")
        plans.append(NotebookPlan(nb.label, res, costs))
    return plans


def _print_run(c: RunCost, out) -> None:
    run, tc = c.run, c.run.train_config
    span = f"{tc.steps - run.start:,} steps" + (f" (fork at {run.start:,})" if run.start else "")
    stored = "  [complete in the store: nothing to train]" if run.complete else ""
    out(f"  {run.dir.name} ({run.key[:8]}): {run.n_members} member(s) x {span} x batch {tc.batch_size}, "
        f"{c.params_per_member:,} parameters each, {c.flops:.2e} FLOPs, "
        f"~{fmt_seconds(c.seconds)} here (chunk {c.chunk}) + ~{fmt_seconds(c.eval_seconds)} evaluating{stored}")
    if c.note:
        out(f"    note: {c.note}")


# ---------------------------------------------------------------- groups: what must execute in one visit

# A notebook's time beyond its runs' training and evaluation (both measured: `cost`): a kernel's start, its
# imports and its analysis, a fixed allowance per notebook (a notebook's recorded time replaces the estimate
# once it has run).
NOTEBOOK_OVERHEAD_S = 15.0
DEVICE_CALL_S = 480  # one call on a GPU machine that runs at most 10 minutes, with time to spare
CALL_OVERHEAD_S = 150  # what scripts/device-run.sh spends besides the groups: install, CUDA tests, benchmarks, packing
# Notebooks side by side on one machine: the throughput of n processes training at once relative to one, by the
# device they train on, straight lines between the measured points, 1 at n = 1 and the last point's value past it.
# cuda: measured on the H200 of the first GPU visit (four Assign-and-Add K=64 trainings at once: 2.9x one alone,
# ../shared/gpu-visits/2026-12-04/four-at-once.txt): the launch-bound steps of these models leave the GPU idle, which
# other processes fill. cpu: torch's threads already keep every core busy, so processes side by side share the cores
# and get one process's work done (measured on a 2-core machine: ten groups of the cpu profile, two at a time, took 955 s
# where their planned times alone add up to 930 s, benchmarks/results/plan_vs_notebooks_cpu_gpu_curve.txt). A CPU runs
# two at a time at most: that exercises the scheduling of a visit (`--dry-run`) and gains nothing.
SIDE_BY_SIDE_THROUGHPUT = {"cuda": {1: 1.0, 4: 2.9}, "cpu": {1: 1.0}}
MAX_SIDE_BY_SIDE = {"cuda": 4, "cpu": 2}


@dataclass
class Group:
    """Notebooks that must execute in one visit to a machine: the notebooks that train runs and every
    notebook that reads them (weights never come back), joined through shared runs. A notebook that only
    reads another notebook's recorded values (a `needs` entry whose runs it does not share) is not joined
    to it: it waits for that notebook's result to be current (`after`), from this visit or a published one."""

    notebooks: list[str]
    runs: list[RunCost]
    claims: int  # claim rows its notebooks grade: the group's value
    seconds: float  # estimated time on the device it was planned on, alone on it
    notebook_seconds: dict[str, float]  # per notebook, in book order: the runs it trains first and its allowance
    problems: list[str]
    after: list[str] = field(default_factory=list)  # notebooks of other groups whose recorded values it reads
    resources: dict = field(default_factory=dict)  # the most any of its notebooks asks for (num_cpus, num_gpus)

    @property
    def name(self) -> str:
        first, rest = self.notebooks[0], len(self.notebooks) - 1
        return first + (f" (+{rest})" if rest else "")


def run_seconds(c: RunCost) -> float:
    """A run's estimated time to train here, its evaluation included (0 if it is complete in the store)."""
    return 0.0 if c.run.complete else c.total_seconds


def groups(plans: list[NotebookPlan], profile: str) -> list[Group]:
    """The connected groups of notebooks (shared runs), in book order, valued and estimated."""
    from . import claims as claims_mod

    label_of = {p.label: p for p in plans}
    parent = {p.label: p.label for p in plans}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[tuple[str, str], str] = {}
    for p in plans:
        for c in p.runs:
            ident = (c.run.dir.name, c.run.key)
            if ident in owner:
                parent[find(p.label)] = find(owner[ident])
            owner.setdefault(ident, p.label)
    graded: dict[str, int] = {}
    for chapter in claims_mod.claim_chapters():
        for claim in claims_mod.load_claims(chapter)["claims"]:
            graded[f"{chapter}/{claim['notebook']}"] = graded.get(f"{chapter}/{claim['notebook']}", 0) + 1
    members: dict[str, list[NotebookPlan]] = {}
    for p in plans:
        members.setdefault(find(p.label), []).append(p)
    out = []
    for ps in members.values():
        counted: set[int] = set()
        per_nb = {}
        for p in ps:
            new = [c for c in p.runs if id(c) not in counted]
            counted.update(id(c) for c in new)
            per_nb[p.label] = sum(run_seconds(c) for c in new) + NOTEBOOK_OVERHEAD_S
        runs = list({id(c): c for p in ps for c in p.runs}.values())
        labels = {p.label for p in ps}
        after = sorted({need for p in ps for need in params.needs(*p.label.split("/", 1))
                        if need in label_of and need not in labels})
        resources = {k: max(float(p.resources.get(k, 0)) for p in ps) for k in ("num_cpus", "num_gpus")}
        out.append(Group([p.label for p in ps], runs, sum(graded.get(p.label, 0) for p in ps),
                         sum(per_nb.values()), per_nb, [f"{p.label}: {p.error}" for p in ps if p.error], after,
                         resources))
    return out


def by_value(candidates: list[Group]) -> list[Group]:
    """Largest value (claims graded) first, the cheaper of equal value first, a group after those it reads."""
    order, placed = [], set()
    todo = sorted(candidates, key=lambda g: (-g.claims, g.seconds))
    while todo:
        ready = next((g for g in todo if all(a in placed or not _in(a, todo) for a in g.after)), todo[0])
        todo.remove(ready)
        order.append(ready)
        placed.update(ready.notebooks)
    return order


def _in(label: str, groups_: list[Group]) -> bool:
    return any(label in g.notebooks for g in groups_)


def choose_groups(candidates: list[Group], budget_s: float, slots: int, device_type: str
                  ) -> tuple[list[Group], list[tuple[Group, str]]]:
    """The groups to run within budget_s, `slots` at a time at most: by value (`by_value`), each one that
    still fits the time left of the side-by-side schedule; returns (chosen in that order, [(skipped, why)])."""
    chosen, skipped = [], []
    for g in by_value(candidates):
        if g.problems:
            skipped.append((g, "; ".join(g.problems)))
            continue
        wall = side_by_side_seconds(chosen + [g], slots, device_type)
        if wall > budget_s:
            skipped.append((g, f"needs ~{fmt_seconds(g.seconds)}; with the groups chosen before it the call would "
                               f"take ~{fmt_seconds(wall)} of {fmt_seconds(max(budget_s, 0))}"))
        else:
            chosen.append(g)
    return chosen, skipped


def throughput(n: int, device_type: str) -> float:
    """How many processes' worth of work n processes training side by side on one `device_type` get done
    (a device type with no measurement is taken to share its cores as a CPU does)."""
    measured = SIDE_BY_SIDE_THROUGHPUT.get(device_type, SIDE_BY_SIDE_THROUGHPUT["cpu"])
    if n in measured:
        return measured[n]
    points = sorted(measured.items())
    for (a, ta), (b, tb) in zip(points, points[1:]):
        if a <= n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    return points[-1][1] if n > points[-1][0] else float(n)


def slots_for(groups_: list[Group], device_type: str, cpus: int | None = None) -> int:
    """How many groups run side by side. On a GPU: as many as their GPU shares fit in one GPU and their CPUs in
    this machine's, at most MAX_SIDE_BY_SIDE (1 for groups that ask for no GPU share: one at a time); elsewhere
    two at most, one per CPU."""
    cpus = cpus or os.cpu_count() or 1
    if not groups_:
        return 1
    if device_type != "cuda":
        return max(1, min(MAX_SIDE_BY_SIDE["cpu"], cpus))
    gpu = max(g.resources.get("num_gpus", 0) for g in groups_)
    cpu = max(g.resources.get("num_cpus", 1) for g in groups_) or 1
    by_gpu = int(1 / gpu) if gpu > 0 else 1
    return max(1, min(MAX_SIDE_BY_SIDE["cuda"], by_gpu, int(cpus // cpu)))


def side_by_side_seconds(groups_: list[Group], slots: int, device_type: str) -> float:
    """Wall time of the groups run in order, up to `slots` at once, sharing one `device_type` (`throughput`):
    each running group advances at throughput(n) / n of its speed alone while n run."""
    if slots <= 1:
        return sum(g.seconds for g in groups_)
    waiting, running, now = [g.seconds for g in groups_], [], 0.0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        rate = throughput(len(running), device_type) / len(running)
        step = min(running) / rate
        now += step
        running = [r - step * rate for r in running if r - step * rate > 1e-9]
    return now


def print_groups(found: list[Group], device: torch.device, out=print) -> dict:
    """Print the groups by value and the whole book's time on this device, one at a time and side by side;
    return those times."""
    out(f"\ngroups (notebooks that train runs and those that read them: one visit each), on {device_name(device)}:")
    for g in by_value(found):
        fits = ("cannot plan: " + "; ".join(g.problems)) if g.problems else \
            ("fits one 8-minute call" if g.seconds <= DEVICE_CALL_S - CALL_OVERHEAD_S else "longer than one 8-minute call")
        after = f"; after {', '.join(g.after)}" if g.after else ""
        out(f"  {g.claims:>2} claims  ~{fmt_seconds(g.seconds):>8}  {', '.join(g.notebooks)}  [{fits}{after}]")
    plannable = [g for g in by_value(found) if not g.problems]
    slots = slots_for(plannable, device.type)
    times = {"device": device_name(device), "groups": len(plannable),
             "unplanned": [g.name for g in found if g.problems],
             "seconds_one_at_a_time": round(sum(g.seconds for g in plannable), 1),
             "seconds_side_by_side": round(side_by_side_seconds(plannable, slots, device.type), 1), "side_by_side": slots}
    out(f"the whole book ({len(plannable)} groups that could be planned): ~{fmt_seconds(times['seconds_one_at_a_time'])} "
        f"one at a time, ~{fmt_seconds(times['seconds_side_by_side'])} with {slots} side by side"
        + (f"; not planned: {', '.join(times['unplanned'])}" if times["unplanned"] else ""))
    budget = DEVICE_CALL_S - CALL_OVERHEAD_S
    chosen, _ = choose_groups(found, budget, slots, device.type)
    out(f"one 8-minute call ({DEVICE_CALL_S} s, ~{CALL_OVERHEAD_S} s of it for installing, the CUDA tests, the "
        f"benchmarks and packing) runs: " + ("; ".join(f"{g.name} (~{fmt_seconds(g.seconds)})" for g in chosen)
                                              or "no group") + " (scripts/device-run.sh --budget-s 480)")
    return times


def print_plan(profile: str, chapters: list[str] | None = None, out=print, json_out=None) -> list[RunCost]:
    """Print every notebook's runs at `profile`, their size and cost on this device, its resources, and the
    groups of notebooks that must execute together with their estimated time here (one at a time and side by
    side); json_out: also write those times there (benchmarks/results/plan_<device>.json on a GPU visit)."""
    t0 = time.time()
    plans = plan_book(profile, chapters, out)
    device = default_device()
    costs = list({id(c): c for p in plans for c in p.runs}.values())
    todo = [c for c in costs if not c.run.complete]
    out(f"\ntotal: {len(costs)} runs ({len(costs) - len(todo)} complete in the store), "
        f"{sum(c.flops for c in todo):.2e} FLOPs to train, ~{fmt_seconds(sum(c.total_seconds for c in todo))} on "
        f"{device_name(device)} one run after another, evaluation included (planned in {time.time() - t0:.0f} s)")
    times = print_groups(groups(plans, profile), device, out)
    if json_out:
        import json

        from .runs import atomic_write_json
        atomic_write_json(json_out, {**times, "profile": profile, "planned_in_s": round(time.time() - t0, 1),
                                     "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return costs
