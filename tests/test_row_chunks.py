"""A sampler's call made in cache-sized pieces makes exactly the rows of the whole call."""
import itertools

import pytest
import torch

from circuitbook.tasks import row_chunks
from circuitbook.tasks.blocklist import BlockListTask, _decode_lehmer
from circuitbook.training import data_sampler

K, B = 5, 4


def labelled_rows(calls):
    """make(lo, hi, steps): row r of member k at step s holds 10^6 k + 10^3 s + r (and its negative)."""
    def make(lo, hi, steps):
        calls.append((lo, hi, steps))
        steps_ = steps.tolist() if torch.is_tensor(steps) else steps
        steps_ = [steps_] if isinstance(steps_, int) else steps_
        k = torch.arange(lo, hi)[:, None]
        s = torch.tensor(steps_).repeat_interleave(B)[None, :]
        r = torch.arange(B).repeat(len(steps_))[None, :]
        v = 10 ** 6 * k + 10 ** 3 * s + r
        return v, -v
    return make


def whole(steps):
    calls = []
    return labelled_rows(calls)(0, K, steps)


@pytest.mark.parametrize("piece_rows, expect", [
    (10 ** 6, "whole"),   # the call fits one piece
    (2 * K * B, "steps"),  # two whole steps a piece
    (2 * B, "members"),   # one step, two members a piece
    (1, "members"),       # a member a piece (never fewer)
])
@pytest.mark.parametrize("steps", [7, [3, 4, 9], [11]])
def test_pieces_make_the_rows_of_the_whole_call(monkeypatch, piece_rows, expect, steps):
    row_bytes = 16
    monkeypatch.setattr(row_chunks, "PIECE_BYTES", piece_rows * row_bytes)
    calls = []
    got = row_chunks.made_in_chunks(labelled_rows(calls), K, steps, B, torch.device("cpu"), row_bytes=row_bytes)
    want = whole(steps)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    n_steps = len(steps) if isinstance(steps, list) else 1
    if expect == "whole" or (expect == "steps" and n_steps == 1):
        assert len(calls) == 1
    elif expect == "steps":
        assert all((lo, hi) == (0, K) and len(s) <= 2 for lo, hi, s in calls) and len(calls) == 2
    else:
        per = max(1, piece_rows // B)
        assert all(hi - lo <= per and len(s) == 1 for lo, hi, s in calls)
        assert len(calls) == n_steps * -(-K // per)


def test_a_tensor_step_and_another_device_are_made_whole(monkeypatch):
    monkeypatch.setattr(row_chunks, "PIECE_BYTES", 1)
    calls = []
    got = row_chunks.made_in_chunks(labelled_rows(calls), K, torch.tensor(7), B, torch.device("cpu"), row_bytes=8)
    assert len(calls) == 1 and torch.equal(got[0], whole(7)[0])
    calls.clear()
    row_chunks.made_in_chunks(labelled_rows(calls), K, [1, 2], B, torch.device("meta"), row_bytes=8)
    assert calls == [(0, K, [1, 2])]


def test_blocklist_batches_are_the_same_in_any_pieces(monkeypatch):
    tasks = [BlockListTask("recall", n_pairs=8, n_blocks=4, burstiness=b, f_v=f, bos=True)
             for b, f in ((1, 0.5), (2, 0.5), (1, 0.2), (1, 0.5), (2, 0.9))]
    seeds = [3, 14, 15, 92, 65]
    made = {}
    for piece_bytes in (2 ** 40, 8 * 25 * 16 * 3, 1):  # whole, whole steps, a member a piece
        monkeypatch.setattr(row_chunks, "PIECE_BYTES", piece_bytes)
        sampler = data_sampler(tasks, seeds).sampler
        made[piece_bytes] = [sampler(5, 16), sampler([5, 6, 9, 40], 16), sampler(torch.tensor(6), 16)]
    first, *others = made.values()
    for other in others:
        for a, b in zip(first, other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(first[0][0], first[1][0][:, :16]) and torch.equal(first[2][0], first[1][0][:, 16:32])


def lehmer_reference(codes: list[int], n: int) -> list[int]:
    left = list(range(n))
    return [left.pop(u) for u in codes]


@pytest.mark.parametrize("n, length", [(5, 5), (5, 3), (200, 7), (40_000, 4)])  # int8, int8, int16, int32
def test_lehmer_codes_decode_to_the_permutation_they_name(n, length):
    g = torch.Generator().manual_seed(n)
    if n == 5:
        rows = [list(c) for c in itertools.product(*[range(n - j) for j in range(length)])]  # every code
    else:
        rows = [[int(torch.randint(n - j, (), generator=g)) for j in range(length)] for _ in range(300)]
        rows += [[n - 1 - j for j in range(length)], [0] * length]  # the largest and smallest elements
    codes = [torch.tensor([r[j] for r in rows]) for j in range(length)]
    got = _decode_lehmer(codes, n)
    assert got.dtype == torch.long and got.shape == (len(rows), length) and got.is_contiguous()
    assert got.tolist() == [lehmer_reference(r, n) for r in rows]
