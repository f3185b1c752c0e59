"""Chapter algorithmic_cores: known answers for the experiment helpers."""
import cmath
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from circuitbook.analysis import ace
from circuitbook.analysis.compare import projector_overlap, weight_cosine
from circuitbook.experiments import algorithmic_cores as ac
from circuitbook.models.toy import ToyConfig, ToyTransformer


# ------------------------------------------------------------------ planted system
@pytest.fixture(scope="module")
def planted():
    return ac.planted_system(seed=0)


def test_planted_core_and_operator_are_recovered(planted):
    core = ace.extract_core(planted.H, planted.jacobians, energy_threshold=0.99)
    assert core.rank == 3
    assert projector_overlap(core, planted.U) == pytest.approx(1.0, abs=1e-6)
    # covariance alone (PCA) finds the nuisance, the readout alone finds the silent directions
    pca = torch.linalg.svd(planted.H - planted.H.mean(0), full_matrices=False).Vh[:3].T
    assert projector_overlap(pca, planted.U) < 0.2
    readout_dirs = torch.linalg.svd(planted.readout, full_matrices=False).Vh[:3].T
    assert projector_overlap(readout_dirs, planted.U) < 0.5
    S, T = planted.Z.shape[:2]
    op = ace.fit_core_operator(core.coordinates(planted.H).reshape(S, T, 3))
    known = planted.eigenvalues
    assert sorted(abs(complex(e)) for e in known) == pytest.approx([0.6, 0.95, 0.95])
    assert ac.eig_relative_error(op.eigenvalues, known) < 0.05


def test_planted_model_validates(planted):
    model = ac.PlantedModel(planted)
    tokens = torch.arange(planted.H.shape[0])[:, None]
    inputs = ace.collect_ace_inputs(model, tokens, "hook_h")
    core = ace.extract_core(inputs.activations, inputs.jacobians, rank=3)
    counts = torch.bincount(planted.labels)
    val = ace.validate_core(model, tokens, planted.labels, "hook_h", core,
                            chance=float(counts.max() / counts.sum()))
    assert val.clean == pytest.approx(1.0, abs=1e-3)
    assert val.keep[2] == pytest.approx(1.0, abs=0.01) and val.sufficient_dim == 3
    # removing the whole core leaves the mean activation: one constant prediction, the majority class here
    assert val.remove[2] == pytest.approx(val.chance, abs=0.01) and val.necessary_dim <= 3


def test_a_nuisance_correlated_with_the_core_by_chance_tilts_the_core_by_the_predicted_amount():
    """Without the in-sample decorrelation the nuisance keeps its chance correlation with the latents
    (as in real data). ACE's core is then span(Cov U), not span(U): the known answer."""
    clean = ac.planted_system(seed=0, decorrelate=True)
    chance = ac.planted_system(seed=0, decorrelate=False)
    for system in (clean, chance):
        core = ace.extract_core(system.H, system.jacobians, rank=3)
        assert projector_overlap(core, system.predicted_core()) == pytest.approx(1.0, abs=1e-9)
    assert projector_overlap(clean.predicted_core(), clean.U) == pytest.approx(1.0, abs=1e-9)
    # the tilt is real and of the size the chance covariances predict: Cov U = U Czz + V Cnz
    z = chance.Z.reshape(-1, 3)
    n = (chance.H - chance.H.mean(0)) @ chance.V
    zc = z - z.mean(0)
    czz, cnz = zc.T @ zc / (len(z) - 1), n.T @ zc / (len(z) - 1)
    tilt = cnz @ torch.linalg.inv(czz)  # core = span(U + V tilt)
    expected = torch.linalg.qr(chance.U + chance.V @ tilt).Q
    assert projector_overlap(expected, chance.predicted_core()) == pytest.approx(1.0, abs=1e-9)
    # ||U^T Q||^2 / 3 for Q = orth(U + V T) is tr((I + T^T T)^-1) / 3
    predicted = float(torch.trace(torch.linalg.inv(torch.eye(3, dtype=torch.float64) + tilt.T @ tilt)) / 3)
    got = projector_overlap(ace.extract_core(chance.H, chance.jacobians, rank=3), chance.U)
    assert got == pytest.approx(predicted, abs=1e-9)
    assert 1 - got > 1e-3  # not hidden: the chance correlation moves the core visibly


def test_paper_keep_drops_the_mean_along_silent_directions_the_readout_reads(planted):
    """The planted readout reads the silent directions W, along which every activation equals the offset.
    The book's keep (about the mean) keeps that offset: accuracy 1. The paper's keep h <- QQ^T h removes it,
    shifting every input's logits by -R (I - QQ^T) h: the known answer below, computed by hand."""
    model = ac.PlantedModel(planted)
    tokens = torch.arange(planted.H.shape[0])[:, None]
    core = ace.extract_core(planted.H, planted.jacobians, rank=3)
    book = ace.validate_core(model, tokens, planted.labels, "hook_h", core, chance=0.25, definition=ace.BOOK)
    paper = ace.validate_core(model, tokens, planted.labels, "hook_h", core, chance=0.25, definition=ace.PAPER)
    assert book.keep[-1] == pytest.approx(1.0)
    kept = planted.H @ core.projector
    by_hand = float(((kept @ planted.readout.T + planted.bias).argmax(-1) == planted.labels).double().mean())
    assert paper.keep[-1] == pytest.approx(by_hand, abs=1e-3) and by_hand < 0.9


# ------------------------------------------------------------------ readout-side validation
def test_collect_many_equals_one_hook_at_a_time():
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=16, n_layers=2, n_heads=2, d_mlp=32, normalization="LN")
    model = ToyTransformer(cfg, seed=2).eval()
    tokens = torch.randint(0, 7, (20, 4), generator=torch.Generator().manual_seed(1))
    out = lambda z: z[:, 3] - z[:, 5]
    hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_mid", "blocks.1.hook_resid_post"]
    many = ace.collect_ace_inputs_many(model, tokens, hooks, out, batch_size=8)
    for h in hooks:
        one = ace.collect_ace_inputs(model, tokens, h, out, batch_size=8)
        assert torch.allclose(many[h].activations, one.activations, atol=1e-6)
        assert torch.allclose(many[h].jacobians, one.jacobians, atol=1e-5)
    with pytest.raises(ValueError):
        ace.collect_ace_inputs_many(model, tokens, [hooks[0], hooks[0]], out)


# ------------------------------------------------------------------ Markov helpers
def test_eig_relative_error_matches_sets():
    ref = torch.tensor([0.75 + 0.25j, 0.75 - 0.25j, 0.5 + 0j])
    est = torch.tensor([0.5 + 0j, 0.75 - 0.25j, 0.75 + 0.25j])  # same set, other order
    assert ac.eig_relative_error(est, ref) == pytest.approx(0.0, abs=1e-12)
    est2 = torch.tensor([0.55 + 0j, 0.75 - 0.25j, 0.75 + 0.25j, 0.01 + 0j])  # extra eigenvalue ignored
    assert ac.eig_relative_error(est2, ref) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        ac.eig_relative_error(est[:2], ref)


def test_matched_eig_errors_per_eigenvalue():
    ref = torch.tensor([0.75 + 0.25j, 0.75 - 0.25j, 0.5 + 0j])
    est = torch.tensor([0.55 + 0j, 0.75 - 0.25j, 0.76 + 0.25j, 0.01 + 0j])
    err = ac.matched_eig_errors(est, ref)
    assert err == pytest.approx([0.01 / abs(0.75 + 0.25j), 0.0, 0.1])
    assert ac.slow_modes(ref).tolist() == [True, True, False]
    assert ac.eigen_label(0.75 + 0.25j) == "0.75+0.25i" and ac.eigen_label(0.5) == "0.50"


def planted_markov_model(chain, d_model=8, seed=0):
    """A ToyTransformer whose last residual stream is an embedding of the current state: attention
    writes nothing, no MLP, no positions, no LayerNorm; the readout gives logits 4 P[state]."""
    cfg = ToyConfig(d_vocab=chain.n_states, n_ctx=31, d_model=d_model, n_layers=1, n_heads=2, d_mlp=0,
                    positional="none", normalization=None)
    model = ToyTransformer(cfg, seed=seed).eval()
    with torch.no_grad():
        model.blocks[0].attn.W_O.zero_()
        E = model.W_E.double()
        model.unembed.W_U.copy_((torch.linalg.pinv(E) @ (4 * chain.P)).float())
        model.unembed.b_U.zero_()
    return model


def test_markov_pipeline_on_a_planted_model_with_a_known_operator():
    """Known answers: the core is the span of the centred state embeddings (3-D), the fitted operator is
    the empirical transition matrix of the extraction sequences (its eigenvalues exactly), the model
    predicts "stay", and removing the whole core leaves one constant prediction."""
    from circuitbook.tasks.markov import MarkovChain

    chain = MarkovChain.circulant(4, 0.75)
    states = chain.sample(80, 32, seed=3)
    tokens, labels = states[:, :-1], states[:, 1:]
    model = planted_markov_model(chain)
    m = ac.markov_model_analysis(model, chain, tokens, labels, n_sequences=40, definition=ace.PAPER)
    E = model.W_E.double()
    centred_span = torch.linalg.svd(E - E.mean(0), full_matrices=False).Vh[:3].T
    assert m.core.rank == 3 and m.core.sigma.numel() == 3
    assert projector_overlap(m.core, centred_span) == pytest.approx(1.0, abs=1e-6)
    fit = tokens[:40]
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for a, b in zip(fit[:, :-1].flatten(), fit[:, 1:].flatten()):
        counts[a, b] += 1
    empirical = counts / counts.sum(1, keepdim=True)
    eig = torch.linalg.eigvals(empirical)
    eig = eig[torch.argsort((eig - 1).abs())][1:]  # drop the eigenvalue 1
    assert ac.matched_eig_errors(m.operator.eigenvalues, eig).max() < 1e-6
    truth = ac.matched_eig_errors(eig, chain.eigenvalues()[1:])
    assert m.eig_errors == pytest.approx(truth, abs=1e-6)
    assert m.slow_error == pytest.approx(truth[:2].max(), abs=1e-6) and m.fast_error == pytest.approx(truth[2], abs=1e-6)
    val_labels, val_tokens = labels[40:80], tokens[40:80]
    assert m.accuracy == pytest.approx(float((val_labels == val_tokens).double().mean()), abs=1e-6)
    v = m.validation
    assert v.definition == "paper" and v.ks == [1, 2, 3]
    # by hand, per state: the paper's keep maps E[s] to E[s] QQ^T, its remove to E[s] - E[s] QQ^T
    P = m.core.projector
    kept_pred = ((E @ P) @ model.W_U.double()).argmax(-1)
    removed_pred = ((E - E @ P) @ model.W_U.double()).argmax(-1)
    assert len(set(removed_pred.tolist())) == 1  # outside the core every state looks the same
    assert v.keep[-1] == pytest.approx(float((val_labels == kept_pred[val_tokens]).double().mean()), abs=1e-6)
    assert v.remove[-1] == pytest.approx(float((val_labels == removed_pred[0]).double().mean()), abs=1e-6)
    assert v.necessary_dim == 3  # max(energy rank 3, k): remove falls to one constant class


def test_state_conditional_operator_recovers_the_chain():
    from circuitbook.tasks.markov import MarkovChain

    chain = MarkovChain.circulant(4, 0.75)
    states = chain.sample(3000, 30, seed=0)
    simplex = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [-1, -1, -1]], dtype=torch.float64)
    clean = simplex[states]  # coordinates that encode the current state only
    op, frac = ac.state_conditional_operator(clean, states, 4)
    assert frac == pytest.approx(0.0, abs=1e-12)
    assert ac.eig_relative_error(op.eigenvalues, chain.eigenvalues()[1:]) < 0.02
    # mixing in the previous state biases the plain fit, not the state-conditional one
    mixed = clean.clone()
    mixed[:, 1:] += 0.5 * clean[:, :-1]
    plain = ace.fit_core_operator(mixed, intercept=True)
    op2, frac2 = ac.state_conditional_operator(mixed, states, 4)
    assert frac2 > 0.05
    assert ac.eig_relative_error(plain.eigenvalues, chain.eigenvalues()[1:]) > 0.1


MARKOV_CFG = dict(markov_states=4, markov_stay=0.75, markov_n_train=64, markov_n_test=40, markov_length=12,
                  markov_d_model=16, markov_n_heads=2, markov_d_mlp=32, markov_epochs=5, markov_batch=32,
                  markov_lr=3e-3, markov_seeds=[0, 100], markov_eval_sequences=20, markov_dropout=0.1,
                  energy_threshold=0.999)


def test_markov_pipeline_on_a_tiny_run(runs_dir):
    cfg = SimpleNamespace(**MARKOV_CFG)
    chain, test = ac.markov_chain(cfg), ac.markov_task(cfg).test
    for setup, norm, dropout, init, definition in (("paper", "postLN", 0.1, "pytorch", "paper"),
                                                   ("normal_init", "postLN", 0.1, "normal", "paper"),
                                                   ("book", "LN", 0.0, "normal", "book")):
        run = ac.train_markov(cfg, setup)
        model_cfg = ac.markov_model_config(cfg, setup)
        assert run.train_config.steps == 10 and run.n_members == 2
        assert (model_cfg.normalization, model_cfg.dropout) == (norm, dropout)
        assert model_cfg.init == init and run.model_config == model_cfg
        assert ac.markov_definition(cfg, setup).name == definition
        members = [ac.markov_member_analysis(run, k, chain, test, ac.markov_definition(cfg, setup), n_sequences=20)
                   for k in range(2)]
        for m in members:
            assert m.core.rank >= 1 and m.coords.shape == (20, 11, m.core.rank)
            assert 0 <= m.common_mode_share <= 1 and m.centred_rank >= 1
            if norm == "postLN":  # an affine readout of 4 logits has 3 centred directions
                assert m.centred_rank <= 3
            if definition == "book":
                assert m.common_mode_share == 0.0 and m.centred_rank == m.core.rank
            assert m.activations.shape == (220, 16) and 0 <= m.accuracy <= 1
            assert m.validation.definition == definition
        assert [m.seed for m in members] == [0, 100]
        pairs = ac.markov_pairs(run, members, chain)
        assert len(pairs) == 1 and 0 <= pairs.overlap[0] <= 1 and 0 <= pairs.cca_mean[0] <= 1 + 1e-9
        # the weights at step 0 are the members' random initialisations
        init = weight_cosine(ac.weight_matrices(run.model(0, step=0)),
                             ac.weight_matrices(ToyTransformer(model_cfg, seed=0))).overall
        assert init == pytest.approx(1.0)
        values = ac.markov_claim_values(chain, members, pairs)
        assert len(values["core_dim"]) == 2 and values["max_weight_cosine"] == abs(pairs.weight_cosine[0])
        assert set(run.metrics().columns) >= {"acc_train", "acc_test"}
    assert run.key != ac.train_markov(cfg, "paper").key
    for bad in (ac.markov_model_config, ac.markov_definition, ac.train_markov):
        with pytest.raises(ValueError, match="setup"):
            bad(cfg, "pre-LN")


def test_next_token_accuracy_scores_every_position():
    """The Markov runs' callback: every-position accuracy per member (member 0's own predictions as labels: 1),
    an `Evaluator` that digests its pools."""
    from circuitbook.tasks.base import Batch
    from circuitbook.training import Ensemble, Evaluator

    cfg = ToyConfig(d_vocab=4, n_ctx=5, d_model=8, n_heads=2, d_mlp=0)
    ens = Ensemble(cfg, [0, 1])
    tokens = torch.randint(0, 4, (10, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pred = ens.logits(tokens).argmax(-1)
    labels = pred[0].clone()
    evaluate = ac.NextTokenAccuracy({"x": Batch(tokens, labels)})
    out = evaluate(ens, 0)["acc_x"]
    assert isinstance(evaluate, Evaluator) and list(evaluate(ens, 0)) == ["acc_x"]
    assert out[0] == pytest.approx(1.0) and out[1] == pytest.approx((pred[1] == labels).float().mean())
    spec = evaluate.spec()
    assert spec["evaluator"] == "NextTokenAccuracy" and spec["positions"] == "all" and "x" in spec["pools"]
    assert ac.NextTokenAccuracy({"x": Batch(tokens, labels.roll(1, 0))}).spec() != spec
    with pytest.raises(ValueError, match="one Batch"):
        ac.NextTokenAccuracy({"x": [Batch(tokens, labels)]})


def test_setups_side_by_side():
    assert ac.seed_summary([3.0, 4.0, 4.0]) == "4 (3 to 4)"
    assert ac.seed_summary([0.5, float("nan")]) == "0.5 (0.5 to 0.5), 1 not measured"
    assert ac.seed_summary(0.123456) == "0.1235" and ac.seed_summary([float("nan")]) == "nan"
    out = ac.compare_setups({"paper": {"x": [1.0, 2.0, 3.0]}, "book": {"x": [4.0, 4.0, 4.0]}}, {"x": "ac_x"})
    assert out.to_dict("records") == [{"measurement": "x", "recorded as": "ac_x", "paper": "2 (1 to 3)",
                                       "book": "4 (4 to 4)"}]


# ------------------------------------------------------------------ grokking helpers
def test_shift_operator_of_a_fourier_representation_is_a_rotation():
    p, freqs = 11, (1, 3)
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    c = ((a + b) % p).flatten().double()
    feats = torch.stack([f(2 * math.pi * k * c / p) for k in freqs for f in (torch.cos, torch.sin)], 1)
    H = feats @ torch.randn(4, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    core = ace.extract_core(H, torch.eye(10, dtype=torch.float64).expand(len(H), 10, 10), rank=4)
    op = ac.shift_operator(core, H, p)
    assert ac.unit_circle_deviation(op.eigenvalues) == pytest.approx(0.0, abs=1e-9)
    angles = sorted(abs(cmath.phase(complex(e))) for e in op.eigenvalues)
    assert angles == pytest.approx(sorted([2 * math.pi * k / p for k in freqs for _ in (0, 1)]))
    assert ac.unit_circle_deviation(torch.tensor([0.5 + 0j, 1j])) == pytest.approx(0.25)


@pytest.mark.parametrize("block", ac.MODULAR_BLOCKS)
def test_modular_core_at_runs_on_a_small_model(block):
    task = ac.modular_task(7, 0.5, block)
    model_cfg = ac.modular_model_config(7, 1, 16, 2, 32, block)
    assert (model_cfg.n_ctx, model_cfg.d_vocab) == ((2, 7) if block == "paper" else (3, 8))
    assert (model_cfg.normalization, model_cfg.init) == (("postLN", "pytorch") if block == "paper" else (None, "normal"))
    model = ToyTransformer(model_cfg, seed=0)
    res = ac.modular_core_at(model, task, definition=ac.with_threshold(ace.PAPER, 0.99), alternative=ace.BOOK)
    assert 1 <= res["rank"] <= 7 and len(res["eigenvalues"]) == res["rank"]
    assert 1 <= res["alt_rank"] <= 6  # centred logits of p = 7 outputs span 6 dimensions, raw logits 7
    for key in ("sufficient_dim", "necessary_dim", "alt_sufficient_dim", "alt_necessary_dim"):
        assert res[key] >= 1  # a number, inf where no k qualifies
    assert res["necessary_dim"] >= res["rank"]  # the paper's: max(energy rank, k)
    assert res["core_dim"] == max(res["rank"], res["necessary_dim"]) and res["necessary_k"] <= res["necessary_dim"]
    assert 0 <= res["unit_circle_share"] <= 1
    with pytest.raises(ValueError, match="block"):
        ac.modular_model_config(7, 1, 16, 2, 32, "pre-LN")


def test_class_mean_operator_of_a_fourier_representation_is_on_the_unit_circle():
    """Activations = Fourier features of the answer c plus per-input noise: the class means rotate exactly
    (every eigenvalue on the circle, share 1); features that shrink along the cycle give share 0."""
    p, freqs = 11, (1, 3)
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    c = ((a + b) % p).flatten()
    feats = torch.stack([f(2 * math.pi * k * c.double() / p) for k in freqs for f in (torch.cos, torch.sin)], 1)
    gen = torch.Generator().manual_seed(0)
    H = feats @ torch.randn(4, 10, generator=gen, dtype=torch.float64) \
        + 0.3 * torch.randn(len(c), 10, generator=gen, dtype=torch.float64)
    core = ace.extract_core(H, torch.eye(10, dtype=torch.float64).expand(len(H), 10, 10), rank=4)
    op = ac.class_mean_operator(core, H, c, p)
    assert ac.unit_circle_share(op.eigenvalues, ac.unit_circle_tolerance(p)) == 1.0
    assert sorted(abs(cmath.phase(complex(e))) for e in op.eigenvalues) == \
        pytest.approx(sorted([2 * math.pi * k / p for k in freqs for _ in (0, 1)]), abs=0.05)
    assert ac.unit_circle_tolerance(53) == pytest.approx(math.sin(math.pi / 53))
    assert ac.unit_circle_share(torch.tensor([1.0 + 0j, 0.5, 1j * 1.04, 0.9]), 0.05) == 0.5
    with pytest.raises(ValueError, match="every answer"):
        ac.class_mean_operator(core, H, c % 5, p)


def test_joint_crossing_is_when_every_member_has_grokked():
    metrics = pd.DataFrame({"step": [0, 10, 20, 30, 40] * 2, "member": [0] * 5 + [1] * 5,
                            "acc_test": [0.1, 0.995, 0.98, 0.999, 1.0, 0.1, 0.2, 0.995, 0.999, 1.0]})
    assert ac.joint_crossing(metrics) == 30  # member 0 dips below 0.99 at step 20
    assert math.isnan(ac.joint_crossing(metrics.assign(acc_test=0.5)))


def test_seed_mean_exponent_fits_the_mean_delay_per_sweep_point():
    """Seeds scatter around delay = 1000 / omega with multiplicative noise that averages to 1 at every
    point: the seed-mean fit recovers -1 exactly, while seeds alone scatter."""
    omegas = [1.0, 1.5, 2.0, 3.0]
    noise = {0: 0.5, 1: 1.5, 2: 1.0}
    rows = [{"seed": s, "omega": w, "delay": 1000 / w * (noise[s] if i % 2 else 2 - noise[s])}
            for i, w in enumerate(omegas) for s in noise]
    rows.append({"seed": 3, "omega": 3.0, "delay": float("nan")})  # did not grok: left out of the mean
    times = pd.DataFrame(rows)
    points = ac.seed_mean_delays(times, "omega")
    assert points["mean"].tolist() == pytest.approx([1000 / w for w in omegas])
    assert points["grokked"].tolist() == [3, 3, 3, 3] and points["seeds"].tolist() == [3, 3, 3, 4]
    fit = ac.seed_mean_exponent(times, "omega")
    assert fit.exponent == pytest.approx(-1.0) and fit.n == 4
    spread = ac.per_seed_exponents(times, "omega")["exponent"]
    assert spread.max() - spread.min() > 0.5
    assert ac.seed_mean_exponent(times[times.omega < 1.6], "omega") is None  # two points: no fit


def test_grokking_times():
    steps = np.arange(0, 1000, 10)
    train = np.clip(steps / 100, 0, 1)  # reaches 1 at step 100
    test = (steps >= 640).astype(float)
    df = pd.DataFrame({"step": np.concatenate([steps, steps]), "member": [0] * 100 + [1] * 100,
                       "seed": [5] * 100 + [6] * 100, "acc_train": np.concatenate([train, train]),
                       "acc_test": np.concatenate([test, np.zeros(100)])})
    times = ac.grokking_times(df)
    assert times.loc[0, ["tau_mem", "tau_grok", "delay"]].tolist() == [100, 640, 540]
    assert math.isnan(times.loc[1, "tau_grok"]) and times.loc[1, "seed"] == 6
    # the first evaluated step at or above the level, not interpolated (unsorted steps are sorted first)
    steps3 = pd.DataFrame({"step": [20, 0, 10, 30], "member": 0, "seed": 1, "acc_train": [1.0, 0.0, 0.995, 0.5],
                           "acc_test": [0.5, 0.0, 0.2, 0.98]})
    row = ac.grokking_times(steps3).iloc[0]
    assert row["tau_mem"] == 10.0 and math.isnan(row["tau_grok"]) and math.isnan(row["delay"])


def test_grokking_summary_and_growth():
    traj = pd.DataFrame({"step": [100, 200, 300, 400, 500] * 2, "member": [0] * 5 + [1] * 5,
                         "rank": [20, 30, 25, 8, 12, 5, 5, 5, 5, 5],
                         "keep_ratio_at_rank": [0.5, 0.6, 0.7, 0.99, 1.0] + [1.0] * 5,
                         "remove_acc_at_rank": [0.3, 0.2, 0.2, 0.02, 0.02] + [0.5] * 5,
                         "unit_circle_deviation": [0.4, 0.3, 0.2, 0.01, 0.02] + [0.5] * 5,
                         "necessary_dim": [5, 6, 7, 8, 24] + [None] * 5,
                         "necessary_k": [5, 6, 7, 3, 24] + [None] * 5,
                         "core_dim": [20, 30, 25, 8, 24] + [math.inf] * 5,
                         "unit_circle_share": [0.0, 0.1, 0.2, 0.95, 1.0] + [0.0] * 5,
                         "sufficient_dim": [30, 30, 20, 8, 8] + [5] * 5})
    times = pd.DataFrame({"member": [0, 1], "seed": [3, 4], "tau_mem": [150.0, 100.0], "tau_grok": [350.0, math.nan]})
    out = ac.grokking_summary(traj, times, 350.0)
    row = out.iloc[0]
    assert row["grok checkpoint"] == 400 and row["rank before (max)"] == 30  # steps 200 and 300
    assert row["core dim before (max)"] == 30 and row["core dim at grokking"] == 8
    assert row["rank at grokking"] == 8 and row["deviation before (median)"] == pytest.approx(0.25)
    assert row["deviation at grokking"] == 0.01 and row["deviation final"] == 0.02
    assert row["circle share at grokking"] == 0.95 and row["necessary k at grokking"] == 3
    assert row["necessary final"] == 24
    # the grokking point is the run's: member 1 (never grokked by itself) is read at the same checkpoint
    assert out.iloc[1]["grok checkpoint"] == 400 and out.iloc[1]["core dim at grokking"] == math.inf
    assert "grok checkpoint" not in ac.grokking_summary(traj, times, math.nan)  # no grokking point: only the times
    g = ac.dimension_growth(traj[traj.member == 0], 350.0)
    assert g["necessary growth"] == 3.0 and g["sufficient ratio"] == 1.0 and g["from step"] == 400
    g1 = ac.dimension_growth(traj[traj.member == 1], math.nan)
    assert g1["from step"] == 100 and not g1["from grokking"] and math.isnan(g1["necessary growth"])
    assert ac.pick_steps(range(1, 101), 5) == [1, 26, 51, 75, 100] and ac.pick_steps([3, 1, 2], 5) == [1, 2, 3]


def test_final_frequencies_of_rotations():
    p = 11
    eig = np.exp(2j * np.pi * np.array([1, -1, 3, -3]) / p)
    traj = pd.DataFrame({"step": [10, 20], "member": [0, 0], "eigenvalues": [np.array([0.5 + 0j]), eig]})
    out = ac.final_frequencies(traj, p)
    assert out.step.tolist() == [20] and out.frequencies[0] == [1, 3]
    assert out["largest distance to an integer"][0] == pytest.approx(0.0, abs=1e-9)
    assert ac.eigen_frequencies(np.exp(2j * np.pi * np.array([2.5]) / p), p) == pytest.approx([2.5])


GROK_CFG = dict(grok_p=7, grok_train_fraction=0.5, grok_layers=1, grok_d_model=8, grok_heads=2, grok_d_mlp=16,
                grok_lr=1e-3, grok_wd=1.0, grok_batch=8, grok_epochs=6, grok_checkpoint_every_epochs=2,
                grok_seeds=[0], grok_block="paper", grok_dropout=0.1, grok_fork_epoch=None)


def test_choose_fork_step_uses_the_paper_epoch_or_the_midpoint(runs_dir):
    cfg = SimpleNamespace(**GROK_CFG)
    run = ac.train_grokking(cfg)
    spe = ac.grokking_task(cfg).steps_per_epoch(8)  # 24 training pairs at batch 8: 3 steps per epoch
    assert spe == 3 and run.checkpoint_steps() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 14, 18]
    times = pd.DataFrame({"member": [0], "tau_mem": [4.0], "tau_grok": [17.0]})
    at = lambda epoch: SimpleNamespace(**{**GROK_CFG, "grok_fork_epoch": epoch})
    assert ac.choose_fork_step(at(3), run, times) == 9  # the last checkpoint at or before epoch 3 (step 9)
    assert ac.choose_fork_step(at(2), run, times) == 6
    assert ac.fork_step(at(2), run) == 6  # the paper's epoch needs no curves
    assert ac.choose_fork_step(cfg, run, times) == 9  # at or before the midpoint 10.5 of 4 and 17
    assert ac.choose_fork_step(cfg, run, times.assign(tau_grok=float("nan"))) == run.checkpoint_steps()[1]
    # from the run's own curves, as the notebook and notebook_runs choose it
    assert ac.fork_step(cfg, run) == ac.auto_fork_step(run, ac.grokking_times(run.metrics()))
    branch = ac.train_wd0_branch(cfg, run, 6)
    assert branch.train_config.weight_decay == 0.0 and branch.train_config.steps == run.train_config.steps
    assert min(branch.checkpoint_steps()) >= 6


def test_notebook_runs_are_planned_without_training(runs_dir):
    """notebook_runs inside planning(): every run of each notebook, nothing trained; a fork step chosen from
    curves is planned at the middle checkpoint, with a note."""
    from circuitbook import params
    from circuitbook.training import planning

    expected = {"01_planted": [], "02_markov": ["algorithmic_cores/markov", "algorithmic_cores/markov_normal_init",
                                                "algorithmic_cores/markov_book", "algorithmic_cores/markov_survey"],
                "03_grokking": ["algorithmic_cores/grokking", "algorithmic_cores/grokking_wd0"],
                "04_delay_law": ["algorithmic_cores/omega_sweep", "algorithmic_cores/p_sweep_7",
                                 "algorithmic_cores/p_sweep_11", "algorithmic_cores/p_sweep_13"],
                "05_agreement": []}
    for nb, names in expected.items():
        cfg = params.resolve("algorithmic_cores", nb, "smoke")
        with planning.planning() as plan:
            runs = ac.notebook_runs(cfg)
        assert [r.dir.name for r in plan.runs] == names and [r.dir.name for r in runs.values()] == names
        if nb == "03_grokking":
            steps = runs["grokking"].checkpoint_steps()
            assert runs["wd0"].start == steps[len(steps) // 2]
            assert "middle checkpoint" in plan.notes["algorithmic_cores/grokking_wd0"]
    assert not runs_dir.exists() or not any(runs_dir.rglob("config.json"))


def test_per_seed_exponents_and_fits_that_cannot_be_made():
    omegas = [1.0, 1.5, 2.0, 3.0]
    rows = [{"seed": s, "omega": w, "delay": 100 * w ** e} for s, e in ((0, -1.0), (1, -0.5)) for w in omegas]
    rows += [{"seed": 2, "omega": w, "delay": d} for w, d in zip(omegas, [50.0, float("nan"), float("nan"), 20.0])]
    out = ac.per_seed_exponents(pd.DataFrame(rows), "omega")
    assert out.exponent[:2].tolist() == pytest.approx([-1.0, -0.5]) and out.points.tolist() == [4, 4, 2]
    assert math.isnan(out.exponent[2])  # two points grokked: no fit
    assert ac.fit_power_law_or_none([1, 2], [3, 4]) is None


def test_column_values_per_seed():
    df = pd.DataFrame({"sweep": ["a", "a", "b"], "exponent": [-1.0, None, 2.0], "text": ["x", "1.5", "y"]})
    assert ac.column_values(df, "exponent", sweep="b") == [2.0]
    out = ac.column_values(df, "exponent", sweep="a")
    assert out[0] == -1.0 and math.isnan(out[1])
    assert ac.column_values(df, "text")[1] == 1.5 and math.isnan(ac.column_values(df, "text")[0])
    assert len(ac.column_values(df, "missing")) == 3 and math.isnan(ac.column_values(df, "missing")[0])


def test_dimensions_are_numbers_never_nan():
    assert ac.dim_value(None) == math.inf and ac.dim_value(3) == 3.0


def test_epochs_to_steps():
    assert ac.epochs_to_steps(900, 1404, 512) == 2700
    assert ac.epochs_to_steps(10, 480, 1000) == 10


# ------------------------------------------------------------------ agreement helpers
def test_margin_metric_and_verbs():
    logits = torch.zeros(3, 2, 6)
    logits[0, -1, 2], logits[1, -1, 4], logits[2, -1, 2] = 1.0, 1.0, -1.0
    margin = ac.agreement_margin(2, 4)(logits[:, -1])
    assert margin.tolist() == [1.0, -1.0, -1.0]
    assert ac.first_verb_number("cabinet is open") == "singular"
    assert ac.first_verb_number(" were there, is it") == "plural"
    assert ac.first_verb_number("nothing here") == ""
    assert ac.first_verb_number(" of the sea.\n\nThe key is", first_clause=True) == ""
    assert ac.first_verb_number(" are in the drawer. It is", first_clause=True) == "plural"


def test_spearman_alignment():
    idx = [f"p{i}" for i in range(10)]
    a = pd.Series(np.arange(10.0), index=idx)
    b = pd.Series(np.arange(10.0) ** 3, index=idx)  # monotone: Spearman 1
    c = pd.Series(-np.arange(10.0), index=idx[::-1])  # same prompts, other order: also increasing in i
    out = ac.spearman_alignment({"a": a, "b": b, "c": c})
    assert out.spearman.tolist() == pytest.approx([1.0, 1.0, 1.0]) and out.n_prompts.tolist() == [10, 10, 10]
    assert ac.spearman_alignment({"a": a}).empty


def test_agreement_pipeline_on_the_tiny_model():
    from circuitbook.models import pretrained as pt
    from circuitbook.tasks import agreement as ag

    loaded = pt.load_bridge(pt.TINY)
    prompts = ag.make_prompts(ag.NOUNS[:12], n_per_subject=2)
    res = ac.agreement_model_analysis(loaded, prompts, layer_stride=1, n_generate=2, gen_tokens=3,
                                      gen_prefix="The dog is old .")
    assert res.per_layer.layer.tolist() == [0, 1] and res.best_layer in (0, 1)
    assert set(res.best) >= {"acc_clean", "acc_keep", "acc_remove", "acc_flip", "flip_rate"}
    assert 0 <= res.best["flip_rate"] <= 1 and len(res.coords) == res.n_test
    assert 1 <= len(res.generations) <= 2  # prompts whose clean continuation starts with a verb, if any
    # the core is oriented: singular prompts have the larger mean coordinate on the training set
    data = ag.encode_prompts(loaded.tokenizer, prompts).split("train")
    cores, ranks, inputs = ac.layer_cores(loaded.bridge, data.tokens, data.labels, data.singular_id, data.plural_id, [1])
    z = cores[1].coordinates(inputs[1].activations)[:, 0]
    assert z[data.labels > 0].mean() >= z[data.labels < 0].mean()
    # a flip applied twice is the identity
    h = torch.randn(5, cores[1].dim)
    once = ace.apply_intervention(h, cores[1].Q.float(), cores[1].mu.float(), "flip")
    assert torch.allclose(ace.apply_intervention(once, cores[1].Q.float(), cores[1].mu.float(), "flip"), h, atol=1e-5)


# ---------------------------------------------------------------- how often seeds agree (AC-2, AC-3 over many seeds)
def _fake_core(basis, sigma):
    return SimpleNamespace(rank=basis.shape[1], sigma=torch.tensor(sigma, dtype=torch.float64), basis=basis)


def test_seed_survey_counts_ranks_shares_and_triples_with_known_answers():
    from circuitbook.analysis.compare import projector_overlap
    from circuitbook.experiments.algorithmic_cores.measure import SeedCore, random_triple_overlaps, seed_survey

    eye = torch.eye(8, dtype=torch.float64)
    # seeds 0, 1 share the subspace e0..e2, seed 2 is e3..e5, seed 3 (rank 4) e0..e3
    bases = [eye[:, :3], eye[:, :3], eye[:, 3:6], eye[:, :4]]
    cores = [SeedCore(seed=s, rank=b.shape[1], fourth_share=f, centred_rank=3, core=b)
             for s, (b, f) in enumerate(zip(bases, [0.0005, 0.0008, 0.0009, 0.002]))]
    out = seed_survey(cores, threshold=0.999, target_rank=3, dim=8, n_random=50)
    assert out["n_seeds"] == 4 and out["share_at_rank"] == 0.75 and out["share_centred_at_rank"] == 1.0
    assert out["share_fourth_counted"] == 0.25 and out["fourth_share_median"] == pytest.approx(0.00085)
    assert out["n_triples"] == 4 and out["share_triples_at_rank"] == 0.25  # only (0, 1, 2)
    o = {(i, j): projector_overlap(bases[i], bases[j]) for i in range(4) for j in range(i + 1, 4)}
    assert o[(0, 1)] == pytest.approx(1.0) and o[(0, 2)] == pytest.approx(0.0)
    means = sorted(np.mean([o[a], o[b], o[c]]) for a, b, c in
                   [((0, 1), (0, 2), (1, 2)), ((0, 1), (0, 3), (1, 3)), ((0, 2), (0, 3), (2, 3)),
                    ((1, 2), (1, 3), (2, 3))])
    assert out["triple_overlap_median"] == pytest.approx(np.median(means))
    assert out["share_triples_low_overlap"] == 0.0
    # random 3-dimensional subspaces of R^64: mean overlap about 3/64 (the chapter's baseline)
    assert np.median(random_triple_overlaps(64, 3, 400)) == pytest.approx(3 / 64, rel=0.15)
    with pytest.raises(ValueError, match="at least 3 seeds"):
        seed_survey(cores[:2], 0.999, 3, 8)
