"""The training loop: ensembles equal separate runs, per-member settings, resume, forks."""
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook.tasks.base import FixedDataset
from circuitbook.tasks.modular import ModularAddition
from circuitbook.training import Optimizer, TrainConfig, per_member_loss
from conftest import assert_same_run, kill_after_checkpoint

TASK = ModularAddition(p=11, train_fraction=0.5)
MODEL = cb.ToyConfig(d_vocab=12, n_ctx=3, d_model=16, n_layers=1, n_heads=2, d_mlp=32, d_vocab_out=11)
EVAL = cb.pool_accuracy({"train": TASK.train, "test": TASK.test})


def short(**kw):
    base = dict(steps=20, batch_size=16, seeds=(0,), lr=3e-3, weight_decay=0.5, eval_every=5, log_checkpoints=3)
    return TrainConfig(**{**base, **kw})


def test_ensemble_members_equal_separate_runs(runs_dir):
    ens = cb.train("t/ens", MODEL, TASK, short(seeds=(0, 1, 2), weight_decay=(0.0, 0.5, 2.0)), evaluate=EVAL)
    for k, (seed, wd) in enumerate([(0, 0.0), (1, 0.5), (2, 2.0)]):
        solo = cb.train("t/solo", MODEL, TASK, short(seeds=(seed,), weight_decay=wd), evaluate=EVAL)
        a, b = ens.state(), solo.state()
        for name in a:
            assert torch.allclose(a[name][k], b[name][0], atol=1e-5), (k, name)
        ma = ens.metrics().query("member == @k").drop(columns="member").reset_index(drop=True)
        mb = solo.metrics().drop(columns="member").reset_index(drop=True)
        pd.testing.assert_frame_equal(ma, mb, atol=1e-5)


def test_members_differ_and_learn(runs_dir):
    run = cb.train("t/learn", MODEL, TASK, short(seeds=(0, 1), steps=150, batch_size=64), evaluate=EVAL)
    m = run.metrics()
    first, last = m[m.step == 0], m[m.step == 150]
    assert (last.acc_train.values > first.acc_train.values + 0.3).all()
    s = run.state()
    assert not torch.allclose(s["embed.W_E"][0], s["embed.W_E"][1])


def test_adamw_matches_torch_per_member():
    """The stacked optimizer equals torch.optim.AdamW run on each member separately."""
    torch.manual_seed(0)
    w = torch.randn(3, 4, 5)
    grads = [torch.randn(3, 4, 5) for _ in range(4)]
    lrs, wds = (1e-2, 3e-2, 1e-3), (0.0, 0.1, 1.0)
    stacked = {"w": w.clone().requires_grad_(True)}
    opt = Optimizer(stacked, {"w"}, TrainConfig(steps=1, batch_size=1, seeds=(0, 1, 2), lr=lrs, weight_decay=wds))
    refs = []
    for k in range(3):
        p = torch.nn.Parameter(w[k].clone())
        refs.append((p, torch.optim.AdamW([p], lr=lrs[k], weight_decay=wds[k])))
    for g in grads:
        stacked["w"].grad = g.clone()
        opt.step()
        for k, (p, o) in enumerate(refs):
            p.grad = g[k].clone()
            o.step()
    for k, (p, _) in enumerate(refs):
        assert torch.allclose(stacked["w"][k], p, atol=1e-6)


def test_next_token_loss_ignores_masked_labels():
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[1, 2, -100, -100], [0, -100, 3, 4]])
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert torch.allclose(per_member_loss(logits, labels, "next_token"), ref)


def test_per_member_data(runs_dir):
    """One task per member: each member trains on its own data."""
    tasks = [ModularAddition(p=11, train_fraction=0.3, split_seed=s) for s in (0, 1)]
    run = cb.train("t/data", MODEL, tasks, short(seeds=(0, 1)))
    solo = cb.train("t/data1", MODEL, tasks[1], short(seeds=(1,)))
    assert torch.allclose(run.state()["unembed.W_U"][1], solo.state()["unembed.W_U"][0], atol=1e-5)


def test_cached_run_is_reused_and_changed_config_is_not(runs_dir, capsys):
    a = cb.train("t/cache", MODEL, TASK, short())
    b = cb.train("t/cache", MODEL, TASK, short())
    assert a.key == b.key and "cached run" in capsys.readouterr().out
    c = cb.train("t/cache", MODEL, TASK, short(lr=1e-3))
    assert c.key != a.key


def test_checkpoints_log_spaced_and_regular():
    tc = short(steps=1000, log_checkpoints=4, checkpoint_every=250)
    assert tc.checkpoint_steps() == [0, 6, 32, 178, 250, 500, 750, 1000]


def test_models_at_checkpoints(runs_dir):
    run = cb.train("t/ckpt", MODEL, TASK, short())
    steps = run.checkpoint_steps()
    assert steps[0] == 0 and steps[-1] == 20
    m0, m20 = run.model(0, step=0), run.model(0)
    assert torch.equal(m0.W_E, cb.ToyTransformer(MODEL, seed=0).W_E)
    assert not torch.equal(m0.W_E, m20.W_E)
    with pytest.raises(ValueError, match="not a checkpoint"):
        run.model(0, step=9)
    with pytest.raises(ValueError, match="member"):
        run.model(5)


def test_fork_continues_from_parent_checkpoint(runs_dir):
    parent = cb.train("t/parent", MODEL, TASK, short(steps=20))
    step = parent.checkpoint_steps()[2]
    child = cb.train("t/child", MODEL, TASK, short(steps=30, weight_decay=0.0), fork_from=(parent, step))
    m = child.metrics()
    assert m.step.min() == step and m.step.max() == 30
    assert child.checkpoint_steps()[0] == step
    assert torch.equal(child.state(step)["embed.W_E"], parent.state(step)["embed.W_E"])


@pytest.mark.parametrize("kw, field", [
    (dict(steps=0), "steps"), (dict(optimizer="lion"), "optimizer"), (dict(lr=-1.0), "lr"),
    (dict(seeds=(0, 0)), "seeds"), (dict(weight_decay=(0.1, 0.2)), "weight_decay"), (dict(eval_every=0), "eval_every"),
])
def test_bad_train_config(kw, field):
    with pytest.raises(ValueError, match=field):
        short(**kw)


def test_bad_task_count(runs_dir):
    with pytest.raises(ValueError, match="task"):
        cb.train("t/bad", MODEL, [TASK, TASK, TASK], short(seeds=(0, 1)))


def test_fixed_dataset_epochs_cover_every_example_once():
    tokens = torch.arange(10).unsqueeze(1).repeat(1, 3)
    data = FixedDataset(tokens, torch.arange(10), vocab_size=10, n_outputs=10)
    seen = torch.cat([data.train_batch(s, 4, seed=0).labels for s in range(3)])
    assert sorted(seen.tolist()) == list(range(10))
    assert torch.equal(data.train_batch(1, 4, 0).labels, data.train_batch(1, 4, 0).labels)
    assert data.train_batch(0, 100, 0).labels.numel() == 10  # full batch


KILL_SCRIPT = textwrap.dedent("""
    import sys, circuitbook as cb
    from circuitbook.tasks.modular import ModularAddition
    task = ModularAddition(p=23, train_fraction=0.5)
    cfg = cb.ToyConfig(d_vocab=24, n_ctx=3, d_model=32, n_layers=1, n_heads=2, d_mlp=64, d_vocab_out=23)
    tc = cb.TrainConfig(steps=int(sys.argv[1]), batch_size=64, seeds=(0, 1), lr=3e-3, weight_decay=(0.1, 1.0),
                        eval_every=10, checkpoint_every=40, log_checkpoints=4)
    cb.train("t/kill", cfg, task, tc, evaluate=cb.pool_accuracy({"test": task.test}))
""")


def test_sigkill_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
    """Kill a run with SIGKILL after its first checkpoint; rerun: same final metrics and weights, exactly."""
    steps = 240
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "CIRCUITBOOK_PROGRESS": "0"}

    def run(store, wait_for_kill=False):
        env["CIRCUITBOOK_RUNS"] = str(store)
        proc = subprocess.Popen([sys.executable, str(script), str(steps)], env=env)
        if wait_for_kill:
            kill_after_checkpoint(proc, store, "t/kill/*/ckpt/step_*.json", 40, timeout=120)
            assert not list(store.glob("t/kill/*/manifest.json"))
        else:
            assert proc.wait() == 0

    killed, clean = tmp_path / "killed", tmp_path / "clean"
    run(killed, wait_for_kill=True)
    run(killed)  # resumes
    run(clean)
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(killed))
    a = assert_same_run(killed, clean)
    assert a.metrics().step.max() == steps and a.metrics().groupby(["step", "member"]).size().max() == 1


def test_device_choice(monkeypatch):
    from circuitbook.training import default_device

    monkeypatch.setenv("CIRCUITBOOK_DEVICE", "cpu")
    assert default_device() == torch.device("cpu")
    assert default_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'gpu0' is not a torch device"):
        default_device("gpu0")


def test_ensemble_logits_follow_the_tokens_device():
    from circuitbook.training import Ensemble

    ens = Ensemble(MODEL, (0, 1), device="cpu")
    out = ens.logits(TASK.test.tokens[:5])
    assert out.shape == (2, 5, 3, 11) and out.device == TASK.test.tokens.device


# ---------------------------------------------------------------- any model class, micro-batches, precision

def test_micro_batches_give_the_full_batch_step(runs_dir):
    """Gradient accumulation over slices is one optimizer step on the whole batch.

    Plain SGD: Adam would turn the rounding noise of a gradient that is exactly zero in theory
    (the key bias) into full-size steps, which says nothing about the accumulation."""
    kw = dict(batch_size=24, weight_decay=0.0, optimizer="sgd", lr=0.1)
    whole = cb.train("t/whole", MODEL, TASK, short(**kw))
    sliced = cb.train("t/sliced", MODEL, TASK, short(**kw, micro_batch_size=7))
    assert whole.key != sliced.key
    for name, w in whole.state().items():
        assert torch.allclose(w, sliced.state()[name], atol=2e-5), name
    pd.testing.assert_series_equal(whole.metrics().train_loss, sliced.metrics().train_loss, atol=1e-5)


def test_micro_batches_weight_next_token_slices_by_scored_labels(runs_dir):
    """Slices with different numbers of scored (non-ignored) labels are weighted by their counts."""
    from circuitbook.training import Ensemble, accumulate_gradients

    tokens = torch.randint(0, 12, (1, 6, 3))
    labels = torch.randint(0, 11, (1, 6, 3))
    labels[0, :2, :2] = -100  # the first slice scores fewer labels
    cfg = TrainConfig(steps=1, batch_size=6, micro_batch_size=2)
    grads = []
    for tc in (TrainConfig(steps=1, batch_size=6), cfg):
        ens = Ensemble(MODEL, (0,))
        loss = accumulate_gradients(ens, tokens, labels, "next_token", tc)
        grads.append((loss, {n: p.grad.clone() for n, p in ens.params.items() if p.grad is not None}))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    for n in grads[0][1]:
        assert torch.allclose(grads[0][1][n], grads[1][1][n], atol=1e-6), n


def test_bf16_autocast_agrees_with_fp32(runs_dir):
    """precision="bf16" (autocast) trains the same model within bf16's resolution on this task."""
    a = cb.train("t/fp32", MODEL, TASK, short(steps=60, batch_size=32), evaluate=EVAL)
    b = cb.train("t/bf16", MODEL, TASK, short(steps=60, batch_size=32, precision="bf16"), evaluate=EVAL)
    la, lb = a.metrics().train_loss.to_numpy()[1:], b.metrics().train_loss.to_numpy()[1:]
    # stated tolerance: 3% relative on every logged loss over 60 steps (bf16 has an 8-bit mantissa)
    assert abs(lb - la).max() / abs(la).max() < 0.03, (la, lb)
    assert not (la == lb).all(), "bf16 must actually change the arithmetic"
    with pytest.raises(ValueError, match="precision"):
        short(precision="fp16")


class _Noisy(torch.nn.Module):
    """A tiny registered model with dropout: members must draw their own masks in training."""

    def __init__(self, cfg, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_out, generator=g) * 0.1)
        self.drop = torch.nn.Dropout(cfg.p)

    def forward(self, tokens, last_only=False):
        out = self.drop(torch.nn.functional.embedding(tokens, self.W))
        return out[:, -1:] if last_only else out

    def trainable_names(self):
        return ["W"]


from dataclasses import asdict, dataclass  # noqa: E402

from circuitbook.models import register_model  # noqa: E402


@register_model
@dataclass(frozen=True)
class NoisyConfig:
    d_vocab: int = 12
    d_out: int = 11
    p: float = 0.5

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    def build(self, seed=0):
        return _Noisy(self, 0 if seed is None else seed)


def test_any_registered_model_trains_and_reloads(runs_dir):
    cfg = NoisyConfig()
    run = cb.train("t/noisy", cfg, TASK, short(seeds=(0, 1)), evaluate=EVAL)
    assert run.model_config == cfg and isinstance(run.model(1), _Noisy)
    assert torch.equal(run.model(1).W, run.state()["W"][1])


def test_dropout_masks_differ_between_members_in_training_and_are_off_in_evaluation():
    from circuitbook.training import Ensemble

    ens = Ensemble(NoisyConfig(), (0, 0))  # two members with identical weights
    tokens = torch.randint(0, 12, (64, 3))
    train_out = ens.logits(tokens, training=True)
    assert not torch.equal(train_out[0], train_out[1]), "each member draws its own dropout mask"
    eval_out = ens.logits(tokens)
    assert torch.equal(eval_out[0], eval_out[1]), "no dropout in evaluation"
    with pytest.raises(TypeError, match="not a registered model config"):
        from circuitbook.models import config_to_dict

        config_to_dict(object())


def test_the_model_class_module_is_part_of_the_code_version(runs_dir):
    """Editing the module that defines a (non-toy) model must retrain its runs."""
    from circuitbook import runs
    from circuitbook.models import onehot

    cfg = next(v for v in vars(onehot).values()
               if isinstance(v, type) and hasattr(v, "build") and v.__module__ == onehot.__name__)
    files = runs._package_sources(cfg.__new__(cfg))
    assert [f.name for f in files] == ["onehot.py"]
