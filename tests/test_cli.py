"""The circuitbook command: help, listings, JSON scorecard, and bad input refused before compute."""
import json
import subprocess
import sys

import pytest

from circuitbook import claims

from circuitbook.cli import main


def run_cli(args, capsys):
    try:
        code = main(args)
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_documents_every_command(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and all(c in out for c in ("build", "run", "release", "params", "scorecard"))
    for cmd, flags in [("build", ["--profile", "--chapter", "--force", "--keep-going"]), ("run", ["-p", "--profile"]),
                       ("release", ["-p", "--label", "--profile", "--json"]),
                       ("params", ["--profile"]), ("scorecard", ["--json", "--profile"])]:
        code, out, _ = run_cli([cmd, "--help"], capsys)
        assert code == 0 and all(f in out for f in flags), cmd


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "circuitbook.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "scorecard" in proc.stdout


def test_scorecard_json(runs_dir, capsys):
    code, out, _ = run_cli(["scorecard", "--profile", "cpu", "--json"], capsys)
    rows = json.loads(out)
    assert code == 0 and len(rows) == 33 + len(claims.load_claims("lenses")["claims"]), "the papers' 33 and the book's own"
    assert {"id", "status", "paper", "measured", "profile"} <= set(rows[0]) and rows[0]["profile"] == "cpu"


def test_params_listing(capsys):
    code, out, _ = run_cli(["params", "book/tour"], capsys)
    assert code == 0 and "steps" in out and "smoke=300" in out and "int in [1, 1000000]" in out


BAD = [
    (["build", "--profile", "gpu"], "invalid choice: 'gpu'"),
    (["build", "--profile", "smoke", "--chapter", "assign-add"], "--chapter 'assign-add' is not a chapter"),
    (["build", "--profile"], "expected one argument"),
    (["build", "--fast"], "unrecognized arguments: --fast"),
    (["run", "book/nope"], "unknown notebook 'book/nope'"),
    (["run", "chapters/../../etc/passwd.ipynb", "--profile", "smoke"], "unknown notebook"),
    (["run", "book/tour", "--profile", "smoke", "-p", "stepz", "10"], "unknown parameter 'stepz' (from overrides) (did you mean 'steps'?)"),
    (["run", "book/tour", "--profile", "smoke", "-p", "steps", "abc"], "parameter 'steps' must be int in [1, 1000000], got 'abc'"),
    (["run", "book/tour", "--profile", "smoke", "-p", "steps", "-5"], "parameter 'steps' must be int in [1, 1000000], got -5"),
    (["run", "book/tour", "--profile", "smoke", "-p", "train_fraction", "1.5"], "parameter 'train_fraction' must be float in [0.05, 0.95]"),
    (["run", "book/tour", "--profile", "smoke", "-p", "seeds", "3"], "parameter 'seeds' must be list[int]"),
    (["run", "book/tour", "--profile", "smoke", "-p", "weight_decays", "[0.1, -1]"], "parameter 'weight_decays' must be list[float]"),
    (["run", "book/tour", "--profile", "smoke", "-p", "lr", "true"], "parameter 'lr' must be float"),
    (["run", "book/tour", "--profile", "smoke", "-p", "steps", "10", "-p", "steps", "20"], "-p steps is given twice"),
    (["run", "book/tour", "-p", "steps"], "expected 2 arguments"),
    (["run"], "the following arguments are required: NOTEBOOK"),
    (["params", "assign-add"], "unknown chapter 'assign-add' (did you mean 'assign_add'?)"),
    (["params", "book/tuor"], "unknown notebook 'tuor' in chapter 'book' (did you mean 'tour'?)"),
    (["scorecard", "--profile", "laptop"], "invalid choice: 'laptop'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("args, needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_clearly_and_writes_nothing(args, needle, runs_dir, capsys):
    from conftest import ROOT

    build_dir = ROOT / "_build"
    before = sorted(p.name for p in build_dir.iterdir()) if build_dir.exists() else None
    code, out, err = run_cli(args, capsys)
    assert code != 0
    assert needle in err, err
    assert not runs_dir.exists(), "a refused command must not create the artifact store"
    after = sorted(p.name for p in build_dir.iterdir()) if build_dir.exists() else None
    assert before == after


def test_scorecard_label_accepts_the_name_release_prints(runs_dir, capsys):
    """`scorecard --label authors` is the `cpu+authors` that `release --label authors` printed; a NAME held at two
    profiles is refused as ambiguous, naming both; an unknown one lists the labels there are."""
    (runs_dir / "results" / "cpu+authors").mkdir(parents=True)
    code, out, err = run_cli(["scorecard", "--label", "authors", "--json"], capsys)
    assert code == 0, err
    assert {r["label"] for r in json.loads(out)} == {"cpu+authors"}
    (runs_dir / "results" / "full+authors").mkdir(parents=True)
    code, _, err = run_cli(["scorecard", "--label", "authors"], capsys)
    assert code != 0 and "--label authors is ambiguous: cpu+authors, full+authors" in err
    code, out, err = run_cli(["scorecard", "--label", "authors", "--profile", "full", "--json"], capsys)
    assert code == 0 and {r["label"] for r in json.loads(out)} == {"full+authors"}, err
    code, _, err = run_cli(["scorecard", "--label", "nobody"], capsys)
    assert code != 0 and "no results label PROFILE+nobody" in err and "cpu+authors" in err
