"""Known-answer tests of the assign_add experiment definitions (phase detection, thresholds,
attention and QK measures, the QK gradient, probes, sweep plumbing)."""
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook.experiments import assign_add as ea
from circuitbook.tasks.assign_add import AssignAddTask, N_VARS, PREFIX_LEN

TASK = AssignAddTask()
TINY = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=16, n_layers=2, n_heads=1, d_mlp=32, mlp=(False, True),
                    bias=False, d_vocab_out=59)


def sigmoid(x, centre, width, lo=0.0, hi=1.0):
    return lo + (hi - lo) / (1 + np.exp(-(np.asarray(x, float) - centre) / width))


# ----------------------------------------------------------------- curves

def test_crossing_step_interpolates():
    assert ea.crossing_step([0, 100, 200], [0.0, 0.5, 1.0], 0.75) == pytest.approx(150)
    assert ea.crossing_step([0, 100], [0.95, 1.0], 0.9) == 0
    assert math.isnan(ea.crossing_step([0, 100], [0.1, 0.2], 0.9))


def test_steepest_rise_finds_sigmoid_centre():
    steps = np.arange(0, 20001, 100)
    step, rise = ea.steepest_rise(steps, sigmoid(steps, 5300, 150), window=1000)
    assert step == pytest.approx(5300, abs=60) and rise > 0.9
    # only after a given step: the second of two rises
    two = sigmoid(steps, 5300, 150, 0, 0.5) + sigmoid(steps, 15000, 300, 0, 0.5)
    step, _ = ea.steepest_rise(steps, two, window=1000, after=7000)
    assert step == pytest.approx(15000, abs=60)
    assert math.isnan(ea.steepest_rise([0, 100], [0, 1], window=500)[0])


def synthetic_metrics(add=1000, jump=5300, routing=5200, refine=15000, steps=20000, every=100, members=1):
    s = np.arange(0, steps + 1, every)
    rows = []
    for k in range(members):
        df = pd.DataFrame({"step": s, "member": k, "seed": k, "train_loss": 1.0})
        df["acc_zero_var_train"] = sigmoid(s, add, 100, 0.02, 1.0)
        for p in ea.VAR_POOLS:
            df[f"acc_{p}"] = sigmoid(s, jump, 100, 0.1, 0.99)
        for p in ea.HARD_POOLS:  # follow the jump a little, then the refinement
            df[f"acc_{p}"] = sigmoid(s, jump, 100, 0.02, 0.2) + sigmoid(s, refine, 200, 0.0, 0.78)
        df["routing"] = sigmoid(s, routing, 100, 0.2, 0.95)
        rows.append(df)
    return pd.concat(rows, ignore_index=True)


def test_detect_phases_on_synthetic_curves():
    ph = ea.detect_phases(synthetic_metrics(), window=1000)
    assert ph.jump_step == pytest.approx(5300, abs=60)
    assert ph.refine_step == pytest.approx(15000, abs=60)
    assert ph.routing_step == pytest.approx(5200, abs=20)
    assert ph.addition_step == pytest.approx(1000 + 100 * math.log(0.9 - 0.02) - 100 * math.log(1 - 0.9), abs=30)
    assert ph.variable_step > ph.jump_step
    assert set(ph.marks()) == {"addition", "jump", "refinement"}


def test_detect_phases_without_refinement():
    m = synthetic_metrics()
    for p in ea.HARD_POOLS:
        m[f"acc_{p}"] = 0.05  # flat: no refinement phase
    ph = ea.detect_phases(m, window=1000)
    assert math.isnan(ph.refine_step) and "refinement" not in ph.marks()


def test_threshold_on_a_step():
    f = np.array([0.05, 0.15, 0.25, 0.35, 0.45] * 2)
    acc = np.array([0.0, 0.2, 0.95, 1.0, 1.0, 0.0, 0.4, 0.85, 1.0, 1.0])  # two seeds
    # means 0, 0.3, 0.9, 1, 1 -> the mean reaches 0.9 exactly at 0.25
    assert ea.threshold(f, acc, 0.9) == pytest.approx(0.25)
    assert ea.threshold(f, acc, 0.6) == pytest.approx(0.15 + 0.1 * 0.3 / 0.6)
    assert math.isnan(ea.threshold([0.1, 0.2], [0.1, 0.2], 0.9))


# ----------------------------------------------------------------- matrices

def test_template_cosine_and_diagonal_fraction():
    eye = torch.eye(12)
    assert ea.template_cosine(3 * eye + 2.0 + torch.arange(12.0)[:, None]) == pytest.approx(1.0)
    assert ea.template_cosine(-eye) == pytest.approx(-1.0)
    assert math.isnan(ea.template_cosine(torch.ones(12, 12)))
    assert abs(ea.template_cosine(torch.randn(12, 12, generator=torch.Generator().manual_seed(0)))) < 0.5
    assert ea.diagonal_argmax_fraction(eye) == 1.0
    assert ea.diagonal_argmax_fraction(torch.roll(eye, 1, 1)) == 0.0


def identity_circuit_model(scale_qk=1.0):
    """A model whose variable embeddings are orthonormal, layer-1 OV and layer-2 QK the identity."""
    cfg = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=74, n_layers=2, n_heads=1, d_mlp=8, mlp=(False, True),
                       bias=False, d_vocab_out=59)
    model = cb.ToyTransformer(cfg, seed=0)
    with torch.no_grad():
        model.embed.W_E.copy_(torch.eye(74))
        model.blocks[0].attn.W_V.copy_(torch.eye(74)[None])
        model.blocks[0].attn.W_O.copy_(torch.eye(74)[None])
        model.blocks[1].attn.W_Q.copy_(scale_qk * torch.eye(74)[None])
        model.blocks[1].attn.W_K.copy_(torch.eye(74)[None])
    return model


def test_variable_qk_matrix_on_identity_circuit():
    qk = ea.variable_qk_matrix(identity_circuit_model(), TASK)
    torch.testing.assert_close(qk, torch.eye(N_VARS) / math.sqrt(74))
    assert ea.diagonal_argmax_fraction(qk) == 1.0 and ea.template_cosine(qk) == pytest.approx(1.0)
    raw = ea.variable_qk_matrix(identity_circuit_model(), TASK, composed=False)
    torch.testing.assert_close(raw, torch.eye(N_VARS) / math.sqrt(74))


# ----------------------------------------------------------------- attention measures

def test_value_positions_and_routing_score_on_hand_built_pattern():
    tokens = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 =",
                          "b 3 c 4 PAD PAD PAD PAD PAD PAD PAD PAD + 1 c ="])
    mask = ea.value_positions(tokens, TASK)
    assert mask[0].nonzero().flatten().tolist() == [2, 5, 10] and mask[1].nonzero().flatten().tolist() == [1, 3]
    prev = torch.zeros(2, 1, 16, 16)
    prev[:, 0, torch.arange(1, 16), torch.arange(15)] = 1.0  # a perfect previous-token head
    prev[:, 0, 0, 0] = 1.0
    assert ea.routing_score(prev, tokens, TASK).tolist() == [1.0]
    uniform = torch.tril(torch.ones(16, 16)) / torch.arange(1, 17)[:, None]
    expected = np.mean([1 / 3, 1 / 6, 1 / 11, 1 / 2, 1 / 4])
    assert ea.routing_score(uniform.expand(2, 1, 16, 16), tokens, TASK).item() == pytest.approx(expected)


def test_bound_attention_on_hand_built_pattern():
    tokens = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 =",
                          "b 3 c 4 PAD PAD PAD PAD PAD PAD PAD PAD + b c ="])
    pattern = torch.zeros(2, 1, 16, 16)
    pattern[0, 0, -1, 2] = 0.7  # `a` is bound at position 2
    pattern[1, 0, -1, 1], pattern[1, 0, -1, 3] = 0.4, 0.5  # b at 1, c at 3: summed
    assert ea.bound_attention(pattern, tokens, TASK).item() == pytest.approx((0.7 + 0.9) / 2)


# ----------------------------------------------------------------- gradient, probes

def test_qk_gradient_matches_autograd_through_the_factors():
    model = cb.ToyTransformer(TINY, seed=3)
    batch = TASK.train_batch(0, 64, 1)
    neg_g = ea.qk_gradient(model, batch.tokens, batch.labels, batch_size=24)  # three chunks
    logits = model(batch.tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, -1], batch.labels)
    model.zero_grad()
    loss.backward()
    attn = model.blocks[1].attn
    # W_QK = W_Q W_K^T  =>  dL/dW_Q = dL/dW_QK W_K and dL/dW_K = dL/dW_QK^T W_Q
    torch.testing.assert_close((-neg_g[0] @ attn.W_K[0].double()).float(), attn.W_Q.grad[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close((-neg_g[0].T @ attn.W_Q[0].double()).float(), attn.W_K.grad[0], rtol=1e-4, atol=1e-6)


def test_qk_basis_reads_and_blocks():
    model = identity_circuit_model()
    M = torch.zeros(74, 74)
    M[TASK.VAR0:, TASK.VAR0:] = torch.eye(N_VARS)
    Mb, names = ea.qk_in_basis(M, model, TASK)
    assert Mb.shape == (86, 86) and names[74] == "a'" and len(names) == 86
    block = ea.variable_block(Mb, TASK)  # moved variables == variables for an identity OV
    torch.testing.assert_close(block, torch.eye(N_VARS, dtype=torch.float64))
    energy = ea.block_energy(Mb, TASK)
    assert energy.loc["numbers", "numbers"] == 0 and energy.loc["moved variables", "moved variables"] > 0


def test_probe_accuracy_separable_and_chance():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (400,), generator=g)
    X = torch.nn.functional.one_hot(y, 4).float() * 3 + 0.1 * torch.randn(400, 4, generator=g)
    assert ea.probe_accuracy(X[:200], y[:200], X[200:], y[200:], 4) == 1.0
    noise = torch.randn(400, 8, generator=g)
    assert ea.probe_accuracy(noise[:200], y[:200], noise[200:], y[200:], 4) < 0.5


# ----------------------------------------------------------------- runs and sweeps plumbing

def test_sweep_members_and_init():
    members = ea.sweep_members([0.1, 0.5, 0.9], [0, 1])
    assert members.member.tolist() == list(range(6))
    assert members.member_seed.tolist() == [0, 1, 2, 1000, 1001, 1002]
    a, b = cb.ToyTransformer(TINY, seed=None), cb.ToyTransformer(TINY, seed=None)
    ea.sweep_init(a, 1000)
    ea.sweep_init(b, 1002)
    assert torch.equal(a.W_E, b.W_E)  # same seed, same init, whatever the value


def test_member_pool_accuracy_pads_per_member_pools():
    ens = cb.Ensemble(TINY, (0, 1))
    short, long_ = TASK.eval_pool("zero_var_train", 5, 0), TASK.eval_pool("one_var_train", 9, 0)
    out = ea.MemberPoolAccuracy({"p": [short, long_]})(ens, 0)["acc_p"]
    for k, b in enumerate([short, long_]):
        pred = ens.member(k)(b.tokens)[:, -1].argmax(-1)
        assert out[k].item() == pytest.approx((pred == b.labels).float().mean().item())


def test_progress_evaluator_returns_every_measure_per_member():
    ens = cb.Ensemble(TINY, (0, 1))
    ev = ea.ProgressEvaluator(TASK, pool_size=20, probe_size=16)
    out = ev(ens, 0)
    for key in ["acc_zero_var_train", "acc_heldout_zero_var", "routing", "bound_1var", "bound_2var", "qk_diag",
                "qk_identity"]:
        assert out[key].shape == (2,)
    assert 0 <= out["routing"].min() <= out["routing"].max() <= 1
    assert ev.spec()["assign_add_progress"] == ea.MEASURES_VERSION


def test_residual_cosines_grid_and_probe_data_shapes():
    model = cb.ToyTransformer(TINY, seed=0)
    cos = ea.residual_cosines(model, TASK, n=30)
    assert set(cos.form) == {"1-var left", "1-var right", "2-var"} and len(cos) == 90
    assert cos[["matched", "mismatched"]].abs().max().max() <= 1 + 1e-9
    grid = ea.mlp_preactivation_grid(model, TASK, n_layouts=1)
    assert grid.shape == (59, 59, 32)
    X, y = ea.variable_probe_data(model, TASK, TASK.eval_pool("one_var_train", 10, 0).tokens, "blocks.0.hook_resid_post")
    assert X.shape[1] == 16 and len(X) == len(y) and int(y.min()) >= 0 and int(y.max()) < N_VARS
    q, k = ea.variable_directions(model, TASK, TASK.eval_pool("one_var_train", 200, 0).tokens)
    assert q.shape == k.shape == (N_VARS, 16)


def test_transition_checkpoints_and_configs():
    run = SimpleNamespace(checkpoint_steps=lambda: [0, 250, 500, 750, 1000], train_config=SimpleNamespace(steps=1000))
    ph = ea.Phases(addition_step=100, variable_step=600, jump_step=500, jump_rise=0.8, routing_step=480,
                   refine_step=float("nan"), refine_rise=0.0, window=100)
    assert ea.transition_checkpoints(run, ph) == {"init": 0, "before jump": 250, "after jump": 750, "final": 1000}
    cfg = SimpleNamespace(d_model=32, d_mlp=64, train_fraction=0.5, split_seed=1, get=lambda k, d=None: None)
    mc = ea.model_config(cfg)
    assert (mc.d_model, mc.d_mlp, mc.mlp, mc.bias, mc.out_dim, mc.d_vocab) == (32, 64, (False, True), False, 59, 74)
    assert ea.make_task(cfg).train_fraction == 0.5


def test_training_batches_of_the_chapter_task_never_leak():
    cfg = SimpleNamespace(train_fraction=0.7, split_seed=42, get=lambda k, d=None: None)
    task = ea.make_task(cfg)
    p = task.parse(torch.cat([task.train_batch(s, 512, 42).tokens for s in range(20)]))
    assert bool(task.is_training_query(p["seq_type"], p["left_var"], p["right_var"], p["n1"], p["n2"]).all())
    assert not bool(torch.isin(p["right_var"], torch.tensor([0, 1])).any())
    assert not bool(torch.isin(p["left_var"], torch.tensor([10, 11])).any())
    assert (task.universe_size, task.n_training_rows()) == (167_088, 102_312)


def test_load_model_reads_an_external_checkpoint(tmp_path):
    model = cb.ToyTransformer(TINY, seed=5)
    path = tmp_path / "tl.pt"
    torch.save({k: v for k, v in model.state_dict().items()}, path)
    cfg = {"checkpoint_path": str(path)}
    loaded, source, run = ea.load_model(SimpleNamespace(get=cfg.get))
    assert run is None and "external checkpoint" in source
    tokens = TASK.eval_pool("two_var_train", 8, 0).tokens
    torch.testing.assert_close(loaded(tokens), model(tokens))


def test_bound_attention_prefix_share():
    tokens = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 ="])
    pattern = torch.zeros(1, 1, 16, 16)
    pattern[0, 0, -1, 2], pattern[0, 0, -1, 5], pattern[0, 0, -1, 14] = 0.3, 0.1, 0.6  # bound, distractor, operand
    assert ea.bound_attention(pattern, tokens, TASK).item() == pytest.approx(0.3)
    assert ea.bound_attention(pattern, tokens, TASK, prefix_share=True).item() == pytest.approx(0.75)


def test_composed_run_reads_a_run_and_its_continuation_as_one():
    def fake(steps, ckpts, metric_steps, tag):
        return SimpleNamespace(
            train_config=SimpleNamespace(steps=steps), model_config=TINY, dir="d", key=tag, path="p",
            manifest={"train_seconds": 10.0}, n_members=1, checkpoint_steps=lambda: ckpts,
            metrics=lambda: pd.DataFrame({"step": metric_steps, "member": 0, "acc": [tag] * len(metric_steps)}),
            model=lambda member=0, step=None: (tag, step))

    run = ea.ComposedRun(fake(100, [0, 50, 100], [0, 50, 100], "a"), fake(150, [100, 150], [100, 150], "b"))
    m = run.metrics()
    assert m.step.tolist() == [0, 50, 100, 150] and m.acc.tolist() == ["a", "a", "a", "b"]
    assert run.checkpoint_steps() == [0, 50, 100, 150] and run.train_config.steps == 150
    assert run.model(0, 50) == ("a", 50) and run.model(0, 100) == ("a", 100) and run.model(0) == ("b", 150)
    assert run.manifest["train_seconds"] == 20.0
