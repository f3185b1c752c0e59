"""The artifact store: keys, atomic writes, damaged runs detected and recomputed."""
import json

import pytest
import torch

import circuitbook as cb
from circuitbook import runs
from circuitbook.tasks.modular import ModularAddition

TASK = ModularAddition(p=7, train_fraction=0.5)
MODEL = cb.ToyConfig(d_vocab=8, n_ctx=3, d_model=8, n_layers=1, n_heads=1, d_mlp=8, d_vocab_out=7)
TC = cb.TrainConfig(steps=12, batch_size=8, seeds=(0, 1), eval_every=4, log_checkpoints=3)


def train():
    return cb.train("t/store", MODEL, TASK, TC)


def test_runs_root_follows_environment(runs_dir):
    assert runs.runs_root() == runs_dir.resolve()
    run = train()
    assert run.path.is_relative_to(runs_dir.resolve())


def test_key_depends_on_config_and_is_stable():
    s = runs.Store("/tmp/x")
    assert s.key({"a": 1, "b": [1, 2]}) == s.key({"b": [1, 2], "a": 1})
    assert s.key({"a": 1}) != s.key({"a": 2})


def test_code_version_covers_the_core_the_model_and_the_task_module_only(runs_dir):
    run = train()
    assert run.config["code_version"] == runs.code_version([TASK, MODEL])
    assert runs.code_version([TASK]) != runs.code_version([]), "the task's module is part of the version"
    assert [f.name for f in runs._package_sources(TASK)] == ["modular.py"]
    assert [f.name for f in runs._package_sources(MODEL)] == ["toy.py"], "the model's module"


def test_complete_run_has_manifest_with_digests(runs_dir):
    run = train()
    manifest = json.loads((run.path / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert "metrics.jsonl" in manifest["files"] and any(f.startswith("ckpt/") for f in manifest["files"])
    for rel, info in manifest["files"].items():
        assert runs.sha256_file(run.path / rel) == info["sha256"]
    assert all(p.suffix != ".pt" for p in run.path.rglob("*")), "weights are safetensors only"


def _damage_and_retrain(run, rel, how, capsys, recomputed="recomputing"):
    path = run.path / rel
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "delete":
        path.unlink()
    with pytest.warns(UserWarning, match="damaged"):
        again = train()
    out = capsys.readouterr().out
    assert "damaged" in out and recomputed in out, out
    assert "cached run" not in out
    return again


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
def test_damaged_checkpoint_is_detected_and_recomputed(runs_dir, capsys, how):
    run = train()
    final = run.state()
    rel = f"ckpt/step_{12:08d}.safetensors"
    # the checkpoints before the damaged one are intact: training goes on from the last of them
    again = _damage_and_retrain(run, rel, how, capsys, "going on from its last intact checkpoint before step 12")
    for name, t in again.state().items():
        assert torch.equal(t, final[name])


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_manifest_or_metrics_is_detected(runs_dir, capsys, how):
    run = train()
    before = run.metrics()
    again = _damage_and_retrain(run, "manifest.json" if how == "truncate" else "metrics.jsonl", how, capsys)
    assert again.metrics().equals(before)


def test_partial_run_resumes_from_last_intact_checkpoint(runs_dir, capsys):
    run = train()
    final = run.state()
    (run.path / "manifest.json").unlink()  # as if killed before finishing
    last = run.path / f"ckpt/step_{12:08d}.safetensors"
    last.write_bytes(last.read_bytes()[:100])  # the newest checkpoint is torn
    again = train()
    out = capsys.readouterr().out
    assert "damaged" in out and "resuming t/store from step" in out
    for name, t in again.state().items():
        assert torch.equal(t, final[name])


def test_load_tensors_checks_digest(tmp_path):
    path = tmp_path / "w.safetensors"
    digest = runs.save_tensors(path, {"w": torch.ones(3)})
    assert torch.equal(runs.load_tensors(path, digest)["w"], torch.ones(3))
    with pytest.raises(runs.DamagedRunError):
        runs.load_tensors(path, "0" * 64)
    path.write_bytes(b"garbage")
    with pytest.raises(runs.DamagedRunError):
        runs.load_tensors(path)


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    runs.atomic_write_json(path, {"v": 1})

    class Boom(Exception):
        pass

    def explode(*a, **k):
        raise Boom

    monkeypatch.setattr(runs.os, "replace", explode)
    with pytest.raises(Boom):
        runs.atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"], "no temporary file is left behind"


def test_torn_jsonl_line_is_dropped(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert runs.read_jsonl(p) == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("name", ["", "../x", "a//b", "a b", "/abs"])
def test_bad_run_names(name):
    with pytest.raises(ValueError, match="run name"):
        runs.Store("/tmp/x").run_dir(name, {})
