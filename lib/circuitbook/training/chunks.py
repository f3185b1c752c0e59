"""Training a run in chunks of members (parts), and choosing how many members train together.

Members share nothing, so a run may train as parts: each is a sub-ensemble trained start to finish in
`<run>/parts/`, with its own checkpoints and lock, and the run is published (stacked checkpoints, merged
metrics, manifest) only when every part is in. The chunk size never enters the run key; it is chosen
from a short calibration of `ensemble.train_step` on the device at hand (`choose_chunk`). Where the
parts train is the part scheduler's business: this process alone by default; a Ray build installs one
that also offers every part to the cluster (`circuitbook.cluster`, which imports this module; this
module never imports it). Not part of any run's key.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from .. import log, runs, settings
from ..models.registry import config_to_dict
from .config import TrainConfig
from .device import default_device, device_name, device_policy
from .capture import step_runner
from .ensemble import Ensemble, Optimizer, data_sampler
from .evaluate import EvalFn
from .loop import Trainer
from .run import Run, checkpoint_rel


class LocalParts:
    """The default part scheduler: this process trains every part, one after another."""

    task_overhead_s = 0.0

    def workers(self) -> int:
        return 1

    def submit(self, spec, bounds):
        """Offer the parts elsewhere; returns something with close() (None: nowhere else)."""
        return None


_scheduler = LocalParts()


def use_scheduler(scheduler) -> None:
    """Install the part scheduler of this process (a Ray build's, in a notebook it executes)."""
    global _scheduler
    _scheduler = scheduler if scheduler is not None else LocalParts()


CHUNK_ENV = "CIRCUITBOOK_CHUNK"
MIN_CALIBRATED_RUN_S = 60.0  # a run estimated shorter than this trains as one ensemble, uncalibrated
MIN_CALIBRATED_STEPS = 200  # ... and so does one of fewer steps (calibrating costs about 8 steps of the whole run)
CALIBRATION_REPEATS = 3  # timed steps per chunk size (after one warm-up); the fastest counts
# A chunk of several members must be estimated this much faster than one member at a time to be chosen:
# a few timed steps flatter larger chunks against whole runs on a CPU (benchmarks/README.md: assign_add in
# pairs calibrated at 1.02x of alone and ran at 0.90x; markov in eights at 1.04-1.09x, ran at 0.97-1.03x),
# and training members one after another is never slower than itself.
SEQUENTIAL_MARGIN = 0.10


@dataclass
class RunSpec:
    """Everything that determines a run, in a form that can be sent to another process (a Ray task)."""

    rundir: runs.RunDir
    full_config: dict
    model: object
    tasks: list
    tc: TrainConfig
    evaluate: EvalFn | None = None
    init_fn: Callable | None = None
    fork_from: tuple[Run, int] | None = None


def split_members(n_members: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of ceil(K / chunk) parts whose sizes differ by at most one member."""
    n = -(-n_members // max(1, min(chunk, n_members)))
    base, extra = divmod(n_members, n)
    bounds, lo = [], 0
    for i in range(n):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def chunk_candidates(n_members: int) -> list[int]:
    """Chunk sizes the calibration measures: powers of two below K, and K."""
    out, c = [], 1
    while c < n_members:
        out.append(c)
        c *= 2
    return out + [n_members]


def best_chunk(n_members: int, steps: int, step_seconds: dict[int, float], workers: int = 1,
               setup_seconds: dict[int, float] | None = None, task_overhead_s: float = 0.0) -> int:
    """The chunk size with the least estimated wall time for the run, if it beats one member at a time
    by more than SEQUENTIAL_MARGIN; else 1.

    A chunk of c members trains in `step_seconds[c]` per step and costs `setup_seconds[c]` once per part
    (building its ensemble and optimizer, its first step's allocations: measured by `calibrate`); the
    ceil(K / c) parts run `workers` at a time, and on a cluster every part beyond the first also pays
    `task_overhead_s` (a Ray task's process and imports), shared among the workers. Ties between chunks
    above 1 go to the larger (fewer parts to publish).
    """
    setup_seconds = setup_seconds or {}
    est = {}
    for c, t in step_seconds.items():
        n = len(split_members(n_members, c))
        rounds = -(-n // max(1, workers))
        est[c] = rounds * (steps * t + setup_seconds.get(c, 0.0)) + (n - 1) * task_overhead_s / min(n, max(1, workers))
    best = min(est, key=lambda c: (est[c], -c))
    if 1 in est and best != 1 and est[best] > (1 - SEQUENTIAL_MARGIN) * est[1]:
        return 1
    return best


def whole_ensemble_on(device: torch.device) -> bool:
    """A GPU trains every member of a run together: there a step of the book's models is bound by launching
    kernels, not by arithmetic (on an H200, 9-12 ms for every chapter's model at K = 8..64, the first GPU
    visit's benchmarks), so splitting a run into chunks only multiplies the launches."""
    return device.type == "cuda"


def _draws_random_numbers(model_cfg) -> bool:
    """Members that draw random numbers while training (dropout) share one random stream under vmap,
    so a chunk would not reproduce them exactly: such runs train as one ensemble."""
    return bool(getattr(model_cfg, "dropout", 0))


def _parse_chunk(choice) -> int | str:
    try:
        return settings.parse_chunk(choice)
    except settings.SettingError:
        raise ValueError(f"chunk={choice!r} (or ${CHUNK_ENV}) is not allowed; expected 'auto', 'all' or an "
                         "integer >= 1") from None


def choose_chunk(spec: RunSpec, requested=None, device: torch.device | None = None) -> int:
    """How many members train together: `requested`, else $CIRCUITBOOK_CHUNK, else measured.

    `auto` times one step of the whole ensemble; a run estimated under MIN_CALIBRATED_RUN_S trains as
    one ensemble. A longer one times a step at each candidate chunk size on this device (a few steps,
    well under 5% of the run) and takes `best_chunk`, counting the Ray cluster's nodes as workers when
    the run trains under a Ray build.
    """
    K = spec.tc.n_members
    choice = _parse_chunk(requested if requested is not None else os.environ.get(CHUNK_ENV, "auto"))
    if choice == "all" or K == 1:
        return K
    if isinstance(choice, int):
        return min(choice, K)
    if _draws_random_numbers(spec.model):
        return K
    device = device or default_device()
    if whole_ensemble_on(device):
        return K
    whole = calibrate(spec, [K], device, repeats=2).step_s[K]
    if spec.tc.steps * whole < MIN_CALIBRATED_RUN_S or spec.tc.steps < MIN_CALIBRATED_STEPS:
        return K  # too short for the calibration (a few steps at each size) to pay for itself
    workers, task_overhead = _scheduler.workers(), _scheduler.task_overhead_s
    cal = calibrate(spec, chunk_candidates(K), device)
    chunk = best_chunk(K, spec.tc.steps, cal.step_s, workers, cal.setup_s, task_overhead)
    log.info(f"{spec.rundir.name}: chunk of {chunk} member(s) of {K} "
          f"(seconds per step | per part setup, by chunk size on {device_name(device)}: "
          + ", ".join(f"{c}: {t:.3f} | {cal.setup_s[c]:.2f}" for c, t in cal.step_s.items())
          + f"; {workers} worker(s))")
    return chunk


@dataclass
class Calibration:
    """Measured on the device at hand, per chunk size c: `step_s[c]`, seconds of one training step of c
    members (making the step's batches, forward, backward, optimizer; the fastest of a few), and `setup_s[c]`,
    the one-off cost of a part of c members (building its ensemble, optimizer and sampler, and its first
    step's extra time over a steady one). Chunk sizes that do not fit on the device are absent."""

    step_s: dict[int, float]
    setup_s: dict[int, float]


_calibrations: dict[str, Calibration] = {}


def calibrate(spec: RunSpec, sizes: Sequence[int], device: torch.device, repeats: int = CALIBRATION_REPEATS
              ) -> Calibration:
    """Time a training step (its batches included) of the first c members for each c in `sizes` on `device`
    (no evaluation),
    sizes interleaved so that a change in the machine's load hits them alike. Remembered per process for
    the same model, batch and device."""
    key = runs.hash_text(runs.canonical_json([config_to_dict(spec.model), spec.tc.batch_size, spec.tc.micro_batch_size,
                                              spec.tc.precision, spec.tc.optimizer, spec.tasks[0].loss,
                                              device_name(device), repeats]))
    have = _calibrations.setdefault(key, Calibration({}, {}))
    todo = [c for c in sizes if c not in have.step_s]
    if todo:
        steps, first = {}, {}
        with device_policy(device):  # timed with the kernels training will use
            _step_fn(spec, min(todo), device)  # the process's one-off costs (first kernels, allocator) are no part's setup
            for c in todo:
                try:
                    steps[c], first[c] = _step_fn(spec, c, device)
                except torch.cuda.OutOfMemoryError:  # a chunk too big for this device is never chosen
                    torch.cuda.empty_cache()
            best = {c: float("inf") for c in steps}
            for _ in range(repeats):
                for c, step in steps.items():
                    best[c] = min(best[c], step())
        have.step_s.update(best)
        have.setup_s.update({c: max(0.0, first[c] - best[c]) for c in steps})
    fits = [c for c in sizes if c in have.step_s]
    return Calibration({c: have.step_s[c] for c in fits}, {c: have.setup_s[c] for c in fits})


def _step_fn(spec: RunSpec, c: int, device: torch.device) -> tuple[Callable[[], float], float]:
    """A timed training step of members 0..c-1 (the step's batches from the run's sampler, then `train_step`),
    and the seconds it took to build them and run their first (warm-up) step; the global RNG is left
    untouched."""
    t0 = time.perf_counter()
    tc = member_slice(spec.tc, 0, c)
    with torch.random.fork_rng(devices=[]):
        ens = Ensemble(spec.model, tc.seeds, None, device)
    opt = Optimizer(ens.params, ens.trainable, tc)
    sampler = data_sampler(spec.tasks[:c], tc.seeds, device)
    take_step, _ = step_runner(ens, opt, sampler, spec.tasks[0].loss, tc)  # the step training will take
    steps = iter(range(1 << 31))

    def step() -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            sync()
            t0 = time.perf_counter()
            take_step(next(steps))
            sync()
        return time.perf_counter() - t0

    step()
    return step, time.perf_counter() - t0


def member_slice(tc: TrainConfig, lo: int, hi: int) -> TrainConfig:
    """The TrainConfig of members lo..hi-1 (per-member lr and weight decay sliced too)."""
    cut = {n: getattr(tc, n)[lo:hi] for n in ("lr", "weight_decay") if isinstance(getattr(tc, n), tuple)}
    return replace(tc, seeds=tc.seeds[lo:hi], **cut)


def _part_tag(lo: int, hi: int) -> str:
    return f"members_{lo:05d}_{hi:05d}"


def part_dir(rundir: runs.RunDir, lo: int, hi: int) -> runs.RunDir:
    return runs.RunDir(rundir.path / "parts" / _part_tag(lo, hi), rundir.name, rundir.key)


def existing_chunk(rundir: runs.RunDir) -> int | None:
    """The chunk size an interrupted attempt chose (it resumes the same way), or None if nothing was trained."""
    plan = rundir.path / "parts" / "plan.json"
    if plan.exists():
        with_plan = runs.read_json(plan)
        return int(with_plan["chunk"])
    if rundir.file("metrics.jsonl").exists() or any(rundir.path.glob("ckpt/step_*.json")):
        return sys.maxsize  # an interrupted whole-ensemble run: resume it as one ensemble
    return None


def _event(rundir: runs.RunDir, tag: str, event: str, **extra) -> None:
    """One file per event (never an append: appends are not atomic on network filesystems)."""
    info = {"part": tag, "event": event, "host": runs._host_id(), "pid": os.getpid(), "time": time.time(), **extra}
    runs.atomic_write_json(rundir.path / "events" / f"{time.time_ns()}-{os.getpid()}-{tag}-{event}.json", info)


def events(rundir: runs.RunDir) -> list[dict]:
    """The training events of a run split into parts (start, resume, finish per part; publish), in order."""
    return sorted((runs.read_json(p) for p in rundir.path.glob("events/*.json")), key=lambda e: e["time"])


def train_part(spec: RunSpec, lo: int, hi: int, lock: runs.LeaseLock, progress=None, device=None) -> None:
    """Train members lo..hi-1 of a run into its part folder (resuming it), under the part's lock."""
    part = part_dir(spec.rundir, lo, hi)
    if part.check_complete()[0]:
        return
    if part.manifest_path.exists():
        part.wipe()  # a damaged part: recomputed
    tag = _part_tag(lo, hi)
    resumed = part.file("metrics.jsonl").exists()
    _event(spec.rundir, tag, "resume" if resumed else "start")
    Trainer(part, {**spec.full_config, "part": [lo, hi]}, spec.model, spec.tasks[lo:hi], member_slice(spec.tc, lo, hi),
             spec.evaluate, spec.init_fn, spec.fork_from, progress, device or default_device(),
             members=range(lo, hi), lock=lock).run()
    _event(spec.rundir, tag, "finish")


def train_part_if_free(spec: RunSpec, lo: int, hi: int, device: str | None = None) -> str:
    """What a Ray task runs: train the part unless it is complete or another process holds it."""
    part = part_dir(spec.rundir, lo, hi)
    if part.check_complete()[0]:
        return "complete"
    lock = runs.LeaseLock(spec.rundir.lock_path(_part_tag(lo, hi)))
    if not lock.try_acquire():
        return "busy"
    try:
        train_part(spec, lo, hi, lock, progress=False, device=default_device(device))
    finally:
        lock.release()
    return "trained"


def train_in_parts(spec: RunSpec, chunk: int, lock: runs.LeaseLock, progress=None, device=None, poll: float = 0.5) -> None:
    """Train a run as parts of at most `chunk` members, then publish it.

    This process trains every part it can claim; under a Ray build every part is also offered to
    the cluster as a task, and whichever process claims a part's lock first trains it (a part whose
    holder died is taken over: see runs.LeaseLock). The run is published once every part is complete.
    """
    rundir = spec.rundir
    plan_path = rundir.path / "parts" / "plan.json"
    if plan_path.exists():
        bounds = [tuple(b) for b in runs.read_json(plan_path)["parts"]]
    else:
        bounds = split_members(spec.tc.n_members, chunk)
        runs.atomic_write_json(plan_path, {"chunk": chunk, "parts": bounds})
    log.info(f"training {rundir.name} ({rundir.key}) in {len(bounds)} parts: "
          + ", ".join(f"members {lo}-{hi - 1}" for lo, hi in bounds))
    remote = _scheduler.submit(spec, bounds)
    watches: dict = {b: {} for b in bounds}
    try:
        while True:
            pending = [b for b in bounds if not part_dir(rundir, *b).check_complete()[0]]
            if not pending:
                break
            for lo, hi in pending:
                part_lock = runs.LeaseLock(rundir.lock_path(_part_tag(lo, hi)))
                if part_lock.try_acquire(watches[(lo, hi)]):
                    try:
                        train_part(spec, lo, hi, part_lock, progress, device)
                    finally:
                        part_lock.release()
                    break
            else:
                lock.check()
                time.sleep(poll)
    finally:
        if remote is not None:
            remote.close()
    lock.check()
    _publish_parts(spec, bounds)


def _publish_parts(spec: RunSpec, bounds: list[tuple[int, int]]) -> None:
    """Stack the parts' checkpoints along the member axis, merge their metrics, write the manifest."""
    rundir = spec.rundir
    parts = [part_dir(rundir, lo, hi) for lo, hi in bounds]
    manifests = [p.manifest() for p in parts]
    schedule = manifests[0]["checkpoints"]
    runs.atomic_write_json(rundir.file("config.json"), spec.full_config)
    for step in schedule:
        rel = checkpoint_rel(step)
        loaded = [runs.load_tensors(p.file(rel), m["files"][rel]["sha256"]) for p, m in zip(parts, manifests)]
        merged = {k: torch.cat([t[k] for t in loaded]) if k.startswith(("param.", "opt.")) else v
                  for k, v in loaded[0].items()}
        digest = runs.save_tensors(rundir.file(rel), merged)
        marker = runs.read_json(parts[0].file(rel).with_suffix(".json"))
        runs.atomic_write_json(rundir.file(rel).with_suffix(".json"),
                               {"step": step, "opt_t": marker["opt_t"], "sha256": digest,
                                "size": rundir.file(rel).stat().st_size})
    rows = [r for p in parts for r in runs.read_jsonl(p.file("metrics.jsonl"))]
    rows.sort(key=lambda r: (r["step"], r["member"]))
    runs.atomic_write_bytes(rundir.file("metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    files = ["config.json", "metrics.jsonl"]
    files += [p.relative_to(rundir.path).as_posix() for p in sorted(rundir.path.glob("ckpt/step_*"))]
    rundir.finalize(files, {"checkpoints": schedule, "parts": [list(b) for b in bounds],
                            "train_seconds": round(sum(m["train_seconds"] for m in manifests), 2)})
    _event(rundir, "run", "publish")
    shutil.rmtree(rundir.path / "parts", ignore_errors=True)
