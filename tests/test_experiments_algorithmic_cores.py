"""Chapter algorithmic_cores: known answers for the experiment helpers."""
import cmath
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from circuitbook.analysis import ace
from circuitbook.analysis.compare import projector_overlap
from circuitbook.experiments import algorithmic_cores as ac
from circuitbook.models.toy import ToyConfig, ToyTransformer
from circuitbook.tasks.modular import ModularAddition


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


# ------------------------------------------------------------------ readout-side validation
@pytest.mark.parametrize("norm", ["LN", None])
def test_validate_readout_equals_hook_validation(norm):
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=16, n_layers=2, n_heads=2, d_mlp=32, d_vocab_out=5, normalization=norm)
    model = ToyTransformer(cfg, seed=1).eval()
    tokens = torch.randint(0, 7, (300, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        labels = model(tokens)[:, -1].argmax(-1)
    labels[::3] = (labels[::3] + 1) % 5  # not all correct
    core, inputs = ac.ace_final(model, tokens, energy_threshold=0.99)
    ref = ace.validate_core(model, tokens, labels, ac.final_hook(cfg), core, chance=0.2)
    got = ac.validate_readout(model, inputs.activations, labels, core, chance=0.2)
    assert got.clean == pytest.approx(ref.clean)
    for mode in ("keep", "remove", "flip"):
        assert getattr(got, mode) == pytest.approx(getattr(ref, mode), abs=1e-6)
    assert (got.sufficient_dim, got.necessary_dim) == (ref.sufficient_dim, ref.necessary_dim)


@pytest.mark.parametrize("norm", ["LN", None])
def test_readout_jacobians_equal_autograd_through_the_model(norm):
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=16, n_layers=2, n_heads=2, d_mlp=32, normalization=norm)
    model = ToyTransformer(cfg, seed=3).eval()
    tokens = torch.randint(0, 7, (30, 4), generator=torch.Generator().manual_seed(2))
    ref = ace.collect_ace_inputs(model, tokens, ac.final_hook(cfg), output_fn=ac.centred_logits, position="all")
    core, got = ac.ace_final(model, tokens, position="all")
    assert torch.allclose(got.activations, ref.activations, atol=1e-6)
    assert torch.allclose(got.jacobians, ref.jacobians, atol=1e-5)
    assert (got.n_sequences, got.n_positions) == (30, 4)


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


def test_next_token_accuracy_callback():
    cfg = ToyConfig(d_vocab=4, n_ctx=5, d_model=8, n_heads=2, d_mlp=0)
    ens = ac.Ensemble(cfg, [0, 1])
    tokens = torch.randint(0, 4, (10, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pred = ens.logits(tokens).argmax(-1)
    labels = pred[0].clone()
    evaluate = ac.next_token_accuracy({"x": ac.Batch(tokens, labels)})
    out = evaluate(ens, 0)["acc_x"]
    assert out[0] == pytest.approx(1.0) and out[1] == pytest.approx((pred[1] == labels).float().mean())
    assert "next_token_accuracy" in evaluate.spec()


def test_markov_pipeline_on_a_tiny_run(runs_dir):
    cfg = SimpleNamespace(markov_states=4, markov_stay=0.75, markov_n_train=64, markov_n_test=40, markov_length=12,
                          markov_d_model=16, markov_n_heads=2, markov_d_mlp=32, markov_epochs=5, markov_batch=32,
                          markov_lr=3e-3, markov_seeds=[0, 100], markov_eval_sequences=20)
    exp = ac.train_markov(cfg)
    assert exp.train_config.steps == 10 and exp.run.n_members == 2
    members = [ac.markov_member_analysis(exp, k, n_sequences=20) for k in range(2)]
    for m in members:
        assert m.core.rank >= 1 and m.coords.shape == (20, 11, m.core.rank)
        assert 0 <= m.accuracy <= 1
    pairs = ac.markov_pairs(exp, members)
    assert len(pairs) == 1 and 0 <= pairs.overlap[0] <= 1 and 0 <= pairs.cca_mean[0] <= 1 + 1e-9


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


def test_modular_core_at_runs_on_a_small_model():
    task = ModularAddition(p=7, train_fraction=0.5)
    model = ToyTransformer(ac.modular_model_config(7, 1, 16, 2, 32), seed=0)
    res = ac.modular_core_at(model, task, max_rank=8)
    assert 1 <= res["rank"] <= 16 and len(res["eigenvalues"]) == res["rank"]
    ks = res["validation"].ks
    assert ks == list(range(1, len(ks) + 1)) and len(ks) <= 6  # centred logits of p = 7 outputs span 6 dims


def test_first_crossing_and_grokking_times():
    steps = np.arange(0, 1000, 10)
    train = np.clip(steps / 100, 0, 1)  # reaches 1 at step 100
    test = (steps >= 640).astype(float)
    assert ac.first_crossing(steps, train, 0.99) == 100
    assert math.isnan(ac.first_crossing(steps, train * 0.5, 0.99))
    df = pd.DataFrame({"step": np.concatenate([steps, steps]), "member": [0] * 100 + [1] * 100,
                       "seed": [5] * 100 + [6] * 100, "acc_train": np.concatenate([train, train]),
                       "acc_test": np.concatenate([test, np.zeros(100)])})
    times = ac.grokking_times(df)
    assert times.loc[0, ["tau_mem", "tau_grok", "delay"]].tolist() == [100, 640, 540]
    assert math.isnan(times.loc[1, "tau_grok"]) and times.loc[1, "seed"] == 6


def test_grokking_summary_and_growth():
    traj = pd.DataFrame({"step": [100, 200, 300, 400, 500] * 2, "member": [0] * 5 + [1] * 5,
                         "rank": [20, 30, 25, 8, 12, 5, 5, 5, 5, 5],
                         "keep_ratio_at_rank": [0.5, 0.6, 0.7, 0.99, 1.0] + [1.0] * 5,
                         "remove_acc_at_rank": [0.3, 0.2, 0.2, 0.02, 0.02] + [0.5] * 5,
                         "unit_circle_deviation": [0.4, 0.3, 0.2, 0.01, 0.02] + [0.5] * 5,
                         "necessary_dim": [5, 6, 7, 8, 24] + [None] * 5,
                         "sufficient_dim": [30, 30, 20, 8, 8] + [5] * 5})
    times = pd.DataFrame({"member": [0, 1], "seed": [3, 4], "tau_mem": [150.0, 100.0], "tau_grok": [350.0, math.nan]})
    out = ac.grokking_summary(traj, times)
    row = out.iloc[0]
    assert row["grok checkpoint"] == 400 and row["rank before (max)"] == 30  # steps 200 and 300
    assert row["rank at grokking"] == 8 and row["deviation before (median)"] == pytest.approx(0.25)
    assert row["deviation at grokking"] == 0.01 and row["deviation final"] == 0.02
    assert row["necessary final"] == 24 and math.isnan(out.iloc[1]["rank at grokking"])
    g = ac.dimension_growth(traj[traj.member == 0], 350.0)
    assert g["necessary growth"] == 3.0 and g["sufficient ratio"] == 1.0 and g["from step"] == 400
    g1 = ac.dimension_growth(traj[traj.member == 1], math.nan)
    assert g1["from step"] == 100 and not g1["from grokking"] and math.isnan(g1["necessary growth"])
    assert ac.pick_steps(range(1, 101), 5) == [1, 26, 51, 75, 100] and ac.pick_steps([3, 1, 2], 5) == [1, 2, 3]


def test_fit_power_law_recovers_exponents():
    rng = np.random.default_rng(0)
    x = np.repeat([0.3, 0.5, 1.0, 1.5, 2.0, 3.0], 6)
    y = 400 * x ** -1.0 * np.exp(rng.normal(0, 0.05, x.size))
    fit = ac.fit_power_law(x, y, n_boot=500)
    assert fit.exponent == pytest.approx(-1.0, abs=0.05) and fit.contains(-1.0)
    assert fit.boot_ci[0] < -1.0 < fit.boot_ci[1] and fit.prefactor == pytest.approx(400, rel=0.1)
    exact = ac.fit_power_law([1, 2, 4, 8], [8, 4, 2, 1], n_boot=50)
    assert exact.exponent == pytest.approx(-1.0) and exact.r2 == pytest.approx(1.0)
    nan_dropped = ac.fit_power_law([1, 2, 4, 8, 16], [8, 4, 2, 1, float("nan")], n_boot=10)
    assert nan_dropped.n == 4
    with pytest.raises(ValueError):
        ac.fit_power_law([1, 1, 1], [1, 2, 3])


def test_epochs_to_steps():
    assert ac.epochs_to_steps(900, 1404, 512) == 2700
    assert ac.epochs_to_steps(10, 480, 1000) == 10


# ------------------------------------------------------------------ agreement helpers
def test_margin_metric_and_verbs():
    logits = torch.zeros(3, 2, 6)
    logits[0, -1, 2], logits[1, -1, 4], logits[2, -1, 2] = 1.0, 1.0, -1.0
    margin = ac.agreement_margin(2, 4)(logits[:, -1])
    assert margin.tolist() == [1.0, -1.0, -1.0]
    metric = ac.agreement_metric(2, 4)
    assert metric(logits, torch.tensor([1, -1, 1])) == pytest.approx(2 / 3)
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
