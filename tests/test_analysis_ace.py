"""ACE: known answers on planted systems, and hook plumbing on real model classes."""
import math

import pytest
import torch
import torch.nn as nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from circuitbook.analysis import ace
from circuitbook.analysis.compare import projector_overlap
from circuitbook.models.toy import ToyConfig, ToyTransformer

N_CLASSES, TASK_RANK, D = 8, 3, 16
AXIS_SCALES = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)  # distinct, so the core's order is known


def cube_corners() -> torch.Tensor:
    """The 8 sign patterns in {-1, 1}^3: class c is read off as the signs of 3 task coordinates."""
    return torch.tensor([[1 - 2 * ((c >> i) & 1) for i in range(3)] for c in range(8)], dtype=torch.float64)


class TableModel(HookedRootModule):
    """token i -> activation table[i] (hook 'hook_h') -> linear readout; a model whose
    activations and Jacobians we choose exactly."""

    def __init__(self, table: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table.float())
        self.readout = nn.Linear(table.shape[1], weight.shape[0])
        with torch.no_grad():
            self.readout.weight.copy_(weight)
            self.readout.bias.copy_(bias)
        self.hook_h = HookPoint()
        self.setup()

    def forward(self, tokens):
        return self.readout(self.hook_h(self.table[tokens]))


@pytest.fixture(scope="module")
def planted():
    """Activations = offset + 3-D class code (task subspace T) + large-variance nuisance in
    8 other directions that the readout ignores. Task coordinate i is scale_i * sign_i(class)
    + noise, and logit_c = <signs_c, task coordinates>, so each axis decides one bit of the
    class. Nuisance is decorrelated from the task coordinates in-sample so that the exact
    answer is span(T), ordered by scale."""
    gen = torch.Generator().manual_seed(0)
    n_per_class = 150
    labels = torch.arange(N_CLASSES).repeat_interleave(n_per_class)
    n = len(labels)
    basis = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64)).Q
    task_dirs, nuisance_dirs = basis[:, :TASK_RANK], basis[:, TASK_RANK:TASK_RANK + 8]
    signs = cube_corners()
    task = AXIS_SCALES * signs[labels] + 0.1 * torch.randn(n, TASK_RANK, generator=gen, dtype=torch.float64)
    nuisance = 5 * torch.randn(n, 8, generator=gen, dtype=torch.float64)
    design = torch.cat([torch.ones(n, 1, dtype=torch.float64), task], 1)
    nuisance -= design @ torch.linalg.lstsq(design, nuisance).solution  # in-sample decorrelation
    offset = 3 * torch.randn(D, generator=gen, dtype=torch.float64)
    H = offset + task @ task_dirs.T + nuisance @ nuisance_dirs.T
    weight = signs @ task_dirs.T  # logits_c = <signs_c, task coordinates>
    model = TableModel(H, weight.float(), (-weight @ offset).float())
    tokens = torch.arange(n)[:, None]
    return dict(H=H, labels=labels, task_dirs=task_dirs, weight=weight, model=model, tokens=tokens)


def test_extract_recovers_planted_subspace_and_rank(planted):
    J = planted["weight"].expand(len(planted["H"]), -1, -1)  # a linear readout: J = W for every sample
    core = ace.extract_core(planted["H"], J, energy_threshold=0.99)
    assert core.rank == TASK_RANK
    assert projector_overlap(core.Q, planted["task_dirs"]) == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(core.Q.T @ core.Q, torch.eye(TASK_RANK, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(core.mu, planted["H"].mean(0))
    assert core.energy[-1] == pytest.approx(1.0)


def test_collected_inputs_match_the_planted_readout(planted):
    inputs = ace.collect_ace_inputs(planted["model"], planted["tokens"], "hook_h")
    assert inputs.activations.shape == (len(planted["H"]), D)
    assert inputs.jacobians.shape == (len(planted["H"]), N_CLASSES, D)
    assert torch.allclose(inputs.jacobians[7], planted["weight"].float(), atol=1e-6)
    core = ace.extract_core(inputs.activations, inputs.jacobians)
    assert core.rank == TASK_RANK
    assert projector_overlap(core, planted["task_dirs"]) > 0.999


def test_keep_remove_flip_on_planted_system(planted):
    J = planted["weight"].expand(len(planted["H"]), -1, -1)
    core = ace.extract_core(planted["H"], J)
    result = ace.validate_core(planted["model"], planted["tokens"], planted["labels"], "hook_h", core,
                               chance=1 / N_CLASSES)
    # keeping k axes leaves 3 - k class bits undecided; removing k axes loses k bits
    assert result.clean == pytest.approx(1.0)
    assert result.keep == pytest.approx([0.25, 0.5, 1.0], abs=0.03)
    assert result.remove == pytest.approx([0.5, 0.25, 1 / N_CLASSES], abs=0.03)
    assert result.remove[-1] == pytest.approx(1 / N_CLASSES)  # without the core: one class for all inputs
    assert max(result.flip) == 0.0  # a mirrored bit is always a wrong bit
    assert result.sufficient_dim == TASK_RANK and result.necessary_dim == TASK_RANK


def test_dimension_rules():
    ks = [1, 2, 3, 4]
    assert ace.sufficient_dimension(ks, [0.5, 0.97, 0.99, 1.0], clean=1.0, tol=0.02) == 3
    assert ace.sufficient_dimension(ks, [0.5, 0.97, 0.9985, 1.0], clean=1.0, tol=1e-3) == 4
    assert ace.necessary_dimension(ks, [0.9, 0.6, 0.28, 0.25], level=0.3) == 3
    assert ace.necessary_dimension(ks, [0.9, 0.8, 0.7, 0.6], level=0.3) is None
    assert ace.necessary_dimension(ks, [0.9, 0.2, 0.1, 0.1], level=0.3, at_least=3) == 3  # max(rank, k)
    assert ace.necessary_dimension(ks, [0.9, 0.8, 0.7, 0.1], level=0.3, at_least=3) == 4
    # the paper's level is twice chance (2/p), the book's chance + 0.05
    assert ace.PAPER.necessary_level(0.25) == 0.5 and ace.BOOK.necessary_level(0.25) == pytest.approx(0.3)
    val = ace.core_validation(ks, 0.75, {"keep": [0.5, 0.7495, 0.75, 0.75], "remove": [0.6, 0.5, 0.3, 0.25],
                                         "flip": [float("nan")] * 4}, chance=0.25, definition=ace.PAPER,
                              energy_rank=3)
    assert (val.sufficient_dim, val.necessary_dim, val.definition, val.centered) == (2, 3, "paper", False)
    val = ace.core_validation(ks, 0.75, {"keep": [0.5, 0.7495, 0.75, 0.75], "remove": [0.6, 0.5, 0.3, 0.25],
                                         "flip": [float("nan")] * 4}, chance=0.25, definition=ace.BOOK)
    assert (val.sufficient_dim, val.necessary_dim, val.definition, val.centered) == (2, 3, "book", True)
    with pytest.raises(ValueError, match="outputs"):
        ace.CoreDefinition("x", 0.99, "logprobs", True, 0.0, 1.0, 0.0, False)
    with pytest.raises(ValueError, match="sufficient_tol"):
        ace.CoreDefinition("x", 0.99, "raw", True, -1.0, 1.0, 0.0, False)


def test_paper_keep_and_remove_act_about_the_origin(planted):
    """The readout reads only the task directions and the core is exactly their span, so W QQ^T = W:
    the paper's (uncentred) keep of the whole core changes no logit, and its remove leaves
    W (I - QQ^T) h + bias = bias for every input: one class, argmax(bias), for all."""
    J = planted["weight"].expand(len(planted["H"]), -1, -1)
    core = ace.extract_core(planted["H"], J)
    result = ace.validate_core(planted["model"], planted["tokens"], planted["labels"], "hook_h", core,
                               chance=1 / N_CLASSES, definition=ace.PAPER, energy_rank=core.rank)
    assert result.centered is False and result.definition == "paper"
    assert result.keep[-1] == 1.0
    constant_class = int(planted["model"].readout.bias.argmax())
    assert result.remove[-1] == pytest.approx(float((planted["labels"] == constant_class).float().mean()))
    assert result.necessary_level == pytest.approx(2 / N_CLASSES)
    # removing two of the three axes already leaves 1/4 <= 2/8: the paper reports max(energy rank 3, 2)
    assert result.remove[1] == pytest.approx(0.25, abs=0.03)
    assert (result.sufficient_dim, result.necessary_dim) == (3, 3)


def test_interventions_algebra():
    gen = torch.Generator().manual_seed(1)
    h, mu = torch.randn(5, 6, generator=gen), torch.randn(6, generator=gen)
    Q = torch.linalg.qr(torch.randn(6, 2, generator=gen)).Q
    keep, remove = ace.apply_intervention(h, Q, mu, "keep"), ace.apply_intervention(h, Q, mu, "remove")
    assert torch.allclose(keep + remove, h + mu, atol=1e-6)
    flip = ace.apply_intervention(h, Q, mu, "flip")
    assert torch.allclose(ace.apply_intervention(flip, Q, mu, "flip"), h, atol=1e-5)
    eye = torch.eye(6)
    assert torch.allclose(ace.apply_intervention(h, eye, mu, "keep"), h, atol=1e-6)
    assert torch.allclose(ace.apply_intervention(h, eye, None, "remove"), torch.zeros_like(h), atol=1e-6)
    with pytest.raises(ValueError, match="mode"):
        ace.apply_intervention(h, Q, mu, "scramble")


def test_operator_recovers_planted_eigenvalues():
    gen = torch.Generator().manual_seed(2)
    true_eigs = [0.9 * complex(math.cos(0.3), math.sin(0.3)), 0.9 * complex(math.cos(0.3), -math.sin(0.3)), 0.5]
    rotation = 0.9 * torch.tensor([[math.cos(0.3), -math.sin(0.3), 0], [math.sin(0.3), math.cos(0.3), 0], [0, 0, 0]],
                                  dtype=torch.float64)
    rotation[2, 2] = 0.5
    change = torch.randn(3, 3, generator=gen, dtype=torch.float64) + 2 * torch.eye(3, dtype=torch.float64)
    A = change @ rotation @ torch.linalg.inv(change)
    z = torch.zeros(200, 20, 3, dtype=torch.float64)
    z[:, 0] = torch.randn(200, 3, generator=gen, dtype=torch.float64)
    for t in range(19):
        z[:, t + 1] = z[:, t] @ A.T + 1e-3 * torch.randn(200, 3, generator=gen, dtype=torch.float64)
    op = ace.fit_core_operator(z)
    assert torch.allclose(op.A, A, atol=1e-2)
    found = sorted(op.eigenvalues.tolist(), key=lambda c: (round(abs(c), 6), c.imag))
    expected = sorted(true_eigs, key=lambda c: (round(abs(c), 6), c.imag))
    assert all(abs(f - e) < 1e-3 for f, e in zip(found, expected))
    assert op.r2 > 0.99
    with_offset = ace.fit_core_operator(list(z + 1.0), intercept=True)  # an affine fit absorbs a shift
    assert torch.allclose(with_offset.eigenvalues, op.eigenvalues, atol=1e-9)


def test_bad_inputs_raise_value_errors(planted):
    H, J = planted["H"], planted["weight"].expand(len(planted["H"]), -1, -1)
    for threshold in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="energy_threshold"):
            ace.extract_core(H, J, energy_threshold=threshold)
    with pytest.raises(ValueError, match="jacobians"):
        ace.extract_core(H, J[:, :, :5])
    with pytest.raises(ValueError, match="activations"):
        ace.extract_core(H[0], J)
    with pytest.raises(ValueError, match="rank"):
        ace.extract_core(H, J, rank=TASK_RANK + 1)
    with pytest.raises(ValueError, match="hook_name"):
        ace.collect_activations(planted["model"], planted["tokens"], "hook_nonexistent")
    with pytest.raises(ValueError, match="position"):
        ace.collect_activations(planted["model"], planted["tokens"], "hook_h", position=3)


# --------------------------------------------------------------------------- #
# Real model classes
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def toy():
    cfg = ToyConfig(d_vocab=11, n_ctx=6, d_model=24, n_layers=2, n_heads=2, d_mlp=40, d_vocab_out=7)
    tokens = torch.randint(0, 11, (40, 6), generator=torch.Generator().manual_seed(3))
    return ToyTransformer(cfg, seed=0), tokens


def reference_jacobian(model, tokens, hook_name, pos, out_pos, select=lambda z: z):
    """d select(logits[0, out_pos]) / d act[0, pos] by torch.autograd.functional.jacobian."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1])
    clean = cache[hook_name]

    def outputs(h):
        def patch(act, hook):
            act = act.clone()
            act[0, pos] = h.reshape(act[0, pos].shape)
            return act
        return select(model.run_with_hooks(tokens[:1], fwd_hooks=[(hook_name, patch)])[0, out_pos])

    return torch.autograd.functional.jacobian(outputs, clean[0, pos].reshape(-1))


@pytest.mark.parametrize("hook_name,dim", [("blocks.1.hook_resid_mid", 24), ("blocks.1.mlp.hook_pre", 40),
                                           ("blocks.0.attn.hook_z", 24)])
def test_toy_jacobians_match_autograd_reference(toy, hook_name, dim):
    model, tokens = toy
    inputs = ace.collect_ace_inputs(model, tokens, hook_name, position=-1, batch_size=16)
    assert inputs.activations.shape == (40, dim) and inputs.jacobians.shape == (40, 7, dim)
    expected = reference_jacobian(model, tokens, hook_name, -1, -1)
    assert torch.allclose(inputs.jacobians[0], expected, atol=1e-5)


def test_toy_all_positions_is_the_same_position_block(toy):
    model, tokens = toy
    select = lambda z: z[..., :3]  # noqa: E731 -- a task output: three of the logits
    inputs = ace.collect_ace_inputs(model, tokens, "blocks.0.hook_resid_post", output_fn=select, position="all")
    assert inputs.jacobians.shape == (40 * 6, 3, 24) and inputs.n_positions == 6
    per_sequence = inputs.jacobians.reshape(40, 6, 3, 24)
    expected = reference_jacobian(model, tokens, "blocks.0.hook_resid_post", 2, 2, select)
    assert torch.allclose(per_sequence[0, 2], expected, atol=1e-5)
    acts = ace.collect_activations(model, tokens, "blocks.0.hook_resid_post", position="all")
    assert torch.allclose(inputs.activations.reshape(40, 6, 24), acts, atol=1e-6)


def test_toy_keep_with_full_basis_leaves_logits_unchanged(toy):
    model, tokens = toy
    acts = ace.collect_activations(model, tokens, "blocks.1.hook_resid_mid", position="all")
    mu = acts.reshape(-1, 24).mean(0)
    with torch.no_grad():
        clean = model(tokens)
        for position in (-1, "all"):
            hook = ace.intervention_hook(torch.eye(24), mu, "keep", position)
            kept = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_mid", hook)])
            assert torch.allclose(kept, clean, atol=1e-5)
        removed = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_mid",
                                                           ace.intervention_hook(torch.eye(24), mu, "remove", -1))])
    assert not torch.allclose(removed[:, -1], clean[:, -1], atol=1e-3)
    assert torch.allclose(removed[:, :-1], clean[:, :-1], atol=1e-6)  # only the chosen position moved


def test_toy_end_to_end_and_hook_errors(toy):
    model, tokens = toy
    inputs = ace.collect_ace_inputs(model, tokens, "blocks.1.hook_resid_mid")
    core = ace.extract_core(inputs.activations, inputs.jacobians, energy_threshold=0.9)
    labels = model(tokens)[:, -1].argmax(-1)  # the model's own answers: clean accuracy 1
    result = ace.validate_core(model, tokens, labels, "blocks.1.hook_resid_mid", core, chance=1 / 7, ks=[core.rank])
    assert result.clean == 1.0 and len(result.keep) == 1
    with pytest.raises(ValueError, match="hook_name"):
        ace.collect_ace_inputs(model, tokens, "blocks.7.hook_resid_post")
    with pytest.raises(ValueError, match="hook_name"):
        ace.collect_activations(model, tokens, "blocks.0.attn.hook_pattern")
    with pytest.raises(ValueError, match="ks"):
        ace.validate_core(model, tokens, labels, "blocks.1.hook_resid_mid", core, chance=0.1, ks=[core.rank + 1])


def test_bridge_hooks():
    from transformer_lens import TransformerBridge

    bridge = TransformerBridge.boot_native(dict(d_model=16, n_layers=2, n_ctx=8, d_head=4, n_heads=4, d_vocab=20,
                                                d_mlp=32, act_fn="gelu", seed=0))
    bridge.eval()  # boot_native returns a model in training mode
    tokens = torch.randint(0, 20, (12, 8), generator=torch.Generator().manual_seed(4))
    select = lambda z: z[..., :3]  # noqa: E731
    inputs = ace.collect_ace_inputs(bridge, tokens, "blocks.1.hook_resid_mid", output_fn=select)
    assert inputs.jacobians.shape == (12, 3, 16)
    expected = reference_jacobian(bridge, tokens, "blocks.1.hook_resid_mid", -1, -1, select)
    assert torch.allclose(inputs.jacobians[0], expected, atol=1e-5)
    mu = inputs.activations.mean(0)
    with torch.no_grad():
        bridge.eval()
        hook = ace.intervention_hook(torch.eye(16), mu, "keep", "all")
        kept = bridge.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", hook)])
        assert torch.allclose(kept, bridge(tokens), atol=1e-5)
    assert ace.collect_activations(bridge, tokens, "blocks.0.mlp.hook_pre").shape == (12, 32)
    logit_diff = ace.collect_ace_inputs(bridge, tokens, "blocks.1.hook_resid_mid",
                                        output_fn=lambda z: z[:, 0] - z[:, 1])  # [B]: one scalar output
    assert torch.allclose(logit_diff.jacobians[:, 0], inputs.jacobians[:, 0] - inputs.jacobians[:, 1], atol=1e-5)
    with pytest.raises(ValueError, match="hook_name"):
        ace.collect_activations(bridge, tokens, "blocks.1.hook_nonexistent")


def test_several_hooks_at_once_equal_one_at_a_time_on_a_bridge():
    """A bridge may use a hook's input elsewhere too: each Jacobian must be taken through what the hook returns,
    and an earlier hook's through the later hooks (one pass for several hooks gives the same as one per hook)."""
    from transformer_lens import TransformerBridge

    bridge = TransformerBridge.boot_native(dict(d_model=16, n_layers=2, n_ctx=8, d_head=4, n_heads=4, d_vocab=20,
                                                d_mlp=32, act_fn="gelu", seed=0))
    bridge.eval()
    tokens = torch.randint(0, 20, (12, 8), generator=torch.Generator().manual_seed(4))
    hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_mid"]
    margin = lambda z: z[..., 0] - z[..., 1]  # noqa: E731
    many = ace.collect_ace_inputs_many(bridge, tokens, hooks, margin, batch_size=5)
    for name in hooks:
        expected = reference_jacobian(bridge, tokens, name, -1, -1, margin)
        one = ace.collect_ace_inputs(bridge, tokens, name, margin, batch_size=5)
        assert torch.allclose(one.jacobians[0, 0], expected, atol=1e-5)
        assert torch.allclose(many[name].jacobians, one.jacobians, atol=1e-5)
        assert torch.allclose(many[name].activations, one.activations, atol=1e-6)


def test_output_mode_share_is_the_energy_of_a_planted_common_mode():
    """Raw logits = centred part (depends on x[:, 0]) + a common shift c * x[:, 1] added to every logit:
    the common mode's share of tr(Cov Obs) is known in closed form."""
    gen = torch.Generator().manual_seed(0)
    n, n_out, c = 4000, 4, 0.1
    H = torch.randn(n, 2, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 2.0], dtype=torch.float64)
    w = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)  # sums to 0: no common mode
    J = torch.stack([torch.stack([w, torch.full((n_out,), c, dtype=torch.float64)], 1)] * n)  # [n, n_out, 2]
    var = H.var(0)
    expected = var[1] * n_out * c ** 2 / (var[0] * (w ** 2).sum() + var[1] * n_out * c ** 2)
    share = ace.output_mode_share(H, J, torch.ones(n_out))
    assert share == pytest.approx(float(expected), rel=1e-6)
    # the sum of sigma^2 is tr(Cov Obs), and that mode is the core's second direction here
    core = ace.extract_core(H, J, rank=2)
    assert float(core.sigma[1] ** 2 / (core.sigma ** 2).sum()) == pytest.approx(share, rel=1e-3)
    # every output direction together carries all of it; a direction orthogonal to both columns none
    assert ace.output_mode_share(H, J, torch.eye(n_out)) == pytest.approx(1.0)
    assert ace.output_mode_share(H, J, torch.tensor([1.0, 1.0, -1.0, -1.0])) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="directions"):
        ace.output_mode_share(H, J, torch.ones(3))
