"""One SGD step of the leading_terms model: index lookups vs dense one-hot products, and a plain matmul.

    python benchmarks/onehot.py                    # both sizes
    python benchmarks/onehot.py --size cpu --repeats 5 --threads 1

A step is forward + mean cross-entropy over all positions + backward + plain SGD update on a fixed
batch of random tokens, for the paper's 3-layer attention-only model with one-hot inputs. Arms,
timed interleaved (the order rotates every repetition):
  lookup   circuitbook.models.onehot.OneHotTransformer: the residual is (tokens, dense part), every
           product with the one-hot part is an index lookup
  naive    the paper's formula with dense one-hot matrices (`onehot.reference_forward`): h^(0) = X
           [batch, T, |V|], every product a matmul
  matmul   a plain fp32 [batch*T, |V|] @ [|V|, |V|] matmul: the machine's achievable GFLOP/s
Both model arms start from the same random weights (zero weights would make softmax trivial) and
their logits are compared before timing. GFLOP/s counts each arm's own matmul FLOPs (forward
multiply-adds x 2, times 3 for forward + backward); "useful" GFLOP/s divides the lookup arm's
time into the naive arm's FLOP count (the work the naive form would need for the same step).
Writes benchmarks/results/onehot.json and onehot.txt.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import common
from circuitbook.models.onehot import OneHotConfig, reference_forward

SIZES = {
    # the cpu profile of chapter leading_terms (|V| 500, T 32, full batch of 256)
    "cpu": dict(vocab=500, seq_len=32, batch=256, repeats=5),
    # the paper's |V| and T at a micro-batch of 4 sequences (one of the full profile's accumulation slices, scaled)
    "paper": dict(vocab=3000, seq_len=200, batch=4, repeats=3),
}
ARMS = ("lookup", "naive", "matmul")


def macs(arm: str, N: int, T: int, V: int, L: int = 3) -> float:
    """Forward multiply-adds of the products each arm computes."""
    if arm == "naive":  # per layer: h W, (h W) h^T, h V, A (h V); then h W_O
        return L * (2 * N * T * V * V + 2 * N * T * T * V) + N * T * V * V
    if arm == "lookup":  # layer 0: A V[x] only; layers >= 1: D W, (h W) D^T, D V, A (h V); then D W_O
        return N * T * T * V + (L - 1) * (2 * N * T * V * V + 2 * N * T * T * V) + N * T * V * V
    return N * T * V * V


def sgd_step(forward, params, tokens, labels, lr=0.1):
    def step():
        logits = forward(tokens)
        loss = -logits.log_softmax(-1).gather(-1, labels[..., None]).mean()
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(lr * p.grad)
    return step


def bench(name: str, repeats: int) -> dict:
    size = dict(SIZES[name])
    repeats = repeats or size["repeats"]
    N, T, V = size["batch"], size["seq_len"], size["vocab"]
    gen = torch.Generator().manual_seed(0)
    model = OneHotConfig(d_vocab=V, n_ctx=T, n_layers=3, init_std=0.02).build(seed=0)
    tokens = torch.randint(V, (N, T), generator=gen)
    labels = torch.randint(V, (N, T), generator=gen)
    with torch.no_grad():
        diff = (model(tokens) - reference_forward(model, tokens)).abs().max().item()
    params = list(model.parameters())
    A = torch.randn(N * T, V, generator=gen)
    Bm = torch.randn(V, V, generator=gen)
    steps = {"lookup": sgd_step(model, params, tokens, labels),
             "naive": sgd_step(lambda t: reference_forward(model, t), params, tokens, labels),
             "matmul": lambda: A @ Bm}
    for step in steps.values():  # warm up
        step()
    times, cpu = {arm: [] for arm in ARMS}, {arm: [] for arm in ARMS}
    for rep in range(repeats):
        order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
        for arm in order:
            t0, c0 = time.perf_counter(), time.process_time()
            steps[arm]()
            times[arm].append(time.perf_counter() - t0)
            cpu[arm].append(time.process_time() - c0)
    med = {arm: statistics.median(t) for arm, t in times.items()}
    flops = {arm: 2 * macs(arm, N, T, V) * (1 if arm == "matmul" else 3) for arm in ARMS}
    gflops = {arm: flops[arm] / med[arm] / 1e9 for arm in ARMS}
    paired = statistics.median(n / l for n, l in zip(times["naive"], times["lookup"]))
    paired_cpu = statistics.median(n / l for n, l in zip(cpu["naive"], cpu["lookup"]))
    return {"size": name, "vocab": V, "seq_len": T, "batch": N, "repeats": repeats, "max_abs_logit_diff": diff,
            "times_s": times, "cpu_s": cpu, "median_s": med, "flops": flops, "gflops": gflops,
            "useful_gflops_lookup": flops["naive"] / med["lookup"] / 1e9,
            "speedup_lookup_over_naive": paired, "speedup_lookup_over_naive_cpu": paired_cpu,
            "fraction_of_matmul": {arm: gflops[arm] / gflops["matmul"] for arm in ("lookup", "naive")}}


def table(results: list[dict]) -> str:
    lines = [f"{'size':<6} {'|V|':>5} {'T':>4} {'batch':>5}  {'lookup s':>9} {'naive s':>9}  {'naive/lookup wall/cpu':>22}  "
             f"{'GFLOP/s lookup':>14} {'naive':>6} {'matmul':>7}  {'of matmul: lookup':>17} {'naive':>6}  "
             f"{'useful GFLOP/s':>14}  {'|dlogits|':>9}"]
    for r in results:
        m, g, f = r["median_s"], r["gflops"], r["fraction_of_matmul"]
        lines.append(f"{r['size']:<6} {r['vocab']:>5} {r['seq_len']:>4} {r['batch']:>5}  {m['lookup']:>9.3f} "
                     f"{m['naive']:>9.3f}  {r['speedup_lookup_over_naive']:>11.2f}x/{r['speedup_lookup_over_naive_cpu']:>6.2f}x  "
                     f"{g['lookup']:>14.1f} "
                     f"{g['naive']:>6.1f} {g['matmul']:>7.1f}  {f['lookup']:>17.2f} {f['naive']:>6.2f}  "
                     f"{r['useful_gflops_lookup']:>14.1f}  {r['max_abs_logit_diff']:>9.1e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=[*SIZES, "both"], default="both")
    ap.add_argument("--repeats", type=int, default=0, help="interleaved repetitions per arm (default: per size)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--vocab", type=int, default=0, help="override |V| (tests use a tiny size)")
    ap.add_argument("--seq-len", type=int, default=0, help="override T")
    ap.add_argument("--batch", type=int, default=0, help="override the batch")
    ap.add_argument("--out", default=None, help="default: results/onehot[_threadsN].json")
    args = ap.parse_args()
    info = common.start(args.threads)
    names = list(SIZES) if args.size == "both" else [args.size]
    results = []
    for name in names:
        for key, value in (("vocab", args.vocab), ("seq_len", args.seq_len), ("batch", args.batch)):
            if value:
                SIZES[name][key] = value
        r = bench(name, args.repeats)
        if r["max_abs_logit_diff"] > 1e-4:
            raise SystemExit(f"{name}: the two forms disagree (max |dlogits| = {r['max_abs_logit_diff']:.2e})")
        results.append(r)
        print(table([r]).splitlines()[-1], flush=True)
    legend = ("one SGD step (forward, mean cross-entropy, backward, update) of the 3-layer one-hot model; "
              "naive/lookup: median of per-repetition ratios of wall time / of process CPU time; GFLOP/s: each arm's own matmul FLOPs; useful "
              "GFLOP/s: the naive form's FLOPs per lookup-step second; matmul: [batch*T, |V|] @ [|V|, |V|] fp32")
    text = table(results)
    print(text)
    common.write("onehot", args.out, args, info, results, legend, text)


if __name__ == "__main__":
    main()
