"""Known answers for the Assign-and-Add data generator (PAPERS.md, chapter assign_add).

Sequences are checked with `read`, a plain-Python parser written from the spec's
token table, so the library's own `parse` is not trusted to grade itself.
"""
import json
import random
from collections import Counter

import pytest
import torch

from circuitbook.tasks.assign_add import POOL_NAMES, AssignAddTask
from circuitbook.tasks.base import Batch

# The spec's token table at N = 59.
N, PLUS, EQ, PAD, VAR0 = 59, 59, 60, 61, 62
LETTERS = "abcdefghijkl"
NOT_RIGHT, NOT_LEFT = {"a", "b"}, {"k", "l"}


@pytest.fixture(scope="module")
def task():
    return AssignAddTask()


@pytest.fixture(scope="module")
def train_pairs(task):
    return {(int(p) // N, int(p) % N) for p in task.train_pairs}


@pytest.fixture(scope="module")
def training_sample(task):
    """20 training batches of 512: 10,240 sequences."""
    return [task.train_batch(step, 512, seed=7) for step in range(20)]


def read(tokens):
    """Parse one sequence by the spec; fail on anything malformed."""
    seq = [int(t) for t in tokens]
    assert len(seq) == 16
    prefix, core = seq[:12], seq[12:]
    assert core[0] == PLUS and core[3] == EQ, seq
    assignments, order, i = {}, [], 0
    while i < 12:
        if prefix[i] == PAD:
            i += 1
            continue
        assert prefix[i] >= VAR0 and i + 1 < 12 and 0 <= prefix[i + 1] < N, seq  # `var value`
        var = LETTERS[prefix[i] - VAR0]
        assert var not in assignments, f"{var} assigned twice: {seq}"
        assignments[var] = prefix[i + 1]
        order.append((i, var))
        i += 2

    def operand(t):
        if t < N:
            return None, t
        var = LETTERS[t - VAR0]
        assert var in assignments, f"queried {var} is unassigned: {seq}"
        return var, assignments[var]

    (left, n1), (right, n2) = operand(core[1]), operand(core[2])
    kind = {(False, False): "zero", (True, False): "left", (False, True): "right", (True, True): "two"}
    return {"type": kind[left is not None, right is not None], "left": left, "right": right,
            "n1": n1, "n2": n2, "assignments": assignments, "starts": order, "label": (n1 + n2) % N}


def read_batch(batch):
    parsed = [read(t) for t in batch.tokens]
    assert [p["label"] for p in parsed] == batch.labels.tolist()
    return parsed


def is_training_position(p):
    if p["type"] == "left":
        return p["left"] not in NOT_LEFT
    if p["type"] == "right":
        return p["right"] not in NOT_RIGHT
    if p["type"] == "two":  # operand by operand, as in 1-var
        return p["left"] not in NOT_LEFT and p["right"] not in NOT_RIGHT
    return True


# ----------------------------------------------------------------- sizes
def test_vocabulary_matches_spec(task):
    assert (task.vocab_size, task.n_outputs, task.seq_len, task.loss) == (74, 59, 16, "last")
    assert (task.PLUS, task.EQ, task.PAD, task.VAR0) == (PLUS, EQ, PAD, VAR0)
    assert task.token_names()[VAR0:] == list(LETTERS)


def test_universe_and_training_counts(task):
    assert task.universe_size == 167_088
    assert len(task.train_pairs) == 2_436 and len(task.heldout_pairs) == 1_045
    assert task.n_training_rows() == 102_312
    assert task.rows_per_type.tolist() == [2436 * 12, 2436 * 10, 2436 * 10, 2436 * 10]
    assert task.natural_two_var_ratio == pytest.approx(10 / 12)


def test_training_rows_are_the_training_part_of_the_universe(task):
    rows = task.training_rows()
    assert len(rows) == 102_312 and len(torch.unique(rows, dim=0)) == 102_312
    var, typ, n1, n2 = torch.meshgrid(torch.arange(12), torch.arange(4), torch.arange(N), torch.arange(N),
                                      indexing="ij")
    universe = torch.stack([var, typ, n1, n2], -1).reshape(-1, 4)
    assert len(universe) == 167_088
    assert int(task.is_training_row(*universe.T).sum()) == 102_312
    assert bool(task.is_training_row(*rows.T).all())


def test_default_split_is_the_authors_python_sample(task, train_pairs):
    # PAPERS.md: random.Random(42).sample(pairs, 2436) over the lexicographic list of the 3,481 pairs
    pairs = [(a, b) for a in range(N) for b in range(N)]
    assert train_pairs == set(random.Random(42).sample(pairs, 2436))
    assert task.pair_split == "authors"
    book = AssignAddTask(pair_split="book")
    assert len(book.train_pairs) == 2436 and not torch.equal(book.train_pairs, task.train_pairs)
    assert book.n_training_rows() == 102_312


def test_two_var_training_uses_the_92_ordered_pairs_operand_by_operand(task, training_sample):
    allowed = {(x, y) for x in set(LETTERS) - NOT_LEFT for y in set(LETTERS) - NOT_RIGHT if x != y}
    assert len(allowed) == 92
    assert {(LETTERS[x], LETTERS[y]) for x, y in task._combos["train"].tolist()} == allowed
    seen = Counter((p["left"], p["right"]) for b in training_sample for p in read_batch(b) if p["type"] == "two")
    assert set(seen) == allowed  # every pair occurs, a and b included on the left
    # the row's variable is the right operand (uniform over c..l), the left is uniform among its partners:
    # P(x, y) = 1/10 * 1/9 for y in c..j and 1/10 * 1/10 for y in k, l
    q = task._training_queries(200_000, torch.Generator().manual_seed(0), (3,))
    pair_share = Counter(zip(q.left_var.tolist(), q.right_var.tolist()))
    assert pair_share[0, 2] / 200_000 == pytest.approx(1 / 90, rel=0.08)  # (a, c)
    assert pair_share[0, 10] / 200_000 == pytest.approx(1 / 100, rel=0.08)  # (a, k)
    assert sum(pair_share[x, y] for x in range(10) for y in (10, 11)) / 200_000 == pytest.approx(0.2, abs=0.005)
    assert len(task._combos["one"]) == 36 and len(task._combos["two"]) == 4
    assert {(LETTERS[x], LETTERS[y]) for x, y in task._combos["two"].tolist()} == {
        (x, y) for x in NOT_LEFT for y in NOT_RIGHT}


def test_pair_split_file(tmp_path, task):
    pairs = [(int(p) // N, int(p) % N) for p in task.train_pairs]
    text = tmp_path / "pairs.txt"
    text.write_text("# the authors' pairs\n" + "\n".join(f"{a} {b}" if i % 2 else f"{a},{b}"
                                                       for i, (a, b) in enumerate(pairs)) + "\n\n")
    from_text = AssignAddTask(train_fraction=None, pair_split=text)
    assert torch.equal(from_text.train_pairs, task.train_pairs) and from_text.train_fraction == pytest.approx(2436 / 3481)
    assert from_text.n_training_rows() == 102_312
    assert from_text.spec()["train_pairs"] == task.spec()["train_pairs"]
    assert torch.equal(AssignAddTask(train_fraction=0.7, pair_split=text).train_pairs, task.train_pairs)
    js = tmp_path / "pairs.json"
    js.write_text(json.dumps([[0, 1], [2, 3]]))
    assert AssignAddTask(train_fraction=None, pair_split=js).train_pairs.tolist() == [1, 2 * N + 3]
    assert AssignAddTask(pair_split="book").spec() != task.spec()


@pytest.mark.parametrize("content, message", [
    ("1 2\n3\n", "line 2: expected two integers"),
    ("1 2\n1 59\n", r"line 2: expected two integers n1 n2 in \[0, 58\]"),
    ("1 2\n-1 3\n", "line 2"),
    ("1 2\n1.5 3\n", "line 2"),
    ("4 5\n4,5\n", r"line 2: pair \(4, 5\) is listed twice"),
    ("# nothing\n", "lists no pairs"),
])
def test_bad_pair_files_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "pairs.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        AssignAddTask(train_fraction=None, pair_split=path)
    assert "pairs.txt" in str(err.value)


def test_bad_pair_split_values(tmp_path):
    with pytest.raises(ValueError, match="pair_split 'authros' is neither one of"):
        AssignAddTask(pair_split="authros")
    path = tmp_path / "pairs.json"
    path.write_text('[[0, 1], [2, 3.5]]')
    with pytest.raises(ValueError, match="item 1"):
        AssignAddTask(train_fraction=None, pair_split=path)
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON list"):
        AssignAddTask(train_fraction=None, pair_split=path)
    path.write_text('[[0, 1]]')
    with pytest.raises(ValueError, match="lists 1 training pairs, but train_fraction=0.7 asks for 2436"):
        AssignAddTask(pair_split=path)
    with pytest.raises(ValueError, match="train_fraction"):
        AssignAddTask(train_fraction=None)


def test_pair_split_is_seeded_and_truncates(task):
    again, other = AssignAddTask(), AssignAddTask(split_seed=1)
    assert torch.equal(task.train_pairs, again.train_pairs)
    assert not torch.equal(task.train_pairs, other.train_pairs)
    both = torch.cat([task.train_pairs, task.heldout_pairs]).sort().values
    assert torch.equal(both, torch.arange(N * N))
    assert len(AssignAddTask(train_fraction=0.5).train_pairs) == 1740  # floor(1740.5)
    assert len(AssignAddTask(train_fraction=1.0).heldout_pairs) == 0


def test_set_sizes_table(task):
    sizes = {row["set"]: row["size"] for row in task.set_sizes()}
    assert sizes["universe"] == 167_088 and sizes["train_rows"] == 102_312
    assert sizes["train_pairs"] == 2_436 and sizes["heldout_pairs"] == 1_045
    assert sizes["heldout_zero_var"] == 1_045
    assert all(sizes[name] == 2000 for name in POOL_NAMES)


def test_other_modulus_scales():
    small = AssignAddTask(modulus=7)
    assert (small.vocab_size, small.n_outputs) == (22, 7)
    assert small.n_training_rows() == int(0.7 * 49) * 42
    read_small = small.parse(small.train_batch(0, 256, 0).tokens)
    assert bool((read_small["label"] == small.train_batch(0, 256, 0).labels).all())


# -------------------------------------------------------------- training batches
def test_training_sequences_are_well_formed_and_labelled(training_sample):
    for batch in training_sample[:8]:
        assert batch.tokens.shape == (512, 16) and batch.tokens.dtype == torch.long
        assert batch.labels.shape == (512,)
        for p in read_batch(batch):  # labels, one assignment per variable, queried ones assigned
            n_required = (p["left"] is not None) + (p["right"] is not None)
            assert max(1, n_required) <= len(p["assignments"]) <= 6
            assert p["left"] is None or p["left"] != p["right"]


def test_training_never_shows_heldout_pairs_or_positions(training_sample, train_pairs):
    for batch in training_sample:
        for p in read_batch(batch):
            assert (p["n1"], p["n2"]) in train_pairs, p
            assert is_training_position(p), p


def test_all_types_occur_in_natural_shares(training_sample):
    parsed = [p for b in training_sample for p in read_batch(b)]
    share = Counter(p["type"] for p in parsed)
    n = len(parsed)
    for kind, rows in (("zero", 12), ("left", 10), ("right", 10), ("two", 10)):
        assert share[kind] / n == pytest.approx(rows / 42, abs=0.02)
    counts = Counter((p["type"], len(p["assignments"])) for p in parsed)
    assert all(counts["zero", k] > 0 for k in range(1, 7)) and all(counts["two", k] > 0 for k in range(2, 7))
    # Every variable shows up in every slot training allows.
    assert {p["left"] for p in parsed if p["type"] == "left"} == set(LETTERS) - NOT_LEFT
    assert {p["right"] for p in parsed if p["type"] == "right"} == set(LETTERS) - NOT_RIGHT
    assert {p["left"] for p in parsed if p["type"] == "two"} == set("abcdefghij")
    assert {p["right"] for p in parsed if p["type"] == "two"} == set("cdefghijkl")


def test_padding_is_scattered(training_sample):
    parsed = [p for b in training_sample for p in read_batch(b)]
    starts = Counter(start for p in parsed for start, _ in p["starts"])
    assert set(starts) == set(range(11))  # an assignment can start at every prefix position
    # The queried variable's assignment is not always first or last.
    ranks = Counter(next(r for r, (_, v) in enumerate(p["starts"]) if v == p["left"])
                    for p in parsed if p["type"] == "left" and len(p["assignments"]) == 3)
    assert set(ranks) == {0, 1, 2}


@pytest.mark.parametrize("ratio", [0.0, 0.2, 2.0])
def test_two_var_ratio_knob(ratio):
    task = AssignAddTask(two_var_ratio=ratio)
    assert task.effective_two_var_ratio == pytest.approx(ratio)
    kinds = torch.cat([task.parse(task.train_batch(s, 512, 0).tokens)["seq_type"] for s in range(40)])
    count = torch.bincount(kinds, minlength=4).tolist()  # zero, left, right, two
    assert count[3] / count[0] == pytest.approx(ratio, rel=0.12, abs=0.01)
    assert count[1] / count[0] == pytest.approx(10 / 12, rel=0.12)  # the other types keep their mix


def test_train_batch_is_a_pure_function_of_seed_and_step(task):
    a, b = task.train_batch(3, 64, seed=5), AssignAddTask().train_batch(3, 64, seed=5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.tokens, task.train_batch(4, 64, seed=5).tokens)
    assert not torch.equal(a.tokens, task.train_batch(3, 64, seed=6).tokens)


def test_library_parse_agrees_with_reference(task, training_sample):
    batch = training_sample[0]
    lib = task.parse(batch.tokens)
    assert torch.equal(lib["label"], batch.labels)
    for i, p in enumerate(read_batch(batch)[:200]):
        assert lib["n1"][i] == p["n1"] and lib["n2"][i] == p["n2"]
        assert lib["n_assignments"][i] == len(p["assignments"])
        if p["left"] is not None:
            assert LETTERS[lib["left_var"][i]] == p["left"]
            assert batch.tokens[i, lib["left_pos"][i]] == p["n1"]
            assert batch.tokens[i, lib["left_pos"][i] - 1] == VAR0 + LETTERS.index(p["left"])
    parsed = task.parse(torch.cat([b.tokens for b in training_sample]))
    assert bool(task.is_training_query(parsed["seq_type"], parsed["left_var"], parsed["right_var"],
                                       parsed["n1"], parsed["n2"]).all())


# ------------------------------------------------------------------- evaluation
def test_nine_pools_with_their_sizes_and_determinism(task):
    pools = task.eval_pools(size=2000, seed=0)
    assert tuple(pools) == POOL_NAMES and len(pools) == 9
    assert all(p.tokens.shape == (2000, 16) and p.labels.shape == (2000,) for p in pools.values())
    again = task.eval_pools(size=2000, seed=0)
    assert all(torch.equal(pools[k].tokens, again[k].tokens) for k in pools)
    other = task.eval_pools(size=2000, seed=1)
    assert not torch.equal(pools["one_var_train"].tokens, other["one_var_train"].tokens)


def test_pools_have_their_properties(task, train_pairs):
    pools = task.eval_pools(size=500, seed=3)
    read_pool = {name: read_batch(batch) for name, batch in pools.items()}
    expected_types = {"zero_var": {"zero"}, "one_var": {"left", "right"}, "two_var": {"two"}}
    for name, parsed in read_pool.items():
        assert {p["type"] for p in parsed} == expected_types[name[:name.index("_var") + 4]], name
        in_train_pairs = [(p["n1"], p["n2"]) in train_pairs for p in parsed]
        at_training_position = [is_training_position(p) for p in parsed]
        if name.endswith("_train"):
            assert all(in_train_pairs) and all(at_training_position), name
        elif name.endswith("add_restricted"):  # held-out pairs, familiar positions
            assert not any(in_train_pairs) and all(at_training_position), name
        else:  # held-out positions, training pairs
            assert all(in_train_pairs) and not any(at_training_position), name

    one = read_pool["one_var_var_restricted"]
    assert {p["left"] for p in one if p["type"] == "left"} == NOT_LEFT
    assert {p["right"] for p in one if p["type"] == "right"} == NOT_RIGHT

    def restricted_operands(p):
        return (p["left"] in NOT_LEFT) + (p["right"] in NOT_RIGHT)

    assert {restricted_operands(p) for p in read_pool["two_var_var_restricted_one"]} == {1}
    assert {restricted_operands(p) for p in read_pool["two_var_var_restricted_two"]} == {2}
    assert {restricted_operands(p) for p in read_pool["two_var_train"]} == {0}


def test_pools_do_not_move_with_the_ratio_knob(task):
    assert torch.equal(AssignAddTask(two_var_ratio=0.0).eval_pool("two_var_train", 100).tokens,
                       task.eval_pool("two_var_train", 100).tokens)


def test_heldout_zero_var_is_exact(task, train_pairs):
    batch = task.heldout_zero_var()
    parsed = read_batch(batch)
    pairs = [(p["n1"], p["n2"]) for p in parsed]
    assert len(pairs) == len(set(pairs)) == 1045
    assert set(pairs) == {(a, b) for a in range(N) for b in range(N)} - train_pairs
    assert {p["type"] for p in parsed} == {"zero"}
    assert torch.equal(batch.tokens, task.heldout_zero_var().tokens)


def test_full_training_fraction_has_empty_heldout_sets():
    full = AssignAddTask(train_fraction=1.0)
    pools = full.eval_pools(size=10)
    assert len(pools["zero_var_add_restricted"].tokens) == 0 and len(pools["one_var_train"].tokens) == 10
    assert len(full.heldout_zero_var().tokens) == 0


# ------------------------------------------------------ building and reading sequences
def test_spec_example_round_trips(task):
    text = "PAD PAD a 40 PAD j 18 PAD PAD PAD k 9 + a 27 ="
    tokens = task.encode(text)
    assert task.decode(tokens) == text
    assert task.parse(tokens)["label"].tolist() == [8]
    assert task.decode(tokens[None]) == [text]


def test_make_batch_controls_operands_and_padding(task):
    batch = task.make_batch(40, 27, left_var="a", n_assignments=3, pads="left", seed=1)
    p = read(batch.tokens[0])
    assert (p["type"], p["left"], p["n1"], p["n2"], p["label"]) == ("left", "a", 40, 27, 8)
    assert batch.tokens[0, :6].tolist() == [PAD] * 6 and len(p["assignments"]) == 3
    right = task.make_batch(torch.arange(5), 3, right_var="k", left_var="c", pads="right", n_assignments=2)
    for i, p in enumerate(read_batch(right)):
        assert (p["left"], p["right"], p["n1"], p["n2"]) == ("c", "k", i, 3)
        assert right.tokens[i, 4:12].tolist() == [PAD] * 8
    single = task.make_batch(torch.zeros(2000, dtype=torch.long), 0, left_var="b", n_assignments=1)
    assert {read(t)["starts"][0][0] for t in single.tokens} == set(range(11))  # 11 layouts of one block
    with pytest.raises(ValueError, match="n_assignments"):
        task.make_batch(1, 2, left_var="a", right_var="b", n_assignments=1)
    with pytest.raises(ValueError, match="differ"):
        task.make_batch(1, 2, left_var="a", right_var="a")
    with pytest.raises(ValueError, match="pads"):
        task.make_batch(1, 2, pads="middle")


def test_spec_is_json_and_tracks_the_knobs(task):
    spec = task.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["modulus"] == 59 and spec["train_fraction"] == 0.7 and spec["two_var_ratio"] is None
    assert AssignAddTask(two_var_ratio=0.2).spec() != spec
    assert AssignAddTask(split_seed=1).spec() != spec


@pytest.mark.parametrize("kwargs, name", [
    ({"train_fraction": 1.5}, "train_fraction"),
    ({"train_fraction": 0}, "train_fraction"),
    ({"train_fraction": 1e-5}, "train_fraction"),
    ({"train_fraction": "0.7"}, "train_fraction"),
    ({"two_var_ratio": -0.1}, "two_var_ratio"),
    ({"two_var_ratio": float("inf")}, "two_var_ratio"),
    ({"split_seed": -1}, "split_seed"),
    ({"split_seed": 1.5}, "split_seed"),
    ({"modulus": 1}, "modulus"),
    ({"modulus": 59.0}, "modulus"),
])
def test_bad_constructor_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AssignAddTask(**kwargs)


def test_bad_call_arguments(task):
    with pytest.raises(ValueError, match="batch_size"):
        task.train_batch(0, 0, 0)
    with pytest.raises(ValueError, match="size"):
        task.eval_pools(size=0)
    with pytest.raises(ValueError, match="name"):
        task.eval_pool("two_var")


def test_returns_batches(task):
    assert isinstance(task.train_batch(0, 4, 0), Batch)
