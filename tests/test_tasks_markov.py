"""Markov-chain task: stationary distribution, ceiling, eigenvalues, sampling, the dataset."""

import pytest
import torch

from circuitbook.tasks.markov import MarkovChain, MarkovSequences


def test_circulant_chain_known_answers():
    chain = MarkovChain.circulant(4, 0.75)
    assert torch.allclose(chain.P[0], torch.tensor([0.75, 0.25, 0, 0], dtype=torch.float64))
    assert torch.allclose(chain.P[3], torch.tensor([0.25, 0, 0, 0.75], dtype=torch.float64))
    assert torch.allclose(chain.stationary(), torch.full((4,), 0.25, dtype=torch.float64))
    assert chain.ceiling_accuracy() == pytest.approx(0.75)
    # circulant eigenvalues 0.75 + 0.25 w^k, w = i: 1, 0.75 + 0.25i, 0.5, 0.75 - 0.25i
    eig = chain.eigenvalues()
    assert eig[0] == pytest.approx(1.0)
    assert sorted(complex(e).imag for e in eig[1:3]) == pytest.approx([-0.25, 0.25])
    assert [complex(e).real for e in eig[1:3]] == pytest.approx([0.75, 0.75])
    assert eig[3] == pytest.approx(0.5)


def test_non_uniform_stationary_and_ceiling():
    P = [[0.9, 0.1], [0.5, 0.5]]
    chain = MarkovChain(P)
    # pi = (5/6, 1/6); best guess: stay in 0 (0.9), from 1 either (0.5)
    assert torch.allclose(chain.stationary(), torch.tensor([5 / 6, 1 / 6], dtype=torch.float64))
    assert chain.ceiling_accuracy() == pytest.approx(5 / 6 * 0.9 + 1 / 6 * 0.5)


def test_sampling_follows_the_chain_and_is_seeded():
    chain = MarkovChain.circulant(4, 0.75)
    s = chain.sample(2000, 20, seed=3)
    assert s.shape == (2000, 20) and s.dtype == torch.long
    assert torch.equal(s, chain.sample(2000, 20, seed=3))
    assert not torch.equal(s, chain.sample(2000, 20, seed=4))
    step = (s[:, 1:] - s[:, :-1]) % 4
    assert set(step.unique().tolist()) <= {0, 1}  # stay or advance, never anything else
    assert step.float().mean().item() == pytest.approx(0.25, abs=0.01)
    counts = torch.bincount(s[:, 0], minlength=4).float() / 2000
    assert torch.allclose(counts, torch.full((4,), 0.25), atol=0.04)


def test_markov_sequences_dataset():
    task = MarkovSequences(MarkovChain.circulant(), n_train=50, n_test=30, length=32, data_seed=1)
    assert task.tokens.shape == (50, 31) and task.labels.shape == (50, 31)
    assert torch.equal(task.tokens[:, 1:], task.labels[:, :-1])  # labels are the next states
    assert task.test.tokens.shape == (30, 31)
    assert not torch.equal(task.test.tokens[:30], task.tokens[:30])
    assert task.loss == "next_token" and task.vocab_size == 4 and task.n_outputs == 4
    assert task.steps_per_epoch(16) == 4
    b = task.train_batch(5, 16, seed=0)
    assert b.tokens.shape == (16, 31) and torch.equal(b.tokens, task.train_batch(5, 16, seed=0).tokens)
    assert task.spec()["chain"]["P"][0] == [0.75, 0.25, 0.0, 0.0]


@pytest.mark.parametrize("bad", [[[0.5, 0.6], [0.5, 0.5]], [[1.0]], [[-0.1, 1.1], [0.5, 0.5]]])
def test_bad_matrices_are_refused(bad):
    with pytest.raises(ValueError):
        MarkovChain(bad)

