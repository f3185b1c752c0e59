"""Leading terms of a last-position loss (analysis.loss_position_terms) and the lenses notebook 04's measures:
known answers on hand-made corpora and models."""
import math

import pytest
import torch

from circuitbook.analysis import leading_terms as lt
from circuitbook.analysis import loss_position_terms as lpt
from circuitbook.models.toy import ToyConfig, ToyTransformer
from circuitbook.experiments.lenses import measure as elm
from circuitbook.training.config import TrainConfig
from circuitbook.training.ensemble import Optimizer

# A hand-made corpus: V = 3 tokens, K = 2 labels, T = 2 positions, N = 4 sequences.
TOKENS = torch.tensor([[0, 1], [0, 2], [1, 2], [2, 2]])
LABELS = torch.tensor([0, 1, 1, 1])


def test_position_label_maps_by_hand():
    F = lpt.position_label_maps(TOKENS, LABELS, 3, 2)
    assert F.shape == (2, 3, 2)
    # position 0: token 0 twice (labels 0, 1), token 1 once (label 1), token 2 once (label 1)
    # F[0, c, k] = (count(c, k) - count(c) / 2) / 4
    want0 = torch.tensor([[1 - 1.0, 1 - 1.0], [0 - 0.5, 1 - 0.5], [0 - 0.5, 1 - 0.5]]) / 4
    # position 1: token 1 once (label 0), token 2 three times (labels 1, 1, 1)
    want1 = torch.tensor([[0.0, 0.0], [1 - 0.5, 0 - 0.5], [0 - 1.5, 3 - 1.5]]) / 4
    assert torch.allclose(F[0], want0.double())
    assert torch.allclose(F[1], want1.double())
    assert torch.allclose(lpt.last_bigram_map(TOKENS, LABELS, 3, 2), want1.double())
    assert torch.allclose(lpt.last_context_map(TOKENS, LABELS, 3, 2), (want0 + want1).double() / 2)
    assert torch.allclose(F.sum(-1), torch.zeros(2, 3, dtype=torch.float64))  # centred over labels


def test_last_bigram_map_is_lt_bigram_map_with_the_label_as_next_token():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (40, 3), generator=g)
    y = torch.randint(0, 5, (40,), generator=g)
    B = lt.bigram_map(x[:, -1:], y[:, None], 5)
    assert torch.allclose(lpt.last_bigram_map(x, y, 5, 5), B)


def test_position_label_maps_refuse_bad_ids():
    with pytest.raises(ValueError):
        lpt.position_label_maps(TOKENS, LABELS, 2, 2)
    with pytest.raises(ValueError):
        lpt.position_label_maps(TOKENS, LABELS + 1, 3, 2)
    with pytest.raises(ValueError):
        lpt.position_label_maps(TOKENS[:, 0], LABELS, 3, 2)


def test_varying_ids_drop_tokens_fixed_in_place():
    x = torch.tensor([[0, 1, 3, 4], [1, 0, 3, 4], [2, 2, 3, 4]])  # 3 and 4 always at positions 2 and 3
    assert lpt.varying_ids(x, 6).tolist() == [0, 1, 2]  # 5 never occurs


def _tiny(n_layers=1, d_mlp=8, V=6, K=4, T=3, seed=0, normalization=None):
    cfg = ToyConfig(d_vocab=V, n_ctx=T, d_model=8, n_layers=n_layers, n_heads=2, d_mlp=d_mlp, d_vocab_out=K,
                    normalization=normalization)
    return ToyTransformer(cfg, seed=seed).eval()


def test_mean_input_jacobian_direct_path_is_the_unembedding():
    model = _tiny()
    with torch.no_grad():  # silence every block: logits = (W_E[x] + W_pos) W_U
        for p in model.blocks.parameters():
            p.zero_()
    x = torch.randint(0, 6, (10, 3), generator=torch.Generator().manual_seed(1))
    G = lpt.mean_input_jacobian(model, x, chunk=4)
    assert G.shape == (3, 8, 4)
    assert torch.allclose(G[-1], model.W_U.double(), atol=1e-6)
    assert torch.allclose(G[:-1], torch.zeros(2, 8, 4, dtype=torch.float64), atol=1e-7)
    # then the embedding term is LT-6's B W_U(0)^T with the last-token bigram map
    y = torch.randint(0, 4, (10,), generator=torch.Generator().manual_seed(2))
    F = lpt.position_label_maps(x, y, 6, 4)
    want = lpt.last_bigram_map(x, y, 6, 4) @ model.W_U.double().T
    assert torch.allclose(lpt.embedding_term(F, G), want, atol=1e-6)


def test_mean_input_jacobian_matches_finite_differences():
    model = _tiny(n_layers=2, normalization="postLN")
    x = torch.randint(0, 6, (5, 3), generator=torch.Generator().manual_seed(3))
    G = lpt.mean_input_jacobian(model, x)
    eps, j, i = 1e-3, 1, 2  # perturb coordinate i of the embedding at position j in every sequence

    def logits(delta):
        def add(act, hook):
            act = act.clone()
            act[:, j, i] += delta
            return act
        with torch.no_grad():
            return model.run_with_hooks(x, fwd_hooks=[("hook_embed", add)])[:, -1].double()

    fd = ((logits(eps) - logits(-eps)) / (2 * eps)).mean(0)
    assert torch.allclose(G[j, i], fd, atol=2e-3)


def test_unembedding_term_of_the_direct_path_is_lt6s():
    model = _tiny()
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.zero_()
        model.pos_embed.W_pos.zero_()
    x = torch.randint(0, 6, (12, 3), generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 4, (12,), generator=torch.Generator().manual_seed(5))
    H = lpt.unembedding_input(model, x, chunk=5)
    assert torch.allclose(H, model.W_E.double()[x[:, -1]], atol=1e-6)
    term = lpt.unembedding_term(H, y, 4)
    want = model.W_E.double().T @ lpt.last_bigram_map(x, y, 6, 4)
    assert torch.allclose(term, want, atol=1e-6)


def test_embedding_agreement_planted_and_random():
    g = torch.Generator().manual_seed(6)
    F = torch.randn(3, 10, 5, generator=g, dtype=torch.float64)
    G = torch.randn(3, 8, 5, generator=g, dtype=torch.float64)
    ids = torch.arange(10)
    planted = 0.01 * lpt.embedding_term(F, G)
    res = lpt.embedding_term_agreement(planted, F, G, ids, n_perm=50, seed=1)
    assert res["cosine"] == pytest.approx(1.0)
    assert res["agrees"] and res["z"] > 3
    zs = [lpt.embedding_term_agreement(torch.randn(10, 8, generator=g), F, G, ids, n_perm=50, seed=s)["z"]
          for s in range(20)]
    assert sum(abs(z) < 3 for z in zs) >= 18


def test_unembedding_agreement_planted_and_random():
    g = torch.Generator().manual_seed(7)
    term = torch.randn(16, 12, generator=g, dtype=torch.float64)
    res = lpt.unembedding_term_agreement(3 * term, term, n_perm=50)
    assert res["cosine"] == pytest.approx(1.0) and res["agrees"]
    zs = [lpt.unembedding_term_agreement(torch.randn(16, 12, generator=g), term, n_perm=50, seed=s)["z"]
          for s in range(20)]
    assert sum(abs(z) < 3 for z in zs) >= 18


def test_decayed_displacement_removes_adamw_decay_exactly():
    W0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    p = W0.clone()[None]  # one ensemble member
    tc = TrainConfig(steps=5, batch_size=1, seeds=(0,), lr=0.01, weight_decay=0.5)
    opt = Optimizer({"w": p}, {"w"}, tc)
    for _ in range(5):
        p.grad = torch.zeros_like(p)  # no data: only the decay moves the weight
        opt.step()
    decay = (1 - 0.01 * 0.5) ** 5
    assert torch.allclose(lpt.decayed_displacement(p[0], W0, decay), torch.zeros(4, 3, dtype=torch.float64),
                          atol=1e-7)
    assert not torch.allclose(p[0], W0)


def test_z_score_and_agreement_span():
    assert lpt.z_score(0.5, 0.1, 0.1) == pytest.approx(4.0)
    assert math.isnan(lpt.z_score(math.nan, 0, 1))
    assert lpt.agreement_span([0.1, 0.2, 0.4], [True, True, False]) == {"span": 0.2, "lost": 0.4}
    assert lpt.agreement_span([0.1, 0.2], [False, True]) == {"span": 0.0, "lost": 0.1}
    assert lpt.agreement_span([0.1, 0.2], [True, True]) == {"span": 0.2, "lost": math.inf}
    with pytest.raises(ValueError):
        lpt.agreement_span([0.2, 0.1], [True, True])
    assert lpt.ratio(1.0, 2.0) == 0.5 and lpt.ratio(math.inf, 2.0) == math.inf
    assert math.isnan(lpt.ratio(1.0, math.nan))


# ---------------------------------------------------------------- the notebook's reading of runs (measure.py)
def test_schedule_seta_and_decay():
    # 10 steps at lr 0.1, then lr 0.01 (a run and its cooldown), weight decay 0.5 throughout
    segs = [(10, 0.1, 0.5), (math.inf, 0.01, 0.5)]
    assert elm.seta_at(segs, 0) == 0.0
    assert elm.seta_at(segs, 5) == pytest.approx(0.5)
    assert elm.seta_at(segs, 12) == pytest.approx(1.0 + 0.02)
    assert elm.decay_at(segs, 12) == pytest.approx((1 - 0.05) ** 10 * (1 - 0.005) ** 2)


class _Run:
    def __init__(self, steps, lr, wd, seeds=(3,), batch_size=4):
        self.train_config = TrainConfig(steps=steps, batch_size=batch_size, seeds=seeds, lr=lr, weight_decay=wd)


class _Composed:
    def __init__(self):
        self.first, self.second = _Run(10, 0.1, 0.5), _Run(5, 0.01, 0.5)
        self.train_config = self.second.train_config


def test_lr_segments_of_a_run_and_a_composed_run():
    assert elm.lr_segments(_Run(7, 0.2, 0.0)) == [(math.inf, 0.2, 0.0)]
    assert elm.lr_segments(_Composed()) == [(10, 0.1, 0.5), (math.inf, 0.01, 0.5)]


def test_first_batches_are_the_trainers():
    from circuitbook.tasks.base import derive_seed
    from circuitbook.tasks.modular import ModularAddition
    task = ModularAddition(p=5, train_fraction=0.6, equals_token=False)
    run = _Run(3, 0.1, 0.0, batch_size=4)
    b = elm.first_batches(task, run, 0, task.steps_per_epoch(4))
    assert torch.equal(b.tokens[:4], task.train_batch(0, 4, derive_seed("data", 3)).tokens)
    # one epoch of a fixed dataset is its whole training split, once each
    assert sorted(map(tuple, b.tokens.tolist())) == sorted(map(tuple, task.tokens.tolist()))


class _PlantedRun:
    """Checkpoints of a tiny model: steps 1 and 2 moved along the leading terms (plus AdamW-like decay of the
    initialisation), step 4 moved at random."""

    def __init__(self, model0, terms, decay_of):
        import copy
        self.models = {0: model0}
        g = torch.Generator().manual_seed(11)
        for step in (1, 2, 4):
            m = copy.deepcopy(model0)
            decay = decay_of(step)
            with torch.no_grad():
                if step < 4:
                    dE = torch.zeros_like(m.W_E, dtype=torch.float64)
                    dE[terms.ids] = terms.embed_target * step
                    dU = terms.unembed_term * step
                else:
                    dE = torch.randn(m.W_E.shape, generator=g, dtype=torch.float64)
                    dU = torch.randn(m.W_U.shape, generator=g, dtype=torch.float64)
                m.embed.W_E.copy_(decay * terms.W_E0 + 1e-3 * dE / dE.norm())
                m.unembed.W_U.copy_(decay * terms.W_U0 + 1e-3 * dU / dU.norm())
            self.models[step] = m

    def model(self, member, step):
        return self.models[step]


def test_leading_term_trajectory_on_a_planted_run():
    from circuitbook.tasks.base import Batch
    model0 = _tiny(n_layers=2, V=12, K=11, T=3)
    g = torch.Generator().manual_seed(12)
    x = torch.randint(0, 11, (400, 3), generator=g)
    x[:, -1] = 11  # a fixed last token ('=' of Assign and Add): not compared
    y = (x[:, 0] + x[:, 1]) % 11
    terms = elm.initial_terms(model0, Batch(x, y), 11, jacobian_size=64, n_perm=30)
    assert 11 not in terms.ids.tolist() and len(terms.ids) == 11
    segs = [(math.inf, 0.01, 1.0)]
    run = _PlantedRun(model0, terms, lambda s: elm.decay_at(segs, s))
    traj = elm.leading_term_trajectory(run, 0, terms, [0, 1, 2, 4], segs, z=3.0)
    assert traj.step.tolist() == [1, 2, 4]
    assert traj.embed_cosine.iloc[0] == pytest.approx(1.0, abs=1e-4)
    assert traj.unembed_cosine.iloc[1] == pytest.approx(1.0, abs=1e-4)
    assert traj.agrees.tolist() == [True, True, False]
    s = elm.agreement_summary(traj)
    assert s["first_seta"] == pytest.approx(0.01)
    assert s["span"] == pytest.approx(0.02) and s["lost"] == pytest.approx(0.04)
