"""`circuitbook release CHAPTER PATH`: a released training run judged by a chapter's rules under one
results label, on a synthetic release made here (tiny step checkpoints and a final state dict, the
authors' layout); bad input refused before any compute."""
import dataclasses
import json

import pytest
import torch

import circuitbook as cb
from circuitbook import build
from conftest import run_cli as cli

TINY = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=16, n_layers=2, n_heads=1, d_mlp=32, mlp=(False, True),
                    bias=False, d_vocab_out=59)


def synthetic_release(folder, steps=(1, 21, 41), config=TINY):
    """The authors' layout in miniature: `checkpoint_step_{s}.pth` and the final `model_state_dict.pth`."""
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        torch.save(cb.ToyTransformer(config, seed=step).state_dict(), folder / f"checkpoint_step_{step}.pth")
    torch.save(cb.ToyTransformer(config, seed=99).state_dict(), folder / "model_state_dict.pth")
    return folder


@pytest.mark.slow
def test_release_judges_a_synthetic_release_under_one_label(tmp_path, runs_dir, capsys):
    folder = synthetic_release(tmp_path / "aa_release")
    code, out, err = cli(["release", "assign_add", str(folder), "--profile", "smoke", "-p", "pair_split", "authors",
                          "--label", "synthetic"], capsys)
    assert code == 0, err[-3000:]
    assert "results label: smoke+synthetic (4 notebooks executed: 02_training, 03_generalization, 04_mechanisms, " \
           "05_gradient_theory)" in out
    code, out, _ = cli(["scorecard", "--label", "smoke+synthetic", "--json"], capsys)
    rows = {r["id"]: r for r in json.loads(out) if r["chapter"] == "assign_add"}
    assert code == 0 and len(rows) == 12
    for claim, row in rows.items():
        assert not row["status"].startswith(("not run", "stale")), (claim, row["status"])
        assert row["release"].startswith(f"aa_release ({folder.resolve()}): 3 step checkpoints (steps 1-41) and the "
                                         f"final model model_state_dict.pth (placed at step 60, assumed"), row["release"]
        assert "'authors' pair split" in row["release"]
        # the book's training knobs and its deviation texts do not describe a release; the evaluation's do
        assert not any(d.startswith(("steps", "batch_size", "lr ", "seeds", "cooldown", "d_model", "sweep"))
                       or "a few dozen steps" in d for d in row["deviations"]), (claim, row["deviations"])
    assert rows["AA-1"]["deviations"] == ["pool_size = 40 (paper: 2000)", "probe_size = 32 (paper: 512)"], \
        "the evaluation's sizes are stated quantities (issue 37)"
    for claim in ("AA-6", "AA-7"):  # the book's sweeps are not trained for a release
        assert rows[claim]["status"].startswith("not measured: a released run has no f or r sweep"), rows[claim]
    assert "every checkpoint evaluated" in rows["AA-2"]["release"]
    assert "the model at step 60 analysed" in rows["AA-5"]["release"]
    for claim in ("AA-2", "AA-3"):  # a release is at the paper's pace: no "not the paper's at this pace"
        assert "pace" not in rows[claim]["status"], rows[claim]["status"]


def test_release_runs_the_notebooks_that_read_one_with_their_own_overrides(tmp_path, runs_dir, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(build, "run_one", lambda nb, profile, overrides, log=None, label=None:
                        calls.append((nb, profile, overrides, label)))
    folder = synthetic_release(tmp_path / "my run")
    label, done, failures = build.release("assign_add", str(folder), "smoke", {"pair_split": "book", "n_attention": 50},
                                          log=lambda m: None)
    assert [c[0] for c in calls] == [f"assign_add/{nb}" for nb in
                                     ("02_training", "03_generalization", "04_mechanisms", "05_gradient_theory")]
    assert all(c[2]["checkpoint_path"] == str(folder.resolve()) and c[2]["pair_split"] == "book" for c in calls)
    assert [("n_attention" in c[2]) for c in calls] == [False, False, True, False]  # only 04 has it
    assert len({c[3] for c in calls}) == 1 and label == f"smoke+{calls[0][3]}" and label.startswith("smoke+my-run-")
    assert not failures and len(done) == 4
    # one state dict: the notebooks that need a training history are skipped, and say so
    calls.clear()
    logs = []
    build.release("assign_add", str(folder / "model_state_dict.pth"), "smoke", {}, label="one", log=logs.append)
    assert [c[0] for c in calls] == ["assign_add/03_generalization", "assign_add/04_mechanisms",
                                     "assign_add/05_gradient_theory"] and calls[0][3] == "one"
    assert any("02_training: skipped, it reads a training history" in m for m in logs)


def test_bad_release_input_is_refused_before_compute(tmp_path, runs_dir, capsys):
    folder = synthetic_release(tmp_path / "release")
    mixed = synthetic_release(tmp_path / "mixed")
    torch.save(cb.ToyTransformer(dataclasses.replace(TINY, d_model=32), seed=0).state_dict(),
               mixed / "checkpoint_step_61.pth")
    cases = [
        (["release", "book", str(folder)], "chapter 'book' has no notebook that reads a released run"),
        (["release", "assign-add", str(folder)], "unknown chapter 'assign-add' (did you mean 'assign_add'?)"),
        (["release", "assign_add", str(tmp_path / "nope")], "does not exist"),
        (["release", "assign_add", str(mixed)], "checkpoint_step_61.pth has"),
        (["release", "assign_add", str(folder), "-p", "checkpoint_path", "x"], "the release's path is the PATH argument"),
        (["release", "assign_add", str(folder), "-p", "n_atention", "5"], "did you mean 'n_attention'?"),
        (["release", "assign_add", str(folder), "-p", "pool_size", "0"], "parameter 'pool_size' must be int"),
        (["release", "assign_add", str(folder), "--label", "../x"], "--label '../x': use letters"),
        (["release", "assign_add"], "the following arguments are required: PATH"),
    ]
    for args, needle in cases:
        code, _, err = cli(args + ["--profile", "smoke"] if len(args) > 2 else args, capsys)
        assert code != 0 and needle in err, (args, err)
    assert not runs_dir.exists(), "a refused release must not create the artifact store"


@pytest.mark.slow
def test_rerunning_a_release_uses_its_cached_executions_until_the_folder_changes(tmp_path, runs_dir, monkeypatch):
    folder = synthetic_release(tmp_path / "cached")
    logs = []
    label, done, failures = build.release("assign_add", str(folder), "smoke", {"pair_split": "authors"},
                                          label="again", log=logs.append)
    assert not failures and len(done) == 4, failures
    executed = []
    real = build.run_one
    monkeypatch.setattr(build, "run_one", lambda nb, *a, **k: executed.append(nb) or real(nb, *a, **k))
    logs.clear()
    assert build.release("assign_add", str(folder), "smoke", {"pair_split": "authors"}, label="again",
                         log=logs.append)[1] == done
    assert executed == [] and sum("unchanged since its last execution under smoke+again" in m for m in logs) == 4
    # another file content in the release folder: its content hash changes, every notebook executes again
    torch.save(cb.ToyTransformer(TINY, seed=5).state_dict(), folder / "checkpoint_step_41.pth")
    build.release("assign_add", str(folder), "smoke", {"pair_split": "authors"}, label="again", log=logs.append)
    assert len(executed) == 4
