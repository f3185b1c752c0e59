"""Each chapter's model on the device at hand: K members as one ensemble vs one after another, and the
training step's FLOP rate against the device's measured matmul peak.

    python benchmarks/gpu.py                           # on a GPU: full profile, K = 8, 16, 32, 64
    python benchmarks/gpu.py --profile smoke --members 2 4 --matmul-size 512   # a quick run on a CPU

For each chapter the model, task, batch and precision of its first full-profile run (the runs the plan
enumerates, `circuitbook.plan.planned_runs`) are timed with train()'s own calibration
(`train.calibrate`: forward, backward and optimizer step of the first c members under vmap, the fastest
of a few after a warm-up, under the same device_policy as training): ensemble(K) = one step of K
members together, sequential(K) = K times one step of one member. FLOPs per member-step come from
torch's FlopCounterMode (`train.step_flops`); the peak is the rate of a square fp32 and bf16 matmul
timed here (the fastest of 10 after 3 warm-ups). Writes results/gpu_<device>.json and .txt.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import common
from circuitbook import plan
from circuitbook.training import RunSpec, calibrate, default_device, device_name, step_flops

RUNS = [("book", "tour"), ("assign_add", "02_training"), ("algorithmic_cores", "02_markov"),
        ("leading_terms", "02_training"), ("inductive_manifold", "03_two_layer")]


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in dtype on device (the fastest of `repeats` after 3 warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def chapter_spec(chapter: str, notebook: str, profile: str, members: int):
    """The RunSpec of the notebook's first planned run, widened to `members` members of the first one's settings."""
    run = plan.planned_runs(chapter, notebook, profile)[0]
    tc = run.train_config
    tc = replace(tc, seeds=tuple(range(members)), lr=tc.per_member("lr")[0],
                 weight_decay=tc.per_member("weight_decay")[0])
    return run, RunSpec(run.dir, {}, run.model_config, [run.tasks[0]] * members, tc)


def bench(chapter: str, notebook: str, profile: str, members: list[int], device: torch.device, peak: dict) -> dict:
    run, spec = chapter_spec(chapter, notebook, profile, max(members))
    flops = step_flops(RunSpec(run.dir, {}, run.model_config, [run.tasks[0]], replace(spec.tc, seeds=(0,))))
    cal = calibrate(spec, sorted({1, *members}), device, repeats=3)
    one = cal.step_s[1]
    rows = []
    for k in members:
        if k not in cal.step_s:
            rows.append({"members": k, "note": "does not fit on the device"})
            continue
        t = cal.step_s[k]
        rate = flops * k / t
        rows.append({"members": k, "ensemble_step_s": t, "sequential_step_s": k * one, "speedup": k * one / t,
                     "flop_rate": rate, "peak_share": rate / peak[spec.tc.precision]})
    return {"chapter": chapter, "notebook": notebook, "run": run.dir.name, "model": run.model_config.to_dict(),
            "batch_size": spec.tc.batch_size, "precision": spec.tc.precision, "flops_per_member_step": flops,
            "one_member_step_s": one, "setup_s": cal.setup_s, "rows": rows}


def table(results: list[dict], peak: dict) -> str:
    lines = [f"matmul peak: fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s",
             f"{'chapter model':<34} {'prec':<4} {'batch':>5} {'K':>3}  {'ensemble ms':>11} {'sequential ms':>13} "
             f"{'S/E':>6}  {'GFLOP/s':>9} {'of peak':>7}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['chapter'] + '/' + r['notebook']:<34} not measured: {r['error']}")
            continue
        for row in r["rows"]:
            head = f"{r['run']:<34} {r['precision']:<4} {r['batch_size']:>5} {row['members']:>3}"
            if "note" in row:
                lines.append(f"{head}  {row['note']}")
                continue
            lines.append(f"{head}  {1000 * row['ensemble_step_s']:>11.2f} {1000 * row['sequential_step_s']:>13.2f} "
                         f"{row['speedup']:>5.2f}x  {row['flop_rate'] / 1e9:>9.1f} {row['peak_share']:>7.1%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="full", help="whose runs' models and batches (default full)")
    ap.add_argument("--members", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--matmul-size", type=int, default=0, help="n of the peak matmul (default 8192 on a GPU, 1024 on a CPU)")
    ap.add_argument("--chapter", action="append", default=None, help="only this chapter (repeatable)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--out", default=None, help="default: results/gpu_<device type>.json")
    args = ap.parse_args()
    info = common.start(args.threads)
    device = default_device()
    info["device"] = device_name(device)
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    n = args.matmul_size or (8192 if device.type == "cuda" else 1024)
    peak = {"fp32": matmul_peak(device, n, torch.float32), "bf16": matmul_peak(device, n, torch.bfloat16)}
    print(f"{info['device']}: matmul {n}^3 fp32 {peak['fp32'] / 1e12:.2f} TFLOP/s, bf16 {peak['bf16'] / 1e12:.2f} TFLOP/s",
          flush=True)
    out = args.out or str(common.RESULTS / f"gpu_{device.type}.json")
    info["matmul_peak_flops"], info["matmul_size"] = peak, n
    legend = (f"profile {args.profile}: one training step (forward, backward, optimizer) of K members of each chapter's "
              "first run: ensemble = together under vmap, sequential = K x one member; S/E = sequential / ensemble; "
              "GFLOP/s = FlopCounterMode FLOPs / step time, against the matmul peak of the run's precision")
    results = []
    for chapter, notebook in RUNS:
        if args.chapter and chapter not in args.chapter:
            continue
        try:
            results.append(bench(chapter, notebook, args.profile, args.members, device, peak))
        except Exception as e:  # noqa: BLE001 - missing data (the full TinyStories), ...: say so, measure the rest
            results.append({"chapter": chapter, "notebook": notebook, "error": f"{type(e).__name__}: {e}"[:300]})
        print("\n".join(table(results[-1:], peak).splitlines()[2:]), flush=True)
        common.write("gpu", out, args, info, results, legend, table(results, peak))  # so far: a stopped run keeps it
    print(table(results, peak))


if __name__ == "__main__":
    main()
