"""Every training task's batched sampler (issue 36): the distributions of the old per-member batches
(`reference_batch`), all members in one call, a member's batches independent of the others', static shapes.

Statistical comparisons are chi-square tests of homogeneity between the sampler's rows and the reference's
on tens of thousands of rows, at fixed keys, so each test is deterministic; ALPHA is divided among a test's
features (Bonferroni).
"""
import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from circuitbook.tasks import draws
from circuitbook.tasks.assign_add import TWO_VAR, AssignAddTask
from circuitbook.tasks.assign_add_bursty import BurstyAssignAddTask
from circuitbook.tasks.base import IGNORE_INDEX, Batch, FixedDataset, StackedSampler, data_key, make_sampler
from circuitbook.tasks.blocklist import KINDS, BlockListTask
from circuitbook.tasks.corpus import Corpus, CorpusTask, Vocab
from circuitbook.tasks.markov import MarkovChain, MarkovSequences
from circuitbook.tasks.modular import ModularAddition
from circuitbook.training import data_sampler

ALPHA = 1e-4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def same_law(features_new: dict, features_old: dict) -> dict:
    """Bonferroni-corrected chi-square homogeneity p-values, per feature (each a 1-d int tensor)."""
    out = {}
    for name, x in features_new.items():
        y = features_old[name]
        if not len(x) or not len(y):  # a feature absent from both samples (2-var rows at r = 0) agrees
            out[name] = float(len(x) == len(y))
            continue
        lo = int(min(x.min(), y.min()))
        size = int(max(x.max(), y.max())) - lo + 1
        table = np.stack([np.bincount((x - lo).numpy(), minlength=size), np.bincount((y - lo).numpy(), minlength=size)])
        table = table[:, table.sum(0) > 0]
        out[name] = 1.0 if table.shape[1] < 2 else float(chi2_contingency(table, correction=False).pvalue)
    return {k: min(1.0, v * len(out)) for k, v in out.items()}


def rows(task, key: int, steps: int, batch: int, new: bool) -> Batch:
    """`steps` batches of one member: the sampler's (new) or the reference's."""
    make = task.train_batch if new else task.reference_batch
    batches = [make(s, batch, key) for s in range(steps)]
    return Batch(torch.cat([b.tokens for b in batches]), torch.cat([b.labels for b in batches]))


# ---------------------------------------------------------------- Assign and Add

def assign_add_features(task, b: Batch) -> dict:
    p = task.parse(b.tokens)
    two = p["seq_type"] == TWO_VAR
    out = {"type": p["seq_type"], "assignments": p["n_assignments"], "left_pos": p["left_pos"] + 1,
           "right_pos": p["right_pos"] + 1, "two_var_operands": (p["left_var"] * 12 + p["right_var"])[two],
           "pads": (b.tokens[:, :12] == task.PAD).long() @ (2 ** torch.arange(12)),  # the PAD pattern
           "label": b.labels}
    out.update({f"token{i}": b.tokens[:, i] for i in range(16)})
    return out


def assert_well_formed(task, b: Batch):
    p = task.parse(b.tokens)
    assert torch.equal(p["label"], b.labels), "every label is (n1 + n2) mod N of its sequence"
    assert task.is_training_query(p["seq_type"], p["left_var"], p["right_var"], p["n1"], p["n2"]).all()
    assigned = b.tokens[:, :12][b.tokens[:, :12] >= task.VAR0].numel()
    assert assigned == int(p["n_assignments"].sum())
    # a variable is assigned at most once (repeats aside): no row assigns one variable twice
    prefix = b.tokens[:, :12:]
    var_counts = torch.stack([(prefix == task.VAR0 + v).sum(1) for v in range(12)], 1)
    assert var_counts.max() <= getattr(task, "repeats", 1)


@pytest.mark.parametrize("kw", [dict(), dict(train_fraction=0.2, two_var_ratio=0.1), dict(pair_split="book")])
def test_assign_add_sampler_draws_the_old_distribution(kw):
    task = AssignAddTask(**kw)
    new, old = rows(task, 11, 30, 2048, True), rows(task, 11, 30, 2048, False)
    assert_well_formed(task, new)
    p = same_law(assign_add_features(task, new), assign_add_features(task, old))
    assert min(p.values()) > ALPHA, p
    shares = torch.bincount(task.parse(new.tokens)["seq_type"], minlength=4).numpy()
    assert chisquare(shares, task.type_probs.numpy() * len(new.labels)).pvalue > ALPHA


@pytest.mark.parametrize("repeats", [2, 3])
def test_bursty_sampler_draws_the_old_distribution(repeats):
    task = BurstyAssignAddTask(repeats=repeats)
    new, old = rows(task, 5, 20, 2048, True), rows(task, 5, 20, 2048, False)
    assert_well_formed(task, new)
    p = same_law(assign_add_features(task, new), assign_add_features(task, old))
    assert min(p.values()) > ALPHA, p


def test_each_member_of_a_sweep_draws_from_its_own_task():
    """f and r sweeps: one call serves members with other pair splits, ratios and repeats."""
    tasks = [AssignAddTask(train_fraction=0.1), AssignAddTask(train_fraction=0.9, two_var_ratio=0.0),
             AssignAddTask(two_var_ratio=2.0), AssignAddTask(train_fraction=0.5, pair_split="book")]
    keys = [data_key(s) for s in range(4)]
    sampler = make_sampler(tasks, keys)
    tokens, labels = zip(*[sampler(s, 1024) for s in range(12)])
    tokens, labels = torch.cat(tokens, 1), torch.cat(labels, 1)
    for k, task in enumerate(tasks):
        b = Batch(tokens[k], labels[k])
        assert_well_formed(task, b)
        shares = torch.bincount(task.parse(b.tokens)["seq_type"], minlength=4).numpy()
        expected = task.type_probs.numpy() * len(b.labels)
        assert chisquare(shares[expected > 0], expected[expected > 0]).pvalue > ALPHA
        assert shares[expected == 0].sum() == 0
        old = rows(task, keys[k], 6, 2048, False)
        p = same_law(assign_add_features(task, b), assign_add_features(task, old))
        assert min(p.values()) > ALPHA, (k, p)
    bursty = [BurstyAssignAddTask(repeats=b) for b in (1, 3)]
    tokens, _ = make_sampler(bursty, keys[:2])(0, 512)
    assert torch.equal(tokens[0], AssignAddTask().train_batch(0, 512, keys[0]).tokens), "b = 1 is the ordinary task"
    read = bursty[1].parse(tokens[1])
    assert (read["n_assignments"][read["seq_type"] > 0] >= 3).all()


# ---------------------------------------------------------------- block lists

def blocklist_features(task: BlockListTask, b: Batch) -> dict:
    ids = b.tokens % task.n_tokens if task.input_ids == "composite" else b.tokens
    out = {f"id{i}": b.tokens[:, i] for i in range(task.seq_len)}
    out.update({"target": b.labels, "query_target": ids[:, -1] * task.n_tokens + b.labels,
                "rare": (b.labels >= task.n_common).long() * (b.labels < task.n_common + task.n_rare).long(),
                "first_pair": ids[:, int(task.bos)] * task.n_tokens + ids[:, int(task.bos) + 1]})
    return out


BLOCK_TASKS = [BlockListTask(kind, n_pairs=12, n_rare=5, n_blocks=4, hops=2, ngram=3, f_r=0.3, f_v=0.4, n_fill=2,
                             n_fill_tokens=2, bos=True) for kind in KINDS]
BLOCK_TASKS += [BlockListTask("recall", n_pairs=10, n_blocks=6, burstiness=3, zipf=1.0, f_v=0.7),
                BlockListTask("recall", n_pairs=6, n_blocks=2, burstiness=2, offsets="fixed", input_ids="tokens"),
                BlockListTask("khop", hops=3, n_pairs=12, n_blocks=5, f_v=1.0, bos=True)]


@pytest.mark.parametrize("task", BLOCK_TASKS, ids=lambda t: f"{t.kind}-b{t.burstiness}-z{t.zipf}-{t.input_ids}")
def test_blocklist_sampler_draws_the_old_distribution(task):
    new, old = rows(task, 3, 10, 2000, True), rows(task, 3, 10, 2000, False)
    assert new.tokens.shape == old.tokens.shape == (20000, task.seq_len)
    p = same_law(blocklist_features(task, new), blocklist_features(task, old))
    assert min(p.values()) > ALPHA, p


def test_blocklist_members_with_other_knobs_and_burstiness_share_one_call():
    base = dict(n_pairs=16, n_rare=4, n_blocks=6)
    tasks = [BlockListTask("recall", f_r=0.0, f_v=0.1, **base), BlockListTask("recall", f_r=0.5, f_v=0.0, **base),
             BlockListTask("recall", f_r=0.2, f_v=0.8, **base), BlockListTask("recall", burstiness=3, f_v=1.0, **base),
             BlockListTask("recall", burstiness=6, f_v=0.5, **base)]
    keys = [data_key(s) for s in range(5)]
    sampler = make_sampler(tasks, keys)
    assert len(sampler.groups) == 4  # f_r = 0, f_r > 0, b = 3, b = 6
    tokens, labels = zip(*[sampler(s, 2000) for s in range(5)])
    tokens, labels = torch.cat(tokens, 1), torch.cat(labels, 1)
    for k, task in enumerate(tasks):
        ids, target = tokens[k] % task.n_tokens, labels[k]
        query = ids[:, -1]
        rare = target >= task.n_common
        assert abs(rare.float().mean().item() - task.f_r) < 4 * (0.25 / len(target)) ** 0.5
        non_canonical = (target != (query ^ 1))[~rare]
        assert abs(non_canonical.float().mean().item() - task.f_v) < 4 * (0.25 / len(non_canonical)) ** 0.5
        # the queried block [query, target] occurs `burstiness` times in the context
        ctx = ids[:, :-1].reshape(len(ids), task.n_blocks, 2)
        copies = ((ctx[:, :, 0] == query[:, None]) & (ctx[:, :, 1] == target[:, None])).sum(1)
        assert (copies == task.burstiness).all()
        old = rows(task, keys[k], 5, 2000, False)
        p = same_law(blocklist_features(task, Batch(tokens[k], labels[k])), blocklist_features(task, old))
        assert min(p.values()) > ALPHA, (k, p)


def test_build_without_distractors_and_with_one_block():
    for task in (BlockListTask("recall", n_pairs=4, n_blocks=2, burstiness=2),
                 BlockListTask("recall", n_pairs=4, n_blocks=1, n_fill=3)):
        b = task.train_batch(0, 50, 1)
        ids = b.tokens % task.n_tokens
        assert b.tokens.shape == (50, task.seq_len) and (ids[:, -1] == b.labels ^ 1).any()


# ---------------------------------------------------------------- fixed datasets (epochs)

def labelled_rows(n: int) -> FixedDataset:
    return FixedDataset(torch.arange(n)[:, None].repeat(1, 3), torch.arange(n), vocab_size=n, n_outputs=n)


def test_every_row_once_per_epoch_per_member_with_a_padded_last_batch():
    data = labelled_rows(10)
    sampler = make_sampler([data] * 3, [data_key(s) for s in range(3)])
    seen = {}
    for step in range(9):  # three epochs of three steps (4 + 4 + 2 rows)
        tokens, labels = sampler(step, 4)
        assert tokens.shape == (3, 4, 3) and labels.shape == (3, 4)
        assert (labels == IGNORE_INDEX).sum(1).tolist() == ([2, 2, 2] if step % 3 == 2 else [0, 0, 0])
        for k in range(3):
            seen.setdefault((k, step // 3), []).extend(labels[k][labels[k] >= 0].tolist())
            assert torch.equal(tokens[k][labels[k] >= 0, 0], labels[k][labels[k] >= 0])
    for order in seen.values():
        assert sorted(order) == list(range(10))
    orders = {key: tuple(v) for key, v in seen.items()}
    assert len(set(orders.values())) == len(orders), "every member and epoch has its own order"


def test_epoch_orders_are_uniform_permutations():
    data = labelled_rows(6)
    sampler = make_sampler([data] * 50, [data_key(s) for s in range(50)])
    firsts, before = [], []
    for epoch in range(60):
        _, labels = sampler(epoch, 6)  # one step per epoch at full... batch 6 = n: full batch, in order
        assert torch.equal(labels[0], torch.arange(6))
        _, labels = sampler(2 * epoch, 3)  # two steps per epoch: the first half of each epoch
        firsts.append(labels[:, 0])
        before.append(((labels == 0).any(1)).long())
    assert chisquare(torch.bincount(torch.cat(firsts), minlength=6).numpy()).pvalue > ALPHA
    assert chisquare(torch.bincount(torch.cat(before), minlength=2).numpy()).pvalue > ALPHA


def test_fixed_dataset_members_of_other_sizes_tensor_steps_and_next_token_labels():
    a, b = labelled_rows(7), labelled_rows(12)
    sampler = make_sampler([a, b], [data_key(1), data_key(2)])
    for step in range(7):
        t1, l1 = sampler(step, 5)
        t2, l2 = sampler(torch.tensor(step), 5)
        assert torch.equal(t1, t2) and torch.equal(l1, l2)
    chain = MarkovChain.circulant()
    seqs = MarkovSequences(chain, n_train=10, n_test=2, length=6)
    tokens, labels = make_sampler([seqs], [5])(2, 4)  # the last batch of an epoch: 2 rows of 4 real
    assert labels.shape == (1, 4, 5) and (labels[0, 2:] == IGNORE_INDEX).all() and (labels[0, :2] >= 0).all()
    assert seqs.train_batch(2, 4, 5).labels.shape == (2, 5)


def test_shared_shuffle_seed_gives_every_member_the_same_batches():
    samples = torch.randint(0, 20, (30, 9), generator=torch.Generator().manual_seed(0))
    corpus = Corpus(samples, Vocab([str(i) for i in range(20)], [1] * 20), {"sampling": "stories"})
    shared, free = CorpusTask(corpus, shuffle_seed=42), CorpusTask(corpus)
    tokens, _ = make_sampler([shared] * 3, [data_key(s) for s in range(3)])(4, 8)
    assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[0], tokens[2])
    assert torch.equal(tokens[0], shared.train_batch(4, 8, 123).tokens)  # the member's own key is ignored
    tokens, _ = make_sampler([free] * 2, [data_key(s) for s in range(2)])(4, 8)
    assert not torch.equal(tokens[0], tokens[1])


def test_fixed_dataset_batches_follow_the_old_law():
    """Which rows step 0 holds: uniform over the rows, as the old randperm's."""
    data = labelled_rows(20)
    new = torch.cat([data.train_batch(0, 5, key).labels for key in range(4000)])
    old = torch.cat([data.reference_batch(0, 5, key).labels for key in range(4000)])
    assert min(same_law({"row": new}, {"row": old}).values()) > ALPHA


# ---------------------------------------------------------------- what every sampler promises

SAMPLED = {
    "assign_add": lambda: [AssignAddTask(train_fraction=f) for f in (0.3, 0.5, 0.7, 0.9)],
    "bursty": lambda: [BurstyAssignAddTask(repeats=b) for b in (1, 2, 3, 1)],
    "blocklist": lambda: [BlockListTask("recall", n_pairs=8, n_blocks=4, burstiness=b, f_v=0.5, bos=True)
                          for b in (1, 2, 1, 4)],
    "modular": lambda: [ModularAddition(p=7, train_fraction=0.5, split_seed=s) for s in range(4)],
    "markov": lambda: [MarkovSequences(MarkovChain.circulant(), n_train=30, n_test=2, length=8)] * 4,
}


@pytest.mark.parametrize("name", SAMPLED)
def test_members_batches_do_not_depend_on_the_other_members(name):
    tasks = SAMPLED[name]()
    seeds = [3, 14, 15, 92]
    whole = data_sampler(tasks, seeds)(7, 16)
    for lo, hi in [(0, 1), (1, 3), (3, 4)]:
        part = data_sampler(tasks[lo:hi], seeds[lo:hi])(7, 16)
        assert all(torch.equal(w[lo:hi], p) for w, p in zip(whole, part))
    for k, (task, seed) in enumerate(zip(tasks, seeds)):
        one = task.train_batch(7, 16, data_key(seed))
        assert torch.equal(whole[0][k, :len(one.tokens)], one.tokens)
    tensor_step = data_sampler(tasks, seeds)(torch.tensor(7), 16)
    assert all(torch.equal(a, b) for a, b in zip(whole, tensor_step))
    assert not torch.equal(whole[0], data_sampler(tasks, seeds)(8, 16)[0])


def test_prefetched_blocks_equal_one_step_at_a_time(monkeypatch):
    """The loop's sampler makes several steps per call: the same batches in any order of steps and sizes."""
    from circuitbook.tasks.base import Prefetch

    monkeypatch.setattr(Prefetch, "ROWS", 64)  # blocks of 4 steps at 2 members x 8 rows
    tasks = SAMPLED["blocklist"]()[:2]
    sampler, direct = data_sampler(tasks, [1, 2]), data_sampler(tasks, [1, 2]).sampler
    assert isinstance(sampler, Prefetch)
    for step, batch in [(0, 8), (1, 8), (5, 8), (3, 8), (6, 8), (6, 4), (7, 8), (2 ** 32 - 1, 8)]:
        for a, b in zip(sampler(step, batch), direct(step, batch)):
            assert torch.equal(a, b), (step, batch)
    assert sampler.capturable and len(sampler.groups) == 2  # b = 1 and b = 2


class ToyTask:
    """A task with only train_batch (as a user's): the generic sampler serves it."""

    vocab_size = n_outputs = 5
    seq_len, loss = 3, "last"

    def train_batch(self, step, batch_size, seed):
        g = torch.Generator().manual_seed(seed + 1000 * step)
        return Batch(torch.randint(5, (batch_size, 3), generator=g), torch.randint(5, (batch_size,), generator=g))


def test_tasks_without_a_batched_sampler_and_mixed_classes_use_the_generic_one():
    sampler = make_sampler([ToyTask(), ToyTask()], [1, 2])
    assert isinstance(sampler, StackedSampler) and not sampler.capturable
    tokens, labels = sampler(3, 4)
    assert torch.equal(tokens[1], ToyTask().train_batch(3, 4, 2).tokens) and labels.shape == (2, 4)
    mixed = make_sampler([AssignAddTask(), BurstyAssignAddTask(repeats=2)], [1, 2])
    assert isinstance(mixed, StackedSampler) and mixed(0, 8)[0].shape == (2, 8, 16)
    for name in SAMPLED:
        assert make_sampler(SAMPLED[name](), [1, 2, 3, 4]).capturable


def test_bad_arguments_are_refused_before_anything_is_drawn():
    task = AssignAddTask()
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            make_sampler([task], [1])(0, bad)
    with pytest.raises(ValueError, match="step must be an integer in"):
        task.train_batch(-1, 4, 0)
    with pytest.raises(ValueError, match="share one modulus"):
        make_sampler([task, AssignAddTask(modulus=7)], [1, 2])
    with pytest.raises(ValueError, match="share seq_len"):
        make_sampler([BlockListTask(n_blocks=3), BlockListTask(n_blocks=4)], [1, 2])
    with pytest.raises(ValueError, match="sequence shape or loss"):
        make_sampler([labelled_rows(5), FixedDataset(torch.zeros(5, 4), torch.zeros(5), vocab_size=2, n_outputs=2)],
                     [1, 2])
    with pytest.raises(ValueError, match="one task per key"):
        make_sampler([task], [1, 2])


# ---------------------------------------------------------------- on a GPU: the same integers, capturable

@pytest.mark.cuda
@pytest.mark.parametrize("name", SAMPLED)
def test_cuda_batches_are_bit_identical_to_the_cpu_and_capturable(name):
    tasks, seeds = SAMPLED[name](), [3, 14, 15, 92]
    cpu, gpu = data_sampler(tasks, seeds, "cpu"), data_sampler(tasks, seeds, "cuda")
    for step in (0, 5, 123):
        for a, b in zip(cpu(step, 32), gpu(step, 32)):
            assert torch.equal(a, b.cpu())
    step = torch.zeros((), dtype=torch.long, device="cuda")
    gpu(step, 32)  # warm-up: cached index tensors exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gpu(step, 32)
    for s in (7, 40, 2):
        step.fill_(s)
        graph.replay()
        for a, b in zip(cpu(s, 32), captured):
            assert torch.equal(a, b.cpu()), (name, s)


@pytest.mark.parametrize("sizes", [(10, 10, 10), (10, 7, 3)])  # a slice of the window; members apart: a gather
def test_the_window_of_epoch_orders_changes_no_batch(sizes, monkeypatch):
    """Orders of many epochs made in one call are those made one epoch at a time, in any order of steps."""
    import circuitbook.tasks.base as base
    tasks, keys = [labelled_rows(n) for n in sizes], [data_key(s) for s in range(len(sizes))]
    steps = list(range(40)) + [2 ** 32 - 1, 5, 1000, 6, 2 ** 32 - 2, 0]
    monkeypatch.setattr(base, "EPOCH_WINDOW_STEPS", 1)
    one_at_a_time = make_sampler(tasks, keys)
    assert one_at_a_time.window_epochs(4) == 1
    expected = [one_at_a_time(s, 4) for s in steps]
    monkeypatch.setattr(base, "EPOCH_WINDOW_STEPS", 256)
    windowed = make_sampler(tasks, keys)
    shortest = min(-(-n // 4) for n in sizes)  # steps of the shortest epoch
    assert windowed.window_epochs(4) == -(-256 // shortest)  # at least 256 steps of it
    for s, (tokens, labels) in zip(steps, expected):
        made = windowed(s, 4)
        assert torch.equal(made[0], tokens) and torch.equal(made[1], labels), s
        by_tensor = windowed(torch.tensor(s), 4)
        assert torch.equal(by_tensor[0], tokens) and torch.equal(by_tensor[1], labels), s
        for k, (task, key) in enumerate(zip(tasks, keys)):
            alone = task.train_batch(s, 4, key)  # (a member whose rows fit one batch: in its own order)
            real = labels[k][labels[k] != IGNORE_INDEX]
            assert torch.equal(real.sort().values, alone.labels.sort().values), (s, k)
            if task.steps_per_epoch(4) > 1:
                assert torch.equal(real, alone.labels), (s, k)
    monkeypatch.setattr(base, "EPOCH_WINDOW_IDS", 3 * 3 * 4 * 10)  # ids of 10 epochs of 3 members
    assert make_sampler(tasks, keys).window_epochs(4) == 10, "the window's row ids are bounded"
