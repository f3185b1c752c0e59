"""The build and the run store survive kills, damage, concurrent use and bad files, and lose no data.

Each test is one hostile case; it fails on a version that lacks the protection it names.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import circuitbook as cb
from circuitbook import build, claims, context
from circuitbook.tasks.modular import ModularAddition
from conftest import run_cli as cli

TASK = ModularAddition(p=11, train_fraction=0.5)
MODEL = cb.ToyConfig(d_vocab=12, n_ctx=3, d_model=16, n_layers=1, n_heads=2, d_mlp=32, d_vocab_out=11)
EVAL = cb.pool_accuracy({"test": TASK.test})


def quiet(_msg):
    pass


# ---------------------------------------------------------------- damaged metrics are never sealed with holes

def _damaged_run(name, edit):
    """Train a short run (checkpoints at 0, 20, 40; evaluations every 5 steps), remove its manifest and
    apply `edit` to the lines of its metrics.jsonl. Returns the clean run's metrics."""
    tc = cb.TrainConfig(steps=40, batch_size=16, eval_every=5, checkpoint_every=20, log_checkpoints=0)
    clean = cb.train(name, MODEL, TASK, tc, evaluate=EVAL)
    reference = clean.metrics()
    (clean.path / "manifest.json").unlink()
    lines = (clean.path / "metrics.jsonl").read_text().splitlines()
    (clean.path / "metrics.jsonl").write_text(edit(lines))
    return tc, reference


def _same_history(run, reference):
    m = run.metrics()
    assert len(m) == len(reference) == 9, "the whole history, not the rows before the damage"
    assert (m.step.to_numpy() == reference.step.to_numpy()).all()
    assert abs(m.acc_test.to_numpy() - reference.acc_test.to_numpy()).max() < 1e-6


def test_garbled_metrics_line_is_not_truncated_and_sealed(runs_dir, capsys):
    def garble(lines):
        lines[5] = lines[5][:10] + "#garbled#"  # the row of step 25, after the checkpoint at 20
        return "\n".join(lines) + "\n"

    tc, reference = _damaged_run("t/m", garble)
    capsys.readouterr()
    again = cb.train("t/m", MODEL, TASK, tc, evaluate=EVAL)
    out = capsys.readouterr().out
    assert "metrics.jsonl is damaged (line 6 of 9 is garbled); its history is intact up to step 20" in out
    assert "resuming t/m from step 20" in out
    _same_history(again, reference)


def test_damage_before_every_checkpoint_trains_again_from_the_start(runs_dir, capsys):
    def garble(lines):
        lines[1] = "{#"  # step 5: before the checkpoint at 20
        return "\n".join(lines) + "\n"

    tc, reference = _damaged_run("t/m1", garble)
    capsys.readouterr()
    again = cb.train("t/m1", MODEL, TASK, tc, evaluate=EVAL)
    out = capsys.readouterr().out
    assert "resuming t/m1 from step 0" in out and "line 2 of 9 is garbled" in out
    _same_history(again, reference)


def test_missing_metrics_rows_are_detected_too(runs_dir, capsys):
    tc, reference = _damaged_run("t/m2", lambda lines: "\n".join(lines[:6] + lines[7:]) + "\n")  # no step 30
    capsys.readouterr()
    again = cb.train("t/m2", MODEL, TASK, tc, evaluate=EVAL)
    out = capsys.readouterr().out
    assert "its history is intact up to step 25" in out and "resuming t/m2 from step 20" in out
    _same_history(again, reference)


def test_a_torn_last_line_is_an_ordinary_resume(runs_dir, capsys):
    tc, reference = _damaged_run("t/m3", lambda lines: "\n".join(lines) + '\n{"step": 45, "mem')
    capsys.readouterr()
    again = cb.train("t/m3", MODEL, TASK, tc, evaluate=EVAL)
    out = capsys.readouterr().out
    assert "resuming t/m3 from step 40" in out and "damaged" not in out
    _same_history(again, reference)


# ---------------------------------------------------------------- the execution cache

def _build(**kw):
    return build.build("smoke", log=quiet, **kw)


def _executing(lines):
    return [l.split(":")[0] for l in lines if l.endswith(": executing ...")]


def test_interrupted_results_are_not_served_from_the_cache(mini_book, runs_dir):
    """SIGKILL of a build mid-notebook leaves results 'running': the next build executes again."""
    _build()
    path = context.results_path("demo", "01_make", "smoke")
    data = json.loads(path.read_text())
    data["status"] = "running"
    path.write_text(json.dumps(data))
    lines = []
    build.build("smoke", log=lines.append)
    assert "[1/2] chapters/demo/01_make.ipynb" in _executing(lines)
    assert any("says 'running' (an interrupted or failed execution)" in l for l in lines)
    assert claims.scorecard("smoke")[0]["status"] == "reproduced"


def test_results_of_other_inputs_are_not_served_from_the_cache(mini_book, runs_dir):
    _build()
    path = context.results_path("demo", "02_use", "smoke")
    data = json.loads(path.read_text())
    data["input_hash"] = "0" * 20
    path.write_text(json.dumps(data))
    lines = []
    build.build("smoke", log=lines.append)
    assert _executing(lines) == ["[2/2] chapters/demo/02_use.ipynb"]


@pytest.mark.parametrize("damage", ["truncate notebook", "garble notebook", "truncate record", "delete results"])
def test_damaged_cache_entries_are_named_and_recomputed(mini_book, runs_dir, damage):
    _build()
    nb = build.Notebook("chapters/demo/02_use.ipynb", "demo", "02_use")
    executed = build.executed_path("smoke", nb)
    target = {"truncate notebook": executed, "garble notebook": executed,
              "truncate record": executed.with_suffix(".json"),
              "delete results": context.results_path("demo", "02_use", "smoke")}[damage]
    text = target.read_text()
    if damage.startswith("truncate"):
        target.write_text(text[: len(text) // 2])
    elif damage.startswith("garble"):
        target.write_text(text.replace('"cells"', '"cellz"'))
    else:
        target.unlink()
    lines = []
    html = build.build("smoke", log=lines.append)  # no --force needed
    assert _executing(lines) == ["[2/2] chapters/demo/02_use.ipynb"], lines
    if damage != "truncate record":
        assert any(str(target) in l for l in lines), f"the damaged file is named: {lines}"
    assert (html / "chapters" / "demo" / "02_use.html").exists()
    assert {r["id"]: r for r in claims.scorecard("smoke")}["D-2"]["status"] == "reproduced"


def test_run_without_overrides_is_the_builds_execution(mini_book, runs_dir, capsys):
    """A failed `circuitbook run` never becomes a cached success; a fixed notebook is executed again."""
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 2.0, fail: true}"))
    code, out, err = cli(["run", "demo/01_make", "--profile", "smoke"], capsys)
    assert code == 1 and "planned failure" in err and "results label smoke" in out
    prof.write_text(prof.read_text().replace("fail: true", "fail: false"))
    lines = []
    build.build("smoke", log=lines.append)
    assert "[1/2] chapters/demo/01_make.ipynb" in _executing(lines)
    code, out, _ = cli(["run", "demo/01_make", "--profile", "smoke"], capsys)
    assert code == 0 and "cached" in out and "results label: smoke" in out, "same cache slot and rules as the build"


def test_run_with_overrides_writes_elsewhere_and_can_be_graded(mini_book, runs_dir, capsys):
    _build()
    code, out, _ = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "value", "0.5"], capsys)
    label = next(l.split(": ", 1)[1] for l in out.splitlines() if l.startswith("results label: "))
    assert code == 0 and label.startswith("smoke+") and label != "smoke"
    code, out, _ = cli(["scorecard", "--label", label, "--json"], capsys)
    rows = {r["id"]: r for r in json.loads(out)}
    assert rows["D-1"]["status"] == "not reproduced" and rows["D-1"]["measured"] == "demo_value = 0.5"
    assert {r["id"]: r for r in claims.scorecard("smoke")}["D-1"]["status"] == "reproduced", "profile's own untouched"
    code, out, _ = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "value", "0.5", "--label", "mine"], capsys)
    assert "results label: smoke+mine" in out
    code, _, err = cli(["scorecard", "--label", "smoke+nothing"], capsys)
    assert code == 2 and "no results under" in err and "smoke+mine" in err


def test_a_truncated_results_file_does_not_crash_the_scorecard(mini_book, runs_dir, capsys):
    _build()
    path = context.results_path("demo", "01_make", "smoke")
    path.write_text(path.read_text()[:30])
    code, out, err = cli(["scorecard", "--profile", "smoke"], capsys)
    assert code == 0 and f"results file {path} is damaged" in out


@pytest.mark.slow
def test_two_builds_at_once_both_succeed(mini_book, runs_dir):
    env = {**os.environ, "CIRCUITBOOK_ROOT": str(mini_book), "CIRCUITBOOK_RUNS": str(runs_dir)}
    cmd = [sys.executable, "-m", "circuitbook.cli", "build", "--profile", "smoke", "--force"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert any("waiting for another circuitbook build of smoke" in o for o in outs), outs
    assert (mini_book / "_build" / "smoke" / "html" / "book" / "scorecard.html").exists()


@pytest.mark.slow
def test_sigkill_of_a_build_mid_notebook_then_rebuild(mini_book, runs_dir):
    """Kill a --force build while a notebook runs: the next build executes it again, not 'cached'."""
    nb = mini_book / "chapters" / "demo" / "02_use.ipynb"
    nb.write_text(nb.read_text().replace('print(\\"twice\\"', 'import time; time.sleep(5)\\nprint(\\"twice\\"'))
    env = {**os.environ, "CIRCUITBOOK_ROOT": str(mini_book), "CIRCUITBOOK_RUNS": str(runs_dir)}
    cmd = [sys.executable, "-m", "circuitbook.cli", "build", "--profile", "smoke"]
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    proc = subprocess.Popen(cmd + ["--force"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    results = context.results_path("demo", "02_use", "smoke")
    first = json.loads(results.read_text())["execution"]
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until the notebook has begun again (its results say running)
        data = json.loads(results.read_text()) if results.exists() else {}
        if data.get("status") == "running" and data.get("execution") != first:
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(results.read_text())["status"] == "running"
    assert claims.scorecard("smoke")[1]["status"].startswith("not run: demo/02_use is still running")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "02_use.ipynb: executing" in out.stdout, out.stdout
    assert claims.scorecard("smoke")[1]["status"] == "reproduced"


# ---------------------------------------------------------------- bad files and values, before any compute

BAD_PROFILES = [
    ("parameters: {value: {type: float\n", "not valid YAML"),
    ("parameters:\n  value: {type: float}\n  value: {type: int}\n", "duplicate key 'value'"),
    ("parameters: [value]\n", "section 'parameters' must be a mapping"),
    ("parameters: {value: {type: float, min: zero}}\ndefaults: {value: 1}\nsmoke: {}\ncpu: {}\nfull: {}\n",
     "has min 'zero'; it must be a finite number"),
    ("parameters: {value: {type: float}}\ndefaults: {value: 1}\nsmoke: {}\ncpu: {}\nfull: {}\nlaptop: {}\n",
     "unknown sections ['laptop']"),
    ("parameters: {value: {type: float}}\ndefaults: {value: .nan}\nsmoke: {}\ncpu: {}\nfull: {}\n",
     "NaN and infinities are never allowed"),
    ("parameters: {value: {type: float}}\ndefaults: {value: 1}\nsmoke: {}\ncpu: {}\nfull: {}\n"
     "notebooks: {01_make: {estimate: 3}}\n", "notebooks.01_make has unknown keys ['estimate']"),
    ("parameters: {value: {type: float}}\ndefaults: {value: 1}\nsmoke: {}\ncpu: {}\nfull: {}\n"
     "deviations: {cpu: 'smaller'}\n", "deviations.cpu must be a list of non-empty strings"),
    ("parameters: {value: {type: float}}\ndefaults: {value: 1}\nsmoke: {}\ncpu: {}\nfull: {}\n"
     "paper: {valeu: 3}\n", "'valeu' is not a parameter (did you mean 'value'?)"),
]


@pytest.mark.parametrize("text, needle", BAD_PROFILES, ids=[n for _, n in BAD_PROFILES])
def test_malformed_profiles_yml_is_refused_naming_the_file(mini_book, runs_dir, capsys, text, needle):
    path = mini_book / "chapters" / "demo" / "profiles.yml"
    path.write_text(text)
    code, _, err = cli(["build", "--profile", "smoke"], capsys)
    assert code == 2 and needle in err and "demo/profiles.yml" in err, err
    assert not runs_dir.exists(), "refused before any compute"


def test_malformed_claims_yml_stops_the_build_before_compute(mini_book, runs_dir, capsys):
    path = mini_book / "chapters" / "demo" / "claims.yml"
    path.write_text(path.read_text().replace("'demo_value >= 2'", "'demo_value >= 0.5x'"))
    code, _, err = cli(["build", "--profile", "smoke"], capsys)
    assert code == 2 and "claim rule 'demo_value >= 0.5x'" in err and str(path) in err
    assert not runs_dir.exists()


@pytest.mark.parametrize("value, needle", [
    ("nan", "NaN and infinities are never allowed"), ("inf", "NaN and infinities are never allowed"),
    (".inf", "NaN and infinities are never allowed"), ("1e400", "NaN and infinities are never allowed"),
])
def test_nan_and_infinite_values_are_refused(mini_book, runs_dir, capsys, value, needle):
    code, _, err = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "value", value], capsys)
    assert code == 2 and needle in err, err
    assert not runs_dir.exists()


def test_integers_beyond_64_bits_are_refused_before_the_kernel(runs_dir, capsys):
    code, _, err = cli(["run", "book/tour", "--profile", "smoke", "-p", "seeds", f"[{2 ** 70}]"], capsys)
    assert code == 2 and "integers must fit in 64 bits" in err, err


def test_numbers_without_a_dot_are_numbers(mini_book, runs_dir, capsys):
    from circuitbook.cli import _parse_value

    assert _parse_value("1e-3") == 0.001 and _parse_value("3") == 3 and _parse_value("[1e-3, 2]") == [0.001, 2]
    assert _parse_value("adamw") == "adamw" and _parse_value("true") is True
    code, out, err = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "value", "2e0"], capsys)
    assert code == 0, err


def test_store_that_is_a_file_gives_one_line(mini_book, tmp_path, monkeypatch, capsys):
    store = tmp_path / "runs-file"
    store.write_text("not a folder")
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(store))
    for args in (["build", "--profile", "smoke"], ["scorecard", "--profile", "smoke"],
                 ["run", "demo/01_make", "--profile", "smoke"]):
        code, out, err = cli(args, capsys)
        assert code == 1 and err.count("\n") == 1 and "is a file, not a folder" in err, (args, err)
        assert "not run" not in out


def test_store_that_cannot_be_written_gives_one_line(mini_book, monkeypatch, capsys):
    monkeypatch.setenv("CIRCUITBOOK_RUNS", "/proc/circuitbook-cannot-write-here")
    code, _, err = cli(["build", "--profile", "smoke"], capsys)
    assert code == 1 and err.count("\n") == 1 and "is not writable" in err, err


def test_a_full_disk_gives_one_line(mini_book, runs_dir, monkeypatch, capsys):
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(runs_dir / "executed"))

    monkeypatch.setattr(build, "_store_execution", full)
    code, _, err = cli(["build", "--profile", "smoke"], capsys)
    assert code == 1 and err.strip().endswith(f"No space left on device ({runs_dir / 'executed'})"), err
    assert err.count("\n") == 1


def test_an_unexpected_error_is_one_line_and_a_traceback_file(mini_book, runs_dir, monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(build, "stage", boom)
    code, _, err = cli(["build", "--profile", "smoke"], capsys)
    assert code == 1 and err.count("\n") == 1 and "RuntimeError: something unforeseen" in err
    log = err.split("full traceback in ")[1].rstrip(")\n")
    assert "Traceback (most recent call last)" in open(log).read()


# ---------------------------------------------------------------- external checkpoints

@pytest.mark.parametrize("content, suffix, needle", [
    (b"these are my notes, not weights\n", ".pt", "is a text file, not a checkpoint"),
    (b"", ".pt", "is empty"),
    (b"", ".safetensors", "is empty"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": {\"dtype\"", ".safetensors", "cannot be read"),
    (b"PK\x03\x04garbage-zip", ".pth", "cannot be read"),
])
def test_a_bad_checkpoint_file_names_path_and_formats(tmp_path, content, suffix, needle):
    from circuitbook.models.loading import read_state_dict

    path = tmp_path / f"model{suffix}"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_state_dict(path)
    msg = str(e.value)
    assert str(path) in msg and needle in msg and "safetensors file" in msg and "torch.save" in msg, msg
    assert "weights_only=False" not in msg and "weights_only" not in msg


def test_a_pickle_with_code_is_refused_not_loaded(tmp_path):
    import pickle

    from circuitbook.models.loading import read_state_dict

    class Evil:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"embed.W_E": Evil()}))
    with pytest.raises(ValueError, match="holds objects other than tensors"):
        read_state_dict(path)


def test_a_checkpoint_path_that_does_not_exist_is_refused_before_the_kernel(runs_dir, capsys):
    code, _, err = cli(["run", "assign_add/04_mechanisms", "--profile", "smoke", "-p", "checkpoint_path",
                        "/nonexistent/model.pt"], capsys)
    assert code == 2 and "'/nonexistent/model.pt', which does not exist" in err, err
    assert not runs_dir.exists()


def test_a_checkpoint_folder_with_mixed_shapes_names_the_odd_file(tmp_path):
    """A released run whose last checkpoint is twice as wide as the rest is not one run: refused,
    naming the odd file and the shapes, before anything is analysed."""
    from circuitbook.experiments import assign_add as ea
    from circuitbook.models.loading import step_checkpoints
    from circuitbook.tasks.assign_add import AssignAddTask

    narrow = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=16, n_layers=2, n_heads=1, d_mlp=32, mlp=(False, True),
                          bias=False, d_vocab_out=59)
    wide = dataclasses.replace(narrow, d_model=32)
    for step in (0, 100, 200):
        torch.save(cb.ToyTransformer(narrow, seed=step).state_dict(), tmp_path / f"checkpoint_step_{step}.pth")
    torch.save(cb.ToyTransformer(wide, seed=3).state_dict(), tmp_path / "checkpoint_step_300.pth")
    with pytest.raises(ValueError) as e:
        step_checkpoints(tmp_path)
    msg = str(e.value)
    assert "checkpoint_step_300.pth" in msg and str(tmp_path) in msg and "the same configuration" in msg, msg
    assert "[74, 32]" in msg and "[74, 16]" in msg and "checkpoint_step_100.pth" not in msg.split("other")[0], msg
    with pytest.raises(ValueError, match="checkpoint_step_300.pth"):
        ea.released_run(tmp_path, AssignAddTask(), pool_size=20, probe_size=16)
    # a final model (no step in its name) of another width is named the same way
    (tmp_path / "checkpoint_step_300.pth").unlink()
    torch.save(cb.ToyTransformer(wide, seed=3).state_dict(), tmp_path / "model_state_dict.pth")
    with pytest.raises(ValueError, match="model_state_dict.pth has"):
        step_checkpoints(tmp_path)
