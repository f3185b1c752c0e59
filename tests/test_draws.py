"""The counter-based stream of training batches (`tasks/draws.py`): known answers, uniformity, independence."""
import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from circuitbook.tasks import draws

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ALPHA = 1e-4  # every statistical test below is deterministic (fixed keys); a law that is off fails it


# ---------------------------------------------------------------- the definition, written again from its text

M32 = 2 ** 32


def ref_mix(x: int) -> int:
    """lowbias32 with unsigned arithmetic mod 2^32 (the published constants)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % M32
    x ^= x >> 15
    x = (x * 0x846CA68B) % M32
    return x ^ (x >> 16)


def ref_word(key: int, step: int, site: int, row: int, col: int) -> int:
    a, b = 0x243F6A88, 0x85A308D3
    for w in (key % M32, key // M32, step, site * 2 ** 24 + row):
        a = ref_mix(a ^ w)
        b = ref_mix(b ^ a)
    return ref_mix(b ^ (col * (2 * a + 1) % M32))


KEYS = [0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 64 - 1, 8_765_432_123_456_789]


def test_words_equal_the_definition_at_the_edges_of_every_input():
    stream = draws.Stream(KEYS)
    for step in (0, 1, 2 ** 31, 2 ** 32 - 1):
        for site in (0, 255):
            got = stream.words(step, site, 5, 4)
            rows = [0, 1, 2, 3, 4]
            want = torch.tensor([[[ref_word(k, step, site, r, c) for c in range(4)] for r in rows] for k in KEYS])
            assert torch.equal(got, want), (step, site)
    # the last row a site can hold
    assert int(draws.Stream([3]).words(9, 7, 2 ** 24, 1)[0, -1, 0]) == ref_word(3, 9, 7, 2 ** 24 - 1, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [draws.WIDE - 1, draws.WIDE, 3 * draws.WIDE + 1])
def test_narrow_and_wide_rows_equal_the_definition(device, width):
    """Rows of WIDE words or more are mixed in int32 arithmetic, narrower ones in int64: both are the definition,
    columns near 2^16 included (their products with a lane wrap many times)."""
    stream = draws.Stream(KEYS, device)
    for step in (0, 2 ** 31 + 7, 2 ** 32 - 1):
        got = stream.words(step, 255, 3, width).cpu()
        want = torch.tensor([[[ref_word(k, step, 255, r, c) for c in range(width)] for r in range(3)] for k in KEYS])
        assert torch.equal(got, want), (step, width)
    far = stream.words(5, 2, 2, draws.MAX_COLUMNS).cpu()[:, :, -width:]
    cols = range(draws.MAX_COLUMNS - width, draws.MAX_COLUMNS)
    want = torch.tensor([[[ref_word(k, 5, 2, r, c) for c in cols] for r in range(2)] for k in KEYS])
    assert torch.equal(far, want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_int32_mix_is_the_mix(device):
    x = torch.cat([torch.tensor([0, 1, 2 ** 15, 2 ** 16 - 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1]),
                   torch.randint(0, 2 ** 32, (5000,), generator=torch.Generator().manual_seed(1))]).to(device)
    assert torch.equal(draws.mix_int32(x.to(torch.int32)).long() & draws.MASK32, draws.mix(x))


def test_known_words():
    """Pinned values: a change of the hash (and of every run's data) shows here first."""
    assert draws.word(0, 0, 0, 0, 0) == ref_word(0, 0, 0, 0, 0) == 3541725832
    assert draws.word(12345, 678, 9, 10, 11) == 2118887947
    assert draws.mix(0) == 0 and draws.mix(1) == ref_mix(1) == 1753845952


def test_mix_of_tensors_and_of_ints_agree_over_the_whole_range():
    x = torch.cat([torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1]),
                   torch.randint(0, 2 ** 32, (2000,), generator=torch.Generator().manual_seed(0))])
    assert torch.equal(draws.mix(x), torch.tensor([ref_mix(int(v)) for v in x]))
    assert draws.mix(x).min() >= 0 and draws.mix(x).max() < M32


def test_a_members_words_do_not_depend_on_the_other_members():
    whole = draws.Stream([11, 22, 33, 44]).words(5, 1, 64, 3)
    for k, key in enumerate([11, 22, 33, 44]):
        assert torch.equal(draws.Stream([key]).words(5, 1, 64, 3)[0], whole[k])
    assert torch.equal(draws.Stream([33, 11]).words(5, 1, 64, 3), whole[[2, 0]])
    # fewer rows or columns are a corner of more
    assert torch.equal(draws.Stream([22]).words(5, 1, 10, 2)[0], whole[1, :10, :2])


def test_tensor_steps_equal_int_steps_and_count_per_member():
    s = draws.Stream([4, 5, 6])
    assert torch.equal(s.words(torch.tensor(17), 2, 8, 3), s.words(17, 2, 8, 3))
    per_member = s.words(torch.tensor([3, 9, 17]), 2, 8, 3)
    for k, step in enumerate([3, 9, 17]):
        assert torch.equal(per_member[k], s.words(step, 2, 8, 3)[k])


@pytest.mark.parametrize("bad", [-1, 2 ** 32, 1.0, True, "3"])
def test_bad_steps_are_refused(bad):
    with pytest.raises(ValueError, match="step must be an integer in"):
        draws.Stream([1]).words(bad, 0, 4, 1)


def test_bad_keys_sites_shapes_and_step_tensors_are_refused():
    with pytest.raises(ValueError, match="key must be an integer in"):
        draws.Stream([-1])
    with pytest.raises(ValueError, match="key must be an integer in"):
        draws.Stream([2 ** 64])
    with pytest.raises(ValueError, match="at least one member key"):
        draws.Stream([])
    s = draws.Stream([1])
    with pytest.raises(ValueError, match="site in"):
        s.words(0, 256, 4, 1)
    with pytest.raises(ValueError, match="rows in"):
        s.words(0, 0, 2 ** 24 + 1, 1)
    with pytest.raises(ValueError, match="int64 tensor"):
        s.words(torch.tensor(3, dtype=torch.int32), 0, 4, 1)
    with pytest.raises(ValueError, match="int64 tensor"):
        s.words(torch.tensor([[[3]]]), 0, 4, 1)
    with pytest.raises(ValueError, match=r"\[1, S\] int64 tensor"):
        s.words(torch.tensor([[3], [4]]), 0, 4, 1)  # two members' steps for a one-member stream
    with pytest.raises(ValueError, match=r"\[1, S\] int64 tensor"):
        s.words(torch.tensor([[3]], dtype=torch.int32), 0, 4, 1)
    with pytest.raises(ValueError, match=r"0-dim, \[1\] or \[1, S\] int64 tensor"):
        s.words(torch.tensor([3, 4]), 0, 4, 1)  # two members' counters for a one-member stream
    with pytest.raises(ValueError, match=r"0-dim, \[1\] int64 tensor"):
        s.step_tensor(torch.tensor([[3]]))  # [K, S] only where asked for


def test_steps_per_member_are_each_members_words_at_its_steps():
    stream = draws.Stream([5, 6, 7])
    steps = torch.tensor([[0, 9, 2 ** 32 - 1], [4, 4, 1], [123456, 0, 7]])
    made = stream.words(steps, 3, 11, 2).view(3, 3, 11, 2)
    for k in range(3):
        for s in range(3):
            alone = draws.Stream([[5, 6, 7][k]]).words(int(steps[k, s]), 3, 11, 2)[0]
            assert torch.equal(made[k, s], alone)


# ---------------------------------------------------------------- uniformity and independence

def words(keys=(1, 2, 3), step=0, site=0, rows=20_000, width=5) -> torch.Tensor:
    return draws.Stream(list(keys)).words(step, site, rows, width)


def uniform_p(values: torch.Tensor, bins: int) -> float:
    return float(chisquare(torch.bincount(values.flatten(), minlength=bins).numpy()).pvalue)


def joint_p(x: torch.Tensor, y: torch.Tensor, bins: int = 16) -> float:
    """Chi-square test of independence of two word samples' top bits (bins a power of two)."""
    shift = 32 - (bins.bit_length() - 1)
    table = torch.zeros(bins, bins, dtype=torch.long)
    table.index_put_((x.flatten() >> shift, y.flatten() >> shift), torch.ones(x.numel(), dtype=torch.long),
                     accumulate=True)
    return float(chi2_contingency(table.numpy(), correction=False).pvalue)


def test_words_are_uniform():
    w = words()  # 300,000 words
    assert uniform_p(w >> 24, 256) > ALPHA  # the top byte
    assert uniform_p(w & 255, 256) > ALPHA  # the bottom byte
    assert uniform_p((w >> 13) & 1023, 1024) > ALPHA
    bits = torch.stack([(w >> j) & 1 for j in range(32)]).flatten(1).float().mean(1)
    assert (bits - 0.5).abs().max() < 4 * 0.5 / w.numel() ** 0.5


def test_words_are_independent_across_members_steps_sites_rows_and_columns():
    w = words()
    assert joint_p(w[0], w[1]) > ALPHA  # members
    assert joint_p(w[0], words(step=1)[0]) > ALPHA  # steps
    assert joint_p(w[0], words(step=2 ** 20)[0]) > ALPHA
    assert joint_p(w[0], words(site=1)[0]) > ALPHA  # sites
    assert joint_p(w[0, :-1], w[0, 1:]) > ALPHA  # neighbouring rows
    assert joint_p(w[..., :-1], w[..., 1:]) > ALPHA  # neighbouring columns
    # keys that differ in one bit, and steps of one member next to each other
    assert joint_p(words(keys=(2 ** 40,))[0], words(keys=(2 ** 40 + 1,))[0]) > ALPHA
    many_steps = torch.stack([words(keys=(7,), step=s, rows=1, width=1)[0, 0, 0] for s in range(4000)])
    assert joint_p(many_steps[:-1], many_steps[1:], bins=4) > ALPHA


def test_rows_of_different_members_steps_and_sites_do_not_repeat():
    """The state is 64 bits wide up to the row: no two rows of a member's steps, or of two members, coincide."""
    w = torch.cat([words(keys=range(50), step=s, rows=200, width=2).flatten(0, 1) for s in range(20)])
    assert len(torch.unique(w[:, 0] << 32 | w[:, 1])) == len(w)


# ---------------------------------------------------------------- words -> draws

def test_below_is_uniform_on_its_range_with_tensor_ranges_too():
    w = words()
    for n in (2, 7, 59, 1000):
        v = draws.below(w, n)
        assert v.min() >= 0 and v.max() < n and uniform_p(v, n) > ALPHA
    n = torch.tensor([3, 11, 12])[:, None, None]
    v = draws.below(w, n)
    for k, m in enumerate([3, 11, 12]):
        assert v[k].max() < m and uniform_p(v[k], m) > ALPHA
    assert int(draws.below(torch.tensor(M32 - 1), 2 ** 31)) == 2 ** 31 - 1


def test_thresholds_and_categorical_known_answers():
    assert draws.threshold(0.0) == 0 and draws.threshold(1.0) == M32 and draws.threshold(0.5) == 2 ** 31
    assert draws.cumulative_thresholds([0.25, 0.0, 0.75]) == [2 ** 30, 2 ** 30]
    thr = torch.tensor(draws.cumulative_thresholds([0.25, 0.0, 0.75]))
    assert draws.categorical(torch.tensor([0, 2 ** 30 - 1, 2 ** 30, M32 - 1]), thr).tolist() == [0, 0, 2, 2]
    w = words()
    probs = [0.1, 0.2, 0.3, 0.4]
    counts = torch.bincount(draws.categorical(w, torch.tensor(draws.cumulative_thresholds(probs))).flatten())
    assert chisquare(counts.numpy(), np.array(probs) * w.numel()).pvalue > ALPHA
    for bad in ([0.5, 0.6], [-0.1, 1.1], []):
        with pytest.raises(ValueError, match="sum to 1"):
            draws.cumulative_thresholds(bad)
    with pytest.raises(ValueError, match="probability"):
        draws.threshold(1.5)


def test_sort_keys_give_uniform_permutations():
    w = words(rows=60_000, width=3)
    keys = draws.sort_keys(w)
    assert (keys[..., :-1] != keys[..., 1:]).all()
    perm = keys.argsort(-1)
    code = (perm[..., 0] * 3 + perm[..., 1]).flatten()  # which of the 6 permutations
    assert uniform_p(torch.unique(code, return_inverse=True)[1], 6) > ALPHA
    tied = draws.sort_keys(torch.zeros(1, 4, dtype=torch.long))  # equal words: the columns break the tie
    assert tied.argsort(-1).tolist() == [[0, 1, 2, 3]]


def test_bits_and_uniforms():
    w = words(rows=5_000, width=2)
    b = draws.bits(w, 40)
    assert b.shape == (3, 5_000, 40) and set(b.unique().tolist()) == {0, 1}
    assert torch.equal(b[..., 33], (w[..., 1] >> 1) & 1)
    assert (b.float().mean((0, 1)) - 0.5).abs().max() < 0.02
    with pytest.raises(ValueError, match="bits"):
        draws.bits(w, 65)
    u = draws.uniform(w)
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert torch.equal(u * 2 ** 24, (w >> 8).float())


# ---------------------------------------------------------------- the same integers on a GPU

@pytest.mark.cuda
def test_cuda_words_and_draws_are_bit_identical_to_the_cpu():
    keys, rows, width = list(range(40)) + KEYS, 3000, 7
    cpu, gpu = draws.Stream(keys), draws.Stream(keys, "cuda")
    for step in (0, 123, 2 ** 32 - 1):
        a, b = cpu.words(step, 5, rows, width), gpu.words(step, 5, rows, width)
        assert torch.equal(a, b.cpu())
        assert torch.equal(gpu.words(torch.tensor(step, device="cuda"), 5, rows, width), b)
        for n in (59, torch.tensor(2 ** 31)):
            assert torch.equal(draws.below(a, n), draws.below(b, n.cuda() if torch.is_tensor(n) else n).cpu())
        assert torch.equal(draws.sort_keys(a).argsort(-1), draws.sort_keys(b).argsort(-1).cpu())
        assert torch.equal(draws.uniform(a), draws.uniform(b).cpu())
