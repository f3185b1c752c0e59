"""One-off draws keep their values when the training stream changes (issue 36).

Training batches now come from the counter-based source (`tasks/draws.py`); evaluation pools, made-to-order
batches, enumerations and data splits still come from their own `torch.Generator`s. These digests were
taken with the code before the change (commit 74eddd6): a value that moves here moved a pool, a split or a
one-off sample that notebooks and claims read.
"""
import hashlib

import pytest
import torch

from circuitbook.tasks.assign_add import AssignAddTask
from circuitbook.tasks.assign_add_bursty import BurstyAssignAddTask
from circuitbook.tasks.blocklist import KINDS, BlockListTask
from circuitbook.tasks.markov import MarkovChain, MarkovSequences
from circuitbook.tasks.modular import ModularAddition


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def assign_add_values() -> dict[str, str]:
    task = AssignAddTask(train_fraction=0.7, two_var_ratio=0.4)
    out = {f"pool/{k}": digest(b.tokens, b.labels) for k, b in task.eval_pools(size=300, seed=3).items()}
    out["heldout_zero_var"] = digest(*task.heldout_zero_var(seed=1).__dict__.values())
    out["make_batch"] = digest(*task.make_batch([1, 2, 3], [4, 5, 6], "a", None, seed=2).__dict__.values())
    out["make_batch_left"] = digest(*task.make_batch(7, 8, "c", "d", n_assignments=4, pads="left").__dict__.values())
    book = AssignAddTask(train_fraction=0.5, pair_split="book", split_seed=4)
    out["book_split"] = digest(book.train_pairs)
    bursty = BurstyAssignAddTask(repeats=2)
    out["bursty_make_batch"] = digest(*bursty.make_batch([1, 2], [3, 4], "a", "e", seed=5).__dict__.values())
    out["bursty_pool"] = digest(bursty.eval_pool("two_var_train", 200, seed=1).tokens)
    return out


def blocklist_values() -> dict[str, str]:
    out = {}
    for kind in KINDS:
        t = BlockListTask(kind, n_pairs=16, n_rare=5, n_blocks=4, hops=2, ngram=3, f_r=0.3, f_v=0.5, n_fill=2,
                          n_fill_tokens=2, bos=True, zipf=0.5)
        s = t.sample(200, seed=7)
        out[f"sample/{kind}"] = digest(s.tokens, s.positions, s.targets, s.is_rare, s.canonical)
    small = BlockListTask("recall", n_pairs=4, n_blocks=2, f_v=1.0, n_fill=1, n_fill_tokens=2)
    s, p = small.enumerate_outcomes()
    out["enumerated"] = digest(s.tokens, s.positions, s.targets, p)
    burst = BlockListTask("recall", n_pairs=8, n_blocks=4, burstiness=2, f_v=0.25, input_ids="tokens")
    out["burst_batch"] = digest(*burst.batch(burst.sample(100, seed=2)).__dict__.values())
    out["automorphism"] = digest(small.random_automorphism(torch.Generator().manual_seed(3)))
    return out


def other_values() -> dict[str, str]:
    chain = MarkovChain.circulant(4, 0.75)
    data = MarkovSequences(chain, n_train=50, n_test=20, length=9, data_seed=2)
    mod = ModularAddition(p=13, train_fraction=0.4, split_seed=1)
    return {"markov_sample": digest(chain.sample(30, 10, seed=4)), "markov_sets": digest(data.tokens, data.test.tokens),
            "modular_split": digest(mod.train_idx, mod.tokens)}


EXPECTED = {
    'pool/zero_var_train': '681bdea560469d07',
    'pool/zero_var_add_restricted': '7ad01c2800f49993',
    'pool/one_var_train': 'f6bab10629c7fce7',
    'pool/one_var_add_restricted': '74bd34d4d3b929a9',
    'pool/one_var_var_restricted': 'c496f79d5226ece3',
    'pool/two_var_train': 'd3134e7adba25d0e',
    'pool/two_var_add_restricted': 'a7d6be085e118593',
    'pool/two_var_var_restricted_one': 'd8f8869bdbb45fa6',
    'pool/two_var_var_restricted_two': '89a8281ba606c19a',
    'heldout_zero_var': '978f0e6477609e9d',
    'make_batch': '8f5c05ee8ec33041',
    'make_batch_left': '8d7e777533fb120f',
    'book_split': '7471a6efcb3ac23e',
    'bursty_make_batch': '7485c1f5441c68d1',
    'bursty_pool': '31b4d6f7be2632fc',
    'sample/recall': 'c19346688194882b',
    'sample/khop': 'b02e900a6cf82c35',
    'sample/ngram': '9513c0a69545753f',
    'sample/ioi': '1f6c041209bbe1ba',
    'sample/conditional': '30415bdefbc90cec',
    'enumerated': '654fcba2d7b99914',
    'burst_batch': 'd18449f9fc8d22fc',
    'automorphism': '0d22eae1a997345c',
    'markov_sample': '8b23f71b06e62719',
    'markov_sets': '332a6d4913d1f950',
    'modular_split': '4a406c910a52ed7b',
}


@pytest.mark.parametrize("values", [assign_add_values, blocklist_values, other_values])
def test_one_off_draws_keep_their_values(values):
    got = values()
    expected = {k: v for k, v in EXPECTED.items() if k in got}
    assert got == expected
