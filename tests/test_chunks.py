"""Runs trained in chunks of members (parts): same key, same numbers member by member, published once."""
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook import runs
from circuitbook.training import Evaluator
from circuitbook.tasks.modular import ModularAddition
from circuitbook.training import (RunSpec, TrainConfig, best_chunk, choose_chunk, chunk_candidates, events,
                               split_members)
from conftest import assert_same_run, kill_after_checkpoint

TASKS = [ModularAddition(p=11, train_fraction=0.5, split_seed=s) for s in range(4)]
MODEL = cb.ToyConfig(d_vocab=12, n_ctx=3, d_model=16, n_layers=1, n_heads=2, d_mlp=32, d_vocab_out=11)
# one pool per member: a chunk must evaluate each of its members on that member's own pool
EVAL = Evaluator({"test": [t.test for t in TASKS], "train": [t.train for t in TASKS]})
TC = TrainConfig(steps=30, batch_size=16, seeds=(3, 4, 5, 6), lr=3e-3, weight_decay=(0.0, 0.5, 1.0, 2.0),
                 eval_every=5, log_checkpoints=3)


def train_into(store, chunk, **kw):
    return cb.train("t/sweep", MODEL, TASKS, TC, evaluate=EVAL, store=runs.Store(store), chunk=chunk, **kw)


def assert_same(a, b, members_a, members_b, atol=1e-5):
    sa, sb = a.state(), b.state()
    for name in sa:
        assert torch.allclose(sa[name][members_a], sb[name][members_b], atol=atol), name
    ma = a.metrics().query("member in @members_a").reset_index(drop=True)
    mb = b.metrics().query("member in @members_b").reset_index(drop=True)
    pd.testing.assert_frame_equal(ma.drop(columns="member"), mb.drop(columns="member"), atol=atol)


def test_split_run_has_the_whole_runs_key_and_numbers(tmp_path):
    whole = train_into(tmp_path / "whole", "all")
    split = train_into(tmp_path / "split", 2)
    assert split.key == whole.key and split.dir.name == whole.dir.name
    assert split.manifest["parts"] == [[0, 2], [2, 4]] and "parts" not in whole.manifest
    assert split.checkpoint_steps() == whole.checkpoint_steps()
    assert_same(split, whole, [0, 1, 2, 3], [0, 1, 2, 3])
    # per-member pools really differ, so a chunk that used the wrong member's pool would not match
    last = whole.metrics().query("step == 30")
    assert last.acc_train.nunique() > 1
    assert not (split.path / "parts").exists(), "parts are removed once the run is published"
    assert [e["event"] for e in events(split.dir) if e["part"] == "run"] == ["publish"]
    finished = sorted(e["part"] for e in events(split.dir) if e["event"] == "finish")
    assert finished == ["members_00000_00002", "members_00002_00004"]
    # a split run is an ordinary cached run afterwards
    again = train_into(tmp_path / "split", "all")
    assert again.manifest == split.manifest


def test_member_k_of_a_split_run_equals_it_trained_alone(tmp_path):
    split = train_into(tmp_path / "split", 1)
    k = 2
    solo_tc = TrainConfig(steps=30, batch_size=16, seeds=(5,), lr=3e-3, weight_decay=1.0, eval_every=5,
                          log_checkpoints=3)
    solo = cb.train("t/solo", MODEL, TASKS[k], solo_tc, store=runs.Store(tmp_path / "solo"),
                    evaluate=Evaluator({"test": [TASKS[k].test], "train": [TASKS[k].train]}))
    assert_same(split, solo, [k], [0])


def test_fork_of_a_whole_parent_trains_in_parts(tmp_path):
    store = runs.Store(tmp_path / "s")
    parent = cb.train("t/parent", MODEL, TASKS, TC, evaluate=EVAL, store=store, chunk="all")
    tc = TrainConfig(steps=40, batch_size=16, seeds=TC.seeds, lr=1e-3, weight_decay=0.0, eval_every=5, log_checkpoints=2)
    a = cb.train("t/child", MODEL, TASKS, tc, evaluate=EVAL, store=store, fork_from=(parent, 30), chunk=3)
    b = cb.train("t/child", MODEL, TASKS, tc, evaluate=EVAL, store=runs.Store(tmp_path / "s2"),
                 fork_from=(cb.train("t/parent", MODEL, TASKS, TC, evaluate=EVAL, store=runs.Store(tmp_path / "s2"),
                                     chunk="all"), 30), chunk="all")
    assert a.manifest["parts"] == [[0, 2], [2, 4]] and a.key == b.key
    assert_same(a, b, [0, 1, 2, 3], [0, 1, 2, 3])


def test_split_and_candidates_known_answers():
    assert split_members(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert split_members(8, 4) == [(0, 4), (4, 8)]
    assert split_members(5, 1) == [(i, i + 1) for i in range(5)]
    assert split_members(4, 9) == [(0, 4)]
    assert chunk_candidates(8) == [1, 2, 4, 8] and chunk_candidates(6) == [1, 2, 4, 6] and chunk_candidates(1) == [1]


def test_best_chunk_known_answers():
    # compute-bound and slower together (assign_add on a CPU): one member at a time wins
    assert best_chunk(8, 1000, {1: 0.050, 2: 0.110, 4: 0.230, 8: 0.490}, workers=1) == 1
    # overhead-bound (markov on a CPU): the whole ensemble wins
    assert best_chunk(8, 1000, {1: 0.014, 2: 0.020, 4: 0.032, 8: 0.060}, workers=1) == 8
    # the same overhead-bound model on 2 workers: two halves run at once
    assert best_chunk(8, 1000, {1: 0.014, 2: 0.020, 4: 0.032, 8: 0.060}, workers=2, task_overhead_s=3.0) == 4
    # a short run does not pay a remote task's overhead
    assert best_chunk(8, 10, {1: 0.014, 2: 0.020, 4: 0.032, 8: 0.060}, workers=2, task_overhead_s=3.0) == 8
    # a chunk must beat one member at a time by more than SEQUENTIAL_MARGIN (10%): this build's assign_add
    # calibrations (in pairs 0.1869 s against 0.0933 alone, so 0% faster) and markov's in eights (4%) train
    # one at a time; markov in fours (0.0616 against 0.0176 alone, 12.5% faster) trains in fours
    assert best_chunk(8, 1000, {1: 0.0933, 2: 0.1869, 4: 0.3812, 8: 0.9442}) == 1
    assert best_chunk(8, 1000, {1: 0.0176, 8: 0.1354}) == 1
    assert best_chunk(8, 1000, {1: 0.0176, 2: 0.0308, 4: 0.0616, 8: 0.1354}) == 4
    # an exact tie between larger chunks goes to the larger (fewer parts to publish)
    assert best_chunk(4, 100, {1: 0.050, 2: 0.050, 4: 0.100}) == 4
    # every part pays its measured setup: over 100 steps, eight one-member parts at 2 s of setup each lose
    # to one ensemble whether it is 15% or only 2.5% cheaper per member-step; over 10,000 steps setup is
    # noise, and 2.5% is inside the margin
    assert best_chunk(8, 100, {1: 0.0100, 8: 0.0680}, setup_seconds={1: 2.0, 8: 2.5}) == 8
    assert best_chunk(8, 100, {1: 0.0100, 8: 0.0780}, setup_seconds={1: 2.0, 8: 2.5}) == 8
    assert best_chunk(8, 10_000, {1: 0.0100, 8: 0.0780}, setup_seconds={1: 2.0, 8: 2.5}) == 1


def test_calibration_times_steps_and_part_setup():
    """calibrate measures a step and a part's setup at each chunk size, on the device at hand."""
    from circuitbook.training import calibrate

    spec = RunSpec(None, {}, MODEL, TASKS, TrainConfig(steps=10, batch_size=8, seeds=(0, 1, 2, 3)))
    cal = calibrate(spec, [1, 2, 4], torch.device("cpu"), repeats=2)
    assert set(cal.step_s) == set(cal.setup_s) == {1, 2, 4}
    assert all(0 < t < 5 for t in cal.step_s.values()) and all(0 <= t < 30 for t in cal.setup_s.values())


@pytest.mark.parametrize("bad", [0, -1, "some", "1.5", 2.0, True])
def test_bad_chunk_is_refused_before_compute(tmp_path, bad):
    with pytest.raises(ValueError, match="chunk=.*'auto', 'all' or an integer >= 1"):
        train_into(tmp_path / "s", bad)
    assert not list((tmp_path / "s").glob("t/sweep/*/ckpt"))


def test_auto_chunk_keeps_short_runs_and_dropout_whole(tmp_path, monkeypatch):
    rundir = runs.Store(tmp_path).run_dir("t/x", {"a": 1})
    spec = RunSpec(rundir, {}, MODEL, TASKS, TC)
    assert choose_chunk(spec, "auto") == 4  # 30 steps of a tiny model: far below a minute
    assert choose_chunk(spec, 3) == 3 and choose_chunk(spec, 99) == 4
    monkeypatch.setenv("CIRCUITBOOK_CHUNK", "2")
    assert choose_chunk(spec) == 2
    monkeypatch.setattr(sys.modules["circuitbook.training.chunks"], "MIN_CALIBRATED_RUN_S", 0.0)
    monkeypatch.setattr(sys.modules["circuitbook.training.chunks"], "MIN_CALIBRATED_STEPS", 0)
    monkeypatch.setenv("CIRCUITBOOK_CHUNK", "auto")
    dropout = RunSpec(rundir, {}, cb.ToyConfig(**{**MODEL.to_dict(), "dropout": 0.1}), TASKS, TC)
    assert choose_chunk(dropout) == 4, "members sharing one random stream are never split"
    assert choose_chunk(spec) in (1, 2, 4)  # measured: any candidate, but it must measure without error


KILL_SCRIPT = textwrap.dedent("""
    import sys
    import circuitbook as cb
    from circuitbook.training import Evaluator
    from circuitbook.tasks.modular import ModularAddition
    tasks = [ModularAddition(p=23, train_fraction=0.5, split_seed=s) for s in (0, 1)]
    cfg = cb.ToyConfig(d_vocab=24, n_ctx=3, d_model=32, n_layers=1, n_heads=2, d_mlp=64, d_vocab_out=23)
    tc = cb.TrainConfig(steps=240, batch_size=64, seeds=(0, 1), lr=3e-3, weight_decay=(0.1, 1.0), eval_every=10,
                        checkpoint_every=40, log_checkpoints=4)
    cb.train("t/kill", cfg, tasks, tc, evaluate=Evaluator({"test": [t.test for t in tasks]}), chunk=1)
""")


@pytest.mark.slow
def test_sigkill_of_a_part_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "CIRCUITBOOK_PROGRESS": "0"}

    def run(store, kill=False):
        env["CIRCUITBOOK_RUNS"] = str(store)
        proc = subprocess.Popen([sys.executable, str(script)], env=env)
        if kill:
            kill_after_checkpoint(proc, store, "t/kill/*/parts/members_00001_00002/ckpt/step_*.json", 40, timeout=300)
            assert not list(store.glob("t/kill/*/manifest.json")), "a partial run is never published"
        else:
            assert proc.wait() == 0

    killed, clean = tmp_path / "killed", tmp_path / "clean"
    run(killed, kill=True)
    run(killed)
    run(clean)
    a = assert_same_run(killed, clean)
    kinds = [(e["part"], e["event"]) for e in events(a.dir)]
    assert kinds.count(("members_00000_00001", "finish")) == 1 and kinds.count(("members_00001_00002", "finish")) == 1
    assert ("members_00001_00002", "resume") in kinds, "the killed part resumed from its checkpoint"
    assert kinds.count(("run", "publish")) == 1
