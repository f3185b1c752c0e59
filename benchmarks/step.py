"""One training step of the book's toy model vs TransformerLens's own native model of the same size.

    python benchmarks/step.py                 # both sizes, with and without LayerNorm
    python benchmarks/step.py --size small --repeats 30

A step is forward + cross-entropy + backward + AdamW step on a fixed batch of
random tokens. Arms, all timed interleaved (order rotates every repetition):
  toy       circuitbook ToyTransformer + torch.optim.AdamW
  bridge    TransformerBridge.boot_native(TransformerBridgeConfig(...)) + torch.optim.AdamW
  native    the same NativeModel without the bridge around it (where the bridge's cost shows)
  cb_loop   what circuitbook.train does for one seed: Ensemble of K=1 under vmap + its own AdamW
The toy model's weights are copied into both native models and the logits compared, so all
arms compute the same function (the toy model has one extra parameter vector, the
unembedding bias b_U, which is zero; TransformerLens's native head has no bias).
Writes benchmarks/results/step.json and step.txt.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch.func import vmap
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.sources.native.model import NativeModel

import circuitbook as cb
import common
from circuitbook.training import Ensemble, Optimizer, per_member_loss

SIZES = {
    # Assign and Add width (2 layers, d_model 128, d_mlp 512, batch 512 x 16, loss at the last position);
    # MLP in both layers and biases, because the native model has no per-layer attn-only switch and no bias-free mode
    "assign_add": dict(n_layers=2, d_model=128, n_heads=1, d_mlp=512, d_vocab=74, d_vocab_out=59, n_ctx=16,
                       batch=512, loss="last", repeats=15),
    # the Markov-chain seed model (1 layer, d_model 64, 4 heads, batch 64 x 32 (the book: 31), next-token loss)
    "small": dict(n_layers=1, d_model=64, n_heads=4, d_mlp=256, d_vocab=4, d_vocab_out=4, n_ctx=32,
                  batch=64, loss="next_token", repeats=40),
}
ARMS = ("toy", "bridge", "native", "cb_loop")


def build(size: dict, norm: str | None):
    s = size
    toy_cfg = cb.ToyConfig(d_vocab=s["d_vocab"], d_vocab_out=s["d_vocab_out"], n_ctx=s["n_ctx"], d_model=s["d_model"],
                           n_layers=s["n_layers"], n_heads=s["n_heads"], d_mlp=s["d_mlp"], act_fn="relu",
                           normalization=norm, bias=True)
    tl_cfg = TransformerBridgeConfig(d_model=s["d_model"], d_head=s["d_model"] // s["n_heads"], n_layers=s["n_layers"],
                                     n_ctx=s["n_ctx"], n_heads=s["n_heads"], d_vocab=s["d_vocab"],
                                     d_vocab_out=s["d_vocab_out"], d_mlp=s["d_mlp"], act_fn="relu",
                                     normalization_type=norm, positional_embedding_type="standard", seed=0)
    toy = cb.ToyTransformer(toy_cfg, seed=0)
    bridge = TransformerBridge.boot_native(tl_cfg)
    native = NativeModel(copy.deepcopy(tl_cfg))
    return toy_cfg, toy, bridge, native



def toy_to_native(toy: cb.ToyTransformer) -> dict[str, torch.Tensor]:
    """The toy model's weights under NativeModel's names and layouts."""
    out = {"tok_embed.weight": toy.embed.W_E, "pos.weight": toy.pos_embed.W_pos, "head.weight": toy.unembed.W_U.T}
    for i, b in enumerate(toy.blocks):
        a, p = b.attn, f"layers.{i}."
        h, d, dh = a.W_Q.shape
        for n in "QKV":
            out[p + f"attn.{n.lower()}.weight"] = getattr(a, f"W_{n}").permute(0, 2, 1).reshape(h * dh, d)
            out[p + f"attn.{n.lower()}.bias"] = getattr(a, f"b_{n}").reshape(-1)
        out[p + "attn.o.weight"], out[p + "attn.o.bias"] = a.W_O.reshape(h * dh, d).T, a.b_O
        out[p + "mlp.fc_in.weight"], out[p + "mlp.fc_in.bias"] = b.mlp.W_in.T, b.mlp.b_in
        out[p + "mlp.fc_out.weight"], out[p + "mlp.fc_out.bias"] = b.mlp.W_out.T, b.mlp.b_out
        if b.has_ln:
            for ln in ("ln1", "ln2"):
                out[p + f"{ln}.weight"], out[p + f"{ln}.bias"] = getattr(b, ln).w, getattr(b, ln).b
    if toy.cfg.normalization == "LN":
        out["ln_out.weight"], out["ln_out.bias"] = toy.ln_final.w, toy.ln_final.b
    return out


@torch.no_grad()
def load_native(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = {n.replace("._original_component", ""): p for n, p in module.named_parameters()}
    if set(params) != set(weights):
        raise RuntimeError(f"weight names differ: {sorted(set(params) ^ set(weights))}")
    for n, p in params.items():
        p.copy_(weights[n])


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "last":
        return F.cross_entropy(logits[:, -1], labels)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def plain_step(model: torch.nn.Module, tokens, labels, kind: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step():
        loss = loss_fn(model(tokens), labels, kind)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def cb_step(toy_cfg, tokens, labels, kind: str):
    tc = cb.TrainConfig(steps=1, batch_size=len(tokens), seeds=(0,), lr=1e-3, weight_decay=0.1)
    ens = Ensemble(toy_cfg, tc.seeds)
    opt = Optimizer(ens.params, ens.trainable, tc)

    def step():
        losses = vmap(partial(per_member_loss, kind=kind))(ens.logits(tokens[None]), labels[None])
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    return step


def bench(name: str, norm: str | None, repeats: int) -> dict:
    size = dict(SIZES[name])
    repeats = repeats or size.pop("repeats")
    size.pop("repeats", None)
    toy_cfg, toy, bridge, native = build(size, norm)
    weights = toy_to_native(toy)
    load_native(bridge, weights)
    load_native(native, weights)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(size["d_vocab"], (size["batch"], size["n_ctx"]), generator=gen)
    label_shape = (size["batch"],) if size["loss"] == "last" else (size["batch"], size["n_ctx"])
    labels = torch.randint(size["d_vocab_out"], label_shape, generator=gen)
    with torch.no_grad():
        ref = toy(tokens)
        logit_diff = {"bridge": (bridge(tokens) - ref).abs().max().item(),
                      "native": (native(tokens) - ref).abs().max().item()}
    n_params = {"toy": sum(p.numel() for p in toy.parameters()),
                "bridge": sum(p.numel() for p in bridge.parameters()),
                "native": sum(p.numel() for p in native.parameters())}
    steps = {"toy": plain_step(toy, tokens, labels, size["loss"]),
             "bridge": plain_step(bridge, tokens, labels, size["loss"]),
             "native": plain_step(native, tokens, labels, size["loss"]),
             "cb_loop": cb_step(toy_cfg, tokens, labels, size["loss"])}
    inner = {}
    for arm, step in steps.items():  # warm up, and pick how many steps make one ~0.2 s timing
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        step()
        inner[arm] = max(1, int(0.2 / (time.perf_counter() - t0)))
    times, cpu = {arm: [] for arm in ARMS}, {arm: [] for arm in ARMS}
    for rep in range(repeats):
        order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
        for arm in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner[arm]):
                steps[arm]()
            times[arm].append(1000 * (time.perf_counter() - t0) / inner[arm])
            cpu[arm].append(1000 * (time.process_time() - c0) / inner[arm])
    med = {arm: statistics.median(t) for arm, t in times.items()}
    best = {arm: min(t) for arm, t in times.items()}

    def paired(a, b, t=times):  # median over repetitions of the per-repetition ratio
        return statistics.median(x / y for x, y in zip(t[a], t[b]))
    return {"size": name, "normalization": norm, "repeats": repeats, **size, "toy_config": toy_cfg.to_dict(),
            "n_params": n_params, "param_difference": n_params["toy"] - n_params["bridge"],
            "max_abs_logit_diff": logit_diff, "inner_steps": inner, "times_ms": times, "cpu_ms": cpu,
            "median_ms": med, "min_ms": best,
            "ratio_toy_over_bridge": paired("toy", "bridge"), "ratio_toy_over_native": paired("toy", "native"),
            "ratio_cb_loop_over_bridge": paired("cb_loop", "bridge"),
            "ratio_toy_over_bridge_min": best["toy"] / best["bridge"],
            "ratio_toy_over_bridge_cpu": paired("toy", "bridge", cpu), "load_avg_1m_at_end": os.getloadavg()[0]}


def table(results: list[dict]) -> str:
    lines = [f"{'size':<11} {'norm':<4} {'params toy/TL':>15}  {'toy ms':>7} {'bridge ms':>9} {'native ms':>9} "
             f"{'cb_loop ms':>10}  {'toy/bridge':>10} {'(min)':>5} {'(cpu)':>5} {'toy/native':>10} "
             f"{'cb_loop/bridge':>14}  {'|dlogits|':>9}"]
    for r in results:
        m, p = r["median_ms"], r["n_params"]
        lines.append(f"{r['size']:<11} {str(r['normalization']):<4} {p['toy']:>7}/{p['bridge']:<7}  {m['toy']:>7.2f} "
                     f"{m['bridge']:>9.2f} {m['native']:>9.2f} {m['cb_loop']:>10.2f}  "
                     f"{r['ratio_toy_over_bridge']:>10.2f} {r['ratio_toy_over_bridge_min']:>5.2f} "
                     f"{r['ratio_toy_over_bridge_cpu']:>5.2f} "
                     f"{r['ratio_toy_over_native']:>10.2f} "
                     f"{r['ratio_cb_loop_over_bridge']:>14.2f}  {max(r['max_abs_logit_diff'].values()):>9.1e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=[*SIZES, "both"], default="both")
    ap.add_argument("--norm", choices=["none", "LN", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=0, help="interleaved repetitions per arm (default: per size)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--out", default=None, help="default: results/step[_threadsN].json")
    args = ap.parse_args()
    info = common.start(args.threads)
    sizes = list(SIZES) if args.size == "both" else [args.size]
    norms = [None, "LN"] if args.norm == "both" else [None if args.norm == "none" else "LN"]
    results = [bench(s, n, args.repeats) for s in sizes for n in norms]
    text = table(results)
    print(text)
    common.write("step", args.out, args, info, results,
                 f"median ms per training step over {[r['repeats'] for r in results]} interleaved repetitions; "
                 "ratios are medians of per-repetition ratios (< 1: the toy model is faster); (min): ratio of the "
                 "fastest repetitions; (cpu): of process CPU time", text)


if __name__ == "__main__":
    main()
