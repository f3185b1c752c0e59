"""Reliability II: results that cannot be forged or left stale, and errors before compute.

Each test is one hostile case of the issue "Reliability II"; it fails on the version that lacked the
protection it names.
"""
import json
import os
import stat
import time

import nbformat
import pytest
import torch

import circuitbook as cb
from circuitbook import build, claims, context, settings
from circuitbook.runs import LeaseLock
from circuitbook.tasks.modular import ModularAddition
from conftest import run_cli as cli


def quiet(_msg):
    pass


def _executing(lines):
    return [line.split(":")[0] for line in lines if line.endswith(": executing ...")]


def _rows(profile="smoke", label=None):
    return {r["id"]: r for r in claims.scorecard(profile, label)}


# ---------------------------------------------------------------- 1. a results file cannot be forged

def test_a_hand_edited_results_file_is_not_graded_and_is_executed_again(mini_book, runs_dir):
    build.build("smoke", log=quiet)
    path = context.results_path("demo", "01_make", "smoke")
    data = json.loads(path.read_text())
    data["values"]["demo_value"]["value"] = 7.0  # the notebook recorded 2.0
    path.write_text(json.dumps(data))
    row = _rows()["D-1"]
    assert row["status"].startswith("not run: ") and "does not match its executed notebook" in row["status"]
    assert str(path) in row["status"], "the row names the file"
    lines = []
    build.build("smoke", log=lines.append)
    assert "[1/2] chapters/demo/01_make.ipynb" in _executing(lines)
    assert any("does not match its executed notebook" in line for line in lines), lines
    assert _rows()["D-1"]["status"] == "reproduced" and _rows()["D-1"]["measured"] == "demo_value = 2"


def test_results_without_their_executed_notebook_are_not_graded(mini_book, runs_dir):
    build.build("smoke", log=quiet)
    executed = context.executed_notebook_path("demo", "02_use", "smoke")
    executed.unlink()
    row = _rows()["D-2"]
    assert row["status"].startswith("not run: ") and str(executed) in row["status"], row["status"]


def test_a_forged_digest_in_the_executed_notebook_does_not_pass_either(mini_book, runs_dir):
    """Editing the results and the digest the executed notebook carries still breaks the cache record."""
    build.build("smoke", log=quiet)
    path = context.results_path("demo", "01_make", "smoke")
    data = json.loads(path.read_text())
    data["values"]["demo_value"]["value"] = 7.0
    path.write_text(json.dumps(data))
    executed = context.executed_notebook_path("demo", "01_make", "smoke")
    nb = nbformat.read(executed, as_version=4)
    nb.metadata["circuitbook"]["results_sha256"] = context.results_digest(json.loads(path.read_text()))
    nbformat.write(nb, executed)
    row = _rows()["D-1"]
    assert row["status"].startswith("not run: ") and "SHA-256" in row["status"], row["status"]


# ---------------------------------------------------------------- 2. labels stay inside the store

@pytest.mark.parametrize("label", ["smoke/../../..", "smoke+../../x", "../smoke", "smoke+a/b", "smoke+", "cpu+x y"])
def test_a_label_outside_the_store_is_refused_by_scorecard_and_run(mini_book, runs_dir, tmp_path, capsys, label):
    planted = tmp_path / "x" / "demo"
    planted.mkdir(parents=True)
    (planted / "01_make.json").write_text(json.dumps({"status": "ok", "values": {"demo_value": {"value": 9.0}}}))
    code, out, err = cli(["scorecard", "--label", label], capsys)
    assert code == 2 and f"--label {label!r}" in err and "reproduced" not in out, (out, err)
    name = label.split("+", 1)[1] if "+" in label else label
    code, _, err = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "value", "3", "--label", name], capsys)
    assert code == 2 and "--label" in err, err


def test_one_function_checks_every_label():
    assert settings.check_label("cpu") == "cpu" and settings.check_label("cpu+mine-2.a") == "cpu+mine-2.a"
    for bad in ("cpu+..", "cpu+.", "gpu+x", "cpu+x/y", "cpu/..", ""):
        with pytest.raises(ValueError, match="label"):
            settings.check_label(bad)


# ---------------------------------------------------------------- 3. files enter by their content

FILE_PARAM = ("  data: {type: path, nullable: true, env: DEMO_DATA_FILE, help: a data file}\n")


def _with_file_parameter(mini_book):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("parameters:\n", "parameters:\n" + FILE_PARAM, 1)
                    .replace("defaults: {value: 1.0, fail: false}", "defaults: {value: 1.0, fail: false, data: null}"))


def test_a_file_named_by_an_environment_variable_enters_by_content(mini_book, runs_dir, tmp_path, monkeypatch):
    _with_file_parameter(mini_book)
    data = tmp_path / "stories.txt"
    data.write_text("once upon a time\n")
    monkeypatch.setenv("DEMO_DATA_FILE", str(data))
    build.build("smoke", log=quiet)
    assert _rows()["D-1"]["status"] == "reproduced"
    data.write_text("")  # an empty file where the stories were
    status = _rows()["D-1"]["status"]
    assert status.startswith("stale: ") and "data ($DEMO_DATA_FILE)" in status and "changed" in status, status
    lines = []
    build.build("smoke", log=lines.append)
    assert _executing(lines) == ["[1/2] chapters/demo/01_make.ipynb", "[2/2] chapters/demo/02_use.ipynb"]
    other = tmp_path / "other.txt"
    other.write_text("")  # the same content under another name: nothing to recompute
    monkeypatch.setenv("DEMO_DATA_FILE", str(other))
    assert _rows()["D-1"]["status"] == "reproduced"


def test_a_file_given_as_a_parameter_enters_by_content(mini_book, runs_dir, tmp_path, capsys):
    _with_file_parameter(mini_book)
    data = tmp_path / "pairs.txt"
    data.write_text("1 2\n")
    code, out, _ = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "data", str(data), "--label", "f"], capsys)
    assert code == 0
    assert _rows(label="smoke+f")["D-1"]["status"] == "reproduced"
    data.write_text("1 2\n3 4\n")
    assert "the file data names changed" in _rows(label="smoke+f")["D-1"]["status"]


def test_the_books_file_parameters_declare_their_environment_variables():
    from circuitbook import params

    assert params.specs("leading_terms", "02_training")["tinystories_path"].env == "CIRCUITBOOK_TINYSTORIES"
    inputs = params.file_inputs("assign_add", "02_training", {"pair_split": __file__})
    assert inputs["pair_split"].startswith("sha256:"), "a pair_split file enters by content"
    assert params.file_inputs("assign_add", "02_training", {"pair_split": "authors"}) == {}


# ---------------------------------------------------------------- 5. settings checked before compute

BAD_SETTINGS = [
    ("CIRCUITBOOK_CHUNK", "abc", "'auto', 'all' or an integer >= 1"),
    ("CIRCUITBOOK_CHUNK", "0", "'auto', 'all' or an integer >= 1"),
    ("CIRCUITBOOK_CHUNK", "-3", "'auto', 'all' or an integer >= 1"),
    ("CIRCUITBOOK_LOCK_LEASE_S", "soon", "a number of seconds > 0"),
    ("CIRCUITBOOK_PROGRESS", "yes", "0 or 1"),
    ("CIRCUITBOOK_DEVICE", "gpu", "a torch device"),
    ("CIRCUITBOOK_TINYSTORIES", "/nonexistent/stories.txt", "does not exist"),
    ("CIRCUITBOOK_CHUNKS", "2", "did you mean 'CIRCUITBOOK_CHUNK'"),
]


def test_a_bad_setting_is_refused_before_compute_even_when_everything_is_cached(mini_book, runs_dir, capsys,
                                                                               monkeypatch):
    build.build("smoke", log=quiet)  # every notebook cached: nothing would train and read the setting
    before = sorted(runs_dir.rglob("*"))
    for name, value, needle in BAD_SETTINGS:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            for args in (["build", "--profile", "smoke"], ["scorecard", "--profile", "smoke"],
                         ["run", "demo/01_make", "--profile", "smoke", "-p", "value", "3"]):
                code, _, err = cli(args, capsys)
                assert code == 2 and name in err and needle in err and repr(value) in err, (args, err)
    assert sorted(runs_dir.rglob("*")) == before, "nothing written"


def test_load_params_checks_the_settings_too(monkeypatch, runs_dir):
    """A notebook executed with plain papermill checks them at its first cell."""
    monkeypatch.setenv("CIRCUITBOOK_CHUNK", "abc")
    with pytest.raises(ValueError, match="CIRCUITBOOK_CHUNK"):
        cb.load_params("book", "tour", "smoke")


# ---------------------------------------------------------------- 7, 8. notebooks checked before execution

def test_a_notebook_without_its_parameters_cell_is_refused_before_execution(mini_book, runs_dir, capsys):
    path = mini_book / "chapters" / "demo" / "02_use.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if "parameters" not in c.metadata.get("tags", [])]
    nbformat.write(nb, path)
    code, _, err = cli(["build", "--profile", "smoke"], capsys)
    assert code == 2 and "chapters/demo/02_use.ipynb" in err and "tagged 'parameters'" in err, err
    assert not runs_dir.exists(), "refused before any compute"


def _second_chapter(root):
    (root / "chapters" / "more").mkdir()
    (root / "chapters" / "more" / "profiles.yml").write_text(
        "parameters: {}\ndefaults: {}\nsmoke: {}\ncpu: {}\nfull: {}\n")
    (root / "chapters" / "more" / "index.md").write_text("# More\n")
    from minibook import notebook

    nbformat.write(notebook("more", "01_other", "print('other')"), root / "chapters" / "more" / "01_other.ipynb")
    toc = root / "_toc.yml"
    toc.write_text(toc.read_text() + "  - file: chapters/more/index\n    sections:\n"
                                      "      - file: chapters/more/01_other\n")
    return root / "chapters" / "more" / "01_other.ipynb"


def test_a_truncated_notebook_outside_the_selected_chapter_is_named(mini_book, runs_dir, capsys):
    other = _second_chapter(mini_book)
    other.write_text(other.read_text()[:40])
    code, _, err = cli(["build", "--profile", "smoke", "--chapter", "demo"], capsys)
    assert code == 2 and "chapters/more/01_other.ipynb" in err and "not a readable notebook" in err, err
    assert not runs_dir.exists()


# ---------------------------------------------------------------- 9. smaller cases

def test_a_missing_store_says_which_store_it_read(tmp_path, monkeypatch, mini_book, capsys):
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "nowhere"))
    code, out, err = cli(["scorecard", "--profile", "smoke"], capsys)
    assert code == 0 and str(tmp_path / "nowhere") in err and "does not exist" in err, err
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(link))
    code, out, err = cli(["scorecard", "--profile", "smoke"], capsys)
    assert code == 0 and "dangling link" in err and str(tmp_path / "gone") in err, err


def test_an_empty_store_says_so(mini_book, runs_dir, capsys):
    runs_dir.mkdir()
    code, out, err = cli(["scorecard", "--profile", "smoke"], capsys)
    assert code == 0 and f"{runs_dir}" in err and "holds no results at smoke" in err, err


def test_written_files_follow_the_umask(mini_book, runs_dir):
    old = os.umask(0o022)
    try:
        build.build("smoke", log=quiet)
    finally:
        os.umask(old)
    for path in (context.results_path("demo", "01_make", "smoke"),
                 context.executed_notebook_path("demo", "01_make", "smoke")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, (path, oct(path.stat().st_mode))


def test_a_lock_held_on_another_host_says_who_and_how_long(tmp_path, capsys):
    path = tmp_path / "run.lock"
    holder = {"host": "other-node/boot", "pid": 4242, "start": "1", "token": "t", "since": time.time() - 5}
    (tmp_path / "run.lock.0").write_text(json.dumps(holder))
    lock = LeaseLock(path, lease=0.6)
    with lock.hold():
        pass
    out = capsys.readouterr().out
    assert "held by pid 4242 on other-node" in out and "0.6 s" in out and "CIRCUITBOOK_LOCK_LEASE_S" in out, out


def test_a_damaged_checkpoint_resumes_from_the_last_intact_one_before_it(runs_dir, capsys):
    task = ModularAddition(p=11, train_fraction=0.5)
    model = cb.ToyConfig(d_vocab=12, n_ctx=3, d_model=16, n_layers=1, n_heads=2, d_mlp=32, d_vocab_out=11)
    tc = cb.TrainConfig(steps=60, batch_size=16, eval_every=5, checkpoint_every=20, log_checkpoints=0)
    evaluate = cb.pool_accuracy({"test": task.test})
    clean = cb.train("t/ck", model, task, tc, evaluate=evaluate)
    reference = {s: clean.state(s) for s in clean.checkpoint_steps()}
    damaged = clean.path / "ckpt" / "step_00000040.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    capsys.readouterr()
    again = cb.train("t/ck", model, task, tc, evaluate=evaluate)
    out = capsys.readouterr().out
    assert "step_00000040.safetensors" in out and "resuming t/ck from step 20" in out, out
    assert again.checkpoint_steps() == [0, 20, 40, 60]
    for step, state in reference.items():
        assert all(torch.allclose(state[k], again.state(step)[k], atol=1e-6) for k in state), step
    assert len(again.metrics()) == len(clean.metrics())


# ---------------------------------------------------------------- 6. every value a range allows runs

@pytest.mark.slow
def test_the_tour_runs_attention_only(runs_dir, capsys):
    """profiles.yml allows d_mlp = 0 ("attention only"): the tour must run with it to the end."""
    code, out, err = cli(["run", "book/tour", "--profile", "smoke", "-p", "d_mlp", "0", "-p", "steps", "30"], capsys)
    assert code == 0, err[-2000:]
