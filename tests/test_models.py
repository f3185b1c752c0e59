"""The toy transformer: TransformerLens names, hooks, caching, patching, variants."""
import math

import pytest
import torch
from transformer_lens import ActivationCache

from circuitbook.models.toy import ToyConfig, ToyTransformer

AA = ToyConfig(d_vocab=74, n_ctx=16, d_model=32, n_layers=2, n_heads=1, d_mlp=64, mlp=(False, True),
               d_vocab_out=59, bias=False)


def tokens(cfg, batch=3):
    return torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=torch.Generator().manual_seed(1))


def test_transformer_lens_weight_names_and_shapes():
    m = ToyTransformer(AA)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["embed.W_E"] == (74, 32)
    assert shapes["pos_embed.W_pos"] == (16, 32)
    assert shapes["blocks.0.attn.W_Q"] == (1, 32, 32)
    assert shapes["blocks.0.attn.W_O"] == (1, 32, 32)
    assert shapes["blocks.1.mlp.W_in"] == (32, 64)
    assert shapes["unembed.W_U"] == (32, 59)
    assert not any(n.split(".")[-1].startswith("b_") for n in shapes), "bias=False must drop every bias"
    assert not any(n.startswith("blocks.0.mlp") for n in shapes), "layer 0 has no MLP"


def test_run_with_cache_returns_activation_cache_and_hooks_fire():
    m = ToyTransformer(AA)
    logits, cache = m.run_with_cache(tokens(AA))
    assert isinstance(cache, ActivationCache)
    assert logits.shape == (3, 16, 59)
    for name in ["hook_embed", "hook_pos_embed", "blocks.0.attn.hook_pattern", "blocks.1.hook_resid_mid",
                 "blocks.1.mlp.hook_pre", "blocks.1.hook_resid_post"]:
        assert name in cache, name
    assert cache["blocks.0.attn.hook_pattern"].shape == (3, 1, 16, 16)
    # causal: no attention to the future, rows sum to one
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones(3, 1, 16))
    assert pattern.triu(1).abs().max() == 0
    fired = []
    m.run_with_hooks(tokens(AA), fwd_hooks=[(lambda n: True, lambda x, hook: fired.append(hook.name))])
    assert set(fired) == set(m.hook_dict)


def test_residual_stream_decomposes():
    m = ToyTransformer(AA)
    _, cache = m.run_with_cache(tokens(AA))
    resid = cache["hook_embed"] + cache["hook_pos_embed"] + cache["blocks.0.hook_attn_out"]
    assert torch.allclose(resid, cache["blocks.0.hook_resid_post"], atol=1e-6)
    assert torch.allclose(cache["blocks.1.hook_resid_mid"] + cache["blocks.1.hook_mlp_out"],
                          cache["blocks.1.hook_resid_post"], atol=1e-6)


def test_patching_a_hook_changes_the_output_and_identity_patch_does_not():
    m = ToyTransformer(AA)
    x = tokens(AA)
    clean = m(x)
    same = m.run_with_hooks(x, fwd_hooks=[("blocks.1.hook_resid_mid", lambda a, hook: a)])
    assert torch.equal(clean, same)
    zeroed = m.run_with_hooks(x, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda a, hook: torch.zeros_like(a))])
    assert (zeroed - clean).abs().max() > 1e-3
    assert torch.equal(m(x), clean), "hooks must be removed after run_with_hooks"


def test_seed_determines_weights_without_touching_global_rng():
    state = torch.get_rng_state()
    a, b, c = ToyTransformer(AA, seed=3), ToyTransformer(AA, seed=3), ToyTransformer(AA, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.W_E, b.W_E) and not torch.equal(a.W_E, c.W_E)


def test_layernorm_and_biases_variant():
    cfg = ToyConfig(d_vocab=10, n_ctx=6, d_model=16, n_layers=2, n_heads=2, d_mlp=32, normalization="LN", act_fn="gelu")
    m = ToyTransformer(cfg)
    _, cache = m.run_with_cache(tokens(cfg))
    assert "blocks.0.ln1.hook_normalized" in cache and "ln_final.hook_normalized" in cache
    normed = cache["blocks.0.ln1.hook_normalized"]  # w = 1, b = 0 at init: zero mean, unit variance
    assert torch.allclose(normed.mean(-1), torch.zeros(3, 6), atol=1e-5)
    assert "blocks.0.attn.b_Q" in dict(m.named_parameters())


def test_one_hot_merged_qk_relative_positions_frozen_ov():
    """The leading-terms model: identity embedding, W_QK, relative bias P, frozen W_O, zero init."""
    cfg = ToyConfig(d_vocab=12, n_ctx=8, d_model=12, n_layers=2, n_heads=1, bias=False, positional="relative",
                    one_hot_embed=True, merged_qk=True, frozen=("blocks.*.attn.W_O",), init_std=0.0, attn_scale=1.0)
    m = ToyTransformer(cfg)
    assert torch.equal(m.W_E, torch.eye(12))
    assert "pos_embed.W_pos" not in dict(m.named_parameters())
    assert set(m.trainable_names()) == {"blocks.0.attn.W_QK", "blocks.0.attn.W_V", "blocks.0.attn.P",
                                       "blocks.1.attn.W_QK", "blocks.1.attn.W_V", "blocks.1.attn.P", "unembed.W_U"}
    assert not m.embed.W_E.requires_grad and not m.blocks[0].attn.W_O.requires_grad
    # the relative bias P[k] is added on the k-th sub-diagonal of the scores
    with torch.no_grad():
        m.blocks[0].attn.P[0, 1] = 5.0
    _, cache = m.run_with_cache(tokens(cfg, 1))
    scores = cache["blocks.0.attn.hook_attn_scores"][0, 0]
    assert torch.allclose(torch.diagonal(scores, -1), torch.full((7,), 5.0))
    assert torch.allclose(torch.diagonal(scores, 0), torch.zeros(8))
    # merged QK: scores = x W_QK x^T
    with torch.no_grad():
        m.blocks[1].attn.W_QK.copy_(torch.randn(1, 12, 12))
    x = tokens(cfg, 1)
    _, cache = m.run_with_cache(x)
    h = cache["blocks.1.hook_resid_pre"][0]
    expected = h @ m.blocks[1].attn.W_QK[0] @ h.T
    got = cache["blocks.1.attn.hook_attn_scores"][0, 0]
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)
    assert torch.allclose(m.blocks[1].attn.QK.AB[0], m.blocks[1].attn.W_QK[0])


def test_qk_factored_matrix_matches_weights():
    m = ToyTransformer(AA)
    attn = m.blocks[1].attn
    assert torch.allclose(attn.QK.AB, attn.W_Q @ attn.W_K.transpose(-1, -2))
    assert torch.allclose(attn.OV.AB, attn.W_V @ attn.W_O)


@pytest.mark.parametrize("bad, field", [
    (dict(positional="rotary"), "positional"),
    (dict(normalization="RMS"), "normalization"),
    (dict(act_fn="tanh"), "act_fn"),
    (dict(one_hot_embed=True), "one_hot_embed"),
    (dict(mlp=(True,)), "mlp"),
    (dict(n_layers=0), "n_layers"),
    (dict(dropout=1.0), "dropout"),
    (dict(dropout=-0.1), "dropout"),
    (dict(normalization="post"), "normalization"),
])
def test_bad_config_names_the_field(bad, field):
    base = dict(d_vocab=10, n_ctx=4, d_model=8, n_layers=2)
    with pytest.raises(ValueError, match=field):
        ToyConfig(**{**base, **bad})


def test_config_round_trips_through_dict():
    assert ToyConfig.from_dict(AA.to_dict()) == AA
    with pytest.raises(ValueError, match="unknown ToyConfig fields"):
        ToyConfig.from_dict({**AA.to_dict(), "d_modle": 3})


@pytest.mark.parametrize("cfg", [AA, ToyConfig(d_vocab=12, n_ctx=8, d_model=12, n_layers=2, positional="relative",
                                                merged_qk=True, one_hot_embed=True, normalization="LN", d_mlp=16),
                                 ToyConfig(d_vocab=12, n_ctx=8, d_model=12, n_layers=2, n_heads=2, d_mlp=16,
                                           normalization="postLN", dropout=0.1)])
def test_last_only_equals_the_last_position_of_the_full_forward(cfg):
    m = ToyTransformer(cfg, seed=1).eval()  # eval: no dropout masks to differ
    x = tokens(cfg)
    assert torch.allclose(m(x, last_only=True)[:, -1], m(x)[:, -1], atol=1e-5)
    assert m(x, last_only=True).shape[1] == 1


# ---------------------------------------------------------------- post-LN and dropout (the Markov paper's layer)
POST = ToyConfig(d_vocab=4, n_ctx=7, d_model=16, n_layers=1, n_heads=4, d_mlp=32, normalization="postLN", dropout=0.1)


def _torch_encoder_layer(block, cfg):
    """PyTorch's default TransformerEncoderLayer holding a post-LN block's weights."""
    d, h, e = cfg.d_model, cfg.n_heads, cfg.head_dim
    layer = torch.nn.TransformerEncoderLayer(d, h, cfg.d_mlp, dropout=cfg.dropout, batch_first=True)
    a = block.attn
    with torch.no_grad():
        # in_proj rows are (head, d_head) pairs: row h*e + j of the query part is W_Q[h, :, j]
        layer.self_attn.in_proj_weight.copy_(torch.cat([W.permute(0, 2, 1).reshape(h * e, d)
                                                        for W in (a.W_Q, a.W_K, a.W_V)]))
        layer.self_attn.in_proj_bias.copy_(torch.cat([b.reshape(h * e) for b in (a.b_Q, a.b_K, a.b_V)]))
        layer.self_attn.out_proj.weight.copy_(a.W_O.reshape(h * e, d).T)
        layer.self_attn.out_proj.bias.copy_(a.b_O)
        layer.linear1.weight.copy_(block.mlp.W_in.T)
        layer.linear1.bias.copy_(block.mlp.b_in)
        layer.linear2.weight.copy_(block.mlp.W_out.T)
        layer.linear2.bias.copy_(block.mlp.b_out)
        for ours, theirs in ((block.ln1, layer.norm1), (block.ln2, layer.norm2)):
            theirs.weight.copy_(ours.w)
            theirs.bias.copy_(ours.b)
    return layer


def _randomise(model, seed=5):
    """Non-trivial biases and LayerNorm gains (at init they are 0 and 1, which would hide mistakes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.rsplit(".", 1)[-1].startswith("W_"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def test_post_ln_block_is_pytorchs_default_encoder_layer_with_a_causal_mask():
    m = ToyTransformer(POST, seed=2)
    _randomise(m)
    m.eval()
    x = tokens(POST, batch=5)
    logits, cache = m.run_with_cache(x)
    layer = _torch_encoder_layer(m.blocks[0], POST).eval()
    mask = torch.nn.Transformer.generate_square_subsequent_mask(POST.n_ctx)
    expected = layer(cache["blocks.0.hook_resid_pre"], src_mask=mask, is_causal=True)
    assert torch.allclose(cache["blocks.0.hook_resid_post"], expected, atol=1e-5)
    # then a linear readout, no final LayerNorm
    assert "ln_final.w" not in dict(m.named_parameters())
    assert torch.allclose(logits, expected @ m.W_U + m.unembed.b_U, atol=1e-5)
    # the LayerNorm comes after each residual add: the output has zero mean, and unit variance times the gain
    out = (cache["blocks.0.hook_resid_post"] - m.blocks[0].ln2.b) / m.blocks[0].ln2.w
    assert torch.allclose(out.mean(-1), torch.zeros(5, POST.n_ctx), atol=1e-4)


def test_dropout_acts_in_training_mode_only_and_zero_dropout_is_the_old_model():
    x = tokens(POST, batch=8)
    m = ToyTransformer(POST, seed=1)
    plain = ToyTransformer(ToyConfig(**{**POST.to_dict(), "dropout": 0.0}), seed=1)
    m.eval()
    assert torch.equal(m(x), plain(x)), "in eval mode dropout must change nothing"
    m.train()
    torch.manual_seed(0)
    a = m(x)
    b = m(x)
    assert not torch.allclose(a, b), "two training-mode passes draw different masks"
    assert not torch.allclose(a, plain(x))
    # the four dropout sites of PyTorch's layer: pattern, attention output, MLP hidden, MLP output
    for site in ("blocks.0.attn.hook_pattern", "blocks.0.mlp.hook_post"):
        assert site in m.hook_dict
    # the default is no dropout: training mode then equals eval mode exactly
    plain.train()
    assert torch.equal(plain(x), plain.eval()(x))
    assert ToyConfig(d_vocab=3, n_ctx=2, d_model=4).dropout == 0.0


def test_each_ensemble_member_draws_its_own_dropout_mask_under_vmap():
    from torch.func import functional_call, stack_module_state, vmap

    members = [ToyTransformer(POST, seed=3) for _ in range(2)]  # identical weights
    params, buffers = stack_module_state(members)
    base = ToyTransformer(POST, seed=None).to("meta")
    x = tokens(POST, batch=4).expand(2, -1, -1)

    def forward(p, b, t):
        return functional_call(base, (p, b), (t,))

    base.train()
    torch.manual_seed(0)
    out = vmap(forward, randomness="different")(params, buffers, x)
    assert not torch.allclose(out[0], out[1]), "identical members must get different masks"
    out = vmap(forward, randomness="same")(params, buffers, x)
    assert torch.equal(out[0], out[1])
    with pytest.raises(RuntimeError):  # the default vmap refuses random ops: train.py must say which
        vmap(forward)(params, buffers, x)
    base.eval()
    out = vmap(forward)(params, buffers, x)
    assert torch.allclose(out[0], members[0].eval()(x[0]), atol=1e-5) and torch.equal(out[0], out[1])


# ---------------------------------------------------------------- init="pytorch" (the algorithmic-cores paper's models)
PT = ToyConfig(d_vocab=6, n_ctx=31, d_model=64, n_layers=2, n_heads=4, d_mlp=256, d_vocab_out=5,
               normalization="postLN", init="pytorch")


def _pytorch_reference(cfg, seed=0):
    """The same model built from PyTorch modules with their default initialisation, as TransformerLens-layout
    tensors: nn.Embedding (tokens, positions), one nn.TransformerEncoderLayer per layer, an nn.Linear readout."""
    torch.manual_seed(seed)
    d, h, e = cfg.d_model, cfg.n_heads, cfg.head_dim
    out = {"embed.W_E": torch.nn.Embedding(cfg.d_vocab, d).weight, "pos_embed.W_pos": torch.nn.Embedding(cfg.n_ctx, d).weight}
    for i in range(cfg.n_layers):
        layer = torch.nn.TransformerEncoderLayer(d, h, cfg.d_mlp, batch_first=True)
        W_q, W_k, W_v = layer.self_attn.in_proj_weight.split(h * e)
        b_q, b_k, b_v = layer.self_attn.in_proj_bias.split(h * e)
        out.update({f"blocks.{i}.attn.W_Q": W_q, f"blocks.{i}.attn.W_K": W_k, f"blocks.{i}.attn.W_V": W_v,
                    f"blocks.{i}.attn.b_Q": b_q, f"blocks.{i}.attn.b_K": b_k, f"blocks.{i}.attn.b_V": b_v,
                    f"blocks.{i}.attn.W_O": layer.self_attn.out_proj.weight,
                    f"blocks.{i}.attn.b_O": layer.self_attn.out_proj.bias,
                    f"blocks.{i}.mlp.W_in": layer.linear1.weight, f"blocks.{i}.mlp.b_in": layer.linear1.bias,
                    f"blocks.{i}.mlp.W_out": layer.linear2.weight, f"blocks.{i}.mlp.b_out": layer.linear2.bias,
                    f"blocks.{i}.ln1.w": layer.norm1.weight, f"blocks.{i}.ln1.b": layer.norm1.bias,
                    f"blocks.{i}.ln2.w": layer.norm2.weight, f"blocks.{i}.ln2.b": layer.norm2.bias})
    readout = torch.nn.Linear(d, cfg.out_dim)
    out.update({"unembed.W_U": readout.weight, "unembed.b_U": readout.bias})
    return {k: v.detach() for k, v in out.items()}


def test_pytorch_init_draws_each_parameter_from_pytorchs_default_distribution():
    ours = dict(ToyTransformer(PT, seed=0).named_parameters())
    ref = _pytorch_reference(PT)
    assert set(ours) == set(ref)
    for name, theirs in ref.items():
        mine = ours[name].detach()
        assert mine.numel() == theirs.numel(), name
        if theirs.std() == 0:  # constants: zero attention biases, LayerNorm gains 1 and biases 0
            assert torch.equal(mine.flatten().unique(), theirs.flatten().unique()), name
            continue
        if theirs.numel() < 200:  # too few draws to compare laws (the readout bias: checked by its bound below)
            continue
        # same family and scale: the largest |value| (uniform laws: the bound) and the std agree
        assert abs(mine.std() / theirs.std() - 1) < 0.15, (name, mine.std(), theirs.std())
        assert abs(mine.abs().max() / theirs.abs().max() - 1) < (0.6 if "W_E" in name or "W_pos" in name else 0.1), name
    # known values: embeddings N(0, 1); readout and first feed-forward layer U(+-1/sqrt(d_model))
    assert abs(ours["embed.W_E"].std() - 1) < 0.15
    bound = 1 / math.sqrt(PT.d_model)
    for name in ("unembed.W_U", "unembed.b_U", "blocks.0.mlp.W_in", "blocks.0.mlp.b_in"):
        assert ours[name].abs().max() <= bound
    assert ours["blocks.0.mlp.W_out"].abs().max() <= 1 / math.sqrt(PT.d_mlp)
    assert ours["blocks.0.attn.W_Q"].abs().max() <= math.sqrt(6 / (4 * PT.d_model))  # xavier on [3d, d]


def test_pytorch_init_is_seeded_and_leaves_the_normal_init_unchanged():
    a, b = ToyTransformer(PT, seed=3), ToyTransformer(PT, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.W_U, ToyTransformer(PT, seed=4).W_U)
    normal = ToyConfig(**{**PT.to_dict(), "init": "normal"})
    assert abs(ToyTransformer(normal, seed=3).W_U.std() - 1 / math.sqrt(PT.d_model)) < 0.01  # N(0, 1/d_model)
    assert ToyConfig.from_dict(PT.to_dict()) == PT


@pytest.mark.parametrize("bad, field", [(dict(init="xavier"), "init"), (dict(init="pytorch", init_std=0.1), "init_std"),
                                        (dict(init="pytorch", merged_qk=True), "merged_qk")])
def test_bad_init_names_the_field_and_the_allowed_values(bad, field):
    with pytest.raises(ValueError, match=f"{field}.*expected"):
        ToyConfig(d_vocab=4, n_ctx=3, d_model=8, **bad)


# ---------------------------------------------------------------- the authors' models, value for value
def _authors_model(cfg, seed, n_layers=None):
    """The authors' model built from PyTorch's own modules in their order (PAPERS.md, algorithmic_cores, "The
    order of draws"): torch.manual_seed(seed), then nn.Embedding(V, d), nn.Embedding(64, d) (the model uses the
    first n_ctx rows), one nn.TransformerEncoderLayer per layer (post-LN, dropout 0.1), nn.Linear(d, V).
    Returned in the book's TransformerLens layout ([in, out] weights, per-head Q/K/V/O)."""
    torch.manual_seed(seed)
    d, h, e, n = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_ctx
    tok, pos = torch.nn.Embedding(cfg.d_vocab, d), torch.nn.Embedding(64, d)
    layers = [torch.nn.TransformerEncoderLayer(d, h, cfg.d_mlp, dropout=0.1, batch_first=True, norm_first=False)
              for _ in range(cfg.n_layers)]
    readout = torch.nn.Linear(d, cfg.out_dim)
    out = {"embed.W_E": tok.weight, "pos_embed.W_pos": pos.weight[:n],
           "unembed.W_U": readout.weight.T, "unembed.b_U": readout.bias}
    for i, layer in enumerate(layers):
        a = layer.self_attn
        heads = [w.reshape(h, e, d).transpose(1, 2) for w in a.in_proj_weight.split(h * e)]
        biases = [b.reshape(h, e) for b in a.in_proj_bias.split(h * e)]
        out.update({f"blocks.{i}.attn.{name}": w for name, w in zip(("W_Q", "W_K", "W_V"), heads)})
        out.update({f"blocks.{i}.attn.{name}": b for name, b in zip(("b_Q", "b_K", "b_V"), biases)})
        out.update({f"blocks.{i}.attn.W_O": a.out_proj.weight.T.reshape(h, e, d),
                    f"blocks.{i}.attn.b_O": a.out_proj.bias,
                    f"blocks.{i}.mlp.W_in": layer.linear1.weight.T, f"blocks.{i}.mlp.b_in": layer.linear1.bias,
                    f"blocks.{i}.mlp.W_out": layer.linear2.weight.T, f"blocks.{i}.mlp.b_out": layer.linear2.bias,
                    f"blocks.{i}.ln1.w": layer.norm1.weight, f"blocks.{i}.ln1.b": layer.norm1.bias,
                    f"blocks.{i}.ln2.w": layer.norm2.weight, f"blocks.{i}.ln2.b": layer.norm2.bias})
    return {k: v.detach() for k, v in out.items()}


# The papers' configurations: the Markov model (4 states, 31 positions read, d 64, 4 heads, FF 256) and the
# grokking model (p = 53, input `a b`, two layers, d 128, 4 heads, FF 512), as the chapter builds them.
MARKOV_PAPER = ToyConfig(d_vocab=4, n_ctx=31, d_model=64, n_layers=1, n_heads=4, d_mlp=256, normalization="postLN",
                         dropout=0.1, init="pytorch")
GROKKING_PAPER = ToyConfig(d_vocab=53, n_ctx=2, d_model=128, n_layers=2, n_heads=4, d_mlp=512, d_vocab_out=53,
                           normalization="postLN", dropout=0.1, init="pytorch")


@pytest.mark.parametrize("cfg", [MARKOV_PAPER, GROKKING_PAPER], ids=["markov", "grokking"])
@pytest.mark.parametrize("seed", [0, 100, 200])
def test_pytorch_init_gives_the_authors_initial_weights_bit_for_bit(cfg, seed):
    theirs = _authors_model(cfg, seed)
    torch.manual_seed(12345)  # whatever the global generator holds, the book's draw does not read it
    torch.rand(7)
    ours = {k: v.detach() for k, v in ToyTransformer(cfg, seed=seed).named_parameters()}
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_pytorch_init_leaves_the_global_generator_where_it_was():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ToyTransformer(MARKOV_PAPER, seed=0)
    assert torch.equal(torch.rand(3), expected)
