"""The inductive_manifold chapter's experiments library: known answers for every measurement helper."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from circuitbook.analysis import imir
from circuitbook.experiments import inductive_manifold as im
from circuitbook.tasks.blocklist import BlockListTask


def test_crossing_steps_interpolate():
    m = pd.DataFrame({"member": [0, 0, 0, 1, 1, 1, 2, 2, 2], "step": [0, 10, 20] * 3,
                      "acc": [0.0, 0.4, 0.8, 0.0, 0.1, 0.2, 0.6, 0.7, 0.9]})
    t = im.crossing_steps(m, "acc", 0.6)
    assert t[0] == pytest.approx(15.0) and math.isnan(t[1]) and t[2] == 0.0


def test_proportional_fit():
    b = np.array([1, 2, 3, 4], float)
    assert im.proportional_fit(b, 0.3 * b) == {"c": pytest.approx(0.3), "r2": pytest.approx(1.0)}
    assert im.proportional_fit(b, 0.3 * b + 1.0)["r2"] < 0.5  # an intercept is not proportionality


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
    model = imir.IMIRConfig.with_directions(layout, imir.two_layer_directions(basis)).build(0).double()
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


def test_logistic_fit_and_own_sizes():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = ["a" if x0 > x1 else "b" for x0, x1 in X]
    fit = im.logistic_fit(X, y)
    assert fit["cv_accuracy"] >= 0.9 and fit["classes"] == ["a", "b"]
    noise = im.logistic_fit(rng.normal(size=(60, 2)), list(rng.choice(["a", "b"], 60)))
    assert noise["cv_accuracy"] < 0.75
    design = im.init_design([0.0, 1.0], base=0.5, jitter=0.0)
    assert len(design) == 4 and design["beta12"].tolist() == [0.5] * 4 and design["member_seed"].tolist() == [0, 1, 2, 3]
    sizes = im.own_sizes(design)
    assert sizes["1->2"].iloc[3] == pytest.approx(math.log(math.sqrt(1 + 0.25 + 0.25)))


def test_init_table_and_three_layer_directions():
    task = im.recall_task(8, 2, f_v=1.0)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 3, 1)
    dirs = im.three_layer_directions(basis)
    assert set(dirs) == {d for c in im.CIRCUITS.values() for d in c}
    model = imir.IMIRConfig.with_directions(layout, dirs, n_layers=3).build(0)
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
    assert im._compact(["I", "pos3", "pos1", "I", "C"]) == "I, C, pos1,3"


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
    cfg_r = imir.IMIRConfig.with_directions(layout, dirs, init=(("alpha", 0.5), ("beta", 1.5), ("gamma", 2.0),
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
    task = im.recall_task(4, 2, f_v=0.5)
    runs = im.train_restricted_and_full(task, [0, 1], steps=4, lr=1.0, batch=16, eval_every=2, pool_size=32,
                                        name="test/im2")
    gap = im.loss_gap(runs["restricted"], runs["unrestricted"])
    assert gap["seed"].tolist() == [0, 1] and (gap["max_gap"] >= 0).all()
    same = im.loss_gap(runs["restricted"], runs["restricted"])
    assert (same["max_gap"] == 0).all()
    params = dict(runs["unrestricted"].model(0).named_parameters())
    basis = imir.IMIRBasis.concatenated(imir.Layout.from_task(task), 2, 1)
    frac = im.captured_fraction(basis, params, imir.two_layer_directions(basis))
    assert 0 < frac <= 1 + 1e-9


def test_bad_arguments_are_refused():
    task = im.recall_task(4, 2, f_v=0.5)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    model = imir.IMIRConfig.with_directions(layout, imir.two_layer_directions(basis)).build(0)
    with pytest.raises(ValueError, match="direction"):
        im.icl_gradient(model, task, 16, 0, icl=("epsilon",))
    with pytest.raises(ValueError, match="loss"):
        im.learned_delta(model, task, "hinge")
    with pytest.raises(ValueError, match="mode"):
        im.train_two_hop(im.two_hop_task(8, 4), 3, "dense", [0], 1, 1.0, 8, 1, 16)


def test_circuit_probe_matches_member_by_member_ablation():
    from circuitbook.training import Ensemble

    task = im.recall_task(8, 2, f_v=1.0)
    layout = imir.Layout.from_task(task)
    dirs = im.three_layer_directions(imir.IMIRBasis.concatenated(layout, 3, 1))
    cfg = imir.IMIRConfig.with_directions(layout, dirs, n_layers=3)
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
