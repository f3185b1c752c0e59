"""Known-answer tests of the assign_add experiment definitions: the phase detector on curves with
known jumps, the AA-8 pipeline on residuals built to be identical, the AA-9 pipeline on a model with
planted Fourier neurons, the AA-12 theory block on hand-made sequences, attention measures on
hand-built patterns, released runs read from a directory of step checkpoints."""
import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook.analysis import attention, curves, fourier
from circuitbook.experiments import assign_add as ea
from circuitbook.tasks.assign_add import N_VARS, AssignAddTask
from circuitbook.training import Evaluator, ReleasedRun

TASK = AssignAddTask()
TINY = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=16, n_layers=2, n_heads=1, d_mlp=32, mlp=(False, True),
                    bias=False, d_vocab_out=59)


def params(**kw):
    """A stand-in for Params: attribute and .get access."""
    return SimpleNamespace(**kw, get=lambda k, d=None: kw.get(k, d))


# ----------------------------------------------------------------- phases on curves with known answers

def ramp(steps, start, end, lo, hi):
    return np.interp(steps, [start, end], [lo, hi])


def synthetic_metrics(shift=0, members=1):
    """Curves made of linear ramps, so every detected step has an exact answer (window 1000):
    0-var 0.02 -> 1 over [500, 1500]; 1-var 0.1 -> 1 over [5000, 6000], 2-var over [5200, 6200];
    QK identity 0 -> 0.9 over [5100, 6100]; bound attention 0.05 -> 0.8 over [5300, 6300], and the
    bound value's lead over the other values 0.4 -> 1 over the same steps;
    routing 0.1 -> 0.95 over [2000, 3000]; hard pools 0.02 -> 0.2 with the jump, + 0.78 over
    [14000, 15000]. Member k is shifted by k * shift steps (after the addition phase)."""
    s = np.arange(0, 20001, 100)
    frames = []
    for k in range(members):
        d = k * shift
        df = pd.DataFrame({"step": s, "member": k, "seed": 42 + k, "train_loss": 1.0})
        df["acc_zero_var_train"] = ramp(s, 500, 1500, 0.02, 1.0)
        df["acc_one_var_train"] = ramp(s, 5000 + d, 6000 + d, 0.1, 1.0)
        df["acc_two_var_train"] = ramp(s, 5200 + d, 6200 + d, 0.1, 1.0)
        df["qk_identity"] = ramp(s, 5100 + d, 6100 + d, 0.0, 0.9)
        df["bound_1var"] = df["bound_2var"] = ramp(s, 5300 + d, 6300 + d, 0.05, 0.8)
        df["bound_over_values"] = ramp(s, 5300 + d, 6300 + d, 0.4, 1.0)
        df["routing"] = ramp(s, 2000, 3000, 0.1, 0.95)
        for p in ea.HARD_POOLS:
            df[f"acc_{p}"] = ramp(s, 5000 + d, 6000 + d, 0.02, 0.2) + ramp(s, 14000 + d, 15000 + d, 0.0, 0.78)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def test_detect_phases_on_ramps_with_known_steps():
    ph = ea.detect_phases(synthetic_metrics(), window=1000)
    assert ph.addition_step == pytest.approx(500 + 0.88 / 0.98 * 1000)
    assert ph.variable_step == pytest.approx(5000 + 0.8 / 0.9 * 1000)  # the 1-var curve is first
    assert ph.var_half_step == pytest.approx(5000 + 0.4 / 0.9 * 1000)
    assert ph.zero_at_var_half == pytest.approx(1.0)
    # the variable accuracy (mean of the two ramps) rises by 0.81 in every window starting in
    # [5000, 5200]: the middle start 5100 gives centre 5600; its whole rise is 0.9
    assert (ph.jump_step, ph.jump_rise, ph.jump_share) == (pytest.approx(5600), pytest.approx(0.81),
                                                           pytest.approx(0.9))
    assert ph.qk_step == pytest.approx(5600) and ph.bound_step == pytest.approx(5800)
    assert ph.routing_step == pytest.approx(2500)
    assert (ph.refine_step, ph.refine_rise) == (pytest.approx(14500), pytest.approx(0.78))
    assert ph.window == 1000 and ph.marks() == {"addition": ph.addition_step, "jump": 5600, "refinement": 14500}
    assert ea.detect_phases(synthetic_metrics()).window == 1000  # default: 1/20 of the run


def test_detect_phases_without_refinement_or_jump():
    m = synthetic_metrics()
    for p in ea.HARD_POOLS:
        m[f"acc_{p}"] = 0.05  # flat: no refinement phase
    ph = ea.detect_phases(m, window=1000)
    assert math.isnan(ph.refine_step) and ph.refine_rise == pytest.approx(0.0) and "refinement" not in ph.marks()
    for p in ea.VAR_POOLS:
        m[f"acc_{p}"] = 0.1 + 0.1 * m.step / 20000  # a slow drift, never a jump
    ph = ea.detect_phases(m, window=1000)
    assert math.isnan(ph.jump_step) and math.isnan(ph.refine_step) and math.isnan(ph.variable_step)
    assert ea.stage_checkpoint(SimpleNamespace(checkpoint_steps=lambda: [0, 100]), ph) is None
    with pytest.raises(ValueError, match="member=3 has no metrics"):
        ea.detect_phases(m, member=3)


def plateau_metrics():
    """The authors' order of events, planted: 0-var 0.02 -> 1 over [300, 800] (addition at step
    300 + 0.88 / 0.98 * 500 = 749); with it the variable accuracy rises 0.02 -> 0.41 over [400, 900]
    (a model that adds a uniformly chosen assigned value: E[1/k]), stays there, jumps to 0.75 over
    [5300, 5400] and creeps to 1.0 by step 15,000. With a window of 1,000 the early rise (0.39)
    beats the jump's window (0.34 + 0.25 * 900 / 9600 = 0.363): a search from step 0 finds it."""
    s = np.arange(0, 20001, 100)
    df = pd.DataFrame({"step": s, "member": 0, "seed": 42})
    df["acc_zero_var_train"] = ramp(s, 300, 800, 0.02, 1.0)
    var = ramp(s, 400, 900, 0.02, 0.41) + ramp(s, 5300, 5400, 0.0, 0.34) + ramp(s, 5400, 15000, 0.0, 0.25)
    df["acc_one_var_train"] = df["acc_two_var_train"] = var
    for p in ea.HARD_POOLS:
        df[f"acc_{p}"] = 0.5 * var
    for c in ("qk_identity", "routing"):
        df[c] = ramp(s, 5300, 5400, 0.0, 0.9)
    # `=`'s summed attention to the bound value rises early with its attention to every prefix number
    # (half-way at step 283), dips and rises a little at the jump; the bound value's lead over the
    # other values rises a little with the plateau and for good with the jump
    df["bound_1var"] = df["bound_2var"] = (ramp(s, 100, 400, 0.05, 0.5) - ramp(s, 1000, 2000, 0.0, 0.1)
                                           + ramp(s, 5300, 5500, 0.0, 0.2))
    df["bound_over_values"] = ramp(s, 400, 900, 0.2, 0.41) + ramp(s, 5300, 5500, 0.0, 0.59)
    return df


@pytest.mark.parametrize("window", [100, 300, 1000, 2000, 4000])
def test_the_jump_is_the_rise_from_the_e1k_plateau_whatever_the_window(window):
    m = plateau_metrics()
    ph = ea.detect_phases(m, window=window)
    assert ph.jump_from == pytest.approx(300 + 0.88 / 0.98 * 500)
    # the detected window holds the planted jump (5300 -> 5400), not the early rise
    assert ph.jump_step - window / 2 <= 5300 + 1e-6 and ph.jump_step + window / 2 >= 5400 - 1e-6
    # the share is of the rise after the addition phase: from the value at step 749 to 1.0
    after_addition = 1.0 - (0.02 + 0.39 * (ph.jump_from - 400) / 500)
    assert ph.jump_share == pytest.approx(ph.jump_rise / after_addition)
    # the bound value's lead is half-way (from its value after the addition phase to 1.0) inside the
    # planted rise; the summed attention's half-way step would be 283
    assert 5300 < ph.bound_step < 5500
    assert curves.half_way_step(m.step, m.bound_1var) == pytest.approx(283.3, abs=0.1)


def test_the_early_plateau_rise_won_when_the_jump_was_searched_from_step_0():
    """What the rule replaced: the steepest window over the whole run is the early rise."""
    m = plateau_metrics()
    step, rise = curves.steepest_rise(m.step, m.acc_one_var_train, 1000)
    assert step < 1500 and rise == pytest.approx(0.39)
    ph = ea.detect_phases(m, window=1000)
    assert 4800 <= ph.jump_step <= 5900 and ph.jump_share > 0.5
    assert ph.jump_rise / (1.0 - 0.02) < 0.5  # the old share (of the rise from step 0) called it not sharp


def test_phases_table_has_one_row_per_seed():
    table = ea.phases_table(synthetic_metrics(shift=300, members=3), window=1000)
    assert table.index.tolist() == [0, 1, 2] and table.seed.tolist() == [42, 43, 44]
    assert table.jump_step.tolist() == pytest.approx([5600, 5900, 6200])
    assert table.refine_step.tolist() == pytest.approx([14500, 14800, 15100])
    assert table.addition_step.nunique() == 1


def test_hard_final_accuracy_is_the_weakest_pool():
    m = synthetic_metrics(members=2)
    m.loc[(m.member == 1) & (m.step == 20000), "acc_two_var_var_restricted_two"] = 0.4
    assert ea.hard_final_accuracy(m).tolist() == pytest.approx([0.98, 0.4])  # 0.2 + 0.78


def test_transition_and_stage_checkpoints():
    run = SimpleNamespace(checkpoint_steps=lambda: [0, 250, 500, 750, 1000])
    ph = ea.Phases(addition_step=100, variable_step=600, var_half_step=550, zero_at_var_half=1.0, jump_from=100,
                   jump_step=500, jump_rise=0.8, jump_share=0.9, qk_step=500, bound_step=500, bound_lo=500, bound_hi=500,
                   routing_step=300,
                   refine_step=float("nan"), refine_rise=0.0, window=100)
    assert ea.transition_checkpoints(run, ph) == {"init": 0, "before jump": 250, "after jump": 750, "final": 1000}
    assert ea.stage_checkpoint(run, ph) == 250
    # never before the addition phase has ended: a jump found too early names no stage at step 0
    early = dataclasses.replace(ph, addition_step=300, jump_from=300, jump_step=400)
    assert ea.stage_checkpoint(run, early) is None
    assert ea.stage_missing_why(early) == ("no checkpoint lies between the end of the addition phase (step 300) "
                                           "and the jump's window (from step 350)")
    assert ea.stage_missing_why(dataclasses.replace(ph, jump_step=float("nan"))).startswith("no jump detected")


# ----------------------------------------------------------------- AA-8: residuals built to be identical

def value_residual(extra=0.0, seed=0, d=24):
    """A 'model' whose residual depends only on the operand values, plus `extra` along a dimension of
    its own in every sequence with a variable operand."""
    g = torch.Generator().manual_seed(seed)
    u, w = torch.randn(59, d, generator=g), torch.randn(59, d, generator=g)

    def residual(tokens):
        p = TASK.parse(tokens)
        out = torch.zeros(len(tokens), d + 1)
        out[:, :d] = u[p["n1"]] + w[p["n2"]]
        out[:, d] = extra * ((p["left_var"] >= 0) | (p["right_var"] >= 0)).float()
        return out

    return residual, u, w


def test_residual_cosines_of_identical_residuals_are_one():
    residual, _, _ = value_residual()
    cos = ea.residual_cosines(None, TASK, n=200, residual=residual)
    assert set(cos.form) == {"1-var left", "1-var right", "2-var"} and len(cos) == 600
    np.testing.assert_allclose(cos.matched, 1.0, atol=1e-12)
    np.testing.assert_allclose(cos.matched_centred, 1.0, atol=1e-12)
    assert abs(cos.mismatched_centred.mean()) < 0.05  # independent pairs: no shared content
    assert len(set(zip(cos.n1[:200], cos.n2[:200]))) == 200  # distinct pairs: a mismatch is another pair


def test_residual_cosines_with_a_form_offset_have_the_exact_centred_value():
    c = 3.0
    residual, u, w = value_residual(extra=c)
    cos = ea.residual_cosines(None, TASK, n=100, residual=residual)
    one = cos[cos.form == "2-var"]
    x = (u[torch.tensor(one.n1.to_numpy())] + w[torch.tensor(one.n2.to_numpy())]).double()
    dev = (x - x.mean(0)).pow(2).sum(1)  # the offset dimension is orthogonal to the content
    expected = (dev - c ** 2 / 4) / (dev + c ** 2 / 4)
    np.testing.assert_allclose(one.matched_centred, expected.numpy(), rtol=1e-6)  # float32 residuals


def test_residual_cosines_operands_sit_at_training_positions():
    seen = []
    cos = ea.residual_cosines(None, TASK, n=300, residual=lambda t: seen.append(t) or torch.randn(len(t), 4))
    tokens = torch.cat(seen[1:])
    p = TASK.parse(tokens)
    assert bool(TASK.is_training_query(p["seq_type"], p["left_var"], p["right_var"], p["n1"], p["n2"]).all())
    two = p["seq_type"] == 3
    pairs = set(zip(p["left_var"][two].tolist(), p["right_var"][two].tolist()))
    assert len(pairs) > 80 and (11, 10) not in pairs  # spread over the 92 pairs, none held out
    assert len(cos) == 900


# ----------------------------------------------------------------- AA-9: a model with planted Fourier neurons

PLANTED = [(9, 0.3, 1.0), (17, -1.0, 2.0), (21, 2.0, 0.5), (9, -2.5, 1.5), (17, 0.7, 1.0), (25, 1.2, 0.8)]


def planted_fourier_model():
    """Layer 1 at `=` attends half to each operand (positions 13, 14) and copies the number into
    dimensions of its own; layer 2's attention writes nothing; MLP neuron j reads
    2 A_j cos(2 pi k_j t / 59 + phi_j) from number t's dimension. So its pre-activation at `=` on
    `+ n m =` is A_j [cos(2 pi k_j n/59 + phi_j) + cos(2 pi k_j m/59 + phi_j)], whatever the prefix."""
    d = 74 + 16 + 59
    cfg = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=d, n_layers=2, n_heads=1, d_mlp=len(PLANTED),
                       mlp=(False, True), bias=False, d_vocab_out=59)
    model = cb.ToyTransformer(cfg, seed=0)
    s = math.sqrt(40 * math.sqrt(d))  # score 40 for the two operand keys, 0 elsewhere
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.W_E[:, :74] = torch.eye(74)
        model.pos_embed.W_pos[:, 74:90] = torch.eye(16)
        a0 = model.blocks[0].attn
        a0.W_Q[0, 74 + 15, 0] = s
        a0.W_K[0, 74 + 13, 0] = a0.W_K[0, 74 + 14, 0] = s
        a0.W_V[0, :59, :59] = torch.eye(59)
        a0.W_O[0, :59, 90:] = torch.eye(59)
        t = torch.arange(59, dtype=torch.float64)
        for j, (k, phi, A) in enumerate(PLANTED):
            model.blocks[1].mlp.W_in[90:, j] = (2 * A * torch.cos(2 * math.pi * k * t / 59 + phi)).float()
    return model


def planted_grid():
    n = torch.arange(59, dtype=torch.float64)
    cols = [A * (torch.cos(2 * math.pi * k * n / 59 + phi)[:, None] + torch.cos(2 * math.pi * k * n / 59 + phi)[None])
            for k, phi, A in PLANTED]
    return torch.stack(cols, -1)


def test_aa9_pipeline_recovers_the_planted_neurons():
    grid = ea.mlp_preactivation_grid(planted_fourier_model(), TASK, n_layouts=2)
    assert grid.shape == (59, 59, len(PLANTED))
    torch.testing.assert_close(grid.double(), planted_grid(), atol=1e-4, rtol=0)
    s = fourier.summarise_grid(grid, power_fraction=0.99)
    assert s.single.best_frequency.tolist() == [k for k, _, _ in PLANTED]
    assert s.median_single_r2 == pytest.approx(1.0, abs=1e-6)
    assert s.key_frequencies == [9, 17, 21, 25] and s.median_multi_r2 == pytest.approx(1.0, abs=1e-6)
    # random sets of four frequencies: a neuron's R^2 is 1 when its own is drawn, else 0
    assert s.random_frequencies_r2 < 0.5


def test_aa9_random_model_needs_many_frequencies():
    grid = ea.mlp_preactivation_grid(cb.ToyTransformer(TINY, seed=1), TASK, n_layouts=2)
    s = fourier.summarise_grid(grid, power_fraction=0.8)
    assert len(s.key_frequencies) > 12 and s.median_single_r2 < 0.5


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


def test_bound_attention_top_share_and_roles_on_hand_built_pattern():
    tokens = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 =",
                          "b 3 c 4 PAD PAD PAD PAD PAD PAD PAD PAD + b c =",
                          "b 3 c 4 PAD PAD PAD PAD PAD PAD PAD PAD + 5 6 ="])
    assert ea.bound_targets(tokens, TASK).nonzero().tolist() == [[0, 2], [1, 1], [1, 3]]
    pattern = torch.zeros(3, 1, 16, 16)
    pattern[0, 0, -1, [2, 5, 14]] = torch.tensor([0.3, 0.1, 0.6])  # bound value, distractor, the constant operand
    pattern[1, 0, -1, [1, 3, 0]] = torch.tensor([0.4, 0.5, 0.1])  # b's value at 1, c's at 3
    assert ea.bound_attention(pattern, tokens, TASK).item() == pytest.approx((0.3 + 0.9) / 2)  # 0-var left out
    # the addends: row 0's bound value and its number operand 27; row 1's two bound values; row 2's 5 and 6
    assert ea.addend_targets(tokens, TASK).nonzero().tolist() == [[0, 2], [0, 14], [1, 1], [1, 3], [2, 13], [2, 14]]
    # `=` attends most to the constant operand in row 0: it is the other addend, not a competitor, so every
    # addend beats the other prefix keys (row 0: the distractor 18 at 0.1; row 1: the variable token b at 0.1)
    assert ea.addends_top_share(pattern[:2], tokens[:2], TASK) == 1.0
    # the bound values beat the other assigned values (row 0: 0.3 > 0.1; row 1: no other value)
    assert ea.bound_over_values_share(pattern[:2], tokens[:2], TASK) == 1.0
    pattern[0, 0, -1, 10] = 0.35  # now the distractor 9 outshines the bound value 40 (0.3), not the operand (0.6)
    assert ea.addends_top_share(pattern[:1], tokens[:1], TASK) == pytest.approx(1 / 2)
    assert ea.bound_over_values_share(pattern[:1], tokens[:1], TASK) == 0.0
    roles = ea.key_roles(tokens, TASK)
    assert roles[0, [1, 2, 4, 5, 0, 12, 13, 14, 15]].tolist() == [
        "variable token", "bound value", "variable token", "other assigned value", "PAD", "+", "left operand",
        "right operand", "="]
    by_role = ea.attention_by_role(pattern[:2], tokens[:2], TASK)
    assert by_role["bound value"] == pytest.approx((0.3 + 0.9) / 2)
    assert by_role["right operand"] == pytest.approx(0.3) and by_role["variable token"] == pytest.approx(0.05)
    assert math.isnan(ea.bound_attention(pattern[2:], tokens[2:], TASK).item())


def test_eq_reading_both_addends_equally_passes_aa11():
    """The authors' measure: `=`'s top-2 keys are the two addends. A 1-var `=` that reads its bound
    value and its number operand equally (0.35 each), the rest spread over the prefix, has both
    addends on top; the old rule (the bound value above every other key, the operand included)
    counted it as a failure."""
    tokens = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 =",
                          "PAD PAD PAD PAD PAD PAD b 3 PAD c 4 PAD + 5 c ="])
    pattern = torch.zeros(2, 1, 16, 16)
    for row, (bound, operand) in enumerate(((2, 14), (10, 13))):
        pattern[row, 0, -1] = 0.3 / 14
        pattern[row, 0, -1, [bound, operand]] = 0.35
    assert ea.addends_top_share(pattern, tokens, TASK) == 1.0
    old_rule = attention.top_key_share(pattern[:, 0, -1], ea.bound_targets(tokens, TASK))
    assert old_rule == 0.0  # a tie with the operand is not "more": the bound value never counted
    # a key outside the prefix (the queried variable token itself) is no competitor either
    pattern[0, 0, -1, 13] = 0.5
    assert ea.addends_top_share(pattern, tokens, TASK) == 1.0


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
    assert attention.diagonal_argmax_fraction(qk) == 1.0 and attention.template_cosine(qk) == pytest.approx(1.0)
    raw = ea.variable_qk_matrix(identity_circuit_model(), TASK, composed=False)
    torch.testing.assert_close(raw, torch.eye(N_VARS) / math.sqrt(74))


# ----------------------------------------------------------------- AA-12: gradient and theory

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


def test_theory_block_on_hand_made_sequences():
    # 1-var `a` with distractors j, k: a' x a' gets 1 - 1/16, a' x j' and a' x k' get -1/16
    one = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 ="])
    P = ea.theory_qk_block(one, TASK)
    expected = torch.zeros(N_VARS, N_VARS, dtype=torch.float64)
    expected[0, 0], expected[0, 9], expected[0, 10] = 15 / 16, -1 / 16, -1 / 16
    torch.testing.assert_close(P, expected)
    # 2-var `+ b c =` with distractor d: both bound values help both queried variables
    two = TASK.encode(["b 3 c 4 d 5 PAD PAD PAD PAD PAD PAD + b c ="])
    P2 = ea.theory_qk_block(two, TASK)
    for u in (1, 2):
        assert P2[u, 1] == pytest.approx(1 - 2 / 16) and P2[u, 2] == pytest.approx(1 - 2 / 16)
        assert P2[u, 3] == pytest.approx(-2 / 16)
    assert P2[3].abs().sum() == 0 and P2.abs().sum() == pytest.approx(2 * (2 * 14 / 16 + 2 / 16))
    # 0-var sequences query nothing; a batch is the mean
    zero = TASK.encode(["b 3 c 4 d 5 PAD PAD PAD PAD PAD PAD + 1 2 ="])
    assert ea.theory_qk_block(zero, TASK).abs().sum() == 0
    torch.testing.assert_close(ea.theory_qk_block(torch.cat([one, zero]), TASK), expected / 2)


def test_theory_block_of_the_training_distribution_is_diagonal_heavy():
    batch = TASK.train_batch(0, 4096, 0)
    P = ea.theory_qk_block(batch.tokens, TASK)
    assert attention.diagonal_argmax_fraction(P) == 1.0 and attention.template_cosine(P) > 0.9


# ----------------------------------------------------------------- runs, released runs, sweeps

def test_sweep_members_and_init():
    members = ea.sweep_members([0.1, 0.5, 0.9], [0, 1])
    assert members.member.tolist() == list(range(6))
    assert members.member_seed.tolist() == [0, 1, 2, 1000, 1001, 1002]
    a, b = cb.ToyTransformer(TINY, seed=None), cb.ToyTransformer(TINY, seed=None)
    ea.sweep_init(a, 1000)
    ea.sweep_init(b, 1002)
    assert torch.equal(a.W_E, b.W_E)  # same seed, same init, whatever the value


def test_evaluator_pads_per_member_pools():
    ens = cb.Ensemble(TINY, (0, 1))
    short, long_ = TASK.eval_pool("zero_var_train", 5, 0), TASK.eval_pool("one_var_train", 9, 0)
    out = Evaluator({"p": [short, long_]})(ens, 0)["acc_p"]
    for k, b in enumerate([short, long_]):
        pred = ens.member(k)(b.tokens)[:, -1].argmax(-1)
        assert out[k].item() == pytest.approx((pred == b.labels).float().mean().item())


def test_progress_evaluator_per_member_and_for_one_model():
    ens = cb.Ensemble(TINY, (0, 1))
    ev = ea.ProgressEvaluator(TASK, pool_size=20, probe_size=16)
    out = ev(ens, 0)
    names = ["acc_zero_var_train", "acc_heldout_zero_var", "routing", "bound_1var", "bound_2var",
             "bound_over_values", "addends_top", "qk_diag", "qk_identity"]
    for key in names:
        assert out[key].shape == (2,)
    one = ev.evaluate_model(ens.member(1))
    for key in names:
        assert one[key] == pytest.approx(float(out[key][1]), abs=1e-6)
    assert ev.spec()["assign_add_progress"] == ea.MEASURES_VERSION == 3


def test_pool_accuracies_of_one_model():
    model = cb.ToyTransformer(TINY, seed=2)
    pool = TASK.eval_pool("two_var_train", 30, 0)
    expected = float((model(pool.tokens)[:, -1].argmax(-1) == pool.labels).float().mean())
    assert ea.pool_accuracies(model, {"p": pool}, chunk=7) == {"p": pytest.approx(expected)}


def released_run(directory, steps=(0, 50, 100)):
    directory.mkdir(exist_ok=True)
    models = {}
    for step in steps:
        models[step] = cb.ToyTransformer(TINY, seed=step)
        torch.save(models[step].state_dict(), directory / f"checkpoint_step_{step}.pth")
    return models


def test_checkpoint_run_reads_a_released_run(tmp_path, runs_dir):
    models = released_run(tmp_path / "release")
    run = ea.released_run(tmp_path / "release", TASK, pool_size=20, probe_size=16)
    assert run.checkpoint_steps() == [0, 50, 100] and run.n_members == 1 and run.key is None
    m = run.metrics()
    assert m.step.tolist() == [0, 50, 100] and set(m.member) == {0}
    ev = ea.ProgressEvaluator(TASK, pool_size=20, probe_size=16)
    for step, model in models.items():
        row = m[m.step == step].iloc[0]
        assert row.acc_two_var_train == pytest.approx(ea.pool_accuracies(model, ev.pools)["two_var_train"])
    tokens = TASK.eval_pool("one_var_train", 4, 0).tokens
    torch.testing.assert_close(run.model(0, 50)(tokens), models[50](tokens))
    torch.testing.assert_close(run.model()(tokens), models[100](tokens))
    assert list((runs_dir / "external").glob("*.json"))  # cached: a second reader does not re-evaluate
    again = ea.released_run(tmp_path / "release", TASK, pool_size=20, probe_size=16)
    pd.testing.assert_frame_equal(again.metrics(), m, check_dtype=False)
    with pytest.raises(ValueError, match="step=60 is not a checkpoint"):
        run.model(0, 60)
    with pytest.raises(ValueError, match="one member"):
        run.model(1)
    assert ea.transition_checkpoints(run, ea.detect_phases(m))["final"] == 100


def test_source_run_and_load_model_for_external_checkpoints(tmp_path, runs_dir):
    models = released_run(tmp_path / "release")
    base = dict(train_fraction=0.7, split_seed=42, pair_split="authors", pool_size=20, probe_size=16)
    run = ea.source_run(params(checkpoint_path=str(tmp_path / "release"), **base))
    assert isinstance(run, ReleasedRun)
    model, source, run = ea.load_model(params(checkpoint_path=str(tmp_path / "release"), **base), step=50)
    assert "released run" in source and "step 50" in source and isinstance(run, ReleasedRun)
    single = tmp_path / "release" / "checkpoint_step_100.pth"
    model, source, run = ea.load_model(params(checkpoint_path=str(single), **base))
    assert run is None and "external checkpoint" in source
    tokens = TASK.eval_pool("two_var_train", 8, 0).tokens
    torch.testing.assert_close(model(tokens), models[100](tokens))
    with pytest.raises(ValueError, match="does not exist"):
        ea.source_run(params(checkpoint_path=str(tmp_path / "missing"), **base))
    with pytest.raises(ValueError, match="not a file"):
        ea.load_model(params(checkpoint_path=str(tmp_path / "missing.pt"), **base))
    with pytest.raises(ValueError, match="is a single checkpoint; this notebook reads a training history"):
        ea.source_run(params(checkpoint_path=str(single), **base))
    other = cb.ToyTransformer(cb.ToyConfig(d_vocab=10, n_ctx=16, d_model=8, n_layers=2, d_mlp=8, d_vocab_out=59),
                              seed=0)
    torch.save(other.state_dict(), tmp_path / "other.pt")
    with pytest.raises(ValueError, match="d_vocab 10.*need d_vocab 74"):
        ea.load_model(params(checkpoint_path=str(tmp_path / "other.pt"), **base))


def test_make_task_takes_the_pair_split(tmp_path):
    base = dict(train_fraction=0.7, split_seed=42)
    assert ea.make_task(params(**base)).pair_split == "authors"
    book = ea.make_task(params(pair_split="book", **base))
    assert book.pair_split == "book" and len(book.train_pairs) == 2436
    path = tmp_path / "pairs.txt"
    path.write_text("0 0\n1 1\n")
    task = ea.make_task(params(pair_split=str(path), **base))  # the file sets the pairs, train_fraction aside
    assert task.train_pairs.tolist() == [0, 60]
    assert ea.sweep_split(params(pair_split=str(path), **base)) == "authors"
    assert ea.sweep_split(params(pair_split="book", **base)) == "book"


def test_schedule_deviations_name_the_knobs_that_move_the_steps():
    paper = {"d_model": 128, "d_mlp": 512, "batch_size": 512, "lr": 0.001, "weight_decay": 0.02,
             "train_fraction": 0.7, "two_var_ratio": None, "cooldown_steps": 0, "steps": 40000}
    same = params(**{**paper, "steps": 10000})  # the length alone does not move a step number
    assert ea.schedule_deviations(same, paper) == []
    cpu = params(**{**paper, "batch_size": 256, "lr": 0.002, "cooldown_steps": 2000})
    assert ea.schedule_deviations(cpu, paper) == ["batch_size 256 (paper: 512)", "lr 0.002 (paper: 0.001)",
                                                  "cooldown_steps 2000 (paper: 0)"]


def test_training_batches_of_the_chapter_task_never_leak():
    task = ea.make_task(params(train_fraction=0.7, split_seed=42))
    p = task.parse(torch.cat([task.train_batch(s, 512, 42).tokens for s in range(20)]))
    assert bool(task.is_training_query(p["seq_type"], p["left_var"], p["right_var"], p["n1"], p["n2"]).all())
    assert not bool(torch.isin(p["right_var"], torch.tensor([0, 1])).any())
    assert not bool(torch.isin(p["left_var"], torch.tensor([10, 11])).any())
    assert (task.universe_size, task.n_training_rows()) == (167_088, 102_312)


def test_model_and_train_configs():
    cfg = params(d_model=32, d_mlp=64, steps=10, batch_size=4, seeds=[42, 43, 44], lr=1e-3, weight_decay=0.02,
                 eval_every=5, checkpoint_every=5, log_checkpoints=0)
    mc = ea.model_config(cfg)
    assert (mc.d_model, mc.d_mlp, mc.mlp, mc.bias, mc.out_dim, mc.d_vocab) == (32, 64, (False, True), False, 59, 74)
    assert ea.train_config(cfg).seeds == (42, 43, 44)


def test_composed_run_reads_a_run_and_its_continuation_as_one():
    def fake(steps, ckpts, metric_steps, tag):
        return SimpleNamespace(
            train_config=SimpleNamespace(steps=steps), model_config=TINY, dir="d", key=tag, name=tag, path="p",
            manifest={"train_seconds": 10.0}, n_members=1, checkpoint_steps=lambda: ckpts,
            metrics=lambda: pd.DataFrame({"step": metric_steps, "member": 0, "acc": [tag] * len(metric_steps)}),
            model=lambda member=0, step=None: (tag, step))

    run = ea.ComposedRun(fake(100, [0, 50, 100], [0, 50, 100], "a"), fake(150, [100, 150], [100, 150], "b"))
    m = run.metrics()
    assert m.step.tolist() == [0, 50, 100, 150] and m.acc.tolist() == ["a", "a", "a", "b"]
    assert run.checkpoint_steps() == [0, 50, 100, 150] and run.train_config.steps == 150
    assert run.model(0, 50) == ("a", 50) and run.model(0, 100) == ("a", 100) and run.model(0) == ("b", 150)
    assert run.manifest["train_seconds"] == 20.0 and ea.final_step(run) == 150


def test_probe_data_reads_assigned_numbers():
    model = cb.ToyTransformer(TINY, seed=0)
    tokens = TASK.encode(["PAD a 40 PAD j 18 PAD PAD PAD k 9 PAD + a 27 ="])
    X, y = ea.variable_probe_data(model, TASK, tokens, "blocks.0.hook_resid_pre")
    assert y.tolist() == [0, 9, 10]
    expected = model.W_E[torch.tensor([40, 18, 9])] + model.W_pos[torch.tensor([2, 5, 10])]
    torch.testing.assert_close(X, expected.detach())


class Oracle:
    """A 'model' that answers from the parsed sequence: right everywhere except, when asked, with
    variable `b` on the right."""

    def __init__(self, wrong_b_right=False):
        self.wrong_b_right = wrong_b_right

    def __call__(self, tokens, last_only=False):
        p = TASK.parse(tokens)
        answer = torch.where((p["right_var"] == 1) & self.wrong_b_right, (p["label"] + 1) % 59, p["label"])
        return torch.nn.functional.one_hot(answer, 59).float()[:, None]


def test_accuracy_by_variable_side_marks_the_held_out_cells():
    table = ea.accuracy_by_variable_side(Oracle(), TASK, n=20)
    assert len(table) == 24 and (table.accuracy == 1.0).all()
    held = table[table["held out"]]
    assert set(zip(held.variable, held.side)) == {("a", "right"), ("b", "right"), ("k", "left"), ("l", "left")}
    wrong = ea.accuracy_by_variable_side(Oracle(wrong_b_right=True), TASK, n=20).set_index(["variable", "side"])
    assert wrong.accuracy[("b", "right")] == 0.0 and wrong.accuracy.drop(("b", "right")).eq(1.0).all()


def test_why_if_missing():
    assert ea.why_if_missing([float("nan"), float("nan")], "no jump") == "no jump"
    assert ea.why_if_missing([float("nan"), 3.0], "no jump") is None
    assert ea.why_if_missing(float("nan"), "x") == "x" and ea.why_if_missing(1.0, "x") is None


def test_phase_records_of_three_seeds_with_known_steps():
    metrics = synthetic_metrics(shift=300, members=3)
    table = ea.phases_table(metrics, window=1000)
    rec = ea.phase_records(table, metrics)
    assert rec["aa2_jump_step"] == ([5600.0, 5900.0, 6200.0], None) and rec["aa2_jump_step_run"][0] == [5600, 5900, 6200]
    assert rec["aa2_jump_share"][0] == pytest.approx([0.9] * 3)
    assert rec["aa2_qk_lag_windows"][0] == pytest.approx([0.0] * 3)  # QK rises at 5600 + shift, as the jump
    assert rec["aa2_bound_lag_windows"][0] == pytest.approx([0.2] * 3)  # bound attention at 5800 + shift
    assert rec["aa1_step_gap"][0] == pytest.approx([5888.9 - 1398.0 + 300 * k for k in range(3)], abs=0.2)
    assert rec["aa3_refine_step"][0] == [14500, 14800, 15100] and rec["aa3_hard_final_min_acc"][0] == [0.98] * 3
    # another pace: the timed keys are not measured, with the reason; the run's own steps stay
    slow = ea.phase_records(table, metrics, pace=["lr 0.002 (paper: 0.001)"])
    values, why = slow["aa2_jump_step"]
    assert all(math.isnan(v) for v in values) and why == "step numbers are not the paper's at this pace: lr 0.002 (paper: 0.001)"
    assert slow["aa2_jump_step_run"] == rec["aa2_jump_step_run"] and slow["aa3_refine_step"][1] == why
    assert "not the paper's" in ea.pace_phrase(["lr"]) and "is compared" not in ea.pace_phrase(["lr"])
    assert "compared with the paper's" in ea.pace_phrase([])


def test_phase_records_say_why_when_nothing_was_detected():
    metrics = synthetic_metrics()
    for p in ea.VAR_POOLS:
        metrics[f"acc_{p}"] = 0.1  # no jump, never 0.5
    rec = ea.phase_records(ea.phases_table(metrics, window=1000), metrics)
    assert rec["aa2_jump_step"][1] == ea.NO_JUMP and rec["aa2_qk_lag_windows"][1] == ea.NO_JUMP
    assert rec["aa1_zero_var_acc_at_var_half"][1] == "the variable accuracy never reached 0.5"
    assert rec["aa3_refine_step"][1] == ea.NO_REFINEMENT and rec["aa3_refine_rise"][1] == ea.NO_JUMP


def test_circuit_emergence_ignores_noise_before_the_rise():
    m = synthetic_metrics()
    m.loc[m.step == 2000, "qk_identity"] = -0.2  # a swing before the rise
    m.loc[m.step == 2100, "qk_identity"] = 0.2
    ph = ea.detect_phases(m, window=1000)
    assert ph.qk_step == pytest.approx(5600) and ph.jump_step == pytest.approx(5600)


def release_like_metrics(rng, pool_size=2000, probe_size=512):
    """The authors' run as issue 37 describes it, measured on `pool_size` sequences per pool and `probe_size`
    per probe type (binomial draws): addition by step 600; the variable accuracy on the E[1/k] plateau, a jump
    5,301 -> 5,401, then a creep; the hard pools rise with the jump and once more at 14,000-16,000; the bound
    value's lead rises 57% of its way at 2,500-4,300 (with the previous-token head) and the rest at the jump."""
    s = np.arange(1, 40002, 100)
    df = pd.DataFrame({"step": s, "member": 0, "seed": -1})

    def drawn(p, n):
        return rng.binomial(n, np.clip(p, 0, 1)) / n

    df["acc_zero_var_train"] = drawn(ramp(s, 100, 600, 0.02, 1.0), pool_size)
    var = ramp(s, 200, 700, 0.02, 0.41) + np.where(s >= 5401, 0.5, 0.0) + ramp(s, 5401, 20000, 0.0, 0.09)
    for p in ea.VAR_POOLS:
        df[f"acc_{p}"] = drawn(var, pool_size)
    hard = 0.3 * var + ramp(s, 5401, 7000, 0.0, 0.2) + ramp(s, 14000, 16000, 0.0, 0.33)
    for p in ea.HARD_POOLS:
        df[f"acc_{p}"] = drawn(hard, pool_size)
    df["bound_over_values"] = drawn(np.where(s >= 5401, 0.968, ramp(s, 2500, 4300, 0.4, 0.755)), 2 * probe_size)
    df["qk_identity"] = sigmoid_curve(s, 5500, 300) * 0.9
    df["routing"] = ramp(s, 2500, 4300, 0.1, 0.95)
    return df


def sigmoid_curve(x, centre, width):
    return 1 / (1 + np.exp(-(np.asarray(x, float) - centre) / width))


@pytest.mark.parametrize("pool_size, probe_size", [(2000, 512), (500, 256)])
def test_aa2_and_aa3_verdicts_do_not_move_between_draws_of_the_evaluation(pool_size, probe_size):
    """Issue 37: on the authors' run the jump lay inside ~20 tied windows and the bound value's half-way step
    in its earlier stage, so the draw of the pools decided AA-2 and AA-3. Over 11 draws here: the jump is the
    jump (5,351), the bound value's stage at the jump is half-way within 100 steps of it, the refinement lies
    in [12,000, 20,000], and AA-2's lags stay within one window on every draw."""
    rng = np.random.default_rng(0)
    for _ in range(11):
        ph = ea.detect_phases(release_like_metrics(rng, pool_size, probe_size), window=2000, pool_size=pool_size,
                              probe_size=probe_size)
        assert ph.jump_step == pytest.approx(5351)
        assert abs(ph.bound_step - ph.jump_step) <= 100 and abs(ph.qk_step - ph.jump_step) <= 2000
        assert 12000 <= ph.refine_step <= 20000 and ph.refine_rise >= 0.2
        assert ph.jump_share >= 0.5


def test_without_the_sampling_error_the_draw_decided_the_jump_and_the_bound_stage():
    """The rules before issue 37 on the same draws: the steepest window's centre moved over the tied windows,
    and the half-way step of the bound value's whole change lay in its earlier stage, over a window away."""
    rng = np.random.default_rng(0)
    jumps = []
    for _ in range(11):
        m = release_like_metrics(rng)
        first, _, _ = curves.steepest_region(m.step, m[[f"acc_{p}" for p in ea.VAR_POOLS]].mean(axis=1), 2000,
                                             after=600)
        jumps.append(first + 1000)
        whole = curves.half_way_step(m.step[m.step >= 600], m.bound_over_values[m.step >= 600])
        assert abs(whole - 5351) > 1000
    assert max(jumps) - min(jumps) >= 500


def test_phase_tolerances_follow_the_sequences_behind_each_point():
    tol = ea.phase_tolerances(2000, 512)
    assert tol["variable"] == pytest.approx(curves.binomial_rise_tolerance(4000))
    assert tol["hard"] == pytest.approx(curves.binomial_rise_tolerance(6000))
    assert tol["bound_over_values"] == pytest.approx(curves.binomial_rise_tolerance(1024))
    assert ea.phase_tolerances(None, None) == {"variable": 0.0, "hard": 0.0, "bound_over_values": 0.0}
    cfg = SimpleNamespace(pool_size=500, probe_size=256, get=lambda k, d=None: None)
    assert ea.phase_settings(cfg) == {"window": None, "pool_size": 500, "probe_size": 256}


def test_phase_intervals_hold_the_values_and_widen_with_fewer_sequences():
    rng = np.random.default_rng(3)
    metrics = release_like_metrics(rng, 500, 256)
    wide = ea.phase_intervals(ea.phases_table(metrics, 2000, 500, 256), metrics, 500, 256)
    narrow = ea.phase_intervals(ea.phases_table(metrics, 2000, 500, 256), metrics, 5000, 2560)
    rec = ea.phase_records(ea.phases_table(metrics, 2000, 500, 256), metrics)
    for key in ("aa2_bound_lag_windows", "aa2_jump_share", "aa3_hard_final_min_acc"):
        (lo, hi), value = wide[key][0], rec[key][0][0]
        assert lo <= value <= hi, key
        assert narrow[key][0][1] - narrow[key][0][0] <= hi - lo, key
    # the hard pools' final accuracies: the lowest Wilson interval ends at 500 sequences
    last = metrics[metrics.step == metrics.step.max()].iloc[0]
    ends = [curves.binomial_interval(last[f"acc_{p}"], 500) for p in ea.HARD_POOLS]
    assert wide["aa3_hard_final_min_acc"][0] == [min(e[0] for e in ends), min(e[1] for e in ends)]
    assert ea.phase_intervals(ea.phases_table(metrics, 2000), metrics, None, None) == {}


def test_binomial_interval_is_the_wilson_interval():
    lo, hi = curves.binomial_interval(0.9, 500)
    z, n, p = 2.0, 500, 0.9
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (lo, hi) == (pytest.approx(centre - half), pytest.approx(centre + half))
    assert curves.binomial_interval(1.0, 500)[1] == 1.0 and curves.binomial_interval(1.0, 500)[0] < 1.0


def test_a_released_run_is_shown_as_the_release_not_as_the_books_training(tmp_path):
    released_run(tmp_path / "release", steps=(1, 101, 201))
    torch.save(cb.ToyTransformer(TINY, seed=9).state_dict(), tmp_path / "release" / "model_state_dict.pth")
    base = dict(pool_size=2000, probe_size=512, eval_seed=1, pair_split="authors", profile="cpu", d_model=128,
                d_mlp=512, steps=10000, batch_size=256, lr=0.002, weight_decay=0.02, seeds=[42], eval_every=100)
    table = ea.run_settings(params(checkpoint_path=str(tmp_path / "release"), **base))
    shown = table.iloc[:, 0].to_dict()
    assert table.columns.tolist() == ["released run"]
    assert shown["release"] == "release" and shown["step checkpoints"] == "3" and shown["checkpoint steps"] == "1 to 201"
    assert shown["final model"].startswith("model_state_dict.pth, step 300 (assumed")
    assert shown["pair_split"] == "authors" and shown["pool_size"] == "2000" and shown["probe_size"] == "512"
    assert not {"lr", "batch_size", "steps", "seeds", "d_model"} & set(shown)  # the book's training: not the release's
    book = ea.run_settings(params(checkpoint_path=None, **base))
    assert book.loc["lr", "cpu"] == 0.002 and book.loc["probe_size", "cpu"] == 512
    assert ea.member_label(-1) == "the release" and ea.member_label(42) == "seed 42"


def test_signal_to_noise_of_parts_with_a_known_signal_and_noise():
    from circuitbook.analysis.baselines import signal_to_noise

    gen = torch.Generator().manual_seed(0)
    signal = torch.zeros(12, 12, dtype=torch.float64)
    signal.fill_diagonal_(1.0)
    sigma, k = 0.5, 16
    parts = [signal + sigma * torch.randn(12, 12, generator=gen, dtype=torch.float64) for _ in range(k)]
    mean, snr = signal_to_noise(parts)
    # ||signal|| = sqrt(12); the standard error of the mean is sigma / sqrt(k) per entry: 12 sigma / sqrt(k) in norm
    assert snr == pytest.approx(math.sqrt(12) / (12 * sigma / math.sqrt(k)), rel=0.25)
    assert torch.allclose(mean, torch.stack(parts).mean(0))
    noise_only = [sigma * torch.randn(12, 12, generator=gen, dtype=torch.float64) for _ in range(k)]
    assert signal_to_noise(noise_only)[1] == pytest.approx(1.0, abs=0.3)  # pure noise: about 1
    with pytest.raises(ValueError, match="at least 2 parts"):
        signal_to_noise(parts[:1])


def test_qk_gradient_block_is_the_whole_batch_gradient_with_its_noise_ratio():
    model = cb.ToyTransformer(TINY, seed=3)
    batch = TASK.train_batch(0, 64, 5)
    grad, block, snr = ea.qk_gradient_block(model, batch.tokens, batch.labels, TASK, parts=4)
    torch.testing.assert_close(grad, ea.qk_gradient(model, batch.tokens, batch.labels)[0])
    torch.testing.assert_close(block, ea.variable_block(ea.qk_in_basis(grad, model, TASK)[0], TASK))
    assert snr > 0 and math.isfinite(snr)
    with pytest.raises(ValueError, match="cannot be split"):
        ea.qk_gradient_block(model, batch.tokens[:3], batch.labels[:3], TASK, parts=4)
