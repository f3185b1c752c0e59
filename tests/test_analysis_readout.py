"""analysis.readout: ACE at the last residual stream of a ToyTransformer, known answers."""
from dataclasses import replace

import pytest
import torch

from circuitbook.analysis import ace
from circuitbook.analysis.compare import projector_overlap
from circuitbook.analysis.readout import (ace_final, affine_readout, centred_logits, core_dimensions, final_hook,
                                          final_residual,
                                          readout, readout_jacobians, validate_readout, validation_ks)
from circuitbook.models.toy import ToyConfig, ToyTransformer


def planted_readout_model(d_model=12, n_out=5, read=(0, 3), seed=0):
    """A ToyTransformer without LayerNorm whose unembedding reads only the residual directions `read`:
    logits = resid W_U + b_U with W_U zero outside those rows (a readout known exactly)."""
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=d_model, n_layers=1, n_heads=2, d_mlp=16, d_vocab_out=n_out,
                    normalization=None)
    model = ToyTransformer(cfg, seed=seed).eval()
    with torch.no_grad():
        W = torch.zeros(d_model, n_out)
        W[list(read)] = torch.randn(len(read), n_out, generator=torch.Generator().manual_seed(seed))
        model.unembed.W_U.copy_(W)
    return model


def test_ace_at_the_readout_of_a_planted_model():
    """Known answers: the Jacobian of the logits is W_U^T on every row (centred: W_U^T minus its mean over
    outputs); ACE's core is span(Cov W_U) (Cov the activations' covariance), 2-dimensional because W_U reads
    two residual directions; `readout` is the affine map itself."""
    model = planted_readout_model()
    assert affine_readout(model) and final_hook(model.cfg) == "blocks.0.hook_resid_post"
    tokens = torch.randint(0, 7, (200, 4), generator=torch.Generator().manual_seed(1))
    resid = final_residual(model, tokens)
    assert resid.shape == (200, 12)
    W = model.W_U.detach()
    with torch.no_grad():
        assert torch.allclose(readout(model, resid), resid @ W + model.unembed.b_U, atol=1e-5)
        assert torch.allclose(model(tokens)[:, -1], readout(model, resid), atol=1e-5)
    raw = readout_jacobians(model, resid, outputs="raw")
    assert torch.allclose(raw, W.T.expand(200, -1, -1), atol=1e-6)
    centred = readout_jacobians(model, resid, outputs="centred")
    assert torch.allclose(centred, (W.T - W.T.mean(0)).expand(200, -1, -1), atol=1e-6)
    assert torch.allclose(centred_logits(torch.tensor([[1.0, 2.0, 6.0]])), torch.tensor([[-2.0, -1.0, 3.0]]))
    core, inputs = ace_final(model, tokens, definition=ace.PAPER)
    assert core.rank <= 2 and core.sigma.numel() == 2  # Obs = W_U W_U^T has rank 2
    H = inputs.activations.double()
    cov = (H - H.mean(0)).T @ (H - H.mean(0)) / (len(H) - 1)
    full, _ = ace_final(model, tokens, definition=ace.PAPER, rank=2)
    # span(Cov W_U) = span(Cov[:, read]): W_U's rows 0 and 3 are its only non-zero ones
    assert projector_overlap(full, cov[:, [0, 3]]) == pytest.approx(1.0, abs=1e-5)
    assert validation_ks(model, full, 7) == list(range(1, 8))


@pytest.mark.parametrize("norm", ["LN", None])
def test_validate_readout_with_the_whole_space_as_core(norm):
    """A core spanning every residual direction: keep is the clean model, remove sets every row to the mean
    (one constant prediction, argmax readout(mu)), flip maps h to 2 mu - h; known accuracies by hand."""
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=8, n_layers=1, n_heads=2, d_mlp=16, d_vocab_out=5, normalization=norm)
    model = ToyTransformer(cfg, seed=2).eval()
    tokens = torch.randint(0, 7, (300, 4), generator=torch.Generator().manual_seed(0))
    resid = final_residual(model, tokens)
    with torch.no_grad():
        labels = readout(model, resid).argmax(-1)
        labels[::4] = (labels[::4] + 1) % 5
    core = ace.extract_core(resid, torch.eye(8).expand(len(resid), 8, 8), rank=8)
    val = validate_readout(model, resid, labels, core, chance=0.2, ks=[8], definition=ace.BOOK)
    mu = core.mu.float()
    with torch.no_grad():
        clean = float((readout(model, resid).argmax(-1) == labels).float().mean())
        removed = float((labels == readout(model, mu[None]).argmax(-1)).float().mean())
        flipped = float((readout(model, 2 * mu - resid).argmax(-1) == labels).float().mean())
    assert val.clean == pytest.approx(0.75, abs=0.01) and val.clean == pytest.approx(clean)
    assert val.keep[0] == pytest.approx(clean, abs=1e-6)
    assert val.remove[0] == pytest.approx(removed, abs=1e-6)
    assert val.flip[0] == pytest.approx(flipped, abs=1e-6)
    with pytest.raises(ValueError, match="ks"):
        validate_readout(model, resid, labels, core, chance=0.2, ks=[9])


@pytest.mark.parametrize("norm", ["LN", None, "postLN"])
@pytest.mark.parametrize("definition", [ace.BOOK, ace.PAPER])
def test_validate_readout_equals_hook_validation(norm, definition):
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=16, n_layers=2, n_heads=2, d_mlp=32, d_vocab_out=5, normalization=norm)
    model = ToyTransformer(cfg, seed=1).eval()
    tokens = torch.randint(0, 7, (300, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        labels = model(tokens)[:, -1].argmax(-1)
    labels[::3] = (labels[::3] + 1) % 5  # not all correct
    core, inputs = ace_final(model, tokens, definition=replace(definition, energy_threshold=0.99))
    ref = ace.validate_core(model, tokens, labels, final_hook(cfg), core, chance=0.2, definition=definition,
                            energy_rank=2)
    got = validate_readout(model, inputs.activations, labels, core, chance=0.2, definition=definition,
                              energy_rank=2)
    assert got.clean == pytest.approx(ref.clean)
    for mode in ("keep", "remove", "flip"):
        assert getattr(got, mode) == pytest.approx(getattr(ref, mode), abs=1e-6)
    assert (got.sufficient_dim, got.necessary_dim) == (ref.sufficient_dim, ref.necessary_dim)
    assert got.definition == definition.name and got.centered == definition.centered
    with pytest.raises(ValueError, match="modes"):
        validate_readout(model, inputs.activations, labels, core, chance=0.2, modes=("keep", "zap"))


@pytest.mark.parametrize("norm", ["LN", None, "postLN"])
@pytest.mark.parametrize("outputs", ["centred", "raw"])
def test_readout_jacobians_equal_autograd_through_the_model(norm, outputs):
    cfg = ToyConfig(d_vocab=7, n_ctx=4, d_model=16, n_layers=2, n_heads=2, d_mlp=32, normalization=norm)
    model = ToyTransformer(cfg, seed=3).eval()
    tokens = torch.randint(0, 7, (30, 4), generator=torch.Generator().manual_seed(2))
    out_fn = centred_logits if outputs == "centred" else None
    ref = ace.collect_ace_inputs(model, tokens, final_hook(cfg), output_fn=out_fn, position="all")
    definition = ace.BOOK if outputs == "centred" else ace.PAPER
    core, got = ace_final(model, tokens, position="all", definition=definition)
    assert torch.allclose(got.activations, ref.activations, atol=1e-6)
    assert torch.allclose(got.jacobians, ref.jacobians, atol=1e-5)
    assert (got.n_sequences, got.n_positions) == (30, 4)
    with pytest.raises(ValueError, match="outputs"):
        readout_jacobians(model, got.activations[:3], outputs="softmax")


@pytest.mark.parametrize("read", [(0, 3), (5,)])
def test_core_dimensions_of_a_planted_readout(read):
    """The unembedding reads len(read) residual directions, so the energy rank is len(read); the core dimension
    is max(rank, necessary dimension) and the bare necessary k never exceeds the necessary dimension; the dimensions
    are those the validation of the same core gives."""
    model = planted_readout_model(read=read)
    tokens = torch.randint(0, 7, (300, 4), generator=torch.Generator().manual_seed(2))
    labels = model(tokens)[:, -1].argmax(-1).detach()  # the model's own answers: clean accuracy 1
    out = core_dimensions(model, tokens, labels, ace.PAPER, chance=1 / 5)
    assert out["rank"] == len(read) and out["clean_acc"] == 1.0
    assert out["core_dim"] == max(float(out["rank"]), out["necessary_dim"])
    assert out["necessary_k"] <= out["necessary_dim"]
    val = out["validation"]
    assert out["sufficient_dim"] == (float(val.sufficient_dim) if val.sufficient_dim is not None else float("inf"))
