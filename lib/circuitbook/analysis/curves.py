"""Reading training curves and sweeps: crossings, steepest rises, thresholds, power laws.

Every rule here is a documented function of the curve, so a step the book quotes is detected,
never typed in. Curves are (steps, values) pairs; steps need not be evenly spaced (a released
run's checkpoints often are not) and are sorted before use. Between evaluations a curve is read
by linear interpolation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _curve(steps, values) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(steps, float), np.asarray(values, float)
    if x.ndim != 1 or x.shape != y.shape or len(x) == 0:
        raise ValueError(f"steps and values must be 1-D and of the same non-zero length; got shapes "
                         f"{x.shape} and {y.shape}")
    order = np.argsort(x, kind="stable")
    return x[order], y[order]


def crossing_step(steps, values, level: float, interpolate: bool = True) -> float:
    """First step at which the curve reaches `level` (the first step itself if it already does; NaN
    if never). interpolate=True reads it between the two evaluations around the crossing (linearly);
    interpolate=False gives the first evaluated step at or above `level` (a time "by step t"
    as a paper that reads its logged evaluations states it, e.g. grokking's tau_mem and tau_grok)."""
    x, y = _curve(steps, values)
    above = np.nonzero(y >= level)[0]
    if len(above) == 0:
        return float("nan")
    i = above[0]
    if i == 0 or not interpolate:
        return float(x[i])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return float(x0 + (level - y0) / (y1 - y0) * (x1 - x0))


def member_crossings(metrics, column: str, level: float, interpolate: bool = True):
    """Per member of a run's metrics (one row per step and member): `crossing_step` of `column`,
    a pandas Series indexed by member."""
    import pandas as pd

    return pd.Series({member: crossing_step(g["step"], g[column], level, interpolate)
                      for member, g in metrics.groupby("member")}, name=column, dtype=float)


def half_way_step(steps, values) -> float:
    """First step at which the curve has covered half of its change from its first value to its last
    (interpolated); NaN for a curve that does not end above where it starts. Where a measure rises
    once but fluctuates before it does, this is steadier than the steepest rise, which a swing of the
    noise can win."""
    x, y = _curve(steps, values)
    if not y[-1] > y[0]:
        return float("nan")
    return crossing_step(x, y, y[0] + 0.5 * (y[-1] - y[0]))


def value_at(steps, values, step: float) -> float:
    """The curve's value at `step` (linear interpolation; NaN for a NaN step)."""
    if np.isnan(step):
        return float("nan")
    x, y = _curve(steps, values)
    return float(np.interp(step, x, y))


def steepest_rise(steps, values, window: float, after: float | None = None) -> tuple[float, float]:
    """(step, rise): the window of `window` steps over which the curve rises most.

    For each evaluation step t (with t >= after, if given) the rise is v(t + window) - v(t) on the
    interpolated curve; the returned step is the best window's centre t + window / 2 and rise its
    size. When consecutive windows tie (a jump shorter than the window lies inside each of
    them), t is the middle of the first run of tied starts, so the step is the jump's centre.
    (NaN, NaN) if no window fits inside the curve.
    """
    if not window > 0:
        raise ValueError(f"window must be > 0, got {window!r}")
    x, y = _curve(steps, values)
    starts = x[(x + window <= x[-1] + 1e-9) & (x >= (after if after is not None else -np.inf))]
    if len(starts) == 0:
        return float("nan"), float("nan")
    rise = np.interp(starts + window, x, y) - np.interp(starts, x, y)
    best = float(rise.max())
    tied = rise >= best - 1e-9 * max(1.0, abs(best))
    first = int(np.argmax(tied))
    last = first + int(np.argmin(np.append(tied[first:], False))) - 1  # end of the first run of ties
    return float((starts[first] + starts[last]) / 2 + window / 2), best


def threshold(values, accuracies, level: float = 0.9) -> float:
    """The smallest sweep value from which the mean accuracy (over seeds) stays at or above `level`.

    Values are grouped (seeds averaged) and sorted. The threshold lies between the last value whose
    mean is below the level and the next one, interpolated linearly; it is the smallest value if
    every mean reaches the level, NaN if the largest value's mean does not. So a lucky member
    below the real threshold does not count: every larger value must generalize too.
    """
    x, y = np.asarray(values, float), np.asarray(accuracies, float)
    if x.shape != y.shape or x.ndim != 1 or len(x) == 0:
        raise ValueError(f"values and accuracies must be 1-D and of the same non-zero length; got shapes "
                         f"{x.shape} and {y.shape}")
    grid = np.unique(x)
    mean = np.array([y[x == v].mean() for v in grid])
    below = np.nonzero(mean < level)[0]
    if len(below) == 0:
        return float(grid[0])
    i = below[-1]
    if i == len(grid) - 1:
        return float("nan")
    x0, x1, y0, y1 = grid[i], grid[i + 1], mean[i], mean[i + 1]
    return float(x0 + (level - y0) / (y1 - y0) * (x1 - x0))


# --------------------------------------------------------------------------- power laws
@dataclass(frozen=True)
class PowerLawFit:
    """log y = log c + exponent * log x (ordinary least squares on the logs).

    ci: the t-based confidence interval of the exponent (level `level`); boot_ci: the percentile
    bootstrap interval from resampling the points.
    """

    exponent: float
    prefactor: float
    ci: tuple[float, float]
    boot_ci: tuple[float, float]
    r2: float
    n: int
    level: float

    def contains(self, value: float) -> bool:
        return self.ci[0] <= value <= self.ci[1]


def fit_power_law(x, y, level: float = 0.95, n_boot: int = 2000, seed: int = 0, min_points: int = 3) -> PowerLawFit:
    """Fit y = c x^exponent on positive, finite points (others are dropped): a delay law, an emergence step
    against a size. Needs `min_points` points (at least 2) at >= 2 distinct x; with 2, the t-interval is NaN."""
    from scipy import stats

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log(x[ok]), np.log(y[ok])
    n = int(ok.sum())
    if n < max(2, min_points) or np.unique(lx).size < 2:
        raise ValueError(f"need at least {max(2, min_points)} positive points at >= 2 distinct x to fit a power law; "
                         f"got {n} at {np.unique(lx).size} distinct x")
    res = stats.linregress(lx, ly)
    tcrit = stats.t.ppf(0.5 + level / 2, n - 2) if n > 2 else float("nan")
    ci = (res.slope - tcrit * res.stderr, res.slope + tcrit * res.stderr)
    rng = np.random.default_rng(seed)
    slopes = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        if np.unique(lx[idx]).size < 2:
            continue
        slopes.append(np.polyfit(lx[idx], ly[idx], 1)[0])
    lo, hi = np.percentile(slopes, [50 * (1 - level), 50 * (1 + level)]) if slopes else (float("nan"),) * 2
    return PowerLawFit(exponent=float(res.slope), prefactor=float(np.exp(res.intercept)), ci=(float(ci[0]), float(ci[1])),
                       boot_ci=(float(lo), float(hi)), r2=float(res.rvalue ** 2), n=n, level=level)


def fit_power_law_or_none(x, y, n_boot: int = 2000, min_points: int = 3) -> PowerLawFit | None:
    """`fit_power_law`, or None where too few points are finite and positive to fit (e.g. too few
    members grokked or an emergence was never reached)."""
    try:
        return fit_power_law(x, y, n_boot=n_boot, min_points=min_points)
    except ValueError:
        return None


def pick_steps(steps: Sequence[int], n: int) -> list[int]:
    """At most n of the given steps, evenly spread over their index (first and last always kept)."""
    steps = sorted(set(int(s) for s in steps))
    if len(steps) <= n:
        return steps
    return sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, n)})


def settled_from(steps, holds) -> float:
    """The first step from which `holds` (a boolean per step) stays true to the last step: when a quantity
    settled for good. NaN if it does not hold at the last step."""
    x, y = _curve(steps, np.asarray(holds, dtype=float))
    if len(x) == 0 or y[-1] < 0.5:
        return float("nan")
    failing = np.nonzero(y < 0.5)[0]
    return float(x[failing[-1] + 1]) if len(failing) else float(x[0])
