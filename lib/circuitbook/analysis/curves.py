"""Reading training curves and sweeps: crossings, steepest rises, thresholds, power laws.

Every rule here is a documented function of the curve, so a step the book quotes is detected,
never typed in. Curves are (steps, values) pairs; steps need not be evenly spaced (a released
run's checkpoints often are not) and are sorted before use. Between evaluations a curve is read
by linear interpolation.
"""
from __future__ import annotations

import math
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


def binomial_rise_tolerance(n: float, z: float = 2.0) -> float:
    """The sampling error of a rise of an accuracy measured on n probe sequences per evaluation: z standard
    errors of the difference of two independent binomial proportions at p = 1/2 (the largest variance),
    z * sqrt(2 * 0.25 / n). Two windows whose rises differ by less cannot be told apart by the probes: a
    different draw of them could order the two the other way. 0 for n = inf (an exact measure)."""
    if not n > 0:
        raise ValueError(f"the probe count must be > 0, got {n!r}")
    return float(z * math.sqrt(0.5 / n))


def binomial_interval(p: float, n: float, z: float = 2.0) -> tuple[float, float]:
    """The Wilson score interval (z standard errors) of an accuracy p measured on n sequences: where another
    draw of n sequences could put it. It holds p, and stays inside [0, 1] (also at p = 0 or 1)."""
    if not n > 0:
        raise ValueError(f"the probe count must be > 0, got {n!r}")
    if math.isnan(p):
        return float("nan"), float("nan")
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(min(p, max(0.0, centre - half))), float(max(p, min(1.0, centre + half)))


def _window_rises(x, y, window: float, after: float | None):
    starts = x[(x + window <= x[-1] + 1e-9) & (x >= (after if after is not None else -np.inf))]
    return starts, np.interp(starts + window, x, y) - np.interp(starts, x, y)


def steepest_region(steps, values, window: float, after: float | None = None,
                    tolerance: float = 0.0) -> tuple[float, float, float]:
    """(first, last, rise): the steepest region of the curve. `rise` is the largest rise over `window` steps
    among windows that start at an evaluation step t >= after; the region is the run of consecutive window
    starts [first, last] around the best one whose rises are within `tolerance` of it (the windows the
    measure's sampling error cannot tell from the steepest: `binomial_rise_tolerance`); it spans the steps
    [first, last + window]. (NaN, NaN, NaN) if no window fits inside the curve."""
    if not window > 0:
        raise ValueError(f"window must be > 0, got {window!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    x, y = _curve(steps, values)
    starts, rise = _window_rises(x, y, window, after)
    if len(starts) == 0:
        return float("nan"), float("nan"), float("nan")
    best = int(np.argmax(rise))
    # exact ties of a step function must tie whatever the float rounding of the interpolation
    near = rise >= rise[best] - tolerance - 1e-12 * max(1.0, abs(rise[best]))
    lo, hi = best, best
    while lo > 0 and near[lo - 1]:
        lo -= 1
    while hi < len(near) - 1 and near[hi + 1]:
        hi += 1
    return float(starts[lo]), float(starts[hi]), float(rise[best])


def steepest_rise(steps, values, window: float, after: float | None = None,
                  tolerance: float = 0.0) -> tuple[float, float]:
    """(step, rise): where the curve rises most, the event's step and its steepest window's rise.

    The steepest region (`steepest_region`: the windows of `window` steps starting at t >= after whose
    rise is within `tolerance` of the largest) says where the event is; its step is where the curve rises
    within that region: among the rises between two consecutive evaluations inside the region's span
    [first, last + window], those within `tolerance` of the largest, and the middle of the span from the
    first of them to the last. So a jump shorter than the window, which every window around it contains,
    is placed at the jump itself, whichever of those windows a draw of the probes makes the steepest; a
    gradual rise, whose single-evaluation rises tie within the noise, at its middle. `rise` is the
    steepest window's rise. (NaN, NaN) if no window fits inside the curve.
    """
    first, last, rise = steepest_region(steps, values, window, after, tolerance)
    if math.isnan(rise):
        return float("nan"), float("nan")
    x, y = _curve(steps, values)
    inside = np.nonzero((x >= first - 1e-9) & (x <= last + window + 1e-9))[0]
    if len(inside) < 2:  # the window lies between two evaluations: its middle is all the curve says
        return float(first + window / 2), rise
    single = np.diff(y[inside])
    near = np.nonzero(single >= single.max() - tolerance - 1e-12 * max(1.0, abs(single.max())))[0]
    lo, hi = inside[near[0]], inside[near[-1]] + 1
    return float((x[lo] + x[hi]) / 2), rise


def stage_half_way_step(steps, values, event: float, after: float | None = None, tolerance: float = 0.0,
                        pause: float | None = None, min_share: float = 0.25) -> float:
    """The step of `stage_half_way` (below)."""
    return stage_half_way(steps, values, event, after, tolerance, pause, min_share)[0]


def stage_half_way(steps, values, event: float, after: float | None = None, tolerance: float = 0.0,
                   pause: float | None = None, min_share: float = 0.25) -> tuple[float, float, float]:
    """The half-way step of the stage of a measure's rise that holds `event` (a step), for a measure that
    rises in stages (e.g. one share that rises first with one head and then with another).

    Stages are separated by pauses: a stretch of `pause` steps over which the measure changes by at most
    `tolerance` (its sampling error; 0 for an exact measure, which then has no pause and one stage). The
    stage holding the event runs from the last evaluation at or before it that ends a pause (else the first
    step >= after) to the first evaluation at or after it that starts one (else the last step); its half-way
    step is where the measure crosses the middle of its values at the two ends (interpolated). When that
    stage carries less than `min_share` of the measure's change after `after` (its largest value minus its
    first), the measure does not rise at the event, and the half-way step of its whole change after
    `after` is returned instead (`half_way_step`): a measure that rose elsewhere is timed where it rose.
    pause defaults to two evaluation intervals (the median spacing).

    Returns (step, lo, hi): [lo, hi] is the sampling interval of the step, where the measure crosses the
    middle minus and plus its sampling error (tolerance / 2: the middle is a mean of two evaluations, and
    `tolerance` is the error of their difference); lo = hi = step for an exact measure.
    """
    x, y = _curve(steps, values)
    keep = x >= after if after is not None else np.ones(len(x), bool)
    x, y = x[keep], y[keep]
    nan = (float("nan"),) * 3
    if len(x) < 2 or math.isnan(event):
        return nan
    pause = 2 * float(np.median(np.diff(x))) if pause is None else float(pause)
    flat_before = [(t - pause >= x[0]) and abs(np.interp(t, x, y) - np.interp(t - pause, x, y)) <= tolerance
                   for t in x]
    flat_after = [(t + pause <= x[-1]) and abs(np.interp(t + pause, x, y) - np.interp(t, x, y)) <= tolerance
                  for t in x]
    starts = [i for i in range(len(x)) if x[i] <= event and flat_before[i]]
    ends = [i for i in range(len(x)) if x[i] >= event and flat_after[i]]
    i0, i1 = (starts[-1] if starts else 0), (ends[0] if ends else len(x) - 1)
    total = float(y.max() - y[0])
    if not y[i1] - y[i0] >= min_share * total or not total > 0:  # no stage at the event: the whole change
        if not y[-1] > y[0]:
            return nan
        i0, i1 = 0, len(x) - 1
    xs, ys, middle = x[i0:i1 + 1], y[i0:i1 + 1], (y[i0] + y[i1]) / 2
    step = crossing_step(xs, ys, middle)
    lo, hi = crossing_step(xs, ys, middle - tolerance / 2), crossing_step(xs, ys, middle + tolerance / 2)
    return step, float(np.fmin(lo, step)), float(np.fmax(hi, step))


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
