"""Known answers for the lenses chapter's notebook 03: the bursty Assign-and-Add task, the induction progress
measures with chosen token sets (analysis.induction) and the measurements of experiments.lenses for LN-6..LN-8."""
import collections
import math

import numpy as np
import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook.analysis import imir, induction
from circuitbook.experiments import lenses as el
from circuitbook.tasks.assign_add import PREFIX_LEN, AssignAddTask
from circuitbook.tasks.assign_add_bursty import BurstyAssignAddTask


# ---------------------------------------------------------------- the bursty task
def _blocks(task, row):
    prefix = row[:PREFIX_LEN]
    return [(prefix[i], prefix[i + 1]) for i in range(PREFIX_LEN - 1) if prefix[i] >= task.VAR0]


@pytest.mark.parametrize("b", [1, 2, 3])
def test_bursty_sequences_repeat_the_queried_assignment_b_times(b):
    task = BurstyAssignAddTask(repeats=b)
    batch = task.train_batch(step=7, batch_size=3000, seed=0)
    assert batch.tokens.shape == (3000, 16)
    parsed = task.parse(batch.tokens)
    assert torch.equal(parsed["label"], batch.labels)  # every label is (n1 + n2) mod 59 of the bound values
    seen_types = set()
    for row, label in zip(batch.tokens.tolist(), batch.labels.tolist()):
        blocks = _blocks(task, row)
        count = collections.Counter(v for v, _ in blocks)
        operands = [t for t in row[PREFIX_LEN + 1:PREFIX_LEN + 3] if t >= task.VAR0]
        seen_types.add(len(operands))
        for v in operands:
            assert count[v] == b  # the queried assignment, b times
        assert all(c == 1 for v, c in count.items() if v not in operands)  # distractors once, distinct
        values = {}
        for v, val in blocks:
            assert 0 <= val < task.modulus and values.setdefault(v, val) == val  # one value per variable
        n_pad = sum(t == task.PAD for t in row[:PREFIX_LEN])
        assert 2 * len(blocks) + n_pad == PREFIX_LEN and len(blocks) <= 6
        lhs, rhs = row[PREFIX_LEN + 1], row[PREFIX_LEN + 2]
        n1 = values[lhs] if lhs >= task.VAR0 else lhs
        n2 = values[rhs] if rhs >= task.VAR0 else rhs
        assert label == (n1 + n2) % task.modulus
    assert seen_types == {0, 1, 2}


def test_bursty_example_by_hand():
    task = BurstyAssignAddTask(repeats=2)
    batch = task.make_batch(40, 27, left_var="a", seed=3)
    blocks = _blocks(task, batch.tokens[0].tolist())
    a = task.VAR0
    assert blocks.count((a, 40)) == 2 and batch.labels.tolist() == [(40 + 27) % 59]
    assert task.decode(batch.tokens[0]).endswith("+ a 27 =")
    full = task.make_batch(1, 2, left_var="a", right_var="c", n_assignments=4, seed=0)  # 2 + 2 copies, no distractor
    assert sorted(_blocks(task, full.tokens[0].tolist())) == sorted([(a, 1), (a, 1), (a + 2, 2), (a + 2, 2)])
    with pytest.raises(ValueError):
        task.make_batch(1, 2, left_var="a", right_var="c", n_assignments=3)  # 4 copies do not fit in 3 blocks


def test_bursty_batches_are_deterministic_and_b1_is_the_ordinary_task():
    task = BurstyAssignAddTask(repeats=3)
    a, b = task.train_batch(11, 64, 5), task.train_batch(11, 64, 5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.tokens, task.train_batch(12, 64, 5).tokens)
    assert not torch.equal(a.tokens, task.train_batch(11, 64, 6).tokens)
    ordinary, once = AssignAddTask(), BurstyAssignAddTask(repeats=1)
    for step in (0, 3):
        assert torch.equal(ordinary.train_batch(step, 128, 1).tokens, once.train_batch(step, 128, 1).tokens)
    assert torch.equal(ordinary.eval_pool("one_var_train", 50, 1).tokens, once.eval_pool("one_var_train", 50, 1).tokens)


def test_bursty_spec_names_b():
    specs = [BurstyAssignAddTask(repeats=b).spec() for b in (1, 2, 3)]
    assert [s["repeats"] for s in specs] == [1, 2, 3]
    assert len({str(s) for s in specs}) == 3
    assert specs[0]["task"] == "assign_add_bursty" and specs[0] != AssignAddTask().spec()
    for bad in (0, 4, 1.5, True):
        with pytest.raises(ValueError):
            BurstyAssignAddTask(repeats=bad)


def test_bursty_run_key_covers_the_parent_task():
    from circuitbook import runs
    files = {p.name for p in runs._package_sources(BurstyAssignAddTask(repeats=2))}
    assert {"assign_add_bursty.py", "assign_add.py"} <= files


# ---------------------------------------------------------------- analysis.induction
def _model(seed=0, d_vocab=10, d_out=6, n_ctx=5):
    cfg = cb.ToyConfig(d_vocab=d_vocab, n_ctx=n_ctx, d_model=8, n_layers=2, n_heads=1, d_mlp=8, mlp=(False, True),
                       bias=False, d_vocab_out=d_out)
    return cb.ToyTransformer(cfg, seed=seed)


def test_induction_measures_match_imir_on_its_default_tokens():
    model = _model()
    mine, theirs = induction.induction_measures(model), imir.progress_measures(model)
    for k in ("alpha", "beta", "gamma"):
        assert mine[k] == pytest.approx(theirs[k], rel=1e-5, abs=1e-6)
    ids = [1, 3, 4]
    split = induction.induction_measures(model, match_ids=ids, copy_ids=ids)
    same = imir.progress_measures(model, ids)
    assert split["beta"] == pytest.approx(same["beta"], rel=1e-5, abs=1e-6)
    assert split["gamma"] == pytest.approx(same["gamma"], rel=1e-5, abs=1e-6)


def test_induction_measures_on_constructed_weights():
    model = _model(d_vocab=10, d_out=6, n_ctx=5)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        d = 8
        model.W_E[:] = torch.zeros(10, d)
        for t in range(8):
            model.W_E[t, t] = 1.0  # token t on axis t (tokens 8, 9 nowhere)
        a1, a2 = model.blocks[0].attn, model.blocks[1].attn
        a1.W_V[0][:] = torch.eye(d)[:, :a1.W_V.shape[-1]]
        a1.W_O[0][:] = torch.eye(d)[:a1.W_O.shape[1], :]
        a2.W_Q[0][:] = torch.eye(d)[:, :a2.W_Q.shape[-1]]
        a2.W_K[0][:] = 2 * torch.eye(d)[:, :a2.W_K.shape[-1]]
        a2.W_V[0][:] = torch.eye(d)[:, :a2.W_V.shape[-1]]
        a2.W_O[0][:] = 3 * torch.eye(d)[:a2.W_O.shape[1], :]
        model.W_U[:] = torch.eye(d)[:, :6]
        # positions: p_i = e_i (i < 5); W_Q^1 = I, W_K^1 maps e_{i-1} to e_i: alpha~ = 4 (pairs i = 1..4)
        model.W_pos[:] = torch.eye(d)[:5]
        shift = torch.zeros(d, d)
        for i in range(1, 5):
            shift[i - 1, i] = 1.0
        a1.W_Q[0][:] = torch.eye(d)[:, :a1.W_Q.shape[-1]]
        a1.W_K[0][:] = shift[:, :a1.W_K.shape[-1]]
    m = induction.induction_measures(model, match_ids=[6, 7, 8], copy_ids=[0, 1, 2])
    assert m["alpha"] == pytest.approx(4.0)
    assert m["beta"] == pytest.approx(2.0 * 2)  # tokens 6, 7 match their copies with weight 2; token 8 is zero
    assert m["gamma"] == pytest.approx(3.0 * 3)  # three copied tokens, each with weight 3
    assert induction.positional_score(model, 2) == pytest.approx(0.0)  # nothing two tokens back
    with pytest.raises(ValueError):
        induction.induction_measures(model, copy_ids=[7])  # 7 is not an output
    with pytest.raises(ValueError):
        induction.positional_score(model, 5)


# ---------------------------------------------------------------- the measurements
def _traj(steps, **cols):
    return pd.DataFrame({"step": steps, "member": 0, **cols})


def test_order_of_rises_known_order():
    steps = np.arange(0, 1001, 100)
    ramp = lambda t0: np.clip((steps - t0) / 100.0, 0, 1)  # rises from t0 to t0 + 100: half-way at t0 + 50
    out = el.order_of_rises(_traj(steps, gamma=ramp(100), beta=ramp(300), alpha=ramp(600)))
    assert (out["t_gamma"], out["t_beta"], out["t_alpha"]) == pytest.approx((150, 350, 650))
    assert out["gamma_beta_lead"] == pytest.approx(0.2) and out["beta_alpha_lead"] == pytest.approx(0.3)
    assert out["why"] is None
    flat = el.order_of_rises(_traj(steps, gamma=ramp(100), beta=np.zeros(len(steps)), alpha=ramp(600)))
    assert math.isnan(flat["gamma_beta_lead"]) and math.isnan(flat["beta_alpha_lead"]) and "beta" in flat["why"]
    assert el.order_of_rises(_traj(steps, gamma=ramp(600), beta=ramp(300), alpha=ramp(100)), total=2000)[
        "gamma_beta_lead"] == pytest.approx(-0.15)


def test_metric_at_interpolates_and_is_nan_outside():
    metrics = pd.DataFrame({"step": [0, 100, 200, 0, 100], "member": [0, 0, 0, 1, 1],
                            "routing": [0.0, 1.0, 3.0, 5.0, 5.0]})
    got = el.metric_at(metrics, 0, "routing", [50, 150, 250])
    assert got[:2] == pytest.approx([0.5, 2.0]) and math.isnan(got[2])


def test_alpha_vs_routing_known_answers():
    steps = np.arange(0, 1001, 100)
    routing = np.clip((steps - 200) / 200.0, 0, 1) + 1e-4 * steps  # strictly rising, half-way near 300
    metrics = pd.DataFrame({"step": steps, "member": 0, "routing": routing})
    alpha = routing ** 2  # a monotone function of routing: rank correlation 1
    alpha2 = np.clip((steps - 600) / 200.0, 0, 1)  # half-way at 700
    out = el.alpha_vs_routing(_traj(steps, alpha=alpha, alpha2=alpha2), metrics, 0)
    t_half = out["t_routing"]
    assert 250 < t_half < 350
    assert out["spearman"] == pytest.approx(1.0)
    assert out["placebo_gap"] == pytest.approx(abs(700 - t_half) / 1000)
    assert out["placebo_spearman"] < 1.0
    anti = el.alpha_vs_routing(_traj(steps, alpha=-routing, alpha2=alpha2), metrics, 0)
    assert anti["spearman"] == pytest.approx(-1.0) and math.isnan(anti["gap"])  # alpha~ falls: no half-way step


def test_burst_times_speedup_and_censoring():
    members = pd.DataFrame({"member": [0, 1, 2, 3], "b": [1, 3, 1, 3], "seed": [0, 0, 1, 1]})
    steps = np.arange(0, 1001, 100)
    acc = {0: np.clip(steps / 800, 0, 1),  # reaches 0.5 at step 400
           1: np.clip(steps / 400, 0, 1),  # at step 200
           2: np.zeros(len(steps)),  # never: censored at 1000
           3: np.clip(steps / 500, 0, 1)}  # at step 250
    metrics = pd.concat([pd.DataFrame({"step": steps, "member": k, "acc": v}) for k, v in acc.items()])
    out = el.burst_times(metrics, members, "acc", 0.5).set_index("seed")
    assert out.loc[0, "speedup"] == pytest.approx(2.0) and out.loc[0, "bound"] == ""
    assert out.loc[1, "speedup"] == pytest.approx(4.0) and out.loc[1, "bound"] == "at least"
    assert not out.loc[1, "reached_b1"] and out.loc[1, "t_b1"] == 1000
    metrics.loc[metrics.member == 1, "acc"] = 0.0
    metrics.loc[metrics.member == 3, "acc"] = 0.0
    out = el.burst_times(metrics, members, "acc", 0.5).set_index("seed")
    assert out.loc[0, "speedup"] == pytest.approx(0.4) and out.loc[0, "bound"] == "at most"
    assert math.isnan(out.loc[1, "speedup"]) and "neither" in out.loc[1, "why"]
    only = el.burst_times(metrics[metrics.member == 0], members[members.member == 0], "acc", 0.5)
    assert math.isnan(only.speedup[0]) and only.why[0]


def test_burst_members_pair_the_seeds():
    cfg = cb.load_params("lenses", "03_progress_measures", "smoke")
    m = el.burst_members(cfg)
    assert list(m.b) == list(cfg.burst_values) * len(cfg.burst_seeds)
    assert (m.member_seed // el.BURST_SEED_STRIDE == m.seed).all()
