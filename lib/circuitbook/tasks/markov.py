"""Sequences from a finite Markov chain, for next-token prediction.

Chapter `algorithmic_cores` (Schiffman, arXiv 2602.22600): a 4-state circulant
chain that stays with probability 0.75 and advances to the next state (mod 4)
with probability 0.25. The tokens are the states 0..n-1. A model that has
learned the chain predicts, at every position, the most likely next state
given the current one; its accuracy cannot exceed the chain's *ceiling*
sum_i pi_i max_j P_ij (0.75 for the circulant chain), pi the stationary
distribution.

Sequences: the first state is drawn from pi, then S_{t+1} ~ P[S_t, :]. A
"sequence of length L" is L states; the model reads states 0..L-2 and predicts
states 1..L-1 at every position (next-token loss), so the input has L - 1
tokens. The training set is a fixed set of sequences (`FixedDataset`, epochs);
the test set is drawn from a different seed.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import Batch, FixedDataset, derive_seed


class MarkovChain:
    """A finite Markov chain with row-stochastic transition matrix P [n, n]."""

    def __init__(self, P):
        P = torch.as_tensor(np.asarray(P, dtype=np.float64))
        if P.ndim != 2 or P.shape[0] != P.shape[1] or P.shape[0] < 2:
            raise ValueError(f"P must be a square [n, n] matrix with n >= 2; got shape {tuple(P.shape)}")
        if (P < 0).any() or not torch.allclose(P.sum(1), torch.ones(P.shape[0], dtype=P.dtype), atol=1e-9):
            raise ValueError("P must be row-stochastic: non-negative entries, every row summing to 1")
        self.P = P

    @classmethod
    def circulant(cls, n_states: int = 4, stay: float = 0.75) -> "MarkovChain":
        """Stay with probability `stay`, else advance to (state + 1) mod n_states."""
        if not (isinstance(n_states, int) and n_states >= 2):
            raise ValueError(f"n_states must be an integer >= 2, got {n_states!r}")
        if not 0 <= stay <= 1:
            raise ValueError(f"stay must be in [0, 1], got {stay!r}")
        P = np.zeros((n_states, n_states))
        for i in range(n_states):
            P[i, i] += stay
            P[i, (i + 1) % n_states] += 1 - stay
        return cls(P)

    @property
    def n_states(self) -> int:
        return self.P.shape[0]

    def stationary(self) -> torch.Tensor:
        """The stationary distribution pi (pi P = pi, sum 1), from the left eigenvector of eigenvalue 1."""
        eigval, eigvec = torch.linalg.eig(self.P.T)
        v = eigvec[:, torch.argmin((eigval - 1).abs())].real
        return v / v.sum()

    def ceiling_accuracy(self) -> float:
        """Best possible next-state accuracy of any predictor that knows the current state."""
        return float((self.stationary() * self.P.max(1).values).sum())

    def eigenvalues(self) -> torch.Tensor:
        """Eigenvalues of P (complex), sorted by modulus (descending), then by angle."""
        eig = torch.linalg.eigvals(self.P)
        order = sorted(range(len(eig)), key=lambda i: (-round(float(eig[i].abs()), 9), float(eig[i].angle())))
        return eig[order]

    def sample(self, n: int, length: int, seed: int) -> torch.Tensor:
        """n sequences of `length` states [n, length] (int64), seeded."""
        if n < 1 or length < 2:
            raise ValueError(f"need n >= 1 and length >= 2; got n={n}, length={length}")
        gen = torch.Generator().manual_seed(derive_seed("markov", seed))
        pi = self.stationary().clamp(min=0).float()
        P = self.P.float()
        states = torch.empty(n, length, dtype=torch.long)
        states[:, 0] = torch.multinomial(pi.expand(n, -1), 1, generator=gen).squeeze(1)
        for t in range(1, length):
            states[:, t] = torch.multinomial(P[states[:, t - 1]], 1, generator=gen).squeeze(1)
        return states

    def spec(self) -> dict:
        return {"P": [[round(float(x), 12) for x in row] for row in self.P]}


class MarkovSequences(FixedDataset):
    """A fixed training set of chain sequences, next-token loss, and a held-out test set.

    tokens [n_train, length - 1] are states 0..L-2; labels [n_train, length - 1] are states 1..L-1.
    """

    def __init__(self, chain: MarkovChain, n_train: int = 3000, n_test: int = 3000, length: int = 32,
                 data_seed: int = 0):
        if n_train < 1 or n_test < 1:
            raise ValueError(f"n_train and n_test must be >= 1; got {n_train}, {n_test}")
        self.chain, self.length, self.data_seed = chain, length, data_seed
        self.n_train, self.n_test = n_train, n_test
        train = chain.sample(n_train, length, derive_seed("train", data_seed))
        test = chain.sample(n_test, length, derive_seed("test", data_seed))
        self.test_states = test
        super().__init__(train[:, :-1], train[:, 1:], vocab_size=chain.n_states, n_outputs=chain.n_states,
                         loss="next_token")

    @property
    def train(self) -> Batch:
        return Batch(self.tokens, self.labels)

    @property
    def test(self) -> Batch:
        return Batch(self.test_states[:, :-1], self.test_states[:, 1:])

    def spec(self) -> dict:
        return {"task": "markov_sequences", "chain": self.chain.spec(), "n_train": self.n_train,
                "n_test": self.n_test, "length": self.length, "data_seed": self.data_seed}

