"""K members trained as one ensemble, in the chunks train() chooses, and one after another.

    python benchmarks/ensemble.py                       # both settings, K = 8
    python benchmarks/ensemble.py --setting markov --steps 200 --repeats 5

Every arm calls `circuitbook.train` exactly as a notebook would: arm "ensemble"
once with seeds (0..K-1) and chunk="all", arm "chunked" once with the chunk size
that train()'s calibration chooses on this machine (`calibrate` + `best_chunk`,
measured here before the race), arm "sequential" K times with one seed each.
Every call gets a fresh empty $CIRCUITBOOK_RUNS, so nothing is cached between arms.
Wall time covers the whole call (model construction, data, the loop, the
first and last checkpoint); `loop` is the trainer's own `train_seconds` (the
step loop only, summed over parts). Arms rotate (E C S, S C E, ...) and medians
are reported. The final weights and losses of every arm are compared member by
member with the sequential runs: same seeds, so they must agree up to float
rounding, else the race is unfair.
Writes benchmarks/results/ensemble.json and ensemble.txt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial

import torch
from torch.func import vmap

import circuitbook as cb
import common
from circuitbook.tasks.assign_add import AssignAddTask
from circuitbook.tasks.base import Batch, step_generator
from circuitbook.training import Ensemble, Optimizer, RunSpec, best_chunk, calibrate, chunk_candidates, per_member_loss

# Batched and single matmuls round differently; Adam's normalised step lets that drift grow a little with steps.
TOLERANCE = {"loss": 1e-4, "weight": 1e-2}


class MarkovChain:
    """A circulant Markov chain over `n` states, next-token loss (chapter algorithmic_cores, 02_markov).

    From state s the chain moves to s + j (mod n) with probability row[j] (the book's chain: stay 0.75,
    advance 0.25), so the increments are i.i.d. and a whole batch is one cumsum. Sequences of
    seq_len + 1 states, fresh each step (the book samples a fixed training set; same cost per step).
    """

    loss = "next_token"

    def __init__(self, n: int = 4, seq_len: int = 31, row=(0.75, 0.25, 0.0, 0.0)):
        self.n, self.seq_len, self.row = n, seq_len, torch.tensor(row)
        self.vocab_size = self.n_outputs = n

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        gen = step_generator(seed, step)
        start = torch.randint(self.n, (batch_size, 1), generator=gen)
        jumps = torch.multinomial(self.row, batch_size * self.seq_len, replacement=True, generator=gen)
        seq = (start + torch.cat([torch.zeros(batch_size, 1, dtype=torch.long),
                                  jumps.view(batch_size, -1).cumsum(1)], 1)) % self.n
        return Batch(seq[:, :-1], seq[:, 1:])

    def spec(self) -> dict:
        return {"task": "markov_chain", "n": self.n, "seq_len": self.seq_len, "row": self.row.tolist()}


SETTINGS = {
    # the seed experiments (algorithmic_cores 02_markov defaults: length 32, LN, batch 64)
    "markov": dict(
        model=cb.ToyConfig(d_vocab=4, n_ctx=31, d_model=64, n_layers=1, n_heads=4, d_mlp=256, normalization="LN"),
        task=MarkovChain, batch_size=64, steps=60),
    # Assign and Add: two layers, one head, no biases or LN, layer 0 attention-only
    "assign_add": dict(
        model=cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=128, n_layers=2, n_heads=1, d_mlp=512,
                           mlp=(False, True), bias=False, d_vocab_out=59),
        task=AssignAddTask, batch_size=512, steps=24),
}


def run_arm(arm: str, setting: dict, task, steps: int, members: int, tmp: str, chunk: int = 1) -> dict:
    """Train K members one way in a fresh store; return wall and loop seconds and the runs."""
    seed_groups = [(s,) for s in range(members)] if arm == "sequential" else [tuple(range(members))]
    how = {"ensemble": "all", "chunked": chunk, "sequential": "all"}[arm]
    root = tempfile.mkdtemp(prefix=f"{arm}-", dir=tmp)
    os.environ["CIRCUITBOOK_RUNS"] = root
    t0, c0 = time.perf_counter(), time.process_time()
    out = []
    for seeds in seed_groups:
        tc = cb.TrainConfig(steps=steps, batch_size=setting["batch_size"], seeds=seeds, lr=1e-3,
                            weight_decay=0.1, eval_every=steps, log_checkpoints=0)
        out.append(cb.train(f"bench_{arm}", setting["model"], task, tc, progress=False, chunk=how))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    loop = sum(r.manifest["train_seconds"] for r in out)
    return {"wall": wall, "cpu": cpu, "loop": loop, "runs": out}


def step_costs(setting: dict, task, members: int, repeats: int = 5) -> dict:
    """Median ms of one bare training step (no data, no logging) at batch 1 and full batch, K=1 and K=members.

    Batch 1 is (almost) pure per-step overhead: Python, dispatch, vmap, autograd,
    optimizer launches. That part is paid once per step by the ensemble and K
    times by the sequential runs; the rest grows with K * batch and is paid by both.
    """
    cases = [(k, b) for b in (1, setting["batch_size"]) for k in (1, members)]
    steps, reps, times, cpu = {}, {}, {c: [] for c in cases}, {c: [] for c in cases}
    for k, b in cases:
        tc = cb.TrainConfig(steps=1, batch_size=b, seeds=tuple(range(k)))
        ens = Ensemble(setting["model"], tc.seeds)
        opt = Optimizer(ens.params, ens.trainable, tc)
        batch = [task.train_batch(0, b, s) for s in range(k)]
        tokens, labels = torch.stack([x.tokens for x in batch]), torch.stack([x.labels for x in batch])

        def step(ens=ens, opt=opt, tokens=tokens, labels=labels):
            losses = vmap(partial(per_member_loss, kind=task.loss))(ens.logits(tokens), labels)
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
        step()
        t0 = time.perf_counter()
        step()
        steps[(k, b)], reps[(k, b)] = step, max(1, int(0.25 / (time.perf_counter() - t0)))
    for rep in range(repeats):
        for c in (cases if rep % 2 == 0 else cases[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps[c]):
                steps[c]()
            times[c].append(1000 * (time.perf_counter() - t0) / reps[c])
            cpu[c].append(1000 * (time.process_time() - c0) / reps[c])
    return {clock: {f"K{k}_batch{b}": statistics.median(ts[(k, b)]) for k, b in cases}
            for clock, ts in (("wall", times), ("cpu", cpu))}


def agreement(ens: cb.Run, seq: list[cb.Run]) -> dict:
    """Max |difference| between ensemble member k and sequential run k: final weights and loss."""
    state = ens.state()
    dw = max((state[n][k] - r.state()[n][0]).abs().max().item() for k, r in enumerate(seq) for n in state)
    final = [m[m.step == m.step.max()].sort_values("member").train_loss.tolist() for m in
             (r.metrics() for r in [ens, *seq])]
    loss_e, loss_s = final[0], [f[0] for f in final[1:]]
    dl = max(abs(a - b) for a, b in zip(loss_e, loss_s))
    return {"max_abs_weight_diff": dw, "max_abs_final_loss_diff": dl, "tolerance": TOLERANCE,
            "agree": dw <= TOLERANCE["weight"] and dl <= TOLERANCE["loss"],
            "final_loss_ensemble": loss_e, "final_loss_sequential": loss_s}


def choose(setting: dict, task, steps: int, members: int) -> tuple[int, dict]:
    """The chunk size train() would choose here for this run: calibrated step times, then best_chunk."""
    tc = cb.TrainConfig(steps=steps, batch_size=setting["batch_size"], seeds=tuple(range(members)))
    spec = RunSpec(None, {}, setting["model"], [task] * members, tc)
    cal = calibrate(spec, chunk_candidates(members), torch.device("cpu"))
    return best_chunk(members, steps, cal.step_s, 1, cal.setup_s), cal


ARMS = ("ensemble", "chunked", "sequential")


def bench(name: str, steps: int, members: int, repeats: int, tmp: str) -> dict:
    setting = SETTINGS[name]
    task = setting["task"]()
    steps = steps or setting["steps"]
    load_start = os.getloadavg()[0]
    chunk, cal = choose(setting, task, steps, members)
    step_s, setup_s = cal.step_s, cal.setup_s
    print(f"  [{name}] calibration (s per step | s setup per part, by chunk size): "
          + ", ".join(f"{c}: {t:.4f} | {setup_s[c]:.3f}" for c, t in step_s.items()) + f" -> chunk {chunk}", flush=True)
    for arm in ARMS:  # warm up kernels, imports, allocator
        run_arm(arm, setting, task, 2, members, tmp, chunk)
    times, last = {arm: [] for arm in ARMS}, {}
    for rep in range(repeats):
        order = ARMS[rep % 3:] + ARMS[:rep % 3]
        for arm in (order if rep % 2 == 0 else order[::-1]):
            r = run_arm(arm, setting, task, steps, members, tmp, chunk)
            times[arm].append({k: r[k] for k in ("wall", "cpu", "loop")})
            last[arm] = r
        print(f"  [{name}] rep {rep + 1}/{repeats}: " + ", ".join(f"{a} {times[a][-1]['wall']:.2f}s" for a in ARMS),
              flush=True)
    agree = agreement(last["ensemble"]["runs"][0], last["sequential"]["runs"])
    agree_chunked = agreement(last["chunked"]["runs"][0], last["sequential"]["runs"])
    costs = step_costs(setting, task, members)
    med = {arm: {k: statistics.median(t[k] for t in ts) for k in ("wall", "cpu", "loop")} for arm, ts in times.items()}
    return {
        "setting": name, "model": setting["model"].to_dict(), "task": task.spec(),
        "batch_size": setting["batch_size"], "steps": steps, "members": members, "repeats": repeats,
        "times_s": times, "median_s": med, "chosen_chunk": chunk, "calibration_step_s": step_s,
        "calibration_setup_s": setup_s,
        "ratio_wall_chunked": med["sequential"]["wall"] / med["chunked"]["wall"],
        "agreement_chunked": agree_chunked,
        "ratio_wall": med["sequential"]["wall"] / med["ensemble"]["wall"],
        "ratio_loop": med["sequential"]["loop"] / med["ensemble"]["loop"],
        "ratio_cpu": med["sequential"]["cpu"] / med["ensemble"]["cpu"],
        "ms_per_member_step": {arm: 1000 * med[arm]["loop"] / (steps * members) for arm in med},
        "agreement": agree, "bare_step_ms": costs, "load_avg_1m": [load_start, os.getloadavg()[0]],
    }


def table(results: list[dict]) -> str:
    lines = [f"{'setting':<11} {'K':>2} {'steps':>5} {'chunk':>5}  {'ensemble s':>10} {'chunked s':>9} {'sequential s':>12}"
             f"  {'S/E':>6} {'S/C':>6}  {'loop S/C':>8} {'cpu S/C':>7}  {'ms/member-step E|C|S':>22}  {'max |dw| E|C':>15}"
             f" {'same':>4}"]
    for r in results:
        m, a, ac = r["median_s"], r["agreement"], r["agreement_chunked"]
        ms = r["ms_per_member_step"]
        loop = m["sequential"]["loop"] / m["chunked"]["loop"]
        cpu = m["sequential"]["cpu"] / m["chunked"]["cpu"]
        lines.append(f"{r['setting']:<11} {r['members']:>2} {r['steps']:>5} {r['chosen_chunk']:>5}  "
                     f"{m['ensemble']['wall']:>10.2f} {m['chunked']['wall']:>9.2f} {m['sequential']['wall']:>12.2f}  "
                     f"{r['ratio_wall']:>5.2f}x {r['ratio_wall_chunked']:>5.2f}x  {loop:>7.2f}x {cpu:>6.2f}x  "
                     f"{ms['ensemble']:>6.1f} | {ms['chunked']:>5.1f} | {ms['sequential']:<6.1f}  "
                     f"{a['max_abs_weight_diff']:>6.1e} | {ac['max_abs_weight_diff']:>6.1e} "
                     f"{'yes' if a['agree'] and ac['agree'] else 'NO':>4}")
    lines += ["", "calibration: s per step of a chunk of c members (the fastest of 3) | s of setup per part -> the chunk train() chooses"]
    for r in results:
        lines.append(f"{r['setting']:<11} " + ", ".join(f"c={c}: {t:.4f} | {r['calibration_setup_s'][c]:.3f}"
                                                  for c, t in r["calibration_step_s"].items())
                     + f" -> {r['chosen_chunk']}")
    lines += ["", "bare step (no data or logging), median ms; overhead share = K=1 at batch 1 / K=1 at full batch",
              f"{'setting':<11} {'clock':<5} {'K=1 b=1':>8} {'K=K b=1':>8} {'K=1 full':>9} {'K=K full':>9}"
              f" {'step ratio':>10} {'overhead share':>14}"]
    for r in results:
        k, b = r["members"], r["batch_size"]
        for clock, c in r["bare_step_ms"].items():
            lines.append(f"{r['setting']:<11} {clock:<5} {c['K1_batch1']:>8.1f} {c[f'K{k}_batch1']:>8.1f} "
                         f"{c[f'K1_batch{b}']:>9.1f} {c[f'K{k}_batch{b}']:>9.1f} "
                         f"{k * c[f'K1_batch{b}'] / c[f'K{k}_batch{b}']:>9.2f}x "
                         f"{c['K1_batch1'] / c[f'K1_batch{b}']:>14.0%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", choices=[*SETTINGS, "both"], default="both")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (default: per setting)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions of each arm, interleaved")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--out", default=None, help="default: results/ensemble[_threadsN].json")
    args = ap.parse_args()
    os.environ["CIRCUITBOOK_PROGRESS"] = "0"
    info = common.start(args.threads)
    names = list(SETTINGS) if args.setting == "both" else [args.setting]
    with tempfile.TemporaryDirectory(prefix="cb-bench-") as tmp:  # every arm gets its own empty store in here
        results = [bench(n, args.steps, args.members, args.repeats, tmp) for n in names]
    text = table(results)
    print(text)
    common.write("ensemble", args.out, args, info, results,
                 f"S/E, S/C = sequential / ensemble and sequential / chunked wall time (median of {args.repeats}); "
                 "loop: the same for the step loop only; cpu: for process CPU time", text)


if __name__ == "__main__":
    main()
