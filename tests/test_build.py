"""Building a (tiny) book: order, caching, failures, scorecard, overrides."""

import pytest

from circuitbook import build, claims, context
from circuitbook.cli import main


def log_into(lines):
    return lambda msg: lines.append(msg)


def test_build_executes_in_order_renders_and_scores(mini_book, runs_dir):
    lines = []
    html = build.build("smoke", log=log_into(lines))
    assert "profile smoke, 2 notebooks (0 cached)" in lines[0]
    executing = [l for l in lines if "executing" in l]
    assert executing[0].startswith("[1/2] chapters/demo/01_make") and executing[1].startswith("[2/2] chapters/demo/02_use")
    assert (html / "chapters" / "demo" / "02_use.html").exists()
    page = (html / "book" / "scorecard.html").read_text()
    assert "D-1" in page and "reproduced" in page
    rows = {r["id"]: r for r in claims.scorecard("smoke")}
    assert rows["D-1"]["status"] == "reproduced" and rows["D-1"]["measured"] == "demo_value = 2"
    assert rows["D-2"]["status"] == "reproduced"
    index = (html / "chapters" / "demo" / "index.html").read_text()
    assert "value is big" in index, "the landing page carries the claims table"
    import nbformat

    executed = nbformat.read(build.executed_path("smoke", build.Notebook("chapters/demo/01_make.ipynb", "demo",
                                                                          "01_make")), as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "hide-input" in injected[0].metadata["tags"], "papermill's parameters are folded"


def test_unchanged_notebooks_are_not_executed_again(mini_book, runs_dir):
    build.build("smoke", log=lambda m: None)
    lines = []
    build.build("smoke", log=log_into(lines))
    assert "(2 cached)" in lines[0]
    assert sum("unchanged, cached" in l for l in lines) == 2
    # a parameter change re-executes the notebook and the one that needs it
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 3.0}"))
    lines = []
    build.build("smoke", log=log_into(lines))
    assert sum("executing" in l for l in lines) == 2
    # editing only the downstream notebook re-executes only it
    nb = mini_book / "chapters" / "demo" / "02_use.ipynb"
    nb.write_text(nb.read_text().replace("twice", "double"))
    lines = []
    build.build("smoke", log=log_into(lines))
    assert [l.split(":")[0] for l in lines if "executing" in l] == ["[2/2] chapters/demo/02_use.ipynb"]


def test_failing_notebook_stops_the_build_and_names_notebook_cell_error(mini_book, runs_dir):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 2.0, fail: true}"))
    with pytest.raises(build.BuildError) as e:
        build.build("smoke", log=lambda m: None)
    msg = str(e.value)
    assert "chapters/demo/01_make.ipynb" in msg and "cell 3 (In [4]: 'if cfg.fail:')" in msg and "RuntimeError: planned failure" in msg
    assert not (mini_book / "_build" / "smoke" / "html").exists(), "nothing rendered without --keep-going"
    status = claims.scorecard("smoke")[0]["status"]
    assert status == "not run: demo/01_make failed at smoke (RuntimeError: planned failure)"


def test_keep_going_renders_failed_page_marked_as_failed(mini_book, runs_dir):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 2.0, fail: true}"))
    with pytest.raises(build.BuildError, match="1 notebook"):
        build.build("smoke", keep_going=True, log=lambda m: None)
    page = (mini_book / "_build" / "smoke" / "html" / "chapters" / "demo" / "01_make.html").read_text()
    assert "failed" in page and "planned failure" in page
    # the failure is not cached: fixing it re-executes
    prof.write_text(prof.read_text().replace("fail: true", "fail: false"))
    lines = []
    build.build("smoke", log=log_into(lines))
    assert "(0 cached)" in lines[0] or "(1 cached)" in lines[0]
    assert any("01_make.ipynb: executing" in l for l in lines)


def test_cli_build_exit_code_and_message_on_failure(mini_book, runs_dir, capsys):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 2.0, fail: true}"))
    assert main(["build", "--profile", "smoke"]) == 1
    err = capsys.readouterr().err
    assert "01_make.ipynb failed at cell 3" in err and "RuntimeError" in err


def test_run_one_with_overrides_keeps_results_apart(mini_book, runs_dir, capsys):
    build.build("smoke", log=lambda m: None)
    assert main(["run", "demo/02_use", "--profile", "smoke", "-p", "value", "5"]) == 0
    out = capsys.readouterr().out
    executed = out.strip().splitlines()[-1]
    label = next(l.split(": ")[1] for l in out.splitlines() if l.startswith("results label: "))
    assert executed.endswith("02_use.ipynb") and label.startswith("smoke+") and label in executed
    custom = context.read_results("demo", "02_use", label)
    assert custom["values"]["demo_twice"]["value"] == 10.0 and custom["overrides"] == {"value": 5}
    row = {r["id"]: r for r in claims.scorecard("smoke")}["D-2"]
    assert row["measured"] == "demo_twice = 4", "a run with overrides never replaces the profile's result"
    assert {r["id"]: r for r in claims.scorecard("smoke", label)}["D-2"]["measured"] == "demo_twice = 10"


def test_toc_order_must_respect_needs(mini_book):
    toc = mini_book / "_toc.yml"
    text = toc.read_text()
    toc.write_text(text.replace("      - file: chapters/demo/01_make\n", "").replace(
        "      - file: chapters/demo/02_use\n", "      - file: chapters/demo/02_use\n      - file: chapters/demo/01_make\n"))
    with pytest.raises(build.BookError, match="needs demo/01_make"):
        build.book_notebooks()


def test_estimate_uses_declared_and_measured_times(mini_book, runs_dir):
    nbs = build.book_notebooks()
    build.compute_hashes(nbs, "smoke")
    seconds, cached = build.estimate(nbs, "smoke", force=False)
    assert cached == 0 and seconds == 60 + 3  # 01_make declares nothing (60 s default), 02_use declares 3 s


def test_unresolved_glue_key_fails_the_build(mini_book, runs_dir):
    import nbformat

    path = mini_book / "chapters" / "demo" / "02_use.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("Twice is {glue:text}`demo_twice`, and {glue:text}`no_such_key`."))
    nbformat.write(nb, path)
    with pytest.raises(build.BuildError, match="(?s)unresolved glue keys.*no_such_key"):
        build.build("smoke", log=lambda m: None)


def test_chapter_build_stages_other_unexecuted_notebooks_with_placeholders(mini_book, runs_dir):
    """--chapter X: notebooks of other chapters without a cached execution are shown as code only."""
    import nbformat

    path = mini_book / "chapters" / "demo" / "02_use.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("Twice is {glue:text}`demo_twice:.2f`."))
    nbformat.write(nb, path)
    toc = mini_book / "_toc.yml"
    toc.write_text(toc.read_text().replace("chapters:\n  - file: book/scorecard",
                                           "chapters:\n  - file: book/tourlike\n  - file: book/scorecard"))
    (mini_book / "book" / "profiles.yml").write_text("parameters: {}\ndefaults: {}\nsmoke: {}\ncpu: {}\nfull: {}\n")
    from minibook import notebook

    nbformat.write(notebook("book", "tourlike", 'cb.record("x", 1.0)'), mini_book / "book" / "tourlike.ipynb")
    lines = []
    html = build.build("smoke", chapters=["book"], log=log_into(lines))
    page = (html / "chapters" / "demo" / "02_use.html").read_text()
    assert "not executed in this build" in page and "demo_twice: not computed in this build" in page
    assert sum("executing" in l for l in lines) == 1
