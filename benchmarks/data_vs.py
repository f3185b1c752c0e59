"""This tree's training batches against another checkout's, side by side: the same runs, the same steps.

    python benchmarks/data_vs.py ../base --chapter inductive_manifold --threads 1

A change that only makes the data faster must make the very same batches. Two worker processes, one
importing this tree's `circuitbook`, one the other checkout's (its `lib/`), build each run's sampler once
(`training.data_sampler` under `device_policy`, as the loop does) and make the same window of steps (`data.window`: whole
prefetch blocks and epochs); the parent asks them in turn, alternating which goes first, so both arms see
the same machine. Per run: mean ms per member-step of each, their ratio (baseline / this tree), and
whether every batch of the window was the same (a SHA-256 over the tokens and labels of both).
The runs are this tree's registry at the profile (`plan.planned_runs`); a run the baseline does not plan
(another name, or an error) is reported, not timed.
Writes results/data_vs_<device type>.json (rows: chapter, run, members, batch_size,
data_ms_per_member_step, baseline_data_ms_per_member_step, ratio, same_batches) and .txt.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------- the worker (one per checkout)

def worker(threads: int) -> None:
    """Answer requests on stdin, one JSON line each: {"chapter", "notebook", "profile", "run", "repeats"}."""
    import torch

    from circuitbook.training import default_device
    from circuitbook.training.device import device_policy

    if threads:
        torch.set_num_threads(threads)
    device = default_device()
    with device_policy(device):  # what the training loop fixes about the process while it makes batches
        _answer(device)


def _answer(device) -> None:
    import torch

    import circuitbook
    import data
    from circuitbook import plan
    from circuitbook.training import data_sampler

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    made: dict[tuple, tuple] = {}
    print(json.dumps({"ready": True, "device": device.type, "package": circuitbook.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            key = (req["chapter"], req["notebook"], req["profile"], req["run"])
            if key not in made:
                runs = {r.dir.name: r for r in plan.planned_runs(req["chapter"], req["notebook"], req["profile"])}
                if req["run"] not in runs:
                    raise KeyError(f"this checkout plans no run {req['run']!r} (it plans {sorted(runs)})")
                run = runs[req["run"]]
                sampler = data_sampler(run.tasks, run.train_config.seeds, device)
                B = run.train_config.batch_size
                sampler(0, B)  # warm-up (cached index tensors)
                made[key] = (sampler, B, run.train_config.n_members, data.window(sampler, B, req["repeats"]))
            sampler, B, K, (first, count) = made[key]
            digest, ms = hashlib.sha256(), []
            for step in range(first, first + count):
                sync()
                t0 = time.perf_counter()
                tokens, labels = sampler(step, B)
                sync()
                ms.append(1e3 * (time.perf_counter() - t0))
                for t in (tokens, labels):
                    digest.update(t.contiguous().cpu().numpy().tobytes())
            answer = {"ms_per_member_step": statistics.mean(ms) / K, "members": K, "batch_size": B,
                      "steps": [first, first + count], "digest": digest.hexdigest()}
        except Exception as e:  # noqa: BLE001 - the parent reports it for this run
            answer = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(answer), flush=True)


class Worker:
    def __init__(self, lib: Path, threads: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lib), str(HERE)])}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=lib.parent)
        ready = self.read()
        if not Path(ready["package"]).resolve().is_relative_to(lib.resolve()):
            raise SystemExit(f"the worker for {lib} imported circuitbook from {ready['package']}")
        self.device = ready["device"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.proc.args} stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------- the parent

def checkout_lib(path: str) -> Path:
    lib = Path(path).resolve() / "lib"
    if not (lib / "circuitbook" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {path}: not a circuitbook checkout (no lib/circuitbook/__init__.py there)")
    return lib


def compare(this: Worker, base: Worker, req: dict, rounds: int) -> dict:
    """`rounds` alternating windows of each arm: the mean of each arm's window means, and the digests."""
    got = {"this": [], "base": []}
    for r in range(rounds):
        for arm, w in ((("this", this), ("base", base)) if r % 2 == 0 else (("base", base), ("this", this))):
            answer = w.ask(**req)
            if "error" in answer:
                return {"error": f"{arm}: {answer['error']}"}
            got[arm].append(answer)
    new = statistics.mean(a["ms_per_member_step"] for a in got["this"])
    old = statistics.mean(a["ms_per_member_step"] for a in got["base"])
    digests = {a["digest"] for a in got["this"] + got["base"]}
    first = got["this"][0]
    return {"members": first["members"], "batch_size": first["batch_size"], "timed_steps": first["steps"],
            "data_ms_per_member_step": new, "baseline_data_ms_per_member_step": old, "ratio": old / new,
            "same_batches": len(digests) == 1}


def table(rows: list[dict]) -> str:
    lines = [f"{'chapter':<18} {'run':<44} {'K':>4} {'batch':>5}  {'ms/member-step base | this':>27} {'x':>6}  batches"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['chapter']:<18} {r['run']:<44} not measured: {r['error']}")
            continue
        lines.append(f"{r['chapter']:<18} {r['run']:<44} {r['members']:>4} {r['batch_size']:>5}  "
                     f"{r['baseline_data_ms_per_member_step']:>12.4f} | {r['data_ms_per_member_step']:<12.4f} "
                     f"{r['ratio']:>5.2f}x  {'same' if r['same_batches'] else 'OTHER'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("baseline", nargs="?", help="another checkout of the book (its lib/ is imported)")
    ap.add_argument("--profile", default="full", help="whose runs (default full)")
    ap.add_argument("--chapter", action="append", default=None, help="only this chapter (repeatable)")
    ap.add_argument("--repeats", type=int, default=4, help="prefetch blocks (or steps) per window")
    ap.add_argument("--rounds", type=int, default=4, help="alternating windows per arm")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in both workers")
    ap.add_argument("--out", default=None, help="default: results/data_vs_<device type>.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.threads)
    if not args.baseline:
        raise SystemExit("data_vs.py: name the baseline checkout (a folder with lib/circuitbook)")
    base_lib = checkout_lib(args.baseline)

    import common
    import data

    info = common.start(args.threads)
    this, base = Worker(HERE.parent / "lib", args.threads), Worker(base_lib, args.threads)
    info.update(device=this.device, baseline=str(base_lib.parent))
    out = args.out or str(common.RESULTS / f"data_vs_{this.device}.json")
    legend = (f"profile {args.profile} on {this.device}: each run's sampler from this tree and from {base_lib.parent}, "
              f"{args.rounds} alternating windows of {args.repeats} prefetch blocks each (mean ms of data per "
              "member-step); x = baseline / this; batches: whether every batch was the same in both")
    rows = []
    try:
        for nb, run, profile, why in data.book_runs(args.chapter, args.profile, None):
            if run is None:  # say so for this notebook, measure the rest
                rows.append({"chapter": nb.chapter, "run": nb.name, "error": why})
                continue
            req = {"chapter": nb.chapter, "notebook": nb.name, "profile": profile, "run": run.dir.name,
                   "repeats": args.repeats}
            rows.append({"chapter": nb.chapter, "notebook": nb.name, "run": run.dir.name, "profile": profile,
                         **compare(this, base, req, args.rounds)})
            print(table(rows[-1:]).splitlines()[1], flush=True)
            common.write("data_vs", out, args, info, rows, legend, table(rows))
    finally:
        this.close()
        base.close()
    print(table(rows))
    if any("error" not in r and not r["same_batches"] for r in rows):
        print("OTHER batches: this tree and the baseline draw different batches for some runs")


if __name__ == "__main__":
    main()
