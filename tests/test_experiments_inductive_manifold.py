"""The inductive_manifold chapter's experiments library: known answers for every measurement helper."""
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from circuitbook.analysis import imir
from circuitbook.models.imir import IMIRConfig
from circuitbook.experiments import inductive_manifold as im
from circuitbook.experiments.inductive_manifold import records
from circuitbook.tasks.blocklist import BlockListTask


def test_type_weights_mix_to_the_factor():
    w = im.type_weights(0.2, 0.5)
    assert w == {"rare": 0.2, "canonical": pytest.approx(0.4), "non-canonical": pytest.approx(0.4)}
    assert w["rare"] + w["non-canonical"] == pytest.approx(im.theory_factor(0.2, 0.5))


def test_factors_and_relative_error():
    assert im.theory_factor(0.2, 0.5) == pytest.approx(0.6)
    assert im.theory_factor(1.0, 0.0) == 1.0 and im.theory_factor(0.0, 0.0) == 0.0
    assert im.calibrated_factor(0.0, 0.5) == pytest.approx(0.75)
    assert im.relative_error([0.55, 0.3], [0.5, 0.3]).tolist() == pytest.approx([0.1, 0.0])


def test_enumerated_task_is_the_uniform_distribution():
    t = BlockListTask("recall", n_pairs=3, n_blocks=1, bos=True)
    data = im.EnumeratedTask(t)
    assert len(data) == t.n_outcomes() == 3 * 2 * 4 * 4  # pairs, orientations, offsets
    assert data.spec()["n"] == len(data) and data.train_batch(0, 10 ** 6, 0).tokens.shape[0] == len(data)
    with pytest.raises(ValueError, match="equally likely"):
        im.EnumeratedTask(BlockListTask("recall", n_pairs=3, n_blocks=1, f_v=0.3))


def test_learned_delta_and_the_suppression_law_at_its_ends():
    task = im.recall_task(8, 2, f_v=0.0, f_r=0.0, n_rare=8)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    model = IMIRConfig.with_directions(layout, imir.two_layer_directions(basis)).build(0).double()
    d = im.learned_delta(model, task, "mse")
    # the delta direction is unit-norm R_C; the least-squares value undoes the normalisation: ||C P_c||_F
    assert d == pytest.approx(math.sqrt(2 * 8 - 1), rel=1e-9)
    s = task.sample(64, 0)
    out = im.with_direction(model, "delta", d)(task.model_inputs(s), last_only=True)[:, -1]
    assert imir.last_position_loss(out, s.targets, "mse", layout).max() < 1e-20  # canonical queries answered
    p = im.learned_delta(model, task, "ce", p_target=0.9)
    probs = (im.with_direction(model, "delta", p)(task.model_inputs(s), last_only=True)[:, -1]).softmax(-1)
    assert probs.gather(-1, s.targets[:, None]).mean().item() == pytest.approx(0.9, abs=1e-6)
    law = im.suppression_law([(1.0, 0.0), (0.0, 0.0)], [0], 8, 8, 2, 256, "mse")
    assert law["measured"].iloc[0] == pytest.approx(1.0)  # all rare: the in-weights circuit changes nothing
    assert law["measured"].iloc[1] == pytest.approx(0.0, abs=1e-9)  # all canonical and solved: no push left


def test_init_design_and_own_sizes():
    design = im.init_design([0.0, 1.0], base=0.5, jitter=0.0)
    assert len(design) == 4 and design["beta12"].tolist() == [0.5] * 4 and design["member_seed"].tolist() == [0, 1, 2, 3]
    sizes = im.own_sizes(design)
    assert sizes["1->2"].iloc[3] == pytest.approx(math.log(math.sqrt(1 + 0.25 + 0.25)))


def test_init_design_slices_and_replicates():
    d = im.init_design([0.0, 1.0, 2.0], base=0.5, jitter=1.0, seed=3, slices=2, replicates=2)
    assert len(d) == 2 * 9 * 2 and d["member_seed"].is_unique and d["point"].nunique() == 18
    by_point = d.groupby("point")
    assert (by_point[list(im.CIRCUIT_DIRECTIONS)].nunique() == 1).all().all(), "replicates start alike"
    assert (by_point["replicate"].apply(sorted).map(tuple) == (0, 1)).all()
    by_slice = d.groupby("slice")
    assert (by_slice[list(im.OTHER_DIRECTIONS)].nunique() == 1).all().all(), "a slice is a 2-d section"
    assert d.loc[d.slice == 0, "beta12"].iloc[0] != d.loc[d.slice == 1, "beta12"].iloc[0]
    assert sorted(by_slice.get_group(1)[["alpha1", "alpha2"]].drop_duplicates().itertuples(index=False)) == sorted(
        (a, b) for a in (0.0, 1.0, 2.0) for b in (0.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="replicates"):
        im.init_design([0.0], 0.5, 1.0, replicates=0)


def test_nested_fits_see_what_own_sizes_cannot():
    """The winner is planted as beta12 > beta13; each circuit's own size is dominated by its gamma,
    drawn independently and large, so own sizes barely predict it while the nested fit with the
    coordinates does: the gap is large and its standard error small."""
    rng = np.random.default_rng(0)
    n = 300
    d = pd.DataFrame({"alpha1": 1.0, "alpha2": 0.1, "beta12": rng.uniform(0, 1, n), "beta13": rng.uniform(0, 1, n),
                      "beta23": 0.1, "gamma2": rng.uniform(2, 6, n), "gamma3": rng.uniform(2, 6, n),
                      "point": np.arange(n)})
    d["winner"] = np.where(d.beta12 > d.beta13, "1->2", "1->3")
    out = im.nested_fits(d)
    assert out["nested_acc"] > 0.9 and out["own_size_acc"] < 0.75
    assert out["gap"] == pytest.approx(out["nested_acc"] - out["own_size_acc"]) and out["gap_se"] < 0.05


def test_point_outcomes_and_boundary_sharpness():
    """Slice 0: winner A in the first column of a 3 x 3 grid, B elsewhere, every replicate agreeing: the
    six points beside the boundary are decided, sharpness 1. Slice 1: the middle column undecided (its
    replicates disagree): 6 decided points beside it, 3 undecided, sharpness 6/9."""
    rows = []
    for sl in (0, 1):
        for i, a1 in enumerate((0.0, 1.0, 2.0)):
            for a2 in (0.0, 1.0, 2.0):
                point = len(rows) // 2
                for r in (0, 1):
                    if sl == 1 and i == 1:
                        w = "A" if r == 0 else "B"
                    else:
                        w = "A" if i == 0 else "B"
                    rows.append({"point": point, "slice": sl, "alpha1": a1, "alpha2": a2, "winner": w})
    pts = im.point_outcomes(pd.DataFrame(rows))
    assert len(pts) == 18 and (pts.outcome == "undecided").sum() == 3
    assert not pts.loc[pts.outcome == "undecided", "replicates_agree"].any()
    assert im.boundary_sharpness(pts[pts.slice == 0]) == {"sharpness": 1.0, "decided_at_boundary": 6,
                                                           "undecided": 0}
    assert im.boundary_sharpness(pts[pts.slice == 1])["sharpness"] == pytest.approx(6 / 9)
    assert im.boundary_sharpness(pts)["sharpness"] == pytest.approx(12 / 15)
    one = pts[pts.slice == 0].assign(outcome="A")
    assert math.isnan(im.boundary_sharpness(one)["sharpness"]), "no boundary: nothing to measure"
    mixed = pd.DataFrame([{"point": 0, "slice": 0, "alpha1": 0.0, "alpha2": 0.0, "winner": "mixed"}])
    assert im.point_outcomes(mixed)["outcome"].iloc[0] == "undecided"


def test_init_table_and_three_layer_directions():
    task = im.recall_task(8, 2, f_v=1.0)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 3, 1)
    dirs = im.three_layer_directions(basis)
    assert set(dirs) == {d for c in im.CIRCUITS.values() for d in c}
    model = IMIRConfig.with_directions(layout, dirs, n_layers=3).build(0)
    im.InitTable({5: {"alpha2": 1.5, "gamma3": 0.25}})(model, 5)
    assert model.phi[model.direction_names.index("alpha2")].item() == 1.5 and model.phi.sum().item() == 1.75
    with pytest.raises(ValueError, match="no initial values"):
        im.InitTable({5: {}})(model, 6)
    with pytest.raises(ValueError, match="expected 3"):
        im.three_layer_directions(imir.IMIRBasis.concatenated(layout, 2, 1))


def test_finds_two_hop_circuit_and_graph():
    chain = ["L1H0|emb|emb|pos1", "L2H0|emb|L1H0|I", "L3H0|L2H0|L1H0|I", "U|L3H0|I"]
    assert im.finds_two_hop_circuit(chain)
    assert not im.finds_two_hop_circuit(chain[:-1])  # no copy to the output
    assert not im.finds_two_hop_circuit(["L1H0|emb|emb|pos1", "L2H0|emb|L1H0|I", "L3H0|emb|L1H0|I", "U|L3H0|I"])
    assert not im.finds_two_hop_circuit(["L1H0|emb|emb|pos2"] + chain[1:])
    table = pd.DataFrame({"coordinate": chain + ["L3H0|emb|emb|I"], "kind": ["key-query"] * 3 + ["readout", "key-query"],
                          "value": [1.0, 1.0, 1.0, 1.0, -1.0], "aiding": [False] * 4 + [True]})
    G = im.circuit_graph(table, 3)
    assert set(G.nodes) == {"emb", "L1H0", "L2H0", "L3H0", "out"}
    assert G.has_edge("L2H0", "L3H0") and G.has_edge("L1H0", "L3H0") and G.has_edge("L3H0", "out")
    assert G.edges["emb", "L3H0", "aiding"]["label"] == "q:I; k:I" and not G.has_edge("emb", "L3H0", "core")
    assert G.edges["emb", "L1H0", "core"]["label"] == "q:pos1; k:pos1"
    assert G.edges["L1H0", "L2H0", "core"]["label"] == "k:I" and G.edges["L3H0", "out", "core"]["label"] == "I"
    assert records._compact(["I", "pos3", "pos1", "I", "C"]) == "I, C, pos1,3"


def test_backward_elimination_keeps_a_planted_induction_circuit():
    """A 2-layer model with a strong induction circuit (alpha, beta, gamma) and small junk coordinates: the
    elimination removes the junk and keeps the circuit, which alone answers every query."""
    task = im.recall_task(8, 3, f_v=1.0)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    theta = basis.random_point(0, 0.02)
    for name, value in (("alpha", 12.0), ("beta", 14.0), ("gamma", 25.0)):
        theta = theta + value * basis.direction_weights(dirs[name]) / basis.direction_norm(dirs[name])
    pool = task.batch(task.sample(256, seed=1))
    ev = im.CoordinateEvaluator(layout, 2, pool)
    res = im.backward_elimination(ev, theta, tau=0.2, screen=8)
    kept = {basis.coordinate_names()[i] for i in torch.nonzero(res["alive"]).squeeze(1).tolist()}
    core = {c for name in ("alpha", "beta", "gamma") for c in dirs[name]}
    assert core <= kept and len(kept) <= len(core) + 10
    assert res["acc"] >= 0.95 and res["loss"] <= res["budget"]
    split = im.aiding_split(ev, res, basis.coordinate_names())
    assert split["acc_with"] == pytest.approx(res["acc"]) and split["n_core"] + split["n_aiding"] == len(kept)


def test_probe_reads_the_same_values_from_both_model_kinds():
    from circuitbook.training import Ensemble

    task = im.recall_task(8, 2, f_v=0.5, bos=True)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    cfg_r = IMIRConfig.with_directions(layout, dirs, init=(("alpha", 0.5), ("beta", 1.5), ("gamma", 2.0),
                                                                ("delta", -1.0)))
    ens_r = Ensemble(cfg_r, [0])
    theta = ens_r.member(0).theta().detach().double()
    ens_u = Ensemble(imir.theory_config(layout, 2, 1), [0], imir.TheoryInit(layout, coords=theta))
    probe = im.Probe(basis, dirs, im.recall_pools(task, 32))
    a, b = probe(ens_r, 0), probe(ens_u, 0)
    for name, value in (("alpha", 0.5), ("beta", 1.5), ("gamma", 2.0), ("delta", -1.0)):
        assert a[name].item() == pytest.approx(value, abs=1e-5) and b[name].item() == pytest.approx(value, abs=1e-4)
    assert torch.allclose(a["loss_task"], b["loss_task"], atol=1e-4)
    assert probe.spec()["directions"] == dirs


def test_restricted_and_full_runs_and_their_loss_gap(runs_dir):
    cfg = SimpleNamespace(tl_n_pairs=4, tl_n_blocks=2, tl_f_v=0.5, tl_seeds=[0, 1], tl_steps=4, tl_lr=1.0, tl_batch=16,
                          tl_eval_every=2, tl_pool=32)
    task = im.two_layer_task(cfg)
    runs = im.train_restricted_and_full(cfg, name="test/im2")
    assert set(runs) == {"restricted", "full S", "unrestricted"}
    assert runs["full S"].model(0).phi.numel() == imir.IMIRBasis.concatenated(imir.Layout.from_task(task), 2,
                                                                             1).n_coords
    gap = im.loss_gap(runs["restricted"], runs["unrestricted"])
    assert gap["seed"].tolist() == [0, 1] and (gap["max_gap"] >= 0).all()

    same = im.loss_gap(runs["restricted"], runs["restricted"])
    assert (same["max_gap"] == 0).all()
    params = dict(runs["unrestricted"].model(0).named_parameters())
    basis = imir.IMIRBasis.concatenated(imir.Layout.from_task(task), 2, 1)
    frac = imir.captured_fraction(basis, params, imir.two_layer_directions(basis))
    assert 0 < frac <= 1 + 1e-9


def test_bad_arguments_are_refused():
    task = im.recall_task(4, 2, f_v=0.5)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    model = IMIRConfig.with_directions(layout, imir.two_layer_directions(basis)).build(0)
    with pytest.raises(ValueError, match="direction"):
        im.icl_gradient(model, task, 16, 0, icl=("epsilon",))
    with pytest.raises(ValueError, match="loss"):
        im.learned_delta(model, task, "hinge")
    with pytest.raises(ValueError, match="mode"):
        im.train_two_hop(SimpleNamespace(im6_mode="dense", im6_layers=3))


def test_circuit_probe_matches_member_by_member_ablation():
    from circuitbook.training import Ensemble

    task = im.recall_task(8, 2, f_v=1.0)
    layout = imir.Layout.from_task(task)
    dirs = im.three_layer_directions(imir.IMIRBasis.concatenated(layout, 3, 1))
    cfg = IMIRConfig.with_directions(layout, dirs, n_layers=3)
    table = {0: {"alpha1": 12.0, "beta12": 14.0, "gamma2": 25.0}, 1: {"alpha2": 12.0, "beta23": 14.0, "gamma3": 25.0}}
    ens = Ensemble(cfg, [0, 1], im.InitTable(table))
    pool = task.batch(task.sample(128, seed=3))
    out = im.CircuitProbe(pool, im.CIRCUITS)(ens, 0)
    before = ens.params["phi"].clone()
    for k in range(2):
        model = ens.member(k)
        for c, d in im.CIRCUITS.items():
            assert out[f"solo_{c}"][k].item() == pytest.approx(im.circuit_accuracy(model, pool, d))
    assert torch.equal(ens.params["phi"], before)  # restored
    assert out["solo_1->2"][0] > 0.9 and out["solo_2->3"][1] > 0.9 and out["solo_2->3"][0] < 0.5


def test_type_gradients_known_answers():
    per, d = im.type_gradients(8, 8, 2, 64, seed=0, loss="mse")
    assert per[("canonical", "delta learned")].norm() < 1e-12  # solved in weights: no push left
    assert torch.allclose(per[("rare", "delta learned")], per[("rare", "delta = 0")])  # delta never sees rare tokens
    assert per[("non-canonical", "delta = 0")].norm() > 0
    table = im.type_gradient_table(per)
    assert table.set_index("queried chain").loc["canonical", "delta = 0"] == pytest.approx(1.0)


class MetricsRun:
    """A stand-in for a Run: only metrics(), as the share of the gradient reads it."""

    def __init__(self, frame):
        self.frame = frame

    def metrics(self):
        return self.frame


def test_share_outside_directions_against_the_exact_projection():
    """At two planted points of the four-direction model (zero, and alpha, beta, gamma, delta non-zero)
    on an enumerable task: the exact share equals 1 - sum_d <g, u_d>^2 / ||proj_S g||^2 computed
    here from the basis; two sampled estimates of 4000 sequences each land near it."""
    task = im.recall_task(3, 1, f_v=1.0)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    points = [dict(alpha=0.0, beta=0.0, gamma=0.0, delta=0.0), dict(alpha=1.0, beta=2.0, gamma=1.5, delta=-0.5)]
    frame = pd.DataFrame([{"member": 0, "seed": 0, "step": 10 * i, "acc_icl": 0.0, **p} for i, p in enumerate(points)])
    exact = im.share_outside_directions(MetricsRun(frame), task, n_points=2, n_grad=None)
    for p, share in zip(points, exact["share_outside"]):
        theta = sum(p[d] * basis.direction_weights(v) / basis.direction_norm(v) for d, v in dirs.items())
        g = imir.expected_gradient(imir.theory_model(layout, 2, 1, coords=theta), task)
        inside = basis.project(g)
        on = sum(basis.direction_value(g, v) ** 2 for v in dirs.values())
        total = sum(w.pow(2).sum().item() for w in inside.values())
        assert share == pytest.approx(1 - on / total, abs=1e-9)
    assert 0 < exact["share_outside"].iloc[0] < 1 and 0 < exact["share_outside"].iloc[1] < 1
    sampled = im.share_outside_directions(MetricsRun(frame), task, n_points=2, n_grad=4000)
    assert np.allclose(sampled["share_outside"], exact["share_outside"], atol=0.05)


def test_the_suppression_law_at_a_point_of_the_trajectory():
    """At zero weights alpha's and beta's components are exactly 0 (their ratios NaN); at a point with
    alpha, beta, gamma non-zero every direction gets gradient; all-rare queries never meet the
    in-weights circuit, so every component's ratio is exactly 1 there too."""
    point = {"alpha": 0.5, "beta": 1.0, "gamma": 2.0}
    per0, _ = im.type_gradients(8, 8, 2, 64, seed=0, loss="mse")
    per1, _ = im.type_gradients(8, 8, 2, 64, seed=0, loss="mse", point=point)
    assert (per0[("non-canonical", "delta = 0")][:2] == 0).all() and per0[("non-canonical", "delta = 0")][2] != 0
    assert (per1[("non-canonical", "delta = 0")].abs() > 1e-6).all()
    law = im.suppression_law([(1.0, 0.0), (0.3, 0.5)], [0], 8, 8, 2, 64, "mse", points=[None, point])
    zero, at = law[law.point == 0], law[law.point == 1]
    assert zero[["measured_alpha", "measured_beta"]].isna().all().all() and zero["measured_gamma"].notna().all()
    assert at.iloc[0][["measured_alpha", "measured_beta", "measured_gamma"]].tolist() == pytest.approx([1.0] * 3)
    assert (at["at_beta"] == 1.0).all() and (zero["at_beta"] == 0.0).all()
    errors = im.per_direction_errors(law).set_index("direction")
    assert not np.isnan(errors.loc["alpha", "median"]), "zero-weight rows left out, the point's kept"
    assert errors.loc["alpha", "median"] == pytest.approx(np.median(im.relative_error(
        at["measured_alpha"], at["theory"])))


def test_trajectory_points_and_per_direction_summaries():
    frame = pd.DataFrame([{"member": m, "step": s, "alpha": 0.1 * s, "beta": 0.2 * s, "gamma": s, "delta": -s}
                          for m in (0, 1) for s in (0, 10, 20, 30, 40)])
    pts = im.trajectory_points(frame, 1, [0.5, 1.0], until=38.0)  # nearest evaluations to 19 and 38
    assert [p["step"] for p in pts] == [20, 40] and pts[0]["beta"] == pytest.approx(4.0)
    assert [p["step"] for p in im.trajectory_points(frame, 0, [0.25], until=float("nan"))] == [10]
    assert [p["step"] for p in im.trajectory_points(frame, 0, [0.0, 0.5, 0.52, 1.0])] == [20, 40], \
        "step 0 (alpha, beta zero) left out, each step once"
    assert im.trajectory_points(frame, 0, [0.0], nonzero=())[0]["step"] == 0
    with pytest.raises(ValueError, match="member 5"):
        im.trajectory_points(frame, 5, [0.5])
    law = pd.DataFrame({"seed": 0, "theory": [0.5, 0.5, 1.0], "measured_alpha": [0.55, 0.45, np.nan],
                        "measured_beta": [0.5, 0.75, 1.0], "measured_gamma": [0.5, 0.5, 1.0]})
    err = im.per_direction_errors(law).set_index("direction")
    assert err.loc["alpha", "median"] == pytest.approx(0.1) and err.loc["alpha", "max"] == pytest.approx(0.1)
    assert err.loc["beta", "max"] == pytest.approx(0.5) and err.loc["gamma", "max"] == 0
    pts = pd.DataFrame([{"seed": 0, "point": 0, "b": b, "g_alpha": 2 * b, "g_beta": -3 * b, "g_gamma": 1.0}
                        for b in (1, 2, 3)])
    r2 = im.per_direction_r2(pts).set_index("direction")["r2"]
    assert r2["alpha"] == pytest.approx(1.0) and r2["beta"] == pytest.approx(1.0) and np.isnan(r2["gamma"])


def test_burstiness_at_points_starts_where_the_step_zero_gradient_is(runs_dir):
    """The point at fraction 0 is step 0 (zero weights): its gradient norm for each b is the one
    burstiness_table measured there, with the same sequences."""
    cfg = SimpleNamespace(im4_n_pairs=8, im4_n_blocks=4, im4_bursts=[1, 2], im4_seeds=[0], im4_steps=6, tl_lr=1.0,
                          tl_batch=16, tl_eval_every=3, tl_pool=32)
    run, members = im.train_burstiness_sweep(cfg, name="test/im4"), im.burstiness_members(cfg)
    table = im.burstiness_table(run, members, 8, 4, 64, 0.5, loss="mse")
    pts = im.burstiness_at_points(run, members, table, 8, 4, 64, [0.0, 1.0], loss="mse", nonzero=())
    assert sorted(pts["point"].unique()) == [0, 1] and set(pts["b"]) == {1, 2}
    start = pts[pts.point == 0].set_index("b")
    norms = np.sqrt((start[["g_alpha", "g_beta", "g_gamma"]] ** 2).sum(axis=1))
    assert np.allclose(norms.to_numpy(), table.set_index("b").loc[[1, 2], "icl_gradient"].to_numpy(), rtol=1e-6)
    assert (pts[pts.point == 1]["step"] == 6).all(), "never emerged: the last step"


def test_random_chain_rate_is_the_hypergeometric_chance():
    """One complete chain (4 coordinates) among 12 that cannot make another: a random subset of k
    contains it with probability C(8, k - 4) / C(12, k); all 12 always do, 3 never."""
    chain = ["L1H0|emb|emb|pos1", "L2H0|emb|L1H0|I", "L3H0|L2H0|L1H0|I", "U|L3H0|I"]
    fillers = ["L1H0|emb|emb|pos0", "L1H0|emb|emb|pos2", "L2H0|emb|emb|I", "L2H0|emb|emb|C", "U|emb|I", "U|emb|C",
               "U|L1H0|I", "U|L2H0|C"]
    names = chain + fillers
    assert im.random_chain_rate(names, 12, draws=50) == 1.0 and im.random_chain_rate(names, 3, draws=50) == 0.0
    expected = math.comb(8, 2) / math.comb(12, 6)
    assert im.random_chain_rate(names, 6, draws=4000, seed=1) == pytest.approx(expected, abs=0.015)
    with pytest.raises(ValueError, match="size=13"):
        im.random_chain_rate(names, 13)


SMOKE_RUNS = {
    "01_tasks": {},
    "02_manifold": {"in S, full batch": "inductive_manifold/im1/in_s", "off S, full batch": "inductive_manifold/im1/off_s",
                    "in S, sampled batches": "inductive_manifold/im1/in_s_sampled"},
    "03_two_layer": {"restricted": "inductive_manifold/im2/restricted", "full S": "inductive_manifold/im2/full_s",
                     "unrestricted": "inductive_manifold/im2/unrestricted",
                     "scaling/N2": "inductive_manifold/scaling/N2", "scaling/N3": "inductive_manifold/scaling/N3",
                     "trajectory": "inductive_manifold/im3_trajectory", "suppression": "inductive_manifold/im3",
                     "burstiness": "inductive_manifold/im4", "standard": "inductive_manifold/standard"},
    "04_initialization": {"ensemble": "inductive_manifold/im5"},
    "05_circuit_detection": {"two_hop": "inductive_manifold/im6/imir"},
}


@pytest.mark.parametrize("notebook", list(SMOKE_RUNS))
def test_notebook_runs_plan_every_run_of_the_notebook(runs_dir, notebook):
    from circuitbook import notebook_runs, params
    from circuitbook.training.planning import planning

    cfg = params.resolve("inductive_manifold", notebook, "smoke")
    with planning() as plan:
        runs = notebook_runs(cfg)
    assert {role: r.dir.name for role, r in runs.items()} == SMOKE_RUNS[notebook]
    assert [r.dir.name for r in plan.runs] == list(SMOKE_RUNS[notebook].values()), "each run planned once, in order"
    if notebook == "03_two_layer":
        assert runs["suppression"].n_members == len(im.suppression_members(cfg))
        assert runs["burstiness"].n_members == len(im.burstiness_members(cfg))
    if notebook == "04_initialization":
        assert runs["ensemble"].n_members == len(im.im5_design(cfg)) == (cfg.im5_slices * cfg.im5_replicates
                                                                          * len(cfg.im5_grid) ** 2)


def test_distance_probe_logs_the_distance_and_the_pool(runs_dir):
    from circuitbook.tasks.base import Batch
    from circuitbook.training import Ensemble

    task = im.recall_task(3, 1, f_v=0.0)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    data = im.EnumeratedTask(task)
    ens = Ensemble(imir.theory_config(layout, 2, 1), [0, 1], imir.TheoryInit(layout, random_scale=0.5))
    out = im.DistanceProbe(basis, Batch(data.tokens, data.labels))(ens, 0)
    assert set(out) == {"acc_pool", "loss_pool", "distance_to_s"}
    assert out["distance_to_s"].shape == (2,) and (out["distance_to_s"] < 1e-6).all(), "started in S"
    assert set(im.DistanceProbe(basis)(ens, 0)) == {"distance_to_s"}
