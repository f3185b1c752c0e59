"""analysis.attention: patterns from hooks, top-key shares and identity templates, with known answers."""
import math

import pytest
import torch

import circuitbook as cb
from circuitbook.analysis import attention


def test_top_key_share_on_hand_built_rows():
    rows = torch.tensor([[0.1, 0.6, 0.3],    # target 1 is the top key
                         [0.5, 0.2, 0.3],    # target 2 is not
                         [0.4, 0.4, 0.2]])   # targets 0 and 1 tie with each other but beat key 2
    targets = torch.tensor([[False, True, False], [False, False, True], [True, True, False]])
    assert attention.top_key_share(rows, targets) == pytest.approx(3 / 4)
    uniform = torch.full((2, 4), 0.25)
    assert attention.top_key_share(uniform, torch.eye(4, dtype=torch.bool)[:2]) == 0.0  # a tie is not "more"
    assert math.isnan(attention.top_key_share(uniform, torch.zeros(2, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        attention.top_key_share(uniform, torch.zeros(4, dtype=torch.bool))


def test_top_key_share_of_random_rows_is_about_one_over_keys():
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(20000, 16, generator=g).softmax(-1)
    targets = torch.zeros(20000, 16, dtype=torch.bool)
    targets[:, 3] = True
    assert attention.top_key_share(rows, targets) == pytest.approx(1 / 16, abs=0.01)


def test_template_cosine_and_diagonal_fraction():
    eye = torch.eye(12)
    assert attention.template_cosine(3 * eye + 2.0 + torch.arange(12.0)[:, None]) == pytest.approx(1.0)
    assert attention.template_cosine(-eye) == pytest.approx(-1.0)
    assert math.isnan(attention.template_cosine(torch.ones(12, 12)))
    T = torch.zeros(12, 12)
    T[0, 1] = T[1, 0] = 1.0
    assert attention.template_cosine(5 * T + torch.arange(12.0), T) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="template"):
        attention.template_cosine(eye, torch.eye(3))
    assert attention.diagonal_argmax_fraction(eye) == 1.0
    assert attention.diagonal_argmax_fraction(torch.roll(eye, 1, 1)) == 0.0
    torch.testing.assert_close(attention.double_centre(torch.ones(3, 3) + torch.arange(3.0)),
                               torch.zeros(3, 3, dtype=torch.float64))


def test_attention_patterns_match_a_uniform_head():
    cfg = cb.ToyConfig(d_vocab=5, n_ctx=4, d_model=8, n_layers=2, n_heads=1, d_mlp=0, bias=False)
    model = cb.ToyTransformer(cfg, seed=0)
    with torch.no_grad():
        model.blocks[1].attn.W_Q.zero_()  # all scores 0: uniform over the causal keys
    tokens = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1], [1, 1, 1, 1]])
    (p1,) = attention.attention_patterns(model, tokens, layers=[1], batch_size=2)
    expected = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5)[:, None]
    torch.testing.assert_close(p1, expected.expand(3, 1, 4, 4))
    p0, p1b = attention.attention_patterns(model, tokens)
    torch.testing.assert_close(p1b, p1)
    torch.testing.assert_close(p0.sum(-1), torch.ones(3, 1, 4))


def test_top_key_share_against_named_competitors():
    # key 0 and 1 are the targets, read equally; key 2 competes; key 3 (say, the query's own token) does not
    rows = torch.tensor([[0.35, 0.35, 0.2, 0.1],
                         [0.30, 0.10, 0.2, 0.4],    # target 1 loses to the competitor; key 3 is not one
                         [0.20, 0.20, 0.2, 0.4]])   # a tie with a competitor is not "more"
    targets = torch.tensor([[True, True, False, False]] * 3)
    competitors = torch.tensor([[False, False, True, False]] * 3)
    assert attention.top_key_share(rows, targets, competitors) == pytest.approx(3 / 6)
    assert attention.top_key_share(rows, targets) == pytest.approx(2 / 6)  # every other key competes
    # a target listed as a competitor too is still never its own rival; a row with no competitor counts
    assert attention.top_key_share(rows, targets, torch.ones(3, 4, dtype=torch.bool)) == pytest.approx(2 / 6)
    assert attention.top_key_share(rows, targets, torch.zeros(3, 4, dtype=torch.bool)) == 1.0
    with pytest.raises(ValueError, match="competitors must all be"):
        attention.top_key_share(rows, targets, competitors[:, :3])
