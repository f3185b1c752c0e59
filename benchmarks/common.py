"""What both benchmark scripts share: the machine record, the busy-machine warning, writing results."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def start(threads: int) -> dict:
    """Set torch's thread count (0: its default) and record the machine, warning when it is busy."""
    if threads:
        torch.set_num_threads(threads)
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "load_avg_1m_at_start": os.getloadavg()[0]}
    print(f"machine: {info['cpu_count']} CPUs, torch {info['torch']}, {info['torch_threads']} threads, "
          f"load {info['load_avg_1m_at_start']:.2f}")
    # A load above this means other jobs hold the cores, and every OpenMP op waits for a descheduled thread.
    info["busy"] = info["load_avg_1m_at_start"] > 0.75 * info["cpu_count"]
    if info["busy"]:
        print(f"WARNING: the machine is busy (load {info['load_avg_1m_at_start']:.1f} on {info['cpu_count']} CPUs): "
              "wall-clock numbers will be noisy; rerun when it is quiet, or with --threads 1 and read the cpu columns")
    return info


def write(name: str, out: str | None, args, info: dict, results: list[dict], legend: str, text: str) -> None:
    """results/<name>[_threadsN].json with everything, and a .txt with the machine line, legend and table."""
    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    path = Path(out or RESULTS / (f"{name}_threads{args.threads}.json" if args.threads else f"{name}.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info, "args": vars(args), "results": results}, indent=2) + "\n")
    path.with_suffix(".txt").write_text(
        f"{info['date']}  {info['cpu_count']} CPUs, torch {info['torch']}, {info['torch_threads']} threads, "
        f"load {info['load_avg_1m_at_start']:.2f} -> {info['load_avg_1m_at_end']:.2f}"
        f"{'  (BUSY machine: wall-clock numbers are noisy)' if info['busy'] else ''}\n{legend}\n{text}\n")
    print(f"wrote {path}")
