"""What the notebooks of chapter leading_terms record and show: summaries of the measurements, the
paper's numbers beside the book's, phrases for the scorecard, the figures.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...analysis import leading_terms as lt
from .runs import lm_is_substitute, lm_name


def lm_label(cfg) -> str:
    """The language model's name on the scorecard row (LT-6), saying when it is a substitute."""
    return lm_name(cfg) + (" (substitute for Pythia-1.4B)" if lm_is_substitute(cfg) else "")


def matrix_summary(frame: pd.DataFrame, lr: float, level: float = 0.7, band: float = 0.9,
                   kinds=("W", "V", "W_O")) -> pd.DataFrame:
    """One row per weight matrix of `kinds` for one lr: its cosine at the last evaluation, its lowest
    cosine, the largest s * eta up to which it stays >= `band` (`s_eta_until_below` of that matrix
    alone) and whether it ends at or below `level` (LT-2 asks every matrix to end above 0.7)."""
    sub = frame[np.isclose(frame["lr"], lr) & frame["kind"].isin(kinds)]
    rows = []
    for name, g in sub.groupby("weight", sort=False):
        g = g.sort_values("s_eta")
        worst = g.set_index("s_eta")["cosine"]
        below = worst[worst < band]
        if below.empty:
            until = float(worst.index.max())
        else:
            before = worst[worst.index < below.index[0]]
            until = float(before.index.max()) if not before.empty else 0.0
        final = float(g["cosine"].iloc[-1])
        rows.append({"weight": name, "kind": g["kind"].iloc[0], "layer": int(g["layer"].iloc[0]), "final": final,
                     "lowest": float(g["cosine"].min()), f"s_eta_above_{band:g}": until, "ends_below": final <= level})
    rows.sort(key=lambda r: (list(kinds).index(r["kind"]), r["layer"]))
    return pd.DataFrame(rows)


def names_or_none(names) -> str:
    """'W2, V0' or 'none': a list of weight names as a phrase for the scorecard row."""
    names = list(names)
    return ", ".join(names) if names else "none"


# LT-4: the paper's losses after removing each weight's leading-term projection (its table, for
# the side-by-side comparison; the scorecard's rules never read these numbers).
PAPER_ABLATION = {"none": 5.349, "W0": 5.350, "W1": 5.352, "W2": 5.361, "V0": 6.192, "V1": 6.526, "V2": 6.520,
                  "W_O": 8.287}


def activation_gib(batch: int, seq_len: int, vocab_size: int, n_layers: int, members: int = 1) -> float:
    """Rough memory of one forward + backward pass: about 5 [batch, T, |V|] float32 tensors per
    layer (the dense residual, h W, h V, the read-out, their gradients' buffers) plus 3 for the
    logits and their log-softmax, per ensemble member."""
    per = batch * seq_len * vocab_size * 4
    return (5 * n_layers + 3) * per * members / 2 ** 30


def embedding_summary(emb: pd.DataFrame, key: str = "embed") -> dict:
    """The checkpoint where the (un)embedding agrees best: its cosine, its baseline there
    (shuffled-token mean + 3 sd) and whether any checkpoint agrees (`agrees`)."""
    best = emb.loc[emb[key].idxmax()]
    return {"step": int(best["step"]), "cosine": float(best[key]),
            "baseline": float(best[f"{key}_base_mean"] + 3 * best[f"{key}_base_std"]),
            "agrees": any(lt.agrees(r[key], r[f"{key}_base_mean"], r[f"{key}_base_std"]) for _, r in emb.iterrows())}


def attention_summary(att: pd.DataFrame) -> pd.DataFrame:
    """Per layer: its best cosine with Q over the checkpoints and whether any checkpoint agrees."""
    flags = att.assign(agrees=[lt.agrees(r.cosine, r.base_mean, r.base_std) for r in att.itertuples()])
    return flags.groupby("layer").agg(best_cosine=("cosine", "max"), agrees=("agrees", "any")).reset_index()


WEIGHT_TITLES = {"W": "attention W", "V": "value V", "P": "positional P", "W_O": "output W_O"}


def plot_cosines(frame: pd.DataFrame, lr: float, levels=(0.9,)):
    """One panel per weight kind (W, V, P, W_O), one line per layer: cosine with the leading term
    against s * eta for one learning rate, a dotted line at each of `levels`. Returns the figure."""
    from ... import plotting

    sub = frame[np.isclose(frame["lr"], lr)].copy()
    sub["layer"] = sub["layer"].map(lambda l: "output" if l < 0 else f"layer {l}")
    fig, axes = plotting.figure(ncols=2, nrows=2, height=6)
    for ax, kind in zip(axes.flat, ("W", "V", "P", "W_O")):
        plotting.curves(ax, sub[sub["kind"] == kind], x="s_eta", y="cosine", hue="layer", title=WEIGHT_TITLES[kind],
                        xlabel="$s\\eta$ (steps x learning rate)", ylabel="cosine with leading term")
        for level in levels:
            ax.axhline(level, color="0.5", lw=0.8, ls=":")
    fig.suptitle(f"learning rate {lr:g}")
    return fig
