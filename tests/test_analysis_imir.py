"""IMIR: selections, the basis of S, coordinates, the restricted model, and Theorem 1 on constructed models."""
import math

import pytest
import torch

from circuitbook.analysis import imir
from circuitbook.models.imir import IMIRConfig, IMIRModel
from circuitbook.tasks.blocklist import BlockListTask


def small_task(**kw):
    base = dict(n_pairs=4, n_blocks=2, f_v=0.0)
    base.update(kw)
    return BlockListTask("recall", **base)


@pytest.fixture(scope="module")
def layout():
    return imir.Layout.from_task(small_task())


def test_selections_known_answers():
    t = BlockListTask("recall", n_pairs=2, n_rare=3, n_blocks=1, f_r=0.5)
    lay = imir.Layout.from_task(t)
    assert (lay.n_tokens, lay.seq_len, lay.d0) == (7, 3, 10)
    sel = lay.selections()
    assert list(sel) == ["I", "C", "I_rare", "pos0", "pos1", "pos2"]
    # I: the centred projector on the 4 common tokens; C P_c swaps each pair
    assert torch.allclose(sel["I"][:4, :4], torch.eye(4, dtype=torch.float64) - 0.25)
    expected_c = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], dtype=torch.float64) - 0.25
    assert torch.allclose(sel["C"][:4, :4], expected_c)
    assert torch.allclose(sel["I_rare"][4:7, 4:7], torch.eye(3, dtype=torch.float64) - 1 / 3)
    # pos1: query label q sees key label q - 1 (mod 3)
    assert sel["pos1"][7 + 2, 7 + 1] == 1 and sel["pos1"][7 + 0, 7 + 2] == 1 and sel["pos1"].sum() == 3
    ro = lay.readout_selections()
    assert list(ro) == ["I", "C", "I_rare", "bias_common", "bias_rare"]
    assert ro["bias_rare"][7:, 4:7].eq(1).all() and ro["bias_rare"].sum() == 9
    # embeddings: class-centred one-hot tokens, one-hot labels
    table = lay.embedding_table()
    row = table[1 + 7 * 2]  # token 1 at label 2
    assert torch.allclose(row[:4], torch.tensor([-0.25, 0.75, -0.25, -0.25], dtype=torch.float64))
    assert row[4:7].abs().sum() == 0 and row[7:].tolist() == [0, 0, 1]


def test_selections_commute_with_the_symmetries():
    t = BlockListTask("recall", n_pairs=3, n_rare=3, n_blocks=1, f_r=0.5)
    lay = imir.Layout.from_task(t)
    gen = torch.Generator().manual_seed(0)
    perm = t.random_automorphism(gen)
    P = torch.zeros(lay.d0, lay.d0, dtype=torch.float64)
    P[perm, torch.arange(t.n_tokens)] = 1
    P[t.n_tokens:, t.n_tokens:] = torch.roll(torch.eye(lay.seq_len, dtype=torch.float64), 1, 0)
    for name, S in lay.selections().items():
        assert torch.allclose(P @ S, S @ P), name


def test_paths_and_action_basis():
    assert imir.paths(2, 1) == [(), ((1, 0),), ((2, 0),), ((1, 0), (2, 0))]
    assert [imir.path_name(p) for p in imir.paths(1, 2)] == ["emb", "L1H0", "L1H1"]
    assert imir.parse_path("L1H0>L3H1") == ((1, 0), (3, 1))
    lay = imir.Layout(tuple([0] * 4), (1, 0, 3, 2), 3)
    basis = imir.IMIRBasis.concatenated(lay, 2, 1)
    # 4 orthonormal paths, each a d0-block of the 4 d0 residual
    A = basis._stacked(2)
    assert A.shape == (4 * 7, 4 * 7) and torch.allclose(A, torch.eye(28, dtype=torch.float64))
    assert basis.n_coords == 1 * 5 + 4 * 5 + 4 * 3  # layer 1: 1x1 pairs, layer 2: 2x2 pairs, readout 4 paths
    assert basis.coordinate_names()[0] == "L1H0|emb|emb|I"
    assert basis.coordinate_names()[-1] == "U|L1H0>L2H0|bias_common"


def test_coordinates_round_trip_and_projection(layout):
    for n_layers, n_heads in ((2, 1), (2, 2), (3, 1)):
        basis = imir.IMIRBasis.concatenated(layout, n_layers, n_heads)
        theta = basis.random_point(0)
        W = basis.weights(theta)
        assert torch.allclose(basis.coordinates(W), theta, atol=1e-12)
        assert basis.outside(W)["relative"] < 1e-13
        # a generic matrix is mostly outside S; its projection is idempotent
        gen = torch.Generator().manual_seed(1)
        G = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in W.items()}
        rel = basis.outside(G)["relative"]
        assert 0.9 < rel <= 1.0
        P = basis.project(G)
        assert basis.outside(P)["relative"] < 1e-12
        assert torch.allclose(basis.project(P)["unembed.W_U"], P["unembed.W_U"], atol=1e-12)


def test_coordinate_norms_and_direction_values(layout):
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    norms = basis.coordinate_norms()
    idx = basis.index()
    assert norms[idx["L1H0|emb|emb|pos1"]].item() == pytest.approx(math.sqrt(layout.seq_len))
    assert norms[idx["L2H0|emb|L1H0|I"]].item() == pytest.approx(math.sqrt(8 - 1))  # ||P_c||_F, 8 common tokens
    d = {"L1H0|emb|emb|pos1": 1.0}
    W = basis.weights(basis.direction_weights(d) * 2.5)
    assert basis.direction_value(W, d) == pytest.approx(2.5 * math.sqrt(layout.seq_len))
    with pytest.raises(ValueError, match="unknown IMIR coordinate"):
        basis.direction_weights({"L9H0|emb|emb|pos1": 1.0})


def test_theory_model_weights_match_the_basis(layout):
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    theta = basis.random_point(3, 0.5)
    model = imir.theory_model(layout, 2, 1, coords=theta)
    assert model.cfg.d_model == 4 * layout.d0 and model.cfg.merged_qk and model.cfg.attn_scale == 1.0
    assert set(model.trainable_names()) == {"blocks.0.attn.W_QK", "blocks.1.attn.W_QK", "unembed.W_U"}
    from_model = imir.IMIRBasis.from_model(model, layout)
    assert torch.allclose(from_model.coordinates(dict(model.named_parameters())), theta, atol=1e-12)
    # the frozen value-output maps copy the residual into the head's block
    x = torch.randn(4 * layout.d0, dtype=torch.float64)
    x[layout.d0:] = 0
    O = imir.writing_maps(model)[0][0]
    assert torch.allclose((O @ x)[layout.d0:2 * layout.d0], x[:layout.d0])


@pytest.mark.parametrize("n_layers", [2, 3])
def test_restricted_model_computes_the_same_function(n_layers):
    t = small_task(n_rare=3, f_r=0.5)
    lay = imir.Layout.from_task(t)
    basis = imir.IMIRBasis.concatenated(lay, n_layers, 1)
    theta = basis.random_point(n_layers, 0.5)
    model = imir.theory_model(lay, n_layers, 1, coords=theta)
    rm = IMIRConfig(lay.token_classes, lay.association, lay.seq_len, n_layers=n_layers).build(0).double()
    with torch.no_grad():
        rm.phi.copy_(theta * basis.coordinate_norms())  # phi is in units of unit directions
    assert torch.allclose(rm.theta(), theta, atol=1e-12)
    x = t.model_inputs(t.sample(32, seed=0))
    assert torch.allclose(rm(x), model(x), atol=1e-12)
    assert torch.allclose(rm(x, last_only=True), model(x, last_only=True), atol=1e-12)


def test_restricted_directions_and_config_round_trip(layout):
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    assert set(dirs) == {"alpha", "beta", "gamma", "delta"}
    cfg = IMIRConfig.with_directions(layout, dirs, init=(("gamma", 0.5),))
    assert IMIRConfig.from_dict(cfg.to_dict()) == cfg
    m = cfg.build(seed=0)
    assert m.direction_names == ["alpha", "beta", "gamma", "delta"] and m.trainable_names() == ["phi"]
    assert m.phi.tolist() == [0.0, 0.0, 0.5, 0.0]
    # phi is the coefficient on the unit direction: direction_value of the built weights gives it back
    W = basis.weights(m.theta().detach().double())
    assert basis.direction_value(W, dirs["gamma"]) == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(ValueError, match="not directions"):
        IMIRConfig.with_directions(layout, dirs, init=(("epsilon", 1.0),))
    with pytest.raises(ValueError, match="unknown IMIRConfig fields"):
        IMIRConfig.from_dict({**cfg.to_dict(), "width": 3})
    with pytest.raises(ValueError, match="unknown coordinate"):
        IMIRConfig.with_directions(layout, {"x": {"L1H0|emb|emb|pos99": 1.0}}).build(0)


def test_restricted_model_trains_in_the_ensemble_loop(runs_dir, layout):
    import circuitbook as cb

    t = small_task(f_v=0.5)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    cfg = IMIRConfig.with_directions(layout, imir.two_layer_directions(basis))
    run = cb.train("test/imir", cfg, t, cb.TrainConfig(steps=20, batch_size=64, seeds=(0, 1), lr=0.5, optimizer="sgd",
                                                        eval_every=10, log_checkpoints=0))
    m = run.model(member=1)
    assert isinstance(m, IMIRModel) and m.phi.abs().sum() > 0
    loss = run.metrics().groupby("step").train_loss.mean()
    assert loss.iloc[-1] < math.log(t.n_tokens) - 0.05  # below the zero-init loss log V


# ---------------------------------------------------------------- Theorem 1

@pytest.mark.parametrize("n_layers, kw", [(2, {}), (2, {"n_rare": 3, "f_r": 0.5}), (3, {"f_v": 1.0})])
def test_theorem1_exact_expected_gradient_stays_in_s(n_layers, kw):
    t = small_task(**kw)
    lay = imir.Layout.from_task(t)
    basis = imir.IMIRBasis.concatenated(lay, n_layers, 1)
    model = imir.theory_model(lay, n_layers, 1, coords=basis.random_point(11, 0.7))
    g = imir.expected_gradient(model, t)
    assert g["unembed.W_U"].norm() > 1e-3  # a real gradient
    assert imir.outside_fraction(basis, g) < 1e-8


def test_theorem1_breaks_when_an_assumption_breaks():
    t = small_task()
    lay = imir.Layout.from_task(t)
    basis = imir.IMIRBasis.concatenated(lay, 2, 1)
    theta = basis.random_point(5, 0.7)
    intact = imir.theory_model(lay, 2, 1, coords=theta)
    assert imir.outside_fraction(basis, imir.expected_gradient(intact, t)) < 1e-8
    cases = {
        "trained value-output maps": (imir.theory_model(lay, 2, 1, coords=theta, trained_value_maps=True), t),
        "non-orthonormal embeddings": (imir.theory_model(lay, 2, 1, coords=theta, token_embedding="gaussian"), t),
        "generator breaks the token symmetry": (intact, small_task(zipf=1.0)),
        "absolute positions": (intact, small_task(offsets="fixed")),
    }
    for name, (model, task) in cases.items():
        assert imir.outside_fraction(basis, imir.expected_gradient(model, task)) > 0.05, name


def test_sampled_gradient_is_only_close_to_s():
    t = small_task(f_v=0.5)
    lay = imir.Layout.from_task(t)
    basis = imir.IMIRBasis.concatenated(lay, 2, 1)
    model = imir.theory_model(lay, 2, 1, coords=basis.random_point(2, 0.7))
    small = imir.outside_fraction(basis, imir.sampled_gradient(model, t, 200, seed=0))
    large = imir.outside_fraction(basis, imir.sampled_gradient(model, t, 20000, seed=0))
    assert 1e-3 < large < small  # Monte-Carlo noise shrinks with n but does not vanish


def test_distance_to_s_of_weights(layout):
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    model = imir.theory_model(layout, 2, 1, coords=basis.random_point(0))
    params = dict(model.named_parameters())
    assert imir.distance_to_s(basis, params) < 1e-13
    off = imir.theory_model(layout, 2, 1, coords=basis.random_point(0), off_s_std=0.1)
    assert imir.distance_to_s(basis, dict(off.named_parameters())) > 0.1


def test_bad_inputs_are_refused(layout):
    with pytest.raises(ValueError, match="association"):
        imir.Layout((0, 0), (0, 0), 3)
    with pytest.raises(ValueError, match="seq_len"):
        imir.Layout((0, 0), (1, 0), 1)
    with pytest.raises(ValueError, match="token_embedding"):
        imir.TheoryInit(layout, token_embedding="random")
    with pytest.raises(ValueError, match="off_s_std"):
        imir.TheoryInit(layout, off_s_std=-1.0)
    with pytest.raises(ValueError, match="n_layers"):
        imir.theory_config(layout, n_layers=0)
    with pytest.raises(ValueError, match="expected 2"):
        imir.two_layer_directions(imir.IMIRBasis.concatenated(layout, 3, 1))
    with pytest.raises(ValueError, match="max_outcomes"):
        imir.expected_gradient(imir.theory_model(layout), BlockListTask("recall", n_pairs=12, n_blocks=6),
                               max_outcomes=100)


def test_progress_measures_known_answers():
    from circuitbook.models.toy import ToyConfig, ToyTransformer

    cfg = ToyConfig(d_vocab=3, n_ctx=3, d_model=4, n_layers=2, n_heads=1, d_head=4, mlp=False, bias=False)
    m = ToyTransformer(cfg, seed=0)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        eye = torch.eye(4)
        m.embed.W_E.copy_(eye[:3])
        m.pos_embed.W_pos.copy_(eye[[0, 1, 2]])
        a1, a2 = m.blocks[0].attn, m.blocks[1].attn
        a1.W_Q[0].copy_(eye)
        a1.W_K[0].copy_(torch.roll(eye, 1, 1))  # p_{i-1} W_K = e_i: matches p_i W_Q
        for W in (a1.W_V, a1.W_O, a2.W_V, a2.W_O, a2.W_Q, a2.W_K):
            W[0].copy_(eye)
        m.unembed.W_U.copy_(eye[:, :3] * 2)
    pm = imir.progress_measures(m)
    assert pm == {"alpha": pytest.approx(2.0), "beta": pytest.approx(3.0), "gamma": pytest.approx(6.0)}


def test_restricted_gradient_is_the_projected_full_gradient():
    """phi are coefficients on unit, mutually orthogonal directions: the restricted model's gradient is the
    full model's weight gradient projected on them, so SGD on phi is projected SGD on the weights."""
    t = small_task(f_v=0.5, bos=True)
    lay = imir.Layout.from_task(t)
    basis = imir.IMIRBasis.concatenated(lay, 2, 1)
    dirs = imir.two_layer_directions(basis)
    rm = IMIRConfig.with_directions(lay, dirs, init=(("alpha", 0.3), ("beta", -0.2), ("gamma", 0.5),
                                                          ("delta", 0.7))).build(0).double()
    full = imir.theory_model(lay, 2, 1, coords=rm.theta().detach())
    s = t.sample(256, seed=0)
    g_r = imir.weighted_gradient(rm, t.model_inputs(s), s.targets)["phi"]
    g_f = imir.weighted_gradient(full, t.model_inputs(s), s.targets)
    for i, name in enumerate(rm.direction_names):
        unit = basis.weights(basis.direction_weights(dirs[name]))
        norm = math.sqrt(sum(w.pow(2).sum() for w in unit.values()))
        projected = sum((g_f[n] * unit[n]).sum() for n in unit) / norm
        assert g_r[i].item() == pytest.approx(projected.item(), rel=1e-9, abs=1e-12)


def test_mse_loss_on_label_embeddings():
    t = small_task(bos=True)
    lay = imir.Layout.from_task(t)
    logits = torch.zeros(2, lay.n_tokens, dtype=torch.float64)
    labels = torch.tensor([0, 3])
    # zero output: half the squared norm of the centred label embedding, 1/2 (1 - 1/8) for 8 common tokens
    assert imir.last_position_loss(logits, labels, "mse", lay).tolist() == pytest.approx([0.4375, 0.4375])
    assert imir.last_position_loss(logits, labels, "ce").tolist() == pytest.approx([math.log(lay.n_tokens)] * 2)
    with pytest.raises(ValueError, match="layout"):
        imir.last_position_loss(logits, labels, "mse")
    with pytest.raises(ValueError, match="loss"):
        imir.last_position_loss(logits, labels, "hinge")
    # Theorem 1 holds for the MSE loss too
    basis = imir.IMIRBasis.concatenated(lay, 2, 1)
    model = imir.theory_model(lay, 2, 1, coords=basis.random_point(4, 0.5))
    assert imir.outside_fraction(basis, imir.expected_gradient(model, t, loss="mse")) < 1e-8


def test_a_stored_imir_config_is_rebuilt_without_importing_its_module_first():
    """Run.model() on an IMIR run works in a fresh process that imported only the registry."""
    import subprocess
    import sys

    stored = {"kind": "IMIRConfig", **IMIRConfig(tuple([0] * 4), (1, 0, 3, 2), 3).to_dict()}
    code = ("import sys\nfrom circuitbook.models.registry import config_from_dict\n"
            "assert 'circuitbook.models.imir' not in sys.modules\n"
            f"print(type(config_from_dict({stored!r}).build(0)).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "IMIRModel"


def test_reading_weights_in_unit_coordinates(layout):
    """A point of S planted on two orthogonal unit basis elements of layer 1: 3 on the previous-token
    element (the direction alpha), 0.5 on the token-identity element (outside every named direction)."""
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    names, norms = basis.coordinate_names(), basis.coordinate_norms()
    named = {c for d in dirs.values() for c in d}
    i = names.index("L1H0|emb|emb|pos1")
    j = names.index("L1H0|emb|emb|I")
    assert names[j] not in named
    theta = torch.zeros(basis.n_coords, dtype=torch.float64)
    theta[i], theta[j] = 3.0 / norms[i], 0.5 / norms[j]
    params = basis.weights(theta)
    unit = imir.unit_coordinates(basis, params)
    expected = torch.zeros(basis.n_coords, dtype=torch.float64)
    expected[i], expected[j] = 3.0, 0.5
    assert list(unit.index) == names and torch.allclose(torch.tensor(unit.to_numpy()), expected, atol=1e-9)
    assert imir.captured_fraction(basis, params, dirs) == pytest.approx(9 / 9.25)
    top = imir.largest_other_coordinates(basis, params, dirs, top=2)
    assert top["coordinate"].iloc[0] == names[j] and top["value (unit element)"].iloc[0] == pytest.approx(0.5)
    assert abs(top["value (unit element)"].iloc[1]) < 1e-9
    zero = {n: torch.zeros_like(w) for n, w in params.items()}
    assert math.isnan(imir.captured_fraction(basis, zero, dirs))


def test_s_dimensions_count_the_basis(layout):
    for n_layers in (2, 3):
        basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
        dims = imir.s_dimensions(layout, n_layers)
        assert len(dims) == n_layers + 1 and dims["coordinates"].sum() == basis.n_coords
        assert dims["paths seen"].tolist() == [2 ** l for l in range(n_layers + 1)]  # (H + 1)^l paths, H = 1
        assert (dims["entries"].iloc[:-1] == basis.D ** 2).all() and dims["entries"].iloc[-1] == basis.D * layout.n_tokens


def test_coordinates_of_both_model_kinds(layout):
    class OneModelRun:
        def __init__(self, model):
            self._model = model

        def model(self, member, step=None):
            return self._model

    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    theta = basis.random_point(0, 0.5)
    restricted = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=2).build(seed=None)
    with torch.no_grad():
        restricted.phi.copy_(theta * basis.coordinate_norms())  # phi: coordinates on unit elements
    assert isinstance(restricted, IMIRModel)
    assert torch.allclose(imir.coordinates_of(OneModelRun(restricted), 0, layout), restricted.theta().double())
    full = imir.theory_model(layout, 2, 1, coords=theta)
    assert torch.allclose(imir.coordinates_of(OneModelRun(full), 0, layout), theta, atol=1e-9)
