"""Results that travel: export on one clone, import on another; hostile archives refused whole."""
import io
import json
import shutil
import tarfile

import nbformat
import pytest

from circuitbook import build, claims, context, transfer
from circuitbook.cli import main
from minibook import write
import sealing


@pytest.fixture(scope="module")
def clone_a(tmp_path_factory):
    """A mini book built at smoke in clone A and exported: (A's folder, A's store, the archives)."""
    tmp = tmp_path_factory.mktemp("clone_a")
    a = write(tmp / "a")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CIRCUITBOOK_ROOT", str(a))
        mp.setenv("CIRCUITBOOK_RUNS", str(tmp / "runs_a"))
        mp.setenv("CIRCUITBOOK_PROGRESS", "0")
        for nb in ("demo/01_make", "demo/02_use"):
            build.run_one(nb, "smoke", {}, log=lambda m: None)
        summary = transfer.export_results("smoke", tmp / "out")
    assert summary["notebooks"] == ["demo/01_make", "demo/02_use"] and not summary["left_out"]
    return a, tmp / "runs_a", summary["archives"]


@pytest.fixture
def exported(clone_a):
    return clone_a[2]


@pytest.fixture
def clone_b(clone_a, tmp_path, monkeypatch):
    """A second clone of A's sources (byte for byte, as git gives) at another path, with an empty run store
    that knows A's key (as a home store knows the key of the visit it started)."""
    b = shutil.copytree(clone_a[0], tmp_path / "b", ignore=shutil.ignore_patterns("_build"))
    monkeypatch.setenv("CIRCUITBOOK_ROOT", str(b))
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "runs_b"))
    sealing.trust(tmp_path / "runs_b", sealing.store_key_of(clone_a[1]))
    return b


def test_round_trip_renders_without_executing_anything(exported, clone_b, tmp_path):
    done = transfer.import_results(exported)
    assert done.label == "smoke" and done.current == ["demo/01_make", "demo/02_use"] and not done.stale
    lines = []
    html = build.build("smoke", log=lines.append)
    assert "(2 cached)" in lines[0]
    assert not [line for line in lines if "executing" in line], "0 notebooks re-executed"
    assert sum("unchanged, cached" in line for line in lines) == 2
    rows = {r["id"]: r["status"] for r in claims.scorecard("smoke")}
    assert rows == {"D-1": "reproduced", "D-2": "reproduced"}
    assert "twice 4.0" in (html / "chapters" / "demo" / "02_use.html").read_text()


def test_results_of_other_sources_are_imported_stale_and_never_graded(exported, clone_b):
    nb = clone_b / "chapters" / "demo" / "02_use.ipynb"
    nb.write_text(nb.read_text().replace("twice", "double"))
    done = transfer.import_results(exported)
    assert done.current == ["demo/01_make"] and done.stale == {"demo/02_use": ["the notebook changed"]}
    rows = {r["id"]: r["status"] for r in claims.scorecard("smoke")}
    assert rows["D-1"] == "reproduced" and rows["D-2"].startswith("stale: the notebook changed")
    lines = []
    html = build.build("smoke", log=lines.append, execute_missing=False)
    assert not [line for line in lines if "executing" in line]
    assert any("02_use.ipynb: stale execution (the notebook changed)" in line for line in lines)
    page = (html / "chapters" / "demo" / "02_use.html").read_text()
    assert "stale" in page and "twice 4.0" in page


def test_a_stale_import_never_replaces_a_current_local_result(exported, clone_b):
    nb = clone_b / "chapters" / "demo" / "01_make.ipynb"
    nb.write_text(nb.read_text().replace("planned failure", "a planned failure"))
    build.run_one("demo/01_make", "smoke", {}, log=lambda m: None)  # current for the edited notebook
    local = context.read_results("demo", "01_make", "smoke")
    done = transfer.import_results(exported)
    assert done.kept_local == ["demo/01_make"] and "demo/02_use" in done.stale
    assert context.read_results("demo", "01_make", "smoke")["execution"] == local["execution"]


def test_no_execute_shows_code_for_what_was_never_executed(clone_b):
    lines = []
    html = build.build("smoke", log=lines.append, execute_missing=False)
    assert "nothing is executed (--no-execute)" in lines[0]
    assert sum("not executed: code only" in line for line in lines) == 2
    assert "not executed in this build" in (html / "chapters" / "demo" / "01_make.html").read_text()
    with pytest.raises(Exception, match="--no-execute executes nothing"):
        build.build("smoke", force=True, execute_missing=False)


def test_archives_are_split_under_the_size_limit_and_each_is_complete(clone_a, tmp_path, monkeypatch):
    exported = clone_a[2]
    monkeypatch.setenv("CIRCUITBOOK_ROOT", str(clone_a[0]))
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(clone_a[1]))
    smallest = min(u.size for u in transfer.notebook_units("smoke"))  # no two notebooks fit one archive
    summary = transfer.export_results("smoke", tmp_path / "small", max_bytes=smallest)
    assert len(summary["archives"]) == 2, "one notebook (results, executed notebook, record) per archive"
    for archive in summary["archives"]:
        manifest = json.loads(_members(archive)[transfer.MANIFEST])
        (entry,) = manifest["notebooks"]
        assert {entry["results"], entry["executed"], entry["record"]} <= set(manifest["files"])
    capped = transfer.export_results("smoke", tmp_path / "capped", max_bytes=smallest, max_archives=1)
    assert len(capped["archives"]) == 1 and any("02_use" in f for f in capped["left_out"])


def _members(archive) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _repack(src, dest, change=None, extra=(), fix_digests=True):
    """Rewrite an archive: change(files) edits the members; the manifest's digests follow unless told not to."""
    files = _members(src)
    manifest = json.loads(files.pop(transfer.MANIFEST))
    if change:
        change(files, manifest)
    if fix_digests:
        manifest["files"] = {n: transfer._sha(d) for n, d in files.items()}
    with tarfile.open(dest, "w:gz") as tar:
        for name, data in [*files.items(), (transfer.MANIFEST, json.dumps(manifest).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return dest


def _tamper_hash(files, manifest):
    name = "results/smoke/demo/01_make.json"
    data = json.loads(files[name])
    data["inputs"]["params"] = "0" * 20
    files[name] = json.dumps(data).encode()


def _unknown_notebook(files, manifest):
    manifest["notebooks"][0]["notebook"] = "demo/09_other"


def _escape(files, manifest):
    files["results/../../evil.json"] = b"{}"


def _outside(files, manifest):
    files["weights/model.safetensors"] = b"x"


def _bad_record(files, manifest):
    name = "executed/smoke/chapters/demo/01_make.json"
    record = json.loads(files[name])
    record["sha256"] = "0" * 64
    files[name] = json.dumps(record).encode()


def _other_label(files, manifest):
    manifest["label"] = "nonsense"


@pytest.mark.parametrize("change, fix, needle", [
    (_tamper_hash, True, "its recorded input hash is not the hash of its recorded inputs"),
    (_unknown_notebook, True, "demo/09_other is not a notebook of this book"),
    (_escape, True, "has an unsafe path"),
    (_outside, True, "is outside executed, results, metrics, benchmarks, logs"),
    (_bad_record, True, "does not match its cache record's SHA-256"),
    (_other_label, True, "is of profile 'nonsense'"),
    (_tamper_hash, False, "does not match its SHA-256 in the manifest (damaged)"),
])
def test_hostile_archives_are_refused_whole_before_anything_is_written(exported, clone_b, tmp_path, change, fix,
                                                                       needle):
    bad = _repack(exported[0], tmp_path / "bad.tar.gz", change, fix_digests=fix)
    with pytest.raises(transfer.TransferError) as e:
        transfer.import_results([bad])
    assert needle in str(e.value) and str(bad) in str(e.value)
    assert not (tmp_path / "runs_b" / "results").exists() and not (tmp_path / "runs_b" / "executed").exists()


def test_links_garbage_and_missing_files_are_refused(exported, clone_b, tmp_path, capsys):
    link = tarfile.TarInfo("results/smoke/demo/link.json")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(transfer.TransferError, match="is not a plain file"):
        transfer.import_results([_repack(exported[0], tmp_path / "link.tar.gz", extra=[link])])
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"not a tar at all")
    assert main(["import-results", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert "garbage.tar.gz: not a readable circuitbook results archive" in err
    assert main(["import-results", str(tmp_path / "missing.tar.gz")]) == 2
    assert "missing.tar.gz: no such file" in capsys.readouterr().err
    assert not (tmp_path / "runs_b" / "results").exists()


def test_cli_exports_and_imports(exported, clone_b, tmp_path, capsys, monkeypatch):
    assert main(["import-results", *map(str, exported)]) == 0
    out = capsys.readouterr().out
    assert "imported 2 notebooks of smoke: 2 current, 0 stale, 0 failed" in out and "--no-execute" in out
    assert main(["export-results", "--label", "smoke", "--out", str(tmp_path / "again")]) == 0
    assert "2 notebooks of smoke in 1 archive(s)" in capsys.readouterr().out
    assert main(["export-results", "--label", "cpu", "--out", str(tmp_path / "none")]) == 2
    assert "no results under" in capsys.readouterr().err


def test_executed_notebook_is_a_notebook_after_import(exported, clone_b):
    transfer.import_results(exported)
    nb = build.Notebook("chapters/demo/02_use.ipynb", "demo", "02_use")
    assert any("twice" in str(c.get("outputs")) for c in nbformat.read(build.executed_path("smoke", nb), 4).cells)


def test_benchmarks_and_logs_travel_and_a_gpus_results_land_in_benchmarks(clone_a, tmp_path, monkeypatch):
    monkeypatch.setenv("CIRCUITBOOK_ROOT", str(clone_a[0]))
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(clone_a[1]))
    (tmp_path / "gpu_cuda.json").write_text('{"speedup": 3}')
    (tmp_path / "gpu_cpu.json").write_text('{"speedup": 1}')
    (tmp_path / "visit.txt").write_text("log")
    extra = {"benchmarks/gpu_cuda.json": tmp_path / "gpu_cuda.json", "benchmarks/gpu_cpu.json": tmp_path / "gpu_cpu.json",
             "logs/visit.txt": tmp_path / "visit.txt"}
    archives = transfer.export_results("smoke", tmp_path / "out", extra=extra)["archives"]
    with pytest.raises(transfer.TransferError, match="must go under benchmarks/ or logs/"):
        transfer.export_results("smoke", tmp_path / "bad", extra={"runs/x": tmp_path / "visit.txt"})
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "runs_b"))
    sealing.trust(tmp_path / "runs_b", sealing.store_key_of(clone_a[1]))
    done = transfer.import_results(archives, benchmarks_dir=tmp_path / "bench")
    assert done.files == [tmp_path / "bench" / "gpu_cuda.json"] and done.metrics == 0
    assert (tmp_path / "runs_b" / "imported" / "smoke" / "logs" / "visit.txt").read_text() == "log"
    assert (tmp_path / "runs_b" / "imported" / "smoke" / "benchmarks" / "gpu_cpu.json").exists()
