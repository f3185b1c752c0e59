"""The one-hot attention-only model of the leading_terms chapter: the paper's formula, hooks, vmap."""
import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap
from transformer_lens import ActivationCache

from circuitbook.models.onehot import OneHotConfig, OneHotTransformer, reference_forward

CFG = OneHotConfig(d_vocab=11, n_ctx=7, n_layers=3, init_std=0.5)


def tokens(cfg=CFG, batch=4, seed=1):
    return torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=torch.Generator().manual_seed(seed))


def test_names_shapes_and_exact_zero_init():
    m = OneHotConfig(d_vocab=9, n_ctx=5, n_layers=2).build()
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"blocks.0.attn.W_QK": (9, 9), "blocks.0.attn.W_V": (9, 9), "blocks.0.attn.P": (5,),
                      "blocks.1.attn.W_QK": (9, 9), "blocks.1.attn.W_V": (9, 9), "blocks.1.attn.P": (5,),
                      "unembed.W_U": (9, 9)}
    assert all(p.abs().max() == 0 for p in m.parameters()), "the paper starts every weight at exactly zero"
    assert m.trainable_names() == list(shapes)
    assert sorted(m.weights()) == ["P0", "P1", "V0", "V1", "W0", "W1", "W_O"]
    assert m.weights()["W_O"] is m.unembed.W_U
    # zero weights: uniform attention over the causal prefix, uniform output
    logits, cache = m.run_with_cache(tokens(m.cfg))
    assert logits.abs().max() == 0
    pattern = cache["blocks.1.attn.hook_pattern"][0]
    assert torch.allclose(pattern, torch.tril(torch.ones(5, 5)) / torch.arange(1, 6)[:, None])


def test_forward_equals_the_papers_formula_with_dense_one_hot_matrices():
    m = CFG.build(seed=3).double()
    x = tokens()
    expected = reference_forward(m, x)
    assert torch.allclose(m(x), expected, rtol=0, atol=1e-12)
    assert torch.allclose(m(x, last_only=True)[:, 0], expected[:, -1], rtol=0, atol=1e-12)
    no_pos = OneHotConfig(d_vocab=11, n_ctx=7, n_layers=2, positional=False, init_std=0.5).build(seed=2).double()
    assert torch.allclose(no_pos(x), reference_forward(no_pos, x), atol=1e-12)
    assert "blocks.0.attn.P" not in dict(no_pos.named_parameters())


def test_positional_bias_sits_on_the_sub_diagonals():
    m = OneHotConfig(d_vocab=5, n_ctx=4, n_layers=1).build().double()
    with torch.no_grad():
        m.blocks[0].attn.P.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    _, cache = m.run_with_cache(tokens(m.cfg, batch=1))
    scores = cache["blocks.0.attn.hook_attn_scores"][0]
    assert scores[3, 3] == 10 and scores[3, 2] == 20 and scores[3, 0] == 40 and scores[2, 0] == 30
    assert torch.isinf(scores[0, 1]) and scores[0, 1] < 0, "causal mask"


def test_hooks_cache_and_residual_decomposition():
    m = CFG.build(seed=4).double()
    x = tokens()
    logits, cache = m.run_with_cache(x)
    assert isinstance(cache, ActivationCache)
    onehot = torch.nn.functional.one_hot(x, 11).double()
    assert torch.allclose(cache["blocks.0.hook_resid_pre"], onehot)
    resid = onehot
    for l in range(3):
        resid = resid + cache[f"blocks.{l}.hook_attn_out"]
        assert torch.allclose(cache[f"blocks.{l}.hook_resid_post"], resid, atol=1e-12)
    assert torch.allclose(resid @ m.unembed.W_U, logits, atol=1e-12)
    fired = []
    m.run_with_hooks(x, fwd_hooks=[(lambda n: True, lambda a, hook: fired.append(hook.name))])
    assert set(fired) == set(m.hook_dict)


def test_editing_a_residual_through_a_hook_changes_the_output_as_the_formula_says():
    m = CFG.build(seed=5).double()
    x = tokens()
    clean = m(x)
    same = m.run_with_hooks(x, fwd_hooks=[("blocks.1.hook_resid_pre", lambda a, hook: a)])
    assert torch.allclose(same, clean, atol=1e-12)
    # zero layer 0's read-out: the model is then layers 1-2 on the one-hot input
    edited = m.run_with_hooks(x, fwd_hooks=[("blocks.0.hook_attn_out", lambda a, hook: torch.zeros_like(a))])
    two_layer = OneHotConfig(d_vocab=11, n_ctx=7, n_layers=2).build().double()
    two_layer.load_state_dict({k.replace("blocks.1.", "blocks.0.").replace("blocks.2.", "blocks.1."): v
                               for k, v in m.state_dict().items() if not k.startswith("blocks.0.")})
    assert torch.allclose(edited, two_layer(x), atol=1e-12)
    assert (edited - clean).abs().max() > 1e-3
    assert torch.equal(m(x), clean), "hooks are removed after run_with_hooks"


def test_runs_under_vmap_as_an_ensemble():
    members = [CFG.build(seed=s) for s in (0, 1, 2)]
    params, buffers = stack_module_state(members)
    base = CFG.build(seed=None).to("meta")
    x = tokens()

    def one(p, b, t):
        return functional_call(base, (p, b), (t,))

    out = vmap(one, in_dims=(0, 0, None))(params, buffers, x)
    for k, m in enumerate(members):
        assert torch.allclose(out[k], m(x), atol=1e-5)


def test_config_round_trip_and_hostile_values():
    cfg = OneHotConfig(d_vocab=30, n_ctx=8, n_layers=2, positional=False)
    assert OneHotConfig.from_dict(cfg.to_dict()) == cfg
    assert isinstance(cfg.build(seed=0), OneHotTransformer)
    with pytest.raises(ValueError, match="d_vocab"):
        OneHotConfig(d_vocab=0, n_ctx=8)
    with pytest.raises(ValueError, match="n_ctx"):
        OneHotConfig(d_vocab=4, n_ctx=2.5)
    with pytest.raises(ValueError, match="init_std"):
        OneHotConfig(d_vocab=4, n_ctx=2, init_std=-1.0)
    with pytest.raises(ValueError, match="unknown OneHotConfig fields"):
        OneHotConfig.from_dict({"d_vocab": 4, "n_ctx": 2, "d_model": 4})


def test_seeded_random_init_is_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = CFG.build(seed=7), CFG.build(seed=7), CFG.build(seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.unembed.W_U, b.unembed.W_U) and not torch.equal(a.unembed.W_U, c.unembed.W_U)
