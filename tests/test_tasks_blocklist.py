"""Block-list tasks: the relations each kind promises, the data knobs, exact and statistical symmetry."""
from collections import defaultdict

import pytest
import torch

from circuitbook.tasks.blocklist import KINDS, BlockListTask, rejection_rate, symmetry_test, two_sample_test


def test_recall_known_answers():
    t = BlockListTask("recall", n_pairs=6, n_blocks=3, f_v=0.0)
    assert (t.seq_len, t.n_tokens, t.vocab_size, t.n_outputs) == (7, 12, 84, 12)
    assert t.association().tolist() == [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10]
    s = t.sample(500, seed=0)
    q = s.tokens[:, -1]
    assert torch.equal(s.targets, q ^ 1)  # f_v = 0: the target is always C(query)
    # the query's block [q, C q] is in the context: some even index holds q followed by the target
    ctx = s.tokens[:, :-1].reshape(500, 3, 2)
    assert ((ctx[:, :, 0] == q[:, None]) & (ctx[:, :, 1] == s.targets[:, None])).any(1).all()
    # all context tokens distinct
    assert all(len(set(row.tolist())) == 6 for row in s.tokens[:, :-1])
    # cyclic labels: consecutive, wrapping
    assert torch.equal((s.positions[:, 1:] - s.positions[:, :-1]) % 7, torch.ones(500, 6, dtype=torch.long))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_answers_from_its_context(kind):
    t = BlockListTask(kind, n_pairs=16, n_rare=5, n_blocks=4, hops=2, ngram=3, f_r=0.3, f_v=0.5, n_fill=2)
    s = t.sample(300, seed=1)
    toks, tgt = s.tokens, s.targets
    fill = toks >= t.n_common + t.n_rare
    for i in range(300):
        ctx = [int(x) for x, f in zip(toks[i, :-t.query_len], fill[i, :-t.query_len]) if not f]
        blocks = [ctx[j:j + t.block_len] for j in range(0, len(ctx), t.block_len)]
        query = toks[i, -t.query_len:].tolist()
        if kind == "recall":
            assert [query[0], int(tgt[i])] in blocks
        elif kind == "ioi":
            assert [int(tgt[i]), query[0]] in blocks
        elif kind in ("ngram", "conditional"):
            assert query + [int(tgt[i])] in blocks
            if kind == "conditional":  # every block shares the key; only one matches the condition
                assert all(b[0] == query[0] for b in blocks)
                assert sum(b[:2] == query for b in blocks) == 1
        else:  # 2-hop: [q z1] and [z1 target] are both blocks
            z1 = [b[1] for b in blocks if b[0] == query[0]]
            assert len(z1) == 1 and [z1[0], int(tgt[i])] in blocks
        # the canonical flag says whether the target is C of its predecessor in the chain
        pred = {"recall": query[0], "ioi": query[0], "ngram": query[-1], "conditional": query[-1]}.get(kind)
        if pred is not None and not s.is_rare[i]:
            assert bool(s.canonical[i]) == (int(tgt[i]) == (pred ^ 1))


def test_bos_starts_every_sequence():
    t = BlockListTask("recall", n_pairs=6, n_blocks=3, bos=True)
    assert t.seq_len == 8 and t.n_tokens == 13 and t.bos_token == 12
    s = t.sample(50, seed=0)
    assert (s.tokens[:, 0] == 12).all() and (s.tokens[:, 1:] != 12).all()
    assert t.token_classes()[-1] == 3 and t.association()[12] == 12
    assert t.describe(s, 0).startswith("<s> ")
    assert t.random_automorphism(torch.Generator().manual_seed(0))[12] == 12
    assert t.with_knobs(f_v=0.5).f_v == 0.5 and t.with_knobs(f_v=0.5).bos
    with pytest.raises(ValueError, match="unknown knobs"):
        t.with_knobs(width=3)


def test_knobs_set_the_rates():
    t = BlockListTask("recall", n_pairs=10, n_rare=4, n_blocks=6, f_r=0.25, f_v=0.4, burstiness=3)
    s = t.sample(20000, seed=2)
    assert s.is_rare.float().mean().item() == pytest.approx(0.25, abs=0.01)
    common = ~s.is_rare
    assert s.canonical[common].float().mean().item() == pytest.approx(0.6, abs=0.015)
    assert (s.targets[s.is_rare] >= t.n_common).all() and (s.targets[common] < t.n_common).all()
    # burstiness: the queried block appears exactly b = 3 times
    ctx = s.tokens[:, :-1].reshape(-1, 6, 2)
    hits = ((ctx[:, :, 0] == s.tokens[:, -1:]) & (ctx[:, :, 1] == s.targets[:, None])).sum(1)
    assert (hits == 3).all()


def test_batches_are_pure_functions_of_step_and_seed():
    t = BlockListTask("khop", n_pairs=12, n_blocks=4, f_v=1.0)
    a, b = t.train_batch(7, 64, seed=3), t.train_batch(7, 64, seed=3)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.tokens, t.train_batch(8, 64, seed=3).tokens)
    tok, pos = t.decode(a.tokens)
    assert tok.max() < t.n_tokens and pos.max() < t.seq_len and a.tokens.max() < t.vocab_size


def test_enumeration_is_the_exact_distribution():
    t = BlockListTask("recall", n_pairs=4, n_blocks=2, f_v=0.5)
    s, p = t.enumerate_outcomes()
    assert len(s) == t.n_outcomes() == 4 * 3 * 2 * 1 * 16 * 4 * 2 * 5  # pairs, orientations, canon bits, order, offset
    assert p.sum().item() == pytest.approx(1.0, abs=1e-12)
    # exact marginal: P(canonical) = 1 - f_v, P(last label = l) = 1/L
    assert p[s.canonical].sum().item() == pytest.approx(0.5, abs=1e-12)
    for label in range(t.seq_len):
        assert p[s.positions[:, -1] == label].sum().item() == pytest.approx(1 / t.seq_len, abs=1e-12)
    # the sampler draws from the same law: the canonical rate and the query marginal match
    x = t.sample(40000, seed=0)
    assert x.canonical.float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert torch.bincount(x.tokens[:, -1], minlength=8).float().div(40000).sub(1 / 8).abs().max() < 0.01
    with pytest.raises(ValueError, match="max_outcomes"):
        BlockListTask("recall", n_pairs=12, n_blocks=6).enumerate_outcomes(max_outcomes=1000)


def _law(task, sample, prob):
    law = defaultdict(float)
    for tok, pos, y, pr in zip(task.model_inputs(sample).tolist(), sample.positions.tolist(), sample.targets.tolist(),
                               prob.tolist()):
        law[(tuple(tok), y)] += pr
    return law


def _max_law_change(task, move):
    s, p = task.enumerate_outcomes()
    before = _law(task, s, p)
    after = _law(task, move(s), p)
    keys = set(before) | set(after)
    return max(abs(before.get(k, 0.0) - after.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize("kind", ["recall", "ioi", "khop"])
def test_symmetries_hold_exactly_on_the_enumerated_distribution(kind):
    t = BlockListTask(kind, n_pairs=4, n_rare=3 if kind == "recall" else 0, n_blocks=2, hops=2,
                      f_r=0.5 if kind == "recall" else 0.0, f_v=0.0 if kind != "khop" else 1.0, bos=kind == "ioi")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        perm = t.random_automorphism(gen)
        assert _max_law_change(t, lambda s: t.relabel(s, perm)) < 1e-12
    assert _max_law_change(t, lambda s: t.shift(s, 2)) < 1e-12


def test_broken_generators_are_not_invariant():
    zipf = BlockListTask("recall", n_pairs=4, n_blocks=2, zipf=1.0)
    perm = torch.tensor([2, 3, 0, 1, 4, 5, 6, 7])  # swaps the first two pairs: preserves the association
    assert _max_law_change(zipf, lambda s: zipf.relabel(s, perm)) > 1e-3
    fixed = BlockListTask("recall", n_pairs=4, n_blocks=2, offsets="fixed")
    assert _max_law_change(fixed, lambda s: fixed.shift(s, 1)) > 1e-3
    # a permutation that breaks the association is not a symmetry even of the good generator
    good = BlockListTask("recall", n_pairs=4, n_blocks=2)
    bad_perm = torch.tensor([0, 2, 1, 3, 4, 5, 6, 7])
    assert _max_law_change(good, lambda s: good.relabel(s, bad_perm)) > 1e-3


def test_two_sample_test_accepts_symmetric_and_rejects_broken_generators():
    sym = BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.2)
    assert symmetry_test(sym, "relabel", 2000, seed=0)["p_value"] > 0.01
    assert symmetry_test(sym, "shift", 2000, seed=0)["p_value"] > 0.01
    zipf = BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.2, zipf=0.5)
    assert symmetry_test(zipf, "relabel", 2000, seed=0)["p_value"] < 1e-4
    fixed = BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.2, offsets="fixed")
    assert symmetry_test(fixed, "shift", 2000, seed=0)["p_value"] < 1e-4
    # the same data twice is never rejected; two different tasks always are
    x = sym.sample(1000, seed=5)
    assert two_sample_test(sym, x, x)["p_value"] == 1.0
    other = BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.8)
    assert two_sample_test(sym, x, other.sample(1000, seed=6))["p_value"] < 1e-4


@pytest.mark.slow
def test_stated_size_and_power():
    """The test's stated properties at n = 2000 sequences per sample, alpha = 0.01 (30 repetitions):
    size <= 0.1 on the symmetric generator, power >= 0.9 against zipf = 0.5 and fixed offsets."""
    sym = BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.2)
    assert rejection_rate(sym, "relabel", 2000, reps=30) <= 0.1
    assert rejection_rate(sym, "shift", 2000, reps=30) <= 0.1
    assert rejection_rate(BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.2, zipf=0.5), "relabel", 2000, 30) >= 0.9
    assert rejection_rate(BlockListTask("recall", n_pairs=8, n_blocks=3, f_v=0.2, offsets="fixed"), "shift", 2000,
                          30) >= 0.9


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "copy"}, "kind"),
    ({"n_pairs": 1}, "n_pairs"),
    ({"n_pairs": 3, "n_blocks": 4}, "n_pairs"),
    ({"f_r": 1.5}, "f_r"),
    ({"f_v": -0.1}, "f_v"),
    ({"burstiness": 5, "n_blocks": 3}, "n_blocks"),
    ({"f_r": 0.2, "n_rare": 1}, "n_rare"),
    ({"offsets": "random"}, "offsets"),
    ({"zipf": -1.0}, "zipf"),
    ({"n_blocks": 2.5}, "n_blocks"),
    ({"input_ids": "bytes"}, "input_ids"),
])
def test_bad_knobs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockListTask(**kwargs)


def test_bad_symmetry_arguments_are_refused():
    t = BlockListTask("recall", n_pairs=4, n_blocks=2)
    with pytest.raises(ValueError, match="transform"):
        symmetry_test(t, "mirror", 100, seed=0)
    with pytest.raises(ValueError, match="permutation"):
        t.relabel(t.sample(4, 0), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="composite"):
        BlockListTask("recall", n_pairs=4, n_blocks=2, input_ids="tokens").decode(torch.zeros(2, 5, dtype=torch.long))
