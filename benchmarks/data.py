"""One step's batches of every chapter's training runs: made member by member on the host (the path before
issue 36) vs by the run's sampler on the device, against the training step itself.

    python benchmarks/data.py                                  # every chapter, full profile, on the device at hand
    python benchmarks/data.py --chapter assign_add --repeats 5 --step-repeats 1
    python benchmarks/data.py --threads 1 --max-step-s 60            # a CPU: skip steps of minutes (data timed)

The runs are each notebook's registry at the profile (`circuitbook.plan.planned_runs`: the very tasks, members
and batch size the notebooks train; a run read by several notebooks is timed once). Where a notebook cannot be
planned at the profile (leading_terms at full needs the full TinyStories) its runs are taken at
--fallback-profile and the row says so. Per run, on the device (CIRCUITBOOK_DEVICE, else CUDA when
available, else CPU), the mean over consecutive steps after a warm-up, a window that holds whole blocks of the
steps a sampler makes per call (`Prefetch`; --repeats of them) and a whole epoch of a fixed dataset (whose
order is made on the step that enters the epoch), so the mean is what training pays per step:
  old   each member's `reference_batch(step, batch, key)` (the torch.Generator batches; `train_batch` for a
        task without one), stacked and moved to the device: what `stack_batches` did every step;
  new   `training.data_sampler(tasks, seeds, device)(step, batch)`, built once (as the loop does): on a CPU
        with a C compiler the samplers' fused kernels (`circuitbook.tasks.native`);
  torch the same sampler with its kernel set aside, its torch ops (the form every other device runs), on the
        same steps; its batches are checked equal to the kernel's (only where the run has a kernel);
  step  `training.train_step` of that ensemble on the sampler's batch (forward, backward, optimizer), the
        fastest of --step-repeats after a warm-up (not timed where the warm-up passes --max-step-s: "> S s").
All three run under the device policy training uses (`training.device.device_policy`).
Targets (issue 36): on a CPU at most 0.1 ms of data per member-step, on a GPU data at most 10% of the step.
Writes results/data_<device type>.json (rows: chapter, notebook, run, members, batch_size, old/new data ms,
step_ms, data_ms_per_member_step, old_data_ms_per_member_step, ...) and .txt.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import time
from contextlib import contextmanager

import torch

import common
from circuitbook import plan
from circuitbook.book import book_notebooks
from circuitbook.tasks.base import EpochSampler, Prefetch, data_key
from circuitbook.training import Ensemble, Optimizer, data_sampler, default_device, device_name, train_step
from circuitbook.training.device import device_policy

CPU_TARGET_MS_PER_MEMBER_STEP = 0.1
GPU_TARGET_SHARE_OF_STEP = 0.10


def timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return 1e3 * (time.perf_counter() - t0)
    return timed


def old_batches(tasks, keys, step: int, batch: int, device: torch.device):
    """Today's path before the sampler: one batch per member on the host, stacked, copied to the device."""
    made = [(t.reference_batch if hasattr(t, "reference_batch") else t.train_batch)(step, batch, k)
            for t, k in zip(tasks, keys)]
    return torch.stack([b.tokens for b in made]).to(device), torch.stack([b.labels for b in made]).to(device)


MAX_EPOCH_WINDOW = 512  # steps; a longer window of epochs is timed over its first 512 steps (orders made on the first)


def window(sampler, batch: int, repeats: int) -> tuple[int, int]:
    """(first step, number of steps) to time: `repeats` whole prefetch blocks, or a whole window of epochs of a
    fixed dataset (`EpochSampler.window_epochs`: their orders are made in one call; at least `repeats` steps),
    starting at a boundary."""
    block = sampler.ahead(batch) if isinstance(sampler, Prefetch) else 1
    epochs = 1
    if isinstance(sampler, EpochSampler) and not (batch >= sampler.n_max and len(set(sampler.sizes)) == 1):
        epochs = min(MAX_EPOCH_WINDOW, sampler.window_epochs(batch) * max(sampler.steps_per_epoch(batch)))
    return max(block, epochs), max(epochs, block * repeats)


class StepTooLong(Exception):
    pass


@contextmanager
def at_most(seconds: float | None):
    """Raise StepTooLong in the block after `seconds` (None: no limit). Python code between torch ops sees it,
    so a training step stops within one op."""
    if not seconds:
        yield
        return

    def stop(signum, frame):
        raise StepTooLong

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def kernels(sampler) -> list:
    """The sampler's fused CPU kernels (`tasks.native`), one per part that has one."""
    inner = getattr(sampler, "sampler", sampler)
    return [part for part in getattr(inner, "groups", [inner]) if getattr(part, "native", None) is not None]


def without_kernels(sampler):
    """The sampler making its batches by torch ops (every kernel set aside)."""
    for part in kernels(sampler):
        part.native = None
    return sampler


def bench_run(run, device: torch.device, repeats: int, step_repeats: int, max_step_s: float | None = None) -> dict:
    tc, tasks = run.train_config, run.tasks
    keys = [data_key(s) for s in tc.seeds]
    timed = timer(device)
    # Every arm runs under the device policy, as the training loop does (on a CPU it sets how the process
    # keeps the memory it frees, for good: without it the first run a process measures would be timed
    # under other conditions than every later one and than training).
    with device_policy(device):
        sampler = data_sampler(tasks, tc.seeds, device)
        tokens, labels = sampler(0, tc.batch_size)  # warm-up, and the step's batch
        first, count = window(sampler, tc.batch_size, repeats)
        new = [timed(lambda s=s: sampler(s, tc.batch_size)) for s in range(first, first + count)]
        with_kernel = bool(kernels(sampler))
        torch_ms = None
        if with_kernel:
            by_torch = without_kernels(data_sampler(tasks, tc.seeds, device))
            check = first + count  # past the window (and its warm-up): the timed blocks are made while timed
            if not all(torch.equal(a, b) for a, b in zip(by_torch(check, tc.batch_size), sampler(check, tc.batch_size))):
                raise SystemExit(f"{run.dir.name}: the kernel's batches differ from the torch form's at step {check}")
            torch_ms = [timed(lambda s=s: by_torch(s, tc.batch_size)) for s in range(first, first + count)]
        old_batches(tasks, keys, 0, tc.batch_size, device)
        old = [timed(lambda s=s: old_batches(tasks, keys, s, tc.batch_size, device)) for s in range(1, repeats + 1)]
        step = time_step(run, device, tokens, labels, step_repeats, max_step_s)
    K = tc.n_members
    new_ms, old_ms = statistics.mean(new), statistics.mean(old)
    return {"run": run.dir.name, "members": K, "batch_size": tc.batch_size, "task": type(tasks[0]).__name__,
            "capturable": bool(sampler.capturable), "kernel": with_kernel, "timed_steps": [first, first + count],
            "old_data_ms": old_ms,
            "torch_data_ms": statistics.mean(torch_ms) if torch_ms else None,
            "torch_data_ms_per_member_step": statistics.mean(torch_ms) / tc.n_members if torch_ms else None,
            "data_ms": new_ms, "step_ms": step, "step_over_s": None if step is not None else max_step_s,
            "data_share_of_step": new_ms / step if step is not None else None, "data_ms_per_member_step": new_ms / K,
            "old_data_ms_per_member_step": old_ms / K, "speedup": old_ms / new_ms,
            "data_ms_all": new, "old_data_ms_all": old}


def time_step(run, device: torch.device, tokens, labels, repeats: int, max_s: float | None) -> float | None:
    """The fastest of `repeats` training steps after a warm-up (ms); None where the warm-up step took more than
    `max_s` seconds (a CPU step of a big model: the data arms are measured already)."""
    tc, timed = run.train_config, timer(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        ens = Ensemble(run.model_config, tc.seeds, None, device)
        opt = Optimizer(ens.params, ens.trainable, tc)
        kind = run.tasks[0].loss
        try:
            with at_most(max_s):
                train_step(ens, opt, tokens, labels, kind, tc)
        except StepTooLong:
            return None
        return min(timed(lambda: train_step(ens, opt, tokens, labels, kind, tc)) for _ in range(repeats))


def runs_of(chapter: str, notebook: str, profile: str, fallback: str | None) -> tuple[list, str, str]:
    """(planned runs, the profile they were planned at, why not at `profile` or '')."""
    try:
        return plan.planned_runs(chapter, notebook, profile), profile, ""
    except Exception as e:  # noqa: BLE001 - missing data (the full TinyStories): try the fallback profile
        why = f"{type(e).__name__}: {e}"[:200]
        if not fallback or fallback == profile:
            raise
        return plan.planned_runs(chapter, notebook, fallback), fallback, why


def book_runs(chapters: list[str] | None, profile: str, fallback: str | None):
    """(notebook, run, profile planned at, why not at `profile` or '') for every planned run of the book's
    notebooks (of `chapters`, or all), each run once; a notebook that cannot be planned: (notebook, None,
    profile, the error)."""
    seen = set()
    for nb in book_notebooks():
        if chapters and nb.chapter not in chapters:
            continue
        try:
            planned, planned_at, why = runs_of(nb.chapter, nb.name, profile, fallback)
        except Exception as e:  # noqa: BLE001 - the caller reports it and goes on
            yield nb, None, profile, f"{type(e).__name__}: {e}"[:200]
            continue
        for run in planned:
            if (run.dir.name, run.key) not in seen:
                seen.add((run.dir.name, run.key))
                yield nb, run, planned_at, why


def step_text(row: dict) -> str:
    return f"{row['step_ms']:.1f}" if row["step_ms"] is not None else f">{row['step_over_s']:g} s"


def share_text(row: dict) -> str:
    return f"{row['data_share_of_step']:.1%}" if row["data_share_of_step"] is not None else "-"


def table(rows: list[dict], device: torch.device) -> str:
    lines = [f"{'chapter':<18} {'run':<44} {'prof':<5} {'K':>3} {'batch':>5}  {'old ms':>8} {'new ms':>7} "
             f"{'step ms':>8} {'new/step':>8}  {'ms/member-step old | new':>25} {'x':>6}  {'torch form':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['chapter']:<18} {r['notebook']:<44} not measured: {r['error']}")
            continue
        lines.append(f"{r['chapter']:<18} {r['run']:<44} {r['profile']:<5} {r['members']:>3} {r['batch_size']:>5}  "
                     f"{r['old_data_ms']:>8.2f} {r['data_ms']:>7.2f} {step_text(r):>8} "
                     f"{share_text(r):>8}  {r['old_data_ms_per_member_step']:>12.3f} | "
                     f"{r['data_ms_per_member_step']:<10.4f} {r['speedup']:>5.0f}x  "
                     + (f"{r['torch_data_ms_per_member_step']:>10.4f}" if r.get("torch_data_ms_per_member_step")
                        else f"{'-':>10}"))
    target = ("(target: <= 10% of the step)" if device.type == "cuda"
              else f"(target: <= {CPU_TARGET_MS_PER_MEMBER_STEP} ms per member-step)")
    lines += ["", f"per chapter: the worst run {target}"]
    for chapter in dict.fromkeys(r["chapter"] for r in rows):
        measured = [r for r in rows if r["chapter"] == chapter and "error" not in r
                    and (device.type != "cuda" or r["step_ms"] is not None)]  # on a GPU the target is a share
        if not measured:
            continue
        worst = max(measured, key=lambda r: r["data_share_of_step"] if device.type == "cuda"
                    else r["data_ms_per_member_step"])
        met = (worst["data_share_of_step"] <= GPU_TARGET_SHARE_OF_STEP if device.type == "cuda"
               else worst["data_ms_per_member_step"] <= CPU_TARGET_MS_PER_MEMBER_STEP)
        lines.append(f"{chapter:<18} {worst['run']:<44} {worst['data_ms_per_member_step']:.4f} ms/member-step, "
                     f"{share_text(worst).strip()} of the step, old {worst['old_data_ms_per_member_step']:.3f} "
                     f"ms/member-step: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="full", help="whose runs (default full)")
    ap.add_argument("--fallback-profile", default="cpu", help="for a notebook that cannot be planned at --profile")
    ap.add_argument("--chapter", action="append", default=None, help="only this chapter (repeatable)")
    ap.add_argument("--repeats", type=int, default=8, help="timed data calls (consecutive steps) per arm (mean)")
    ap.add_argument("--step-repeats", type=int, default=2, help="timed training steps (fastest)")
    ap.add_argument("--max-step-s", type=float, default=None,
                    help="stop timing a run's training step whose warm-up takes longer (seconds; its data is timed)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--out", default=None, help="default: results/data_<device type>.json")
    args = ap.parse_args()
    info = common.start(args.threads)
    device = default_device()
    info["device"] = device_name(device)
    out = args.out or str(common.RESULTS / f"data_{device.type}.json")
    legend = (f"profile {args.profile} on {info['device']}: one step's batches of each run, old = per-member "
              "reference_batch + stack + copy (the path before issue 36), new = the run's sampler on the device "
              "(mean over whole prefetch blocks and epochs, at least --repeats steps); "
              f"step = train_step on that batch (fastest of {args.step_repeats}); "
              "x = old / new; torch form = the sampler's torch ops on the same steps (ms/member-step; runs with "
              "a CPU kernel, same batches checked)")
    rows = []
    for nb, run, profile, why in book_runs(args.chapter, args.profile, args.fallback_profile):
        if run is None:  # say so for this notebook, measure the rest
            rows.append({"chapter": nb.chapter, "notebook": nb.name, "error": why})
            continue
        row = {"chapter": nb.chapter, "notebook": nb.name, "profile": profile, "note": why,
               **bench_run(run, device, args.repeats, args.step_repeats, args.max_step_s)}
        rows.append(row)
        print("\n".join(table([row], device).splitlines()[1:2]), flush=True)
        common.write("data", out, args, info, rows, legend, table(rows, device))  # so far: a stopped run keeps it
    print(table(rows, device))


if __name__ == "__main__":
    main()
