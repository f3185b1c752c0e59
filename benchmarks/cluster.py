"""One sweep on a two-node local Ray cluster vs the same sweep in one local process.

    python benchmarks/cluster.py                 # 8 members of the markov model, 1500 steps
    python benchmarks/cluster.py --members 8 --steps 3000

Starts `ray start --head` and a second `ray start --address` on this machine (one CPU each,
loopback, small object store; stopped at the end by pid), then trains the same sweep twice, each
arm in a fresh empty run store:

- local:   `circuitbook.train` in one process with one torch thread (what one node of one CPU does),
           the chunk size chosen by train()'s calibration for one worker;
- cluster: `circuitbook.train` inside a Ray task of one CPU (as a notebook of a Ray build runs), with
           $CIRCUITBOOK_RAY_ADDRESS set: train() calibrates for the cluster's 2 slots, and the parts
           it splits the sweep into train on both nodes (the task's own process trains parts too).

The arms alternate (local first on odd repetitions); ratio = local / cluster wall time. The
per-task overhead is the cluster arm's wall time times its slots, minus the parts' own step-loop
seconds, over the number of parts (idle time from imbalance included); the round trip of an
empty Ray task is reported beside it. The two arms' final weights are compared member by member.
Writes benchmarks/results/cluster.json and cluster.txt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import circuitbook as cb
import common
from ensemble import SETTINGS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from raycluster import AUTH, LocalCluster  # noqa: E402


def sweep(setting: dict, members: int, steps: int):
    tc = cb.TrainConfig(steps=steps, batch_size=setting["batch_size"], seeds=tuple(range(members)), lr=1e-3,
                        weight_decay=tuple(0.05 * (k + 1) for k in range(members)), eval_every=max(1, steps // 10),
                        log_checkpoints=4)
    return setting["model"], setting["task"](), tc


def train_here(setting: dict, members: int, steps: int, store: str) -> dict:
    """One arm: train the sweep into `store`; wall seconds, chunking and step-loop seconds."""
    os.environ["CIRCUITBOOK_RUNS"] = store
    os.environ["CIRCUITBOOK_PROGRESS"] = "0"
    torch.set_num_threads(1)
    model, task, tc = sweep(setting, members, steps)
    t0 = time.perf_counter()
    run = cb.train("bench/sweep", model, task, tc)
    wall = time.perf_counter() - t0
    return {"wall": wall, "parts": run.manifest.get("parts", [[0, members]]), "loop": run.manifest["train_seconds"],
            "state": {k: v.clone() for k, v in run.state().items()}, "key": run.key}


def cluster_arm(ray, address: str, setting_name: str, members: int, steps: int, store: str) -> dict:
    def task(name, k, n, st, addr):
        os.environ["CIRCUITBOOK_RAY_ADDRESS"] = addr
        os.environ["CIRCUITBOOK_RAY_RESOURCES"] = '{"num_cpus": 1}'
        from ensemble import SETTINGS as S  # benchmarks/ is on the cluster's PYTHONPATH
        return train_here(S[name], k, n, st)

    remote = ray.remote(num_cpus=1)(task)
    t0 = time.perf_counter()
    out = ray.get(remote.remote(setting_name, members, steps, store, address))
    out["wall_outer"] = time.perf_counter() - t0
    return out


def empty_task_ms(ray, n: int = 8) -> float:
    @ray.remote(num_cpus=1)
    def noop():
        import circuitbook.training  # noqa: F401  (what a part task imports first)
        return 0

    ray.get([noop.remote() for _ in range(2)])  # warm workers
    t0 = time.perf_counter()
    ray.get([noop.remote() for _ in range(n)])
    return 1000 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", choices=list(SETTINGS), default="markov")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.threads = 1
    info = common.start(1)
    here = Path(__file__).resolve().parent
    cluster = LocalCluster()  # its workers import `ensemble` (the settings) from benchmarks/
    cluster.env["PYTHONPATH"] = os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    import ray

    results = []
    try:
        t0 = time.perf_counter()
        cluster.start()
        start_s = time.perf_counter() - t0
        os.environ.update(AUTH)  # this driver speaks the cluster's auth mode, whatever ~/.ray holds
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
        noop_ms = empty_task_ms(ray)
        setting = SETTINGS[args.setting]
        with tempfile.TemporaryDirectory(prefix="cb-cluster-") as tmp:
            for rep in range(args.repeats):
                arms = {}
                order = ("local", "cluster") if rep % 2 == 0 else ("cluster", "local")
                for arm in order:
                    store = tempfile.mkdtemp(prefix=f"{arm}-", dir=tmp)
                    arms[arm] = (train_here(setting, args.members, args.steps, store) if arm == "local" else
                                 cluster_arm(ray, cluster.address, args.setting, args.members, args.steps, store))
                    print(f"  rep {rep + 1}: {arm} {arms[arm]['wall']:.1f} s, parts {arms[arm]['parts']}", flush=True)
                loc, clu = arms["local"], arms["cluster"]
                dw = max((loc["state"][n] - clu["state"][n]).abs().max().item() for n in loc["state"])
                slots = 2
                n_parts = len(clu["parts"])
                overhead = (clu["wall"] * min(slots, n_parts) - clu["loop"]) / n_parts
                results.append({"rep": rep, "local_s": loc["wall"], "cluster_s": clu["wall"],
                                "cluster_task_s": clu["wall_outer"], "ratio": loc["wall"] / clu["wall"],
                                "local_parts": loc["parts"], "cluster_parts": clu["parts"],
                                "local_loop_s": loc["loop"], "cluster_loop_s_summed": clu["loop"],
                                "overhead_per_task_s": overhead, "same_key": loc["key"] == clu["key"],
                                "max_abs_weight_diff": dw})
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.stop()
    ratio = statistics.median(r["ratio"] for r in results)
    lines = [f"setting {args.setting}: {args.members} members x {args.steps} steps; cluster started in {start_s:.0f} s; "
             f"empty Ray task round trip {noop_ms:.0f} ms",
             f"{'rep':>3} {'local s':>8} {'cluster s':>9} {'ratio':>6}  {'local parts':<20} {'cluster parts':<34}"
             f" {'overhead/task s':>15} {'same key':>8} {'max |dw|':>8}"]
    for r in results:
        lines.append(f"{r['rep'] + 1:>3} {r['local_s']:>8.1f} {r['cluster_s']:>9.1f} {r['ratio']:>5.2f}x  "
                     f"{str(r['local_parts']):<20} {str(r['cluster_parts']):<34} {r['overhead_per_task_s']:>15.1f} "
                     f"{'yes' if r['same_key'] else 'NO':>8} {r['max_abs_weight_diff']:>8.1e}")
    lines.append(f"median ratio local / cluster: {ratio:.2f}x (ideal on 2 one-CPU nodes: about 2x)")
    text = "\n".join(lines)
    print(text)
    common.write("cluster", args.out, args, info, [{**r} for r in results] + [{"empty_task_ms": noop_ms,
                                                                                "cluster_start_s": start_s}],
                 "ratio = local wall / cluster wall for the same sweep (same run key); overhead per task = "
                 "(cluster wall x slots - parts' step-loop seconds) / parts", text)


if __name__ == "__main__":
    main()
