"""The training loop: one ensemble into one run folder, with checkpoints and exact resumption.

`Trainer.run()` trains from step 0 (or a fork's step, or the newest intact checkpoint) to the end,
evaluating every `eval_every` steps and checkpointing on the config's schedule (weights, optimizer state
and RNG state, log-spaced plus regular). A killed run resumes from its last intact checkpoint and ends
with the numbers of an uninterrupted one, because every batch is a pure function of (member seed,
step): the run's sampler (`data_sampler`, built once) makes each step's batches on the training device.
Its source is part of every run's key, with `config.py` and `ensemble.py`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from .. import log, runs
from ..tasks.base import derive_seed
from .config import TrainConfig
from .device import device_policy
from .capture import step_runner
from .ensemble import Ensemble, Optimizer, data_sampler
from .run import checkpoint_rel


class Trainer:
    """Trains one ensemble into one folder: a whole run, or one part (members `members`) of a split run."""

    def __init__(self, rundir, full_config, model_cfg, tasks, tc: TrainConfig, evaluate, init_fn, fork_from, progress,
                 device, members: Sequence[int] | None = None, lock: runs.LeaseLock | None = None):
        self.dir, self.tc, self.tasks, self.evaluate = rundir, tc, tasks, evaluate
        self.full_config, self.lock = full_config, lock
        self.ens = Ensemble(model_cfg, tc.seeds, init_fn, device, members)
        self.members = self.ens.members
        self.opt = Optimizer(self.ens.params, self.ens.trainable, tc)
        self.sampler = data_sampler(tasks, tc.seeds, self.ens.device)
        self.start = 0
        if fork_from is not None:
            parent, step = fork_from
            self._load_checkpoint(parent.dir.file(checkpoint_rel(step)), parent.manifest["files"][checkpoint_rel(step)]["sha256"],
                                  members=self.members)
            self.opt.t = step
            self.start = step
        self.schedule = set(tc.checkpoint_steps(self.start))
        self.progress = progress if progress is not None else os.environ.get("CIRCUITBOOK_PROGRESS", "1") != "0"
        self.metrics_path = rundir.file("metrics.jsonl")
        self.last_loss = torch.full((tc.n_members,), float("nan"))
        log.info(f"training {rundir.name} ({rundir.key[:8]}): {tc.n_members} member(s), {tc.steps} steps "
                 f"on {self.ens.device}")

    # -- checkpoints ---------------------------------------------------
    def _write_checkpoint(self, step: int) -> None:
        if self.lock is not None:
            self.lock.check()  # judged dead and taken over while paused: stop writing
        tensors = {f"param.{n}": p for n, p in self.ens.state().items()}
        tensors.update({f"opt.{n}": t for n, t in self.opt.state().items()})
        tensors["rng.torch"] = torch.get_rng_state()
        if self.ens.device.type == "cuda":  # dropout draws on the GPU's generator: a resumed run needs it too
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.ens.device)
        rel = checkpoint_rel(step)
        digest = runs.save_tensors(self.dir.file(rel), tensors)
        # the JSON marker is written last: a checkpoint without it never counts
        runs.atomic_write_json(self.dir.file(rel).with_suffix(".json"),
                               {"step": step, "opt_t": self.opt.t, "sha256": digest,
                                "size": self.dir.file(rel).stat().st_size})

    def _load_checkpoint(self, path: Path, sha256: str, members: Sequence[int] | None = None) -> None:
        """Weights, optimizer state and RNG state of a checkpoint; `members`: take only these rows of a
        checkpoint that holds more members (a part forking from a whole parent run)."""
        tensors = runs.load_tensors(path, sha256)
        if members is not None:
            rows = torch.tensor(list(members))
            tensors = {k: (v.index_select(0, rows) if k.startswith(("param.", "opt.")) else v)
                       for k, v in tensors.items()}
        self.ens.load_state({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
        self.opt.load_state({k[4:]: v for k, v in tensors.items() if k.startswith("opt.")}, self.opt.t)
        torch.set_rng_state(tensors["rng.torch"])
        if "rng.cuda" in tensors and self.ens.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.ens.device)

    def _resume(self) -> int:
        """Load the newest intact checkpoint that an intact metrics history reaches; return its step.

        Every evaluation row up to a checkpoint's step must be in metrics.jsonl for the run to go
        on from there. If a row is garbled or missing, the run goes on from the newest checkpoint
        before the damage (everything after it is recomputed, so the history ends up whole) and
        says so; with none, it trains again from its start. It is never sealed with holes. A torn
        last line (a crash while appending) is expected and dropped.
        """
        markers = sorted(self.dir.path.glob("ckpt/step_*.json"), reverse=True)
        rows, problem = self._read_metrics()
        intact = self._intact_until(rows)
        for marker in markers:
            try:
                info = runs.read_json(marker)
                step = int(info["step"])
                if step > intact:
                    continue
                if problem or step < int(markers[0].stem[5:]):
                    why = problem or f"it has no rows after step {intact}"
                    last = max((int(r["step"]) for r in rows if int(r["step"]) <= intact), default=self.start)
                    log.info(f"{self.metrics_path} is damaged ({why}); its history is intact up to step "
                          f"{last}, so {self.dir.name} goes on from the checkpoint at step {step} and recomputes "
                          "what follows")
                self._load_checkpoint(marker.with_suffix(".safetensors"), info["sha256"])
                self.opt.t = info["opt_t"]
                kept = [r for r in rows if r["step"] <= step]
                runs.atomic_write_bytes(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept).encode())
                for later in markers:  # checkpoints after the damage are recomputed too
                    if int(later.stem[5:]) > step:
                        later.unlink(missing_ok=True)
                        later.with_suffix(".safetensors").unlink(missing_ok=True)
                log.info(f"resuming {self.dir.name} from step {step}")
                return step
            except (runs.DamagedRunError, KeyError, TypeError, ValueError) as e:
                log.info(f"checkpoint {marker.name} is damaged ({e}); ignoring it")
                marker.unlink(missing_ok=True)
                marker.with_suffix(".safetensors").unlink(missing_ok=True)
        if markers or rows:
            why = problem or "no checkpoint before the first missing row" if rows else "no intact checkpoint"
            log.info(f"{self.dir.name}: {why}; training again from step {self.start}")
        for stale in self.dir.path.glob("ckpt/step_*"):
            stale.unlink(missing_ok=True)
        self.metrics_path.unlink(missing_ok=True)
        return self.start

    def _read_metrics(self) -> tuple[list[dict], str]:
        """(rows up to the first unreadable line, what is wrong beyond a torn last line or '')."""
        if not self.metrics_path.exists():
            return [], ""
        lines = self.metrics_path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "step" not in row or "member" not in row:
                    raise ValueError("not a metrics row")
                rows.append(row)
            except ValueError:
                if i < len(lines) - 1:
                    return rows, f"line {i + 1} of {len(lines)} is garbled"
                break  # torn last line
        return rows, ""

    def _intact_until(self, rows: list[dict]) -> int:
        """The last step up to which every (evaluation step, member) row is present (start - 1: none)."""
        tc = self.tc
        have = {(int(r["step"]), int(r["member"])) for r in rows}
        evals = [self.start] + [s for s in range(self.start + 1, tc.steps + 1) if s % tc.eval_every == 0 or s == tc.steps]
        last = self.start - 1
        for i, s in enumerate(evals):
            if not all((s, k) in have for k in self.members):
                return (evals[i] - 1) if i else self.start - 1
            last = s
        return last

    # -- the loop ------------------------------------------------------
    def _log(self, step: int) -> None:
        row_metrics = {"train_loss": self.last_loss}
        if self.evaluate is not None:
            row_metrics.update(self.evaluate(self.ens, step))
        rows = []
        for k in range(self.tc.n_members):
            row = {"step": step, "member": self.members[k], "seed": self.tc.seeds[k]}
            for name, values in row_metrics.items():
                v = values[k] if hasattr(values, "__len__") else values
                row[name] = float(v)
            rows.append(row)
        with open(self.metrics_path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))

    def run(self) -> None:
        # The run draws its random numbers (dropout) from its own stream, seeded from its members' seeds, so it
        # repeats in any process (torch seeds its global generator at random in each one); a resumed run
        # loads the stream's state from its checkpoint. The caller's generators are left as they were.
        devices = [self.ens.device] if self.ens.device.type == "cuda" else []
        with device_policy(self.ens.device), torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed("train", *self.tc.seeds))
            self._run()

    def _run(self) -> None:
        self.dir.path.mkdir(parents=True, exist_ok=True)
        runs.atomic_write_json(self.dir.file("config.json"), self.full_config)
        step = self._resume()
        tc, kind = self.tc, self.tasks[0].loss
        take_step, how = step_runner(self.ens, self.opt, self.sampler, kind, tc)
        log.info(f"{self.dir.name}: {how}")
        if step == self.start and not self.metrics_path.exists():
            self._log(step)
            if step in self.schedule:
                self._write_checkpoint(step)
        stream = log.progress_stream()
        bar = tqdm(total=tc.steps, initial=step, desc=self.dir.name, disable=not self.progress,
                   mininterval=10, file=stream, dynamic_ncols=False, ncols=100)
        t0 = time.time()
        while step < tc.steps:
            self.last_loss = take_step(step)
            step += 1
            bar.update(1)
            if step % tc.eval_every == 0 or step == tc.steps:
                self._log(step)
            if step in self.schedule:
                self._write_checkpoint(step)
        bar.close()
        if stream is not sys.stderr:
            stream.close()
        if self.lock is not None:
            self.lock.check()
        files = ["config.json", "metrics.jsonl"]
        files += [p.relative_to(self.dir.path).as_posix() for p in sorted(self.dir.path.glob("ckpt/step_*"))]
        self.dir.finalize(files, {"checkpoints": sorted(self.schedule), "train_seconds": round(time.time() - t0, 2)})
