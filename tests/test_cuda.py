"""The training paths on a CUDA GPU, and the decisions that keep them equal to the CPU's.

Tests marked `cuda` need a CUDA GPU and are skipped without one (conftest.py); scripts/device-run.sh runs
them there (`pytest -m cuda tests/test_cuda.py`). Most are parametrized over devices, so that the same
assertions also run on the CPU here and in CI. Decisions (training.device.device_policy): fp32 matrix products in
full fp32 (no TF32), deterministic algorithms on CUDA (scatter-adds in the backward of gathers and
embeddings take their deterministic kernels), the GPU's random state in checkpoints, cosines in float64.
"""
import os
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook import runs
from circuitbook.models.onehot import OneHotConfig
from circuitbook.tasks.base import Batch, step_generator
from circuitbook.tasks.modular import ModularAddition
from circuitbook.training import Ensemble, RunSpec, TrainConfig, calibrate, choose_chunk, chunk_candidates
from circuitbook.training.device import device_policy
from conftest import assert_same_run, kill_after_checkpoint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
TASK = ModularAddition(p=23, train_fraction=0.5)
MODEL = cb.ToyConfig(d_vocab=24, n_ctx=3, d_model=32, n_layers=1, n_heads=2, d_mlp=64, d_vocab_out=23)
EVAL = cb.pool_accuracy({"train": TASK.train, "test": TASK.test})
# A CUDA run and a CPU run round differently (reduction order); Adam's normalised step lets that drift grow
# a little with steps. These are the tolerances benchmarks/ensemble.py states for batched vs single matmuls.
TOLERANCE = {"weight": 1e-2, "loss": 1e-4}


def short(**kw):
    base = dict(steps=60, batch_size=64, seeds=(0, 1), lr=3e-3, weight_decay=(0.1, 1.0), eval_every=10,
                log_checkpoints=3)
    return TrainConfig(**{**base, **kw})


def train_on(device, store, tc=None, model=MODEL, task=TASK, name="t/cuda", **kw):
    return cb.train(name, model, task, tc or short(), evaluate=EVAL if task is TASK else None,
                    store=runs.Store(store), device=device, **kw)


def max_weight_diff(a, b) -> float:
    sa, sb = a.state(), b.state()
    return max((sa[n] - sb[n]).abs().max().item() for n in sa)


def final_losses(run) -> list[float]:
    m = run.metrics()
    return m[m.step == m.step.max()].sort_values("member").train_loss.tolist()


@pytest.mark.cuda
def test_a_run_trained_on_cuda_matches_the_cpu_run(tmp_path):
    gpu, cpu = train_on("cuda", tmp_path / "gpu"), train_on("cpu", tmp_path / "cpu")
    assert gpu.key == cpu.key, "the device is not part of the run key"
    assert max_weight_diff(gpu, cpu) <= TOLERANCE["weight"]
    assert max(abs(a - b) for a, b in zip(final_losses(gpu), final_losses(cpu))) <= TOLERANCE["loss"]
    acc = [r.metrics().query("step == 60").sort_values("member").acc_train.tolist() for r in (gpu, cpu)]
    assert acc[0] == pytest.approx(acc[1], abs=1 / len(TASK.train.labels) + 1e-9), "at most one example apart"


@pytest.mark.parametrize("device", DEVICES)
def test_training_twice_gives_the_same_numbers_bit_for_bit(tmp_path, device):
    """The one-hot model's scores gather entries of W; their backward is a scatter-add, deterministic here."""
    task = NextToken(vocab=40, seq_len=12)
    model = OneHotConfig(d_vocab=40, n_ctx=12, n_layers=2, init_std=0.02)
    tc = TrainConfig(steps=15, batch_size=32, seeds=(0, 1), lr=0.05, optimizer="sgd", eval_every=5, log_checkpoints=0)
    a = train_on(device, tmp_path / "a", tc, model, task, name="t/onehot")
    b = train_on(device, tmp_path / "b", tc, model, task, name="t/onehot")
    for name, t in a.state().items():
        assert torch.equal(t, b.state()[name]), name
    pd.testing.assert_frame_equal(a.metrics(), b.metrics(), check_exact=True)


class NextToken:
    """Random tokens, next-token loss: a batch is a pure function of (seed, step)."""

    loss = "next_token"

    def __init__(self, vocab: int, seq_len: int):
        self.vocab, self.seq_len = vocab, seq_len

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        seq = torch.randint(self.vocab, (batch_size, self.seq_len + 1), generator=step_generator(seed, step))
        return Batch(seq[:, :-1], seq[:, 1:])

    def spec(self) -> dict:
        return {"task": "next_token_random", "vocab": self.vocab, "seq_len": self.seq_len}


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_trains_and_stays_near_fp32(tmp_path, device):
    # 150 steps: a single batch's loss is noisy, so learning is judged on the mean of the last evaluations
    bf16 = train_on(device, tmp_path / "bf16", short(precision="bf16", steps=150))
    fp32 = train_on(device, tmp_path / "fp32", short(steps=150))
    assert bf16.key != fp32.key, "precision is part of the run key"
    first = bf16.metrics().query("step == 0").train_loss
    assert (first.isna() | (first > 0)).all()
    lb, lf = final_losses(bf16), final_losses(fp32)
    curves = bf16.metrics().pivot(index="step", columns="member", values="train_loss")
    assert (curves.iloc[-3:].mean() < curves.loc[10]).all(), "it learns"
    # bf16 keeps 8 bits of mantissa in the products; the loss is computed in fp32 (summed_loss casts)
    assert max(abs(b - f) for b, f in zip(lb, lf)) <= 0.05 * max(lf) + 0.02
    ens, tokens = Ensemble(MODEL, (0, 1), device=device), TASK.train.tokens[:64].to(device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        low = ens.logits(tokens, last_only=True).float()
    full = ens.logits(tokens, last_only=True)
    assert 0 < (low - full).abs().max() < 0.05, "the products ran in bf16, and close to fp32"


@pytest.mark.parametrize("device", DEVICES)
def test_the_ensemble_under_vmap_equals_its_members_one_by_one(device):
    ens = Ensemble(MODEL, (0, 1, 2), device=device)
    tokens = TASK.test.tokens[:50]
    together = ens.logits(tokens)
    assert together.device == tokens.device, "logits come back where the tokens were"
    for k in range(3):
        member = ens.member(k).to(device)
        alone = member(tokens.to(device)).cpu()
        assert torch.allclose(together[k], alone, atol=1e-5), k
    cpu = Ensemble(MODEL, (0, 1, 2)).logits(tokens)
    assert torch.allclose(together, cpu, atol=1e-4), "the same weights on either device"


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_calibration_and_chunked_training(tmp_path, device, monkeypatch):
    tc = short(seeds=(0, 1, 2, 3), weight_decay=0.1)
    spec = RunSpec(None, {}, MODEL, [TASK] * 4, tc)
    cal = calibrate(spec, chunk_candidates(4), torch.device(device), repeats=2)
    assert set(cal.step_s) == {1, 2, 4} and all(0 < t < 10 for t in cal.step_s.values())
    assert all(s >= 0 for s in cal.setup_s.values())
    monkeypatch.delenv("CIRCUITBOOK_CHUNK", raising=False)
    assert choose_chunk(spec, "auto", torch.device(device)) == 4, "a one-second run is not worth calibrating"
    whole = train_on(device, tmp_path / "whole", tc, chunk="all")
    parts = train_on(device, tmp_path / "parts", tc, chunk=2)
    assert parts.manifest["parts"] == [[0, 2], [2, 4]] and parts.key == whole.key
    assert max_weight_diff(parts, whole) <= TOLERANCE["weight"]


KILL_SCRIPT = textwrap.dedent("""
    import sys, circuitbook as cb
    from circuitbook.tasks.modular import ModularAddition
    task = ModularAddition(p=23, train_fraction=0.5)
    cfg = cb.ToyConfig(d_vocab=24, n_ctx=3, d_model=32, n_layers=1, n_heads=2, d_mlp=64, d_vocab_out=23, dropout=0.1)
    tc = cb.TrainConfig(steps=int(sys.argv[1]), batch_size=64, seeds=(0, 1), lr=3e-3, weight_decay=(0.1, 1.0),
                        eval_every=10, checkpoint_every=40, log_checkpoints=4)
    cb.train("t/kill", cfg, task, tc, evaluate=cb.pool_accuracy({"test": task.test}), device=sys.argv[2])
""")


@pytest.mark.parametrize("device", DEVICES)
def test_resume_after_a_kill_equals_the_uninterrupted_run(tmp_path, monkeypatch, device):
    """With dropout, so the resumed run needs the random state of the device it trains on too."""
    steps = 240
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "CIRCUITBOOK_PROGRESS": "0"}

    def run(store, wait_for_kill=False):
        env["CIRCUITBOOK_RUNS"] = str(store)
        proc = subprocess.Popen([sys.executable, str(script), str(steps), device], env=env)
        if wait_for_kill:
            kill_after_checkpoint(proc, store, "t/kill/*/ckpt/step_*.json", 40, timeout=300)
        else:
            assert proc.wait() == 0

    killed, clean = tmp_path / "killed", tmp_path / "clean"
    run(killed, wait_for_kill=True)
    run(killed)  # resumes
    run(clean)
    assert_same_run(killed, clean)


def test_device_policy_on_cuda_and_its_restoration():
    """The settings device_policy makes for a CUDA device (set and restored without touching a GPU)."""
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8"), "set before cuBLAS starts"
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())
    torch.set_float32_matmul_precision("high")  # as a notebook or library might
    try:
        with device_policy(torch.device("cuda")):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled(), "an op without a deterministic kernel warns"
            assert torch.get_float32_matmul_precision() == "highest", "no TF32 in fp32 training"
        assert not torch.are_deterministic_algorithms_enabled() or before[0]
        assert torch.get_float32_matmul_precision() == "high", "restored"
        with device_policy(torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == "high", "a CPU is left as it is"
    finally:
        torch.set_float32_matmul_precision(before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_cosines_are_float64_whatever_the_dtype_of_their_inputs(device):
    from circuitbook.analysis import attention, compare, leading_terms, representations

    g = torch.Generator().manual_seed(0)
    a64, b64 = torch.randn(20, 20, generator=g, dtype=torch.float64), torch.randn(20, 20, generator=g, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = a64.to(device=device, dtype=dtype), b64.to(device=device, dtype=dtype)
        ra, rb = a.double().cpu(), b.double().cpu()  # the rounded inputs, exactly
        assert compare.matrix_cosine(a, b) == pytest.approx(compare.matrix_cosine(ra, rb), abs=1e-12)
        assert leading_terms.cosine(a, b) == pytest.approx(leading_terms.cosine(ra, rb), abs=1e-12)
        assert attention.template_cosine(a, b) == pytest.approx(attention.template_cosine(ra, rb), abs=1e-12)
        assert attention.template_cosine(a) == pytest.approx(attention.template_cosine(ra), abs=1e-12)
        paired = representations.paired_cosines(a.cpu(), b.cpu())
        assert paired["matched"].dtype == torch.float64


def test_no_new_run_starts_after_the_deadline(tmp_path, monkeypatch):
    from circuitbook.training.runner import DEADLINE_ENV, BudgetExhausted

    done = train_on("cpu", tmp_path, short(steps=5))
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() - 1))
    again = train_on("cpu", tmp_path, short(steps=5))  # a cached run still loads
    assert again.key == done.key
    with pytest.raises(BudgetExhausted, match="before run t/cuda started; stopped between runs"):
        train_on("cpu", tmp_path, short(steps=6))
    assert not list((tmp_path / "t" / "cuda").glob("*/metrics.jsonl"))[1:], "nothing half-trained"
    monkeypatch.setenv(DEADLINE_ENV, "soon")
    with pytest.raises(ValueError, match="is not a unix time"):
        train_on("cpu", tmp_path, short(steps=7))


def test_a_dropout_run_repeats_in_another_process_and_leaves_the_callers_generator(tmp_path):
    """torch seeds its generator at random in each process: a run draws from its own stream instead."""
    script = tmp_path / "drop.py"
    script.write_text(KILL_SCRIPT.replace('"t/kill"', '"t/drop"'))
    env = {**os.environ, "CIRCUITBOOK_PROGRESS": "0"}
    for store in ("one", "two"):
        subprocess.run([sys.executable, str(script), "20", "cpu"], env={**env, "CIRCUITBOOK_RUNS": str(tmp_path / store)},
                       check=True, capture_output=True)
    (a,), (b,) = ([cb.Run(runs.RunDir(p, "t/drop", p.name)) for p in (tmp_path / s).glob("t/drop/*")]
                  for s in ("one", "two"))
    pd.testing.assert_frame_equal(a.metrics(), b.metrics(), check_exact=True)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    model = cb.ToyConfig(**{**MODEL.to_dict(), "dropout": 0.1})
    train_on("cpu", tmp_path / "here", short(steps=5), model=model)
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- the captured step (training.capture)
# A step replayed from one CUDA graph runs the eager step's kernels in the eager step's order on the same
# inputs (the batch from the same device counter, dropout from the same generator, Adam's corrections from the
# same device count), so the two runs should agree to the last bit; the stated tolerance allows for a
# kernel that picks its algorithm at launch. Tests whose names hold "captured" decide whether a GPU visit
# trains with the captured step (circuitbook.visit.captured_step_verified).
CAPTURE_TOLERANCE = {"weight": 1e-6, "loss": 1e-6}
DROPOUT_MODEL = cb.ToyConfig(**{**MODEL.to_dict(), "dropout": 0.1})


def _train_with_capture(monkeypatch, store, capture: str, **kw):
    monkeypatch.setenv("CIRCUITBOOK_CAPTURE", capture)
    return train_on("cuda", store, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", [MODEL, DROPOUT_MODEL], ids=["plain", "dropout"])
def test_captured_steps_equal_eager_steps(tmp_path, monkeypatch, precision, model):
    from circuitbook.training import capture

    replays = []
    real_call = capture.GraphStep.__call__
    monkeypatch.setattr(capture.GraphStep, "__call__", lambda self, step: replays.append(step) or real_call(self, step))
    tc = short(precision=precision, steps=80)
    eager = _train_with_capture(monkeypatch, tmp_path / "eager", "0", tc=tc, model=model)
    assert not replays, "CIRCUITBOOK_CAPTURE=0: eager"
    captured = _train_with_capture(monkeypatch, tmp_path / "captured", "1", tc=tc, model=model)
    assert replays == list(range(80)), "every step replayed, in order"
    assert captured.key == eager.key, "how the step is taken is not part of the run key"
    assert max_weight_diff(captured, eager) <= CAPTURE_TOLERANCE["weight"]
    a, b = captured.metrics(), eager.metrics()
    assert (a.train_loss - b.train_loss).abs().max() <= CAPTURE_TOLERANCE["loss"]
    assert a.filter(like="acc_").equals(b.filter(like="acc_")), "the evaluations agree"


@pytest.mark.cuda
def test_captured_run_resumes_after_a_kill_to_the_uninterrupted_captured_run(tmp_path):
    steps = 240
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "CIRCUITBOOK_PROGRESS": "0", "CIRCUITBOOK_CAPTURE": "1"}

    def run(store, wait_for_kill=False):
        env["CIRCUITBOOK_RUNS"] = str(store)
        proc = subprocess.Popen([sys.executable, str(script), str(steps), "cuda"], env=env)
        if wait_for_kill:
            kill_after_checkpoint(proc, store, "t/kill/*/ckpt/step_*.json", 40, timeout=300)
        else:
            assert proc.wait() == 0

    killed, clean = tmp_path / "killed", tmp_path / "clean"
    run(killed, wait_for_kill=True)
    run(killed)  # resumes, captures again from the checkpoint's state
    run(clean)
    assert_same_run(killed, clean)


def test_the_captured_step_is_chosen_only_on_cuda_with_the_setting(monkeypatch):
    from circuitbook.training.capture import capture_choice

    monkeypatch.setenv("CIRCUITBOOK_CAPTURE", "1")
    assert capture_choice(torch.device("cpu")) == (False, "eager step (no CUDA graphs on a CPU)")
    assert capture_choice(torch.device("cuda"))[0]
    monkeypatch.setenv("CIRCUITBOOK_CAPTURE", "0")
    ok, why = capture_choice(torch.device("cuda"))
    assert not ok and "a GPU visit sets it once the captured step's CUDA tests pass" in why
    monkeypatch.delenv("CIRCUITBOOK_CAPTURE")
    assert not capture_choice(torch.device("cuda"))[0], "eager unless a visit verified it"


def test_a_visit_captures_only_where_its_captured_tests_passed(tmp_path):
    from circuitbook.visit import captured_step_verified

    def report(cases):
        path = tmp_path / "report.xml"
        path.write_text("<testsuites><testsuite>" + "".join(cases) + "</testsuite></testsuites>")
        return captured_step_verified(path)
    passed = '<testcase classname="t" name="test_captured_steps_equal_eager_steps[plain]"/>'
    failed = ('<testcase classname="t" name="test_captured_run_resumes"><failure message="x"/></testcase>')
    skipped = '<testcase classname="t" name="test_captured_x"><skipped message="no GPU"/></testcase>'
    assert report([passed]) == (True, "1 CUDA tests of the captured step passed on this machine")
    assert report([passed, failed]) == (False, "CUDA tests of the captured step failed here: test_captured_run_resumes")
    assert report([skipped]) == (False, "no CUDA test of the captured step ran here")
    assert captured_step_verified(tmp_path / "missing.xml")[0] is False


@pytest.mark.parametrize("model", [MODEL, DROPOUT_MODEL], ids=["plain", "dropout"])
def test_the_body_a_graph_captures_takes_the_eager_steps_on_a_cpu(model):
    """What GraphStep records (its batch from a device step counter, Adam's count on the device), run
    uncaptured on the CPU, equals the eager steps bit for bit: only the replaying is left to the GPU tests."""
    from circuitbook.training.capture import EagerStep, GraphStep
    from circuitbook.training.ensemble import Optimizer, data_sampler

    tc = short(steps=12)

    def runner(kind):
        ens = Ensemble(model, tc.seeds)
        opt = Optimizer(ens.params, ens.trainable, tc)
        return kind(ens, opt, data_sampler([TASK] * 2, tc.seeds), TASK.loss, tc)
    eager, body = runner(EagerStep), runner(GraphStep)
    torch.manual_seed(3)
    losses_eager = [eager(step) for step in range(12)]
    torch.manual_seed(3)
    body.step_t.fill_(0)
    losses_body = [body._body() for _ in range(12)]
    assert int(body.step_t) == 12 and body.opt.t == eager.opt.t == 12
    for a, b in zip(losses_eager, losses_body):
        assert torch.equal(a, b)
    for name, p in eager.ens.params.items():
        assert torch.equal(p, body.ens.params[name]), name
