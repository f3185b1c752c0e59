"""The book a reader gets from a fresh clone (`make book`): rendered from published/, executing nothing.

Skipped until published/ holds the cpu profile (`circuitbook publish --profile cpu`); then every notebook
page must come from a published result that is current for this checkout, in a private run store (nothing of
this machine's), and the scorecard must grade the cpu rows it shows (CI checks the committed state)."""
import os

import pytest

from circuitbook import build, claims, publish
from conftest import ROOT, SHARED_TINYSTORIES

pytestmark = [pytest.mark.book, pytest.mark.skipif(not (ROOT / "published" / "cpu" / "index.json").exists(),
                                                   reason="nothing published at cpu yet")]


def test_a_fresh_clone_renders_the_whole_book_from_published_results(tmp_path, monkeypatch):
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("CIRCUITBOOK_PROGRESS", "0")
    if not os.environ.get("CIRCUITBOOK_TINYSTORIES") and SHARED_TINYSTORIES.exists():
        monkeypatch.setenv("CIRCUITBOOK_TINYSTORIES", str(SHARED_TINYSTORIES))  # as the Makefile does

    def refuse(*a, **k):
        raise AssertionError("the published book executed a notebook")
    monkeypatch.setattr(publish, "execute", refuse)
    lines = []
    html = publish.build_published(log=lines.append, execute_missing=False)
    stale = [line for line in lines if "stale" in line and "(at " in line]
    assert not stale, "every published cpu result is current for this checkout:\n" + "\n".join(stale)
    for nb in build.book_notebooks(ROOT):
        page = html / nb.path.replace(".ipynb", ".html")
        assert page.exists(), nb.path
        assert "The numbers on this page are of profile" in page.read_text(), f"{nb.path} says where they came from"
    rows = claims.scorecard("cpu")
    graded = [r for r in rows if claims.status_kind(r["status"]) not in ("not run", "stale")]
    assert len(graded) >= 0.8 * len(rows), f"only {len(graded)} of {len(rows)} cpu rows graded"
    assert all(r["provenance"] for r in graded), "each graded row names machine, environment and commit"
    assert "full" in (html / "book" / "scorecard.html").read_text(), "full beside cpu"
    assert set(publish.profiles()) >= {"cpu"}
