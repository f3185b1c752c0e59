"""Modular addition: the `a b =` layout and the paper's `a b` layout."""
import pytest
import torch

from circuitbook.tasks.modular import ModularAddition


def test_equals_token_layouts_share_pairs_labels_and_split():
    with_eq, without = ModularAddition(p=7, train_fraction=0.5), ModularAddition(p=7, train_fraction=0.5,
                                                                                 equals_token=False)
    assert with_eq.all.tokens.shape == (49, 3) and without.all.tokens.shape == (49, 2)
    assert torch.equal(with_eq.all.tokens[:, :2], without.all.tokens)
    assert torch.equal(with_eq.all.labels, without.all.labels)
    assert torch.equal(without.all.labels, (without.all.tokens[:, 0] + without.all.tokens[:, 1]) % 7)
    assert torch.equal(with_eq.train_idx, without.train_idx)
    assert with_eq.vocab_size == 8 and without.vocab_size == 7 and int(without.all.tokens.max()) == 6
    assert "equals_token" not in with_eq.spec() and without.spec()["equals_token"] is False


def test_bad_equals_token_is_refused():
    with pytest.raises(ValueError, match="equals_token"):
        ModularAddition(p=7, equals_token="no")
