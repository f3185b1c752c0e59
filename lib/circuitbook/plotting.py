"""One figure style for the whole book (seaborn), and a few shared plots.

`use_style()` is applied by `load_params()`, so every notebook's figures look
the same: white grid, colour-blind palette, fonts readable in print.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns

PALETTE = "colorblind"
FIGSIZE = (6.4, 3.6)


def use_style() -> None:
    sns.set_theme(context="notebook", style="whitegrid", palette=PALETTE, font_scale=0.95,
                  rc={"figure.figsize": FIGSIZE, "figure.dpi": 110, "savefig.dpi": 150,
                      "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8.5,
                      "axes.spines.top": False, "axes.spines.right": False, "figure.autolayout": True})


def figure(ncols: int = 1, nrows: int = 1, width: float | None = None, height: float | None = None, **kw):
    """fig, axes sized for the book's page width."""
    width = width or min(FIGSIZE[0] * max(ncols, 1) * 0.8, 12)
    height = height or FIGSIZE[1] * nrows * (0.9 if nrows > 1 else 1)
    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=nrows * ncols == 1, **kw)


def curves(ax, df, x: str, y: str, hue: str | None = None, title: str = "", xlabel: str | None = None,
           ylabel: str | None = None, logx: bool = False, **kw):
    """Line plot of a long-format DataFrame with labelled axes."""
    sns.lineplot(data=df, x=x, y=y, hue=hue, ax=ax, **kw)
    ax.set(title=title, xlabel=xlabel or x, ylabel=ylabel or y)
    if logx:
        ax.set_xscale("log")
    if hue and ax.get_legend() is not None:
        ax.legend(title=hue, frameon=False)
    return ax


def mark_steps(ax, steps: dict[str, float], color: str = "0.3") -> None:
    """Vertical dashed lines with labels at the top of the axes (phases, thresholds)."""
    for label, x in steps.items():
        ax.axvline(x, color=color, ls="--", lw=1)
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=8, color=color, xytext=(-2, -2), textcoords="offset points")


def heatmap(ax, matrix, title: str = "", xlabel: str = "", ylabel: str = "", xticklabels="auto",
            yticklabels="auto", center: float | None = 0.0, cmap: str = "RdBu_r", cbar_label: str = "", **kw):
    """Annotated-free heatmap with a diverging map centred at 0 by default."""
    m = np.asarray(matrix.detach().cpu() if hasattr(matrix, "detach") else matrix, dtype=float)
    sns.heatmap(m, ax=ax, center=center, cmap=cmap, xticklabels=xticklabels, yticklabels=yticklabels,
                cbar_kws={"label": cbar_label} if cbar_label else None, **kw)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return ax
