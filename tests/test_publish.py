"""Published results (circuitbook.publish) and the book built from them (publish.build_published)."""
import json
import shutil

import nbformat
import pytest

from circuitbook import build, claims, publish, signing
from circuitbook.cli import main
from minibook import ROOT


def _build_and_publish(mini_book, lines=None):
    build.build("smoke", log=(lambda m: lines.append(m)) if lines is not None else (lambda m: None))
    return publish.publish("smoke", log=lambda m: None)


def _fresh_store(tmp_path, monkeypatch, name="reader-runs"):
    """Another machine: a new run store (and so a new seal key), the same checkout with published/."""
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / name))


def _no_execution(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the published book executed a notebook")
    monkeypatch.setattr(publish, "execute", refuse)


def test_a_fresh_clone_renders_the_published_book_executing_nothing(mini_book, runs_dir, tmp_path, monkeypatch):
    out = _build_and_publish(mini_book)
    assert sorted(out.added) == ["demo/01_make", "demo/02_use"] and out.new_publisher
    base = mini_book / "published" / "smoke"
    index = json.loads((base / "index.json").read_text())
    entry = index["notebooks"]["demo/01_make"]
    assert set(entry["files"]) >= {"results/demo/01_make.json", "executed/chapters/demo/01_make.ipynb"}
    assert entry["provenance"]["machine"] and entry["provenance"]["commit"], "device and commit of each notebook"
    assert not list(base.rglob("*.key")) and not list(base.rglob("*.safetensors")), "no keys, no weights"
    _fresh_store(tmp_path, monkeypatch)
    _no_execution(monkeypatch)
    lines = []
    html = publish.build_published(log=lines.append, execute_missing=False)
    assert any("published/smoke: 2 current" in line for line in lines)
    page = (html / "chapters" / "demo" / "01_make.html").read_text()
    assert "The numbers on this page are of profile" in page and "smoke" in page
    scorecard = (html / "book" / "scorecard.html").read_text()
    assert "D-1" in scorecard and "cpu" in scorecard and "full" in scorecard, "full beside cpu"
    rows = {r["id"]: r for r in claims.scorecard("smoke")}
    assert rows["D-1"]["status"] == "reproduced" and rows["D-1"]["provenance"], "graded here, with its provenance"


def test_publishing_again_replaces_what_it_supersedes_and_keeps_the_rest(mini_book, runs_dir):
    _build_and_publish(mini_book)
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 3.0}"))
    build.build("smoke", log=lambda m: None)
    out = publish.publish("smoke", log=lambda m: None)
    assert sorted(out.added) == ["demo/01_make", "demo/02_use"]
    data = json.loads((mini_book / "published" / "smoke" / "results" / "demo" / "01_make.json").read_text())
    assert data["values"]["demo_value"]["value"] == 3.0


def test_a_hand_edited_published_result_is_never_graded(mini_book, runs_dir, tmp_path, monkeypatch):
    _build_and_publish(mini_book)
    base = mini_book / "published" / "smoke"
    results = base / "results" / "demo" / "01_make.json"
    data = json.loads(results.read_text())
    data["values"]["demo_value"]["value"] = 9.0
    results.write_text(json.dumps(data))
    _fresh_store(tmp_path, monkeypatch, "one")
    loaded = publish.load("smoke", log=lambda m: None)
    assert "does not match the SHA-256 the signed index holds" in loaded.refused["demo/01_make"]
    assert claims.scorecard("smoke")[0]["status"].startswith("not run")
    # the forger recomputes the digest in the index too: the signature no longer verifies
    index = json.loads((base / "index.json").read_text())
    index["notebooks"]["demo/01_make"]["files"]["results/demo/01_make.json"] = publish._sha(results.read_bytes())
    (base / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    _fresh_store(tmp_path, monkeypatch, "two")
    with pytest.raises(publish.PublishError, match="its signature does not verify"):
        publish.load("smoke", log=lambda m: None)
    # ... and re-signs it with a key of its own, which publishers.json does not list
    (base / "index.sig.json").write_text(json.dumps(signing.sign((base / "index.json").read_bytes())))
    with pytest.raises(publish.PublishError, match="does not list"):
        publish.load("smoke", log=lambda m: None)
    lines = []
    publish.build_published(log=lines.append, execute_missing=False)
    assert any("published/smoke is not used" in line for line in lines)
    assert claims.scorecard("smoke")[0]["status"].startswith("not run"), "never graded"


def test_a_published_result_whose_sources_changed_renders_stale_and_is_not_graded(mini_book, runs_dir, tmp_path,
                                                                                  monkeypatch):
    _build_and_publish(mini_book)
    source = mini_book / "chapters" / "demo" / "01_make.ipynb"
    nb = nbformat.read(source, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("A sentence added after publishing."))
    nbformat.write(nb, source)
    _fresh_store(tmp_path, monkeypatch)
    _no_execution(monkeypatch)
    loaded = publish.load("smoke", log=lambda m: None)
    assert "demo/01_make" in loaded.stale
    html = publish.build_published(log=lambda m: None, execute_missing=False)
    assert "stale" in (html / "chapters" / "demo" / "01_make.html").read_text()
    assert claims.scorecard("smoke")[0]["status"].startswith("stale")


def test_a_failed_notebook_renders_with_placeholders_for_what_it_never_recorded(mini_book, runs_dir):
    source = mini_book / "chapters" / "demo" / "01_make.ipynb"
    nb = nbformat.read(source, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("The value is {glue:text}`demo_value:.2f`."))
    nbformat.write(nb, source)
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 2.0, fail: true}"))
    assert main(["build", "--profile", "smoke", "--keep-going"]) == 1, "rendered, and the failure said"
    page = (mini_book / "_build" / "smoke" / "html" / "chapters" / "demo" / "01_make.html").read_text()
    assert "demo_value: not computed: the notebook failed" in page


def test_the_published_folder_keeps_its_budget():
    """published/ is cloned by every reader and travels to a GPU machine with the checkout."""
    folder = ROOT / publish.FOLDER
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0
    assert size <= publish.BUDGET_MIB * 2 ** 20, f"published/ is {size / 2 ** 20:.1f} MiB"


def test_every_published_folder_of_the_book_verifies():
    """What is committed under published/ is signed by a listed publisher and matches its index."""
    for profile in publish.ORDER:
        base = ROOT / publish.FOLDER / profile
        if not (base / publish.INDEX).exists():
            continue
        data = (base / publish.INDEX).read_bytes()
        signing.verify(data, json.loads((base / publish.SIGNATURE).read_text()),
                       signing.read_publishers(ROOT / publish.FOLDER / signing.PUBLISHERS), str(base))
        for entry in json.loads(data)["notebooks"].values():
            for rel, sha in entry["files"].items():
                assert publish._sha((base / rel).read_bytes()) == sha, rel


def test_publish_with_nothing_current_says_so_and_writes_nothing(mini_book, runs_dir, capsys):
    assert main(["publish", "--profile", "cpu"]) == 2
    assert "nothing to publish at cpu" in capsys.readouterr().err
    assert not (mini_book / "published").exists()
    shutil.rmtree(mini_book / "published", ignore_errors=True)


RUN_BODY = '''from circuitbook import context, runs
run_dir = runs.runs_root() / "demo" / "made" / "k1"
run_dir.mkdir(parents=True, exist_ok=True)
for name in ("config.json", "metrics.jsonl", "manifest.json"):
    (run_dir / name).write_text('{"file": "%s"}\\n' % name)
class Made:
    key, path, dir = "k1", str(run_dir), type("D", (), {"name": "demo/made"})()
context.note_run(Made())
cb.record("demo_value", cfg.value)
'''


def test_publishing_from_a_store_that_loaded_the_published_results_keeps_their_run_metrics(
        mini_book, runs_dir, tmp_path, monkeypatch):
    import nbformat as nbf
    from minibook import notebook
    nbf.write(notebook("demo", "01_make", RUN_BODY), mini_book / "chapters" / "demo" / "01_make.ipynb")
    _build_and_publish(mini_book)
    base = mini_book / "published" / "smoke"
    metrics = {p.relative_to(base).as_posix() for p in (base / "metrics").rglob("*") if p.is_file()}
    assert metrics == {f"metrics/demo/made/k1/{n}" for n in ("config.json", "metrics.jsonl", "manifest.json")}
    _fresh_store(tmp_path, monkeypatch)  # another machine: it loads what was published, reruns nothing, publishes
    loaded = publish.load("smoke", log=lambda m: None)
    assert sorted(loaded.current) == ["demo/01_make", "demo/02_use"]
    publish.publish("smoke", log=lambda m: None)
    for rel in metrics:
        assert (base / rel).is_file(), f"{rel} was dropped by a publish from a store that only loaded it"
    entry = json.loads((base / "index.json").read_text())["notebooks"]["demo/01_make"]
    assert metrics <= set(entry["files"])
