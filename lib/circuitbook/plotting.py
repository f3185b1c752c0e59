"""One figure and table style for the whole book (seaborn), and a few shared plots.

`use_style()` is applied by `load_params()`, so every notebook's figures look the same: white grid,
colour-blind palette, fonts and lines readable at the page's width and in print. Conventions (see
CONTRIBUTING.md): one figure per cell, labelled axes with units, a caption in the cell's metadata
(`mystnb.figure.caption`: what to look for, and which library function computed it), a log step axis
where the dynamics happen early (`step_axis`), colour families by kind of curve (`family_colors`), and
tables formatted for a reader (`table`).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

PALETTE = "colorblind"
FIGSIZE = (7.0, 3.8)  # inches: the text column at the book's 110 dpi
MAX_WIDTH = 7.6  # wider figures are shrunk by the page, and their text with them
FAMILIES = ("Blues", "Greens", "Oranges", "Purples", "Reds", "Greys")


def use_style() -> None:
    sns.set_theme(context="notebook", style="whitegrid", palette=PALETTE, font_scale=1.0,
                  rc={"figure.figsize": FIGSIZE, "figure.dpi": 110, "savefig.dpi": 150,
                      "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 10, "ytick.labelsize": 10,
                      "legend.fontsize": 9.5, "legend.title_fontsize": 10, "legend.frameon": False,
                      "lines.linewidth": 1.8, "lines.markersize": 5, "axes.spines.top": False,
                      "axes.spines.right": False, "figure.autolayout": True})


def figure(ncols: int = 1, nrows: int = 1, width: float | None = None, height: float | None = None, **kw):
    """fig, axes sized for the book's page width (never wider than MAX_WIDTH inches).

    axes is one Axes for a 1 x 1 figure, else a 2-D array [nrows][ncols].
    """
    width = min(width or FIGSIZE[0] * (1 if ncols == 1 else 0.55 * ncols), MAX_WIDTH * (1.0 if ncols < 3 else 1.15))
    height = height or FIGSIZE[1] * (1 if nrows == 1 else 0.8 * nrows)
    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=nrows * ncols == 1, **kw)


def curves(ax, df, x: str, y: str, hue: str | None = None, title: str = "", xlabel: str | None = None,
           ylabel: str | None = None, logx: bool = False, **kw):
    """Line plot of a long-format DataFrame with labelled axes."""
    sns.lineplot(data=df, x=x, y=y, hue=hue, ax=ax, **kw)
    ax.set(title=title, xlabel=xlabel or x, ylabel=ylabel or y)
    if logx:
        ax.set_xscale("log")
    if hue and ax.get_legend() is not None:
        ax.legend(title=hue)
    return ax


def family_colors(groups: Mapping[str, Iterable[str]]) -> dict[str, tuple]:
    """One colour family per group of curves, one shade per curve: {curve: colour}.

    groups: {"0-var": ["0-var", "0-var, held-out pairs"], "1-var": [...], ...}; the first curve of a
    group gets the darkest shade, so the main curve of each family stands out.
    """
    out = {}
    for family, (name, members) in zip(FAMILIES * 3, groups.items()):
        members = list(members)
        shades = sns.color_palette(family, len(members) + 2)[::-1][: len(members)]
        out.update(zip(members, shades))
    return out


def step_axis(ax, steps, events: Iterable[float] = (), label: str = "training step") -> str:
    """Put the step axis where the dynamics happen: a log axis when the events (phase steps) sit in
    the first fifth of the run, else linear. Returns the scale chosen ("log" or "linear")."""
    steps = np.asarray([s for s in steps if s is not None], float)
    events = [e for e in events if e is not None and not math.isnan(e)]
    end = float(steps.max()) if len(steps) else 1.0
    early = bool(events) and max(events) < 0.2 * end
    if early and (steps > 0).any():
        ax.set_xscale("symlog", linthresh=max(1.0, float(steps[steps > 0].min())))
        ax.set_xmargin(0)  # a margin on a symlog axis reaches below step 0 and far past the end
    ax.set_xlabel(label + (" (log scale)" if early else ""))
    return "log" if early else "linear"


def mark_steps(ax, steps: dict[str, float], color: str = "0.3") -> None:
    """Vertical dashed lines with labels at the top of the axes (phases, thresholds)."""
    for label, x in steps.items():
        if x is None or (isinstance(x, float) and math.isnan(x)):
            continue
        ax.axvline(x, color=color, ls="--", lw=1)
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=9, color=color, xytext=(-2, -2), textcoords="offset points")


def legend_below(ax, ncol: int = 3, title: str | None = None) -> None:
    """The legend under the axes, in columns: readable without squeezing the plot."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=ncol, title=title)


def figure_legend(fig, ax, ncol: int = 4, title: str | None = None) -> None:
    """One legend for a figure of several panels that share their curves: `ax`'s entries, under the
    whole figure, in columns (instead of a small legend repeated in every panel)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, title=title)


def heatmap(ax, matrix, title: str = "", xlabel: str = "", ylabel: str = "", xticklabels="auto",
            yticklabels="auto", center: float | None = 0.0, cmap: str = "RdBu_r", cbar_label: str = "", **kw):
    """Heatmap without annotations, with a diverging map centred at 0 by default."""
    m = np.asarray(matrix.detach().cpu() if hasattr(matrix, "detach") else matrix, dtype=float)
    sns.heatmap(m, ax=ax, center=center, cmap=cmap, xticklabels=xticklabels, yticklabels=yticklabels,
                cbar_kws={"label": cbar_label} if cbar_label else None, **kw)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return ax


def table(df, digits: int = 3, integers: Iterable[str] = (), percent: Iterable[str] = (),
          index: bool = True):
    """A DataFrame formatted for a reader: `integers` columns without decimals (steps, counts),
    `percent` columns as percentages, every other float to `digits` significant decimals; NaN as "-".
    Name columns with their units (e.g. "step", "wall time (s)") before calling.
    """
    integers, percent = set(integers), set(percent)
    formats = {}
    for col in df.columns:
        if col in integers:
            formats[col] = _integer
        elif col in percent:
            formats[col] = _percent
        elif df[col].dtype.kind == "f":
            formats[col] = lambda v, d=digits: _float(v, d)
    styler = _spaced(df.style.format(formats))
    return styler if index else styler.hide(axis="index")


def table_by(df, header: str, digits: int = 3, integers: Iterable[str] = (), percent: Iterable[str] = ()):
    """A wide table turned on its side, for a few rows with many measurements (per seed, per model):
    one column per row of `df`, headed by its `header` value, one row per other column; each value
    formatted as `table` formats its column (integers, percent, floats to `digits`, NaN as "-")."""
    integers, percent = set(integers), set(percent)

    def cell(v, col):
        if col in integers:
            return _integer(v)
        if col in percent:
            return _percent(v)
        return _float(v, digits) if isinstance(v, float) else str(v)

    rows = {col: [cell(v, col) for v in df[col]] for col in df.columns if col != header}
    out = pd.DataFrame(rows, index=pd.Index([str(v) for v in df[header]], name=header)).T
    return _spaced(out.style)


def _spaced(styler):
    """Room between the columns (a bare HTML table sets short numbers almost edge to edge)."""
    return styler.set_table_styles([{"selector": "th, td", "props": [("padding", "0.15em 0.7em")]}],
                                   overwrite=False)


def _integer(v) -> str:
    """A step or count: no decimals; NaN as "-", an infinite value (e.g. "no k qualified") as "inf"."""
    if _missing(v):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{int(round(v)):,}"


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _percent(v) -> str:
    return "-" if _missing(v) else f"{100 * v:.1f}%"


def _float(v: float, digits: int) -> str:
    """A measurement to `digits` decimals (scientific when tiny or huge); NaN as "-"."""
    if _missing(v):
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 10 ** -digits):
        return f"{v:.{digits}g}"
    if float(v).is_integer() and abs(v) >= 100:
        return f"{int(v):,}"
    return f"{v:.{digits}f}"


def show_code(*functions):
    """The source of library functions as a code block: a page shows the code that ran, never a copy of it."""
    import inspect

    from IPython.display import Code

    return Code("\n\n".join(inspect.getsource(f).rstrip() for f in functions), language="python")
