"""The chapter's measurements: pure functions of tasks, models, runs and their metrics.

Tasks and symmetries (01)       `pvalue_table`, `power_curve`
The manifold, IM-1 (02)         `gradient_grid`, `broken_assumptions`, `monte_carlo_outside`
Two layers, IM-2..IM-4 (03)     `loss_gap`, `share_outside_directions`, `scaling_table`, `icl_gradient`,
                                `learned_delta`, `type_gradients`, `suppression_law`, `trajectory_points`,
                                `per_direction_errors`, `emergence_table`, `burstiness_table`,
                                `burstiness_at_points`, `per_direction_r2`
Initialisation, IM-5 (04)       `three_layer_directions`, `CIRCUITS`, `winners`, `own_sizes`, `nested_fits`,
                                `point_outcomes`, `boundary_sharpness`
Circuit detection, IM-6 (05)    `backward_elimination`, `aiding_split`, `finds_two_hop_circuit`, `random_chain_rate`
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from ...analysis import imir
from ...analysis.curves import member_crossings
from ...analysis.fits import logistic_fit, paired_gap, proportional_fit
from ...models.imir import IMIRConfig, IMIRModel
from ...tasks.base import Batch, derive_seed
from ...tasks.blocklist import BlockListTask, rejection_rate, symmetry_test
from ...training import Run, default_device
from .evaluate import CoordinateEvaluator, recall_task


# =============================================================================== 01 tasks and symmetries

def pvalue_table(cases: Mapping[str, tuple[BlockListTask, str]], n: int, reps: int, first_seed: int = 0) -> pd.DataFrame:
    """p-values of `reps` symmetry tests for each named (task, transform): the combined p-value and,
    in columns p_<feature>, the p-value of every feature's chi-square test."""
    rows = []
    for name, (task, transform) in cases.items():
        for r in range(reps):
            res = symmetry_test(task, transform, n, first_seed + r)
            rows.append({"case": name, "rep": r, "p_value": res["p_value"],
                         **{f"p_{f}": p for f, p in res["feature_p_values"].items()}})
    return pd.DataFrame(rows)


def power_curve(cases: Mapping[str, tuple[BlockListTask, str]], ns: Sequence[int], reps: int,
                alpha: float) -> pd.DataFrame:
    rows = []
    for name, (task, transform) in cases.items():
        for n in ns:
            rows.append({"case": name, "n": n, "rejection_rate": rejection_rate(task, transform, n, reps, alpha)})
    return pd.DataFrame(rows)



# =============================================================================== 02 the manifold (IM-1)

def _grad_outside(model, basis, task, grads=None) -> dict:
    g = grads if grads is not None else imir.expected_gradient(model, task)
    out = basis.outside(g, g.keys())
    return {"outside": out["relative"], "grad_norm": out["total"]}


def gradient_grid(task: BlockListTask, n_layers: int, n_points: int, scale: float, first_seed: int = 0) -> pd.DataFrame:
    """IM-1 numerically: the exact expected gradient at `n_points` random points of S."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    rows = []
    for i in range(n_points):
        seed = first_seed + i
        model = imir.theory_model(layout, n_layers, 1, coords=basis.random_point(seed, scale))
        rows.append({"layers": n_layers, "point": i, **_grad_outside(model, basis, task)})
    return pd.DataFrame(rows)


def broken_assumptions(task: BlockListTask, n_layers: int, scale: float, seed: int = 0,
                       zipf: float = 1.0) -> pd.DataFrame:
    """The exact expected gradient at one point of S when one assumption of Theorem 1 is broken."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    theta = basis.random_point(seed, scale)
    intact = imir.theory_model(layout, n_layers, 1, coords=theta)
    cases = {
        "none (all assumptions hold)": (intact, task),
        "trained value-output maps": (imir.theory_model(layout, n_layers, 1, coords=theta, trained_value_maps=True), task),
        "non-orthonormal embeddings": (imir.theory_model(layout, n_layers, 1, coords=theta,
                                                         token_embedding="gaussian"), task),
        f"token symmetry broken (zipf {zipf:g})": (intact, task.with_knobs(zipf=zipf)),
        "absolute positions (no random offset)": (intact, task.with_knobs(offsets="fixed")),
    }
    rows = [{"layers": n_layers, "broken assumption": name, **_grad_outside(m, basis, t)} for name, (m, t) in cases.items()]
    return pd.DataFrame(rows)


def monte_carlo_outside(task: BlockListTask, n_layers: int, ns: Sequence[int], scale: float, seed: int = 0,
                        reps: int = 3) -> pd.DataFrame:
    """The gradient's part outside S when the expectation is a mean over n sampled sequences."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    model = imir.theory_model(layout, n_layers, 1, coords=basis.random_point(seed, scale))
    rows = []
    for n in ns:
        for r in range(reps):
            g = imir.sampled_gradient(model, task, int(n), seed=1000 * r + int(n))
            rows.append({"layers": n_layers, "n": int(n), "rep": r, **_grad_outside(model, basis, task, g)})
    return pd.DataFrame(rows)



# =============================================================================== 03 two layers (IM-2, IM-3, IM-4)

def loss_gap(restricted: Run, unrestricted: Run, column: str = "loss_task", scale: float | None = None) -> pd.DataFrame:
    """Per seed: the largest |loss_restricted - loss_unrestricted| over the evaluated steps, divided by
    `scale` (default: the loss at step 0, log V at zero init)."""
    a = restricted.metrics().set_index(["seed", "step"])[column]
    b = unrestricted.metrics().set_index(["seed", "step"])[column]
    both = pd.concat({"r": a, "u": b}, axis=1).dropna()
    rows = []
    for seed, g in both.groupby(level="seed"):
        ref = scale if scale is not None else float(g["u"].iloc[0])
        rows.append({"seed": seed, "max_gap": float((g["r"] - g["u"]).abs().max() / ref),
                     "final_restricted": float(g["r"].iloc[-1]), "final_unrestricted": float(g["u"].iloc[-1])})
    return pd.DataFrame(rows)


WEIGHT_NAMES_2 = ("blocks.0.attn.W_QK", "blocks.1.attn.W_QK", "unembed.W_U")


def _flat(weights: Mapping[str, torch.Tensor], names: Sequence[str] = WEIGHT_NAMES_2) -> torch.Tensor:
    return torch.cat([weights[n].detach().double().reshape(-1) for n in names])


def span_columns(basis: imir.IMIRBasis, directions: Mapping[str, Mapping[str, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inner, outer): flattened weights of the named directions and of every basis element of S
    (2-layer model), as columns for `analysis.subspace.share_outside`."""
    eye = torch.eye(basis.n_coords, dtype=torch.float64)
    outer = torch.stack([_flat(basis.weights(eye[i])) for i in range(basis.n_coords)], 1)
    inner = torch.stack([_flat(basis.weights(basis.direction_weights(d))) for d in directions.values()], 1)
    return inner, outer


def share_outside_directions(run: Run, task: BlockListTask, n_points: int, n_grad: int | None,
                             seed: int = 0) -> pd.DataFrame:
    """Along each member's trajectory of a run restricted to (alpha, beta, gamma, delta): the share of
    the in-S part of the expected gradient that lies outside the span of the four directions.

    At `n_points` evaluated steps spread over the run the weights are rebuilt from the logged unit
    coordinates, and the gradient of the unrestricted theory model there is estimated twice from
    n_grad fresh sequences each; `analysis.subspace.share_outside` combines the two estimates so
    that sampling noise does not inflate the share (n_grad None: the exact expected gradient of a
    small task's enumerated distribution, used twice)."""
    from ...analysis import subspace

    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    inner, outer = span_columns(basis, dirs)
    metrics = run.metrics()
    rows = []
    for member, g in metrics.groupby("member"):
        g = g.sort_values("step").reset_index(drop=True)
        picks = sorted(set(np.linspace(0, len(g) - 1, min(n_points, len(g))).round().astype(int)))
        for i in picks:
            r = g.iloc[i]
            theta = sum(float(r[d]) * basis.direction_weights(v) / basis.direction_norm(v) for d, v in dirs.items())
            model = imir.theory_model(layout, 2, 1, coords=theta)
            if n_grad is None:
                a = b = _flat(imir.expected_gradient(model, task))
            else:
                a, b = (_flat(imir.sampled_gradient(model, task, n_grad, seed=derive_seed("share", seed, int(r.step), h)))
                        for h in (0, 1))
            out = subspace.share_outside(a, b, inner, outer)
            rows.append({"member": int(member), "seed": int(r.seed), "step": int(r.step), "acc_icl": float(r.acc_icl),
                         **{d: float(r[d]) for d in dirs}, **out})
    return pd.DataFrame(rows)


def scaling_table(runs: Mapping[int, Run], thresholds: Mapping[str, float]) -> pd.DataFrame:
    """Emergence step of each direction (first crossing of its threshold) and of in-context accuracy."""
    rows = []
    for n, run in runs.items():
        m = run.metrics()
        cross = {col: member_crossings(m, col, thr) for col, thr in thresholds.items()}
        for member, seed in enumerate(run.train_config.seeds):
            rows.append({"N": n, "seed": seed, **{f"T_{col}": float(cross[col].get(member, np.nan)) for col in cross}})
    return pd.DataFrame(rows)



# -------------------------------------------------------------------- the in-context gradient

def icl_gradient(model: IMIRModel, task: BlockListTask, n: int, seed: int,
                 icl: Sequence[str] = ("alpha", "beta", "gamma"), loss: str = "ce") -> float:
    """Norm of the loss gradient on the unit in-context directions, a mean over n sampled sequences
    (the same sequences for every call with the same seed: ratios cancel most sampling noise)."""
    names = model.direction_names
    for d in icl:
        if d not in names:
            raise ValueError(f"icl_gradient: direction {d!r} is not one of the model's {names}")
    g = imir.sampled_gradient(model, task, n, seed, loss=loss, device=default_device())["phi"]
    idx = [names.index(d) for d in icl]
    return float(g[idx].norm())


def with_direction(model: IMIRModel, name: str, value: float) -> IMIRModel:
    """A copy of an IMIRModel with one direction's phi set to `value`."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        m.phi[m.direction_names.index(name)] = value
    return m


def learned_delta(model: IMIRModel, task: BlockListTask, loss: str, p_target: float = 0.99,
                  n: int = 256) -> float:
    """The premise of Theorem 2, 'delta has learned C': the delta (unit direction) at which the
    in-weights circuit alone answers canonical common queries. mse: the least-squares delta
    (the output equals the partner's embedding); ce: the delta at which it gives the partner
    probability p_target (cross-entropy has no finite optimum there)."""
    probe = with_direction(model, "delta", 1.0).double()
    with torch.no_grad():
        probe.phi.zero_()
        probe.phi[probe.direction_names.index("delta")] = 1.0
        s = task.with_knobs(f_r=0.0, f_v=0.0).sample(n, 0)
        logits = probe(task.model_inputs(s), last_only=True)[:, -1]  # linear in delta
    if loss == "mse":
        target = imir.label_targets(imir.Layout.from_task(task), s.targets)
        return float((logits * target).sum() / logits.pow(2).sum())
    if loss != "ce":
        raise ValueError(f"learned_delta: loss={loss!r}; expected 'ce' or 'mse'")
    p = lambda d: float((d * logits).softmax(-1).gather(-1, s.targets[:, None]).mean())
    lo, hi = 0.0, 1.0
    while p(hi) < p_target:
        hi *= 2
        if hi > 1e6:
            raise ValueError(f"learned_delta: p_target={p_target} is not reachable")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p(mid) < p_target else (lo, mid)
    return hi


def theory_factor(f_r, f_v):
    """Theorem 2's suppression factor f_r + (1 - f_r) f_v."""
    return np.asarray(f_r) + (1 - np.asarray(f_r)) * np.asarray(f_v)


def calibrated_factor(f_r, f_v):
    """The factor when delta is at its cross-entropy optimum (P(C q) = 1 - f_v) rather than saturated:
    canonical queries still push with weight f_v, so f_r + (1 - f_r) f_v (2 - f_v)."""
    f_r, f_v = np.asarray(f_r), np.asarray(f_v)
    return f_r + (1 - f_r) * f_v * (2 - f_v)


QUERY_TYPES = {"rare": (1.0, 0.0), "canonical": (0.0, 0.0), "non-canonical": (0.0, 1.0)}  # (f_r, f_v) of each


def type_weights(f_r: float, f_v: float) -> dict[str, float]:
    """Probability of each kind of queried chain under (f_r, f_v)."""
    return {"rare": f_r, "canonical": (1 - f_r) * (1 - f_v), "non-canonical": (1 - f_r) * f_v}


def icl_gradient_vector(model: IMIRModel, task: BlockListTask, n: int, seed: int, loss: str,
                        icl: Sequence[str] = ("alpha", "beta", "gamma")) -> torch.Tensor:
    """The mean loss gradient on the unit in-context directions over n sampled sequences."""
    g = imir.sampled_gradient(model, task, n, seed, loss=loss, device=default_device())["phi"]
    return g[[model.direction_names.index(d) for d in icl]]


ICL_DIRECTIONS = ("alpha", "beta", "gamma")


def with_point(model: IMIRModel, point: Mapping[str, float] | None) -> IMIRModel:
    """A copy of a restricted model with its in-context directions at `point` ({alpha, beta, gamma};
    None: zero, the start of training). delta is left as it is."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        for name in ICL_DIRECTIONS:
            m.phi[m.direction_names.index(name)] = 0.0 if point is None else float(point[name])
    return m


def type_gradients(n_pairs: int, n_rare: int, n_blocks: int, n_grad: int, seed: int, loss: str,
                   p_learned: float = 0.99, point: Mapping[str, float] | None = None) -> tuple[dict, float]:
    """The in-context gradient of the 2-layer model at alpha = beta = gamma = 0 (or at `point`), for each
    kind of queried chain alone (rare, canonical, non-canonical), with delta = 0 and with delta learned
    (`learned_delta`): {(kind, 'delta = 0' | 'delta learned'): gradient vector on (alpha, beta, gamma)},
    and the learned delta.

    The expected gradient of any mixture (f_r, f_v) is the mixture of these with the exact weights
    (`type_weights`): sampling each kind separately removes the noise of a sample's random mix of kinds.
    At zero weights only gamma receives gradient; at a point with alpha, beta, gamma non-zero every
    in-context direction does.
    """
    base = recall_task(n_pairs, n_blocks, f_v=0.0, f_r=0.0, n_rare=n_rare)
    layout = imir.Layout.from_task(base)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    model = IMIRConfig.with_directions(layout, imir.two_layer_directions(basis)).build(0).double()
    d = learned_delta(model, base, loss, p_learned)
    model = with_point(model, point)
    out = {}
    for kind, (fr, fv) in QUERY_TYPES.items():
        task = base.with_knobs(f_r=fr, f_v=fv)
        out[(kind, "delta = 0")] = icl_gradient_vector(model, task, n_grad, seed, loss)
        out[(kind, "delta learned")] = icl_gradient_vector(with_direction(model, "delta", d), task, n_grad, seed, loss)
    return out, d


def suppression_law(grid: Sequence[tuple[float, float]], seeds: Sequence[int], n_pairs: int, n_rare: int,
                    n_blocks: int, n_grad: int, loss: str, p_learned: float = 0.99,
                    points: Sequence[Mapping[str, float] | None] = (None,)) -> pd.DataFrame:
    """Theorem 2: for each in-context point (None: zero weights, the start of in-context learning), each
    (f_r, f_v) and sample seed, the expected in-context gradient with delta learned over the same with
    delta = 0 (no in-weights circuit), each expectation the exact mixture of the per-kind gradients of
    `type_gradients`: the ratio of the norms ('measured') and, per direction d, the ratio of the
    components ('measured_<d>'; NaN where the component is exactly zero, as alpha's and beta's are at
    zero weights)."""
    rows = []
    for p, point in enumerate(points):
        at = {name: 0.0 if point is None else float(point[name]) for name in ICL_DIRECTIONS}
        for seed in seeds:
            per_kind, d = type_gradients(n_pairs, n_rare, n_blocks, n_grad, seed, loss, p_learned, point)
            for fr, fv in grid:
                w = type_weights(fr, fv)
                g = {state: sum(w[k] * per_kind[(k, state)] for k in QUERY_TYPES)
                     for state in ("delta = 0", "delta learned")}
                per_direction = {f"measured_{name}": float(g["delta learned"][i] / g["delta = 0"][i])
                                 if g["delta = 0"][i] != 0 else float("nan") for i, name in enumerate(ICL_DIRECTIONS)}
                rows.append({"point": p, **{f"at_{k}": v for k, v in at.items()}, "f_r": fr, "f_v": fv, "seed": seed,
                             "loss": loss, "theory": float(theory_factor(fr, fv)),
                             "measured": float(g["delta learned"].norm() / g["delta = 0"].norm()),
                             **per_direction, "delta_learned": d})
    return pd.DataFrame(rows)


def trajectory_points(metrics: pd.DataFrame, member: int, fractions: Sequence[float], until: float | None = None,
                      nonzero: Sequence[str] = ("alpha", "beta")) -> list[dict]:
    """The logged (step, alpha, beta, gamma, delta) of one member at the evaluations nearest to
    fraction * until for each fraction (until: a step such as the emergence step; None or NaN: the
    last evaluated step), each step once, leaving out points where a direction of `nonzero` is still
    exactly zero (the start of training)."""
    g = metrics[metrics["member"] == member].sort_values("step")
    if g.empty:
        raise ValueError(f"trajectory_points: no metrics for member {member}")
    end = float(g["step"].max()) if until is None or not np.isfinite(until) else float(until)
    out, seen = [], set()
    for f in fractions:
        r = g.iloc[int(np.abs(g["step"].to_numpy() - f * end).argmin())]
        if int(r["step"]) in seen or any(float(r[d]) == 0 for d in nonzero):
            continue
        seen.add(int(r["step"]))
        out.append({"step": int(r["step"]), **{d: float(r[d]) for d in (*ICL_DIRECTIONS, "delta")}})
    return out


def per_direction_errors(law: pd.DataFrame) -> pd.DataFrame:
    """Per seed and in-context direction: the median and the largest |measured_d / theory - 1| over
    the grid and the points of a `suppression_law` frame (rows where the component is zero left out)."""
    rows = []
    for seed, g in law.groupby("seed"):
        for d in ICL_DIRECTIONS:
            err = relative_error(g[f"measured_{d}"], g["theory"])
            err = err[np.isfinite(err)]
            rows.append({"seed": seed, "direction": d, "median": float(np.median(err)) if len(err) else float("nan"),
                         "max": float(err.max()) if len(err) else float("nan")})
    return pd.DataFrame(rows)


def relative_error(measured, theory) -> np.ndarray:
    return np.abs(np.asarray(measured, float) / np.asarray(theory, float) - 1)


def emergence_table(run: Run, members: Sequence[tuple], columns: Sequence[str], column: str,
                    threshold: float) -> pd.DataFrame:
    """Per member of a sweep: its grid point (named by `columns`), seed and the step at which
    `column` first reaches `threshold`."""
    cross = member_crossings(run.metrics(), column, threshold)
    return pd.DataFrame([{**dict(zip(columns, point)), "seed": seed, "emergence_step": float(cross.get(k, np.nan))}
                         for k, (point, seed, _) in enumerate(members)])


def burstiness_table(run: Run, members: Sequence[tuple], n_pairs: int, n_blocks: int, n_grad: int,
                     acc_threshold: float, f_v: float = 1.0, loss: str = "ce") -> pd.DataFrame:
    """Per member: the in-context gradient at step 0 (zero init; only gamma moves there) and the step at
    which in-context accuracy (b = 1 pool) reaches acc_threshold."""
    metrics = run.metrics()
    cross = member_crossings(metrics, "acc_icl", acc_threshold)
    rows = []
    for k, ((b,), seed, _) in enumerate(members):
        task = recall_task(n_pairs, n_blocks, f_v=f_v, burstiness=b)
        model = run.model(k, 0).double()
        rows.append({"b": b, "seed": seed, "icl_gradient": icl_gradient(model, task, n_grad, seed=k, loss=loss),
                     "emergence_step": float(cross.get(k, np.nan))})
    return pd.DataFrame(rows)


def burstiness_at_points(run: Run, members: Sequence[tuple], table: pd.DataFrame, n_pairs: int, n_blocks: int,
                         n_grad: int, fractions: Sequence[float], f_v: float = 1.0, loss: str = "ce",
                         nonzero: Sequence[str] = ("alpha", "beta")) -> pd.DataFrame:
    """Theorem 3 beyond zero weights: per seed, points of the trajectory of its smallest-b member (at
    `fractions` of that member's emergence step, `table` from `burstiness_table`; of its last step if
    it never emerged; `trajectory_points`, which leaves out points where `nonzero` directions are
    zero), and at each point the in-context gradient on alpha, beta and gamma for every b (the same
    weights for every b; the same sample seed per b as at step 0)."""
    metrics = run.metrics()
    lowest = min(b for (b,), _, _ in members)
    rows = []
    for seed in sorted({s for _, s, _ in members}):
        k0 = next(k for k, ((b,), s, _) in enumerate(members) if b == lowest and s == seed)
        until = table.loc[(table.b == lowest) & (table.seed == seed), "emergence_step"].iloc[0]
        model = run.model(k0, 0).double()
        for p, point in enumerate(trajectory_points(metrics, k0, fractions, until, nonzero)):
            at = with_direction(with_point(model, point), "delta", point["delta"])
            for k, ((b,), s, _) in enumerate(members):
                if s != seed:
                    continue
                task = recall_task(n_pairs, n_blocks, f_v=f_v, burstiness=b)
                g = icl_gradient_vector(at, task, n_grad, seed=k, loss=loss)
                rows.append({"seed": seed, "point": p, "step": point["step"],
                             **{f"at_{d}": point[d] for d in ICL_DIRECTIONS}, "b": b,
                             **{f"g_{d}": float(g[i]) for i, d in enumerate(ICL_DIRECTIONS)}})
    columns = ["seed", "point", "step", *(f"at_{d}" for d in ICL_DIRECTIONS), "b", *(f"g_{d}" for d in ICL_DIRECTIONS)]
    return pd.DataFrame(rows, columns=columns)


def per_direction_r2(points: pd.DataFrame) -> pd.DataFrame:
    """Per seed, point and in-context direction: R^2 of the line through the origin of the gradient
    component against b (`proportional_fit`) of a `burstiness_at_points` frame."""
    rows = []
    for (seed, p), g in points.groupby(["seed", "point"]):
        for d in ICL_DIRECTIONS:
            rows.append({"seed": seed, "point": p, "direction": d, "r2": proportional_fit(g["b"], g[f"g_{d}"])["r2"]})
    return pd.DataFrame(rows)



# =============================================================================== 04 initialisation picks the winner (IM-5)

def three_layer_directions(basis: imir.IMIRBasis, head: int = 0) -> dict[str, dict[str, float]]:
    """The directions of the three induction circuits a 3-layer, 1-head model can form:
    previous-token in layer a (alpha_a), match in layer b through the layer-a head (beta_ab),
    copy from the layer-b head (gamma_b)."""
    if basis.n_layers != 3:
        raise ValueError(f"three_layer_directions: the basis has {basis.n_layers} layers; expected 3")
    ids = ["I"] + (["I_rare"] if "I_rare" in basis.sel_names else [])
    h = head
    return {"alpha1": {f"L1H{h}|emb|emb|pos1": 1.0},
            "alpha2": {f"L2H{h}|emb|emb|pos1": 1.0},
            "beta12": {f"L2H{h}|emb|L1H{h}|{s}": 1.0 for s in ids},
            "beta13": {f"L3H{h}|emb|L1H{h}|{s}": 1.0 for s in ids},
            "beta23": {f"L3H{h}|emb|L2H{h}|{s}": 1.0 for s in ids},
            "gamma2": {f"U|L2H{h}|{s}": 1.0 for s in ids},
            "gamma3": {f"U|L3H{h}|{s}": 1.0 for s in ids}}


CIRCUITS = {"1->2": ("alpha1", "beta12", "gamma2"), "1->3": ("alpha1", "beta13", "gamma3"),
            "2->3": ("alpha2", "beta23", "gamma3")}


OTHER_DIRECTIONS = ("beta12", "beta13", "beta23", "gamma2", "gamma3")


CIRCUIT_DIRECTIONS = ("alpha1", "alpha2", *OTHER_DIRECTIONS)


def own_sizes(design: pd.DataFrame) -> pd.DataFrame:
    """log of each circuit's own initial size ||(alpha, beta, gamma)(0)||."""
    return pd.DataFrame({c: np.log(np.sqrt(sum(design[d] ** 2 for d in dirs))) for c, dirs in CIRCUITS.items()})


@torch.no_grad()
def circuit_accuracy(model: IMIRModel, pool: Batch, keep: Sequence[str]) -> float:
    """Accuracy with every direction outside `keep` set to zero (the model is left unchanged)."""
    saved = model.phi.detach().clone()
    for i, name in enumerate(model.direction_names):
        if name not in keep:
            model.phi[i] = 0.0
    pred = model(pool.tokens, last_only=True)[:, -1].argmax(-1)
    model.phi.copy_(saved)
    return float((pred == pool.labels).float().mean())


def winners(run: Run, min_acc: float) -> pd.DataFrame:
    """Per member: the circuit whose accuracy *alone* first reaches min_acc during training (the circuit that
    forms the induction head first); 'mixed' when two reach it at the same evaluation, 'none' when none does.
    Later the other circuits may grow too: cross-entropy keeps rewarding every working circuit."""
    m = run.metrics()
    cross = {c: member_crossings(m, f"solo_{c}", min_acc) for c in CIRCUITS}
    last = m[m.step == m.step.max()].set_index("member")
    rows = []
    for k in range(run.n_members):
        t = {c: float(cross[c].get(k, np.nan)) for c in CIRCUITS}
        done = sorted((v, c) for c, v in t.items() if not math.isnan(v))
        if not done:
            winner = "none"
        elif len(done) > 1 and done[1][0] == done[0][0]:
            winner = "mixed"
        else:
            winner = done[0][1]
        rows.append({"member_seed": run.train_config.seeds[k], "winner": winner,
                     **{f"step {c}": t[c] for c in CIRCUITS},
                     **{f"final solo {c}": float(last.loc[k, f"solo_{c}"]) for c in CIRCUITS}})
    return pd.DataFrame(rows)


def nested_fits(decided: pd.DataFrame, folds: int = 5, seed: int = 0) -> dict:
    """Two nested multinomial logistic fits of the winner (one class of model, the second with more
    features): on each circuit's own initial size (log ||(alpha, beta, gamma)(0)||, three features),
    and on those plus all seven initial coordinates. Folds keep the replicates of an initial point
    together. Returns both cross-validated accuracies and the gap with its standard error."""
    own = own_sizes(decided).to_numpy()
    coords = decided[list(CIRCUIT_DIRECTIONS)].to_numpy()
    labels, groups = list(decided["winner"]), decided["point"].to_numpy()
    a = logistic_fit(own, labels, folds, seed=seed, groups=groups)
    b = logistic_fit(np.hstack([own, coords]), labels, folds, seed=seed, groups=groups)
    gap = paired_gap(a["cv_correct"], b["cv_correct"], groups)
    return {"own_size_acc": a["cv_accuracy"], "nested_acc": b["cv_accuracy"], "gap": gap["gap"], "gap_se": gap["se"],
            "own_size_train_acc": a["train_accuracy"], "nested_train_acc": b["train_accuracy"]}


def point_outcomes(wins: pd.DataFrame) -> pd.DataFrame:
    """Per initial point of a replicated design: its slice and grid position, the winner when every
    replicate has the same single winner ('decided'), else 'undecided' (replicates disagree, or one is
    mixed or none)."""
    rows = []
    for point, g in wins.groupby("point"):
        w = set(g["winner"])
        single = len(w) == 1 and not w & {"mixed", "none"}
        rows.append({"point": point, "slice": int(g["slice"].iloc[0]), "alpha1": float(g["alpha1"].iloc[0]),
                     "alpha2": float(g["alpha2"].iloc[0]), "outcome": next(iter(w)) if single else "undecided",
                     "replicates_agree": len(w) == 1})
    return pd.DataFrame(rows)


def boundary_sharpness(points: pd.DataFrame) -> dict:
    """How sharp the phase boundaries are, on each slice's alpha1 x alpha2 grid: D / (D + U) with U the
    undecided points and D the decided points next to (4-neighbour) a point of another outcome. A
    boundary that falls between two neighbouring grid points, each decided, gives 1; a band of w
    undecided points across it gives about 2 / (2 + w). NaN when no slice has a boundary."""
    decided_at_boundary = undecided = 0
    for _, g in points.groupby("slice"):
        a1, a2 = sorted(g["alpha1"].unique()), sorted(g["alpha2"].unique())
        grid = {(a1.index(r.alpha1), a2.index(r.alpha2)): r.outcome for r in g.itertuples()}
        for (i, j), outcome in grid.items():
            if outcome == "undecided":
                undecided += 1
                continue
            near = [grid.get((i + di, j + dj)) for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1))]
            decided_at_boundary += any(n is not None and n != outcome for n in near)
    total = decided_at_boundary + undecided
    return {"sharpness": decided_at_boundary / total if total else float("nan"),
            "decided_at_boundary": decided_at_boundary, "undecided": undecided}



# =============================================================================== 05 automated circuit detection (IM-6)

def backward_elimination(evaluator: CoordinateEvaluator, theta: torch.Tensor, tau: float, screen: int = 16,
                         progress: Callable | None = None) -> dict:
    """Algorithm 1: repeatedly zero the coordinate whose removal raises held-out loss least; stop
    when the cheapest removal would take the loss more than `tau` above the full model's.

    Exact search over every coordinate is quadratic; candidates are screened first: the `screen`
    coordinates with the smallest first-order estimate |theta_k dL/dtheta_k| of their removal cost
    (plus every coordinate that is exactly zero) are evaluated exactly each round, and long runs of
    removals that keep the loss within budget are taken in chunks (doubling while they succeed,
    halving back to single removals when they do not). Returns the surviving mask, the elimination
    order and the loss along it.
    """
    theta = theta.double().clone()
    alive = theta != 0
    base_loss, base_acc = evaluator(theta)
    budget = base_loss + tau
    history = [{"removed": None, "n_alive": int(alive.sum()), "loss": base_loss, "acc": base_acc}]
    chunk = 1
    while alive.sum() > 0:
        current = theta * alive
        g = evaluator.gradient(current)
        cost = (current * g).abs() + 0.5 * current.pow(2)  # first-order estimate plus a small size term
        cost[~alive] = float("inf")
        order = torch.argsort(cost)
        n_alive = int(alive.sum())
        if chunk > 1:
            idx = order[:min(chunk, n_alive)]
            trial = alive.clone()
            trial[idx] = False
            loss, acc = evaluator(theta * trial)
            if loss <= budget:
                alive = trial
                history.append({"removed": [int(i) for i in idx], "n_alive": int(alive.sum()), "loss": loss, "acc": acc})
                chunk *= 2
                continue
            chunk = max(1, chunk // 4)
            continue
        best = None
        for i in order[:min(screen, n_alive)]:
            trial = alive.clone()
            trial[i] = False
            loss, acc = evaluator(theta * trial)
            if best is None or loss < best[1]:
                best = (int(i), loss, acc)
        if best is None or best[1] > budget:
            break
        alive[best[0]] = False
        history.append({"removed": [best[0]], "n_alive": int(alive.sum()), "loss": best[1], "acc": best[2]})
        chunk = 2
        if progress is not None:
            progress(int(alive.sum()))
    final_loss, final_acc = evaluator(theta * alive)
    return {"alive": alive, "theta": theta, "history": pd.DataFrame(history), "base_loss": base_loss,
            "base_acc": base_acc, "loss": final_loss, "acc": final_acc, "budget": budget}


def aiding_split(evaluator: CoordinateEvaluator, result: dict, names: Sequence[str]) -> dict:
    """Accuracy of the surviving circuit with and without its aiding directions: the key-query
    coordinates with negative values (they lower attention scores: suppress attention)."""
    alive, theta = result["alive"], result["theta"]
    aiding = torch.tensor([n.startswith("L") and float(t) < 0 for n, t in zip(names, theta)]) & alive
    with_loss, with_acc = evaluator(theta * alive)
    without_loss, without_acc = evaluator(theta * (alive & ~aiding))
    return {"acc_with": with_acc, "acc_without": without_acc, "loss_with": with_loss, "loss_without": without_loss,
            "n_aiding": int(aiding.sum()), "n_core": int((alive & ~aiding).sum())}


def finds_two_hop_circuit(names_alive: Sequence[str]) -> bool:
    """Does the set of surviving coordinates contain a complete 2-hop induction path?

    a previous-token coordinate (pos1) in some layer a, a first hop in a layer b > a matching the
    query's token (I) against a key path through layer a, a second hop in a layer c > b whose query
    path goes through layer b, matching (I) against a key path through a previous-token layer, and
    a readout copy (I) from a path ending in layer c.
    """
    def heads(path: str) -> list[int]:
        return [] if path == "emb" else [int(p[1:].split("H")[0]) for p in path.split(">")]

    prev = {int(n.split("|")[0][1:].split("H")[0]) for n in names_alive
            if n.startswith("L") and n.endswith("|pos1") and n.split("|")[1] == "emb" and n.split("|")[2] == "emb"}
    qk = [n.split("|") for n in names_alive if n.startswith("L") and n.split("|")[3] in ("I", "I_rare")]
    readout = [n.split("|") for n in names_alive if n.startswith("U|") and n.split("|")[2] in ("I", "I_rare")]
    for a in prev:
        for lb, qb, kb, _ in qk:
            b = int(lb[1:].split("H")[0])
            if b <= a or qb != "emb" or a not in heads(kb):
                continue
            for lc, qc, kc, _ in qk:
                c = int(lc[1:].split("H")[0])
                if c <= b or b not in heads(qc) or not (set(heads(kc)) & prev):
                    continue
                if any(heads(p) and heads(p)[-1] == c for _, p, _ in readout):
                    return True
    return False


def random_chain_rate(names: Sequence[str], size: int, draws: int = 2000, seed: int = 0) -> float:
    """The baseline of `finds_two_hop_circuit`: the share of `draws` random subsets of `size` of all
    coordinate names that contain a complete 2-hop chain. If it is high, finding a chain among the
    survivors says little about the elimination."""
    names = list(names)
    if not 0 <= size <= len(names):
        raise ValueError(f"random_chain_rate: size={size} must be between 0 and the {len(names)} coordinates")
    rng = np.random.default_rng(seed)
    hits = sum(finds_two_hop_circuit([names[i] for i in rng.choice(len(names), size, replace=False)])
               for _ in range(draws))
    return hits / draws

