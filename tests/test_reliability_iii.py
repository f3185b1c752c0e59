"""Reliability III: results that travel between machines cannot forge a verdict, run code in a reader's
browser, or make the book read or write outside the store (issue 38).

Each test is one probe of the issue, kept so that it stays passed; each failed on the version (74eddd6) that
lacked the protection it names. Results are sealed (`circuitbook.seal`): an HMAC by a key the store keeps
and archives never carry; a GPU visit seals with a visit key (`circuitbook visit-key`) the home store knows.
"""
import errno
import hashlib
import hmac
import json
import os
import shutil
import stat
import subprocess
import tarfile

import nbformat
import pytest

import circuitbook as cb
from circuitbook import book, build, claims, context, params, settings, transfer
from circuitbook.runs import canonical_json
from conftest import ROOT
from conftest import run_cli as cli
from minibook import notebook as mini_notebook
from minibook import write
import sealing


def quiet(_msg):
    pass


def _rows(profile="smoke", label=None):
    return {r["id"]: r for r in claims.scorecard(profile, label)}


def _executing(lines):
    return [line.split(":")[0] for line in lines if line.endswith(": executing ...")]


DATA_PARAM = "  data: {type: path, nullable: true, help: a data file}\n"


def _with_data_parameter(root):
    prof = root / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("parameters:\n", "parameters:\n" + DATA_PARAM, 1)
                    .replace("defaults: {value: 1.0, fail: false}", "defaults: {value: 1.0, fail: false, data: null}"))


def _set_smoke_value(root, value):
    prof = root / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", f"smoke: {{value: {value}}}"))


@pytest.fixture(scope="module")
def clone_a(tmp_path_factory):
    """A mini book (with a path parameter) executed at smoke in clone A and exported: (A, A's store, archives)."""
    tmp = tmp_path_factory.mktemp("iii_a")
    a = write(tmp / "a")
    _with_data_parameter(a)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CIRCUITBOOK_ROOT", str(a))
        mp.setenv("CIRCUITBOOK_RUNS", str(tmp / "runs_a"))
        mp.setenv("CIRCUITBOOK_PROGRESS", "0")
        for nb in ("demo/01_make", "demo/02_use"):
            build.run_one(nb, "smoke", {}, log=quiet)
        archives = transfer.export_results("smoke", tmp / "out")["archives"]
    assert len(archives) == 1
    return a, tmp / "runs_a", archives


@pytest.fixture
def clone_b(clone_a, tmp_path, monkeypatch):
    """A copy of A's sources with an empty store of its own (which trusts nothing yet)."""
    b = shutil.copytree(clone_a[0], tmp_path / "b", ignore=shutil.ignore_patterns("_build"))
    monkeypatch.setenv("CIRCUITBOOK_ROOT", str(b))
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "runs_b"))
    return b


def _trust_a(clone_a, tmp_path):
    """B knows A's key, as a home store knows the key of the visit it started."""
    return sealing.trust(tmp_path / "runs_b", sealing.store_key_of(clone_a[1]))


def _nothing_written(tmp_path):
    runs = tmp_path / "runs_b"
    return not (runs / "results").exists() and not (runs / "executed").exists() and not (runs / "imported").exists()


# ---------------------------------------------------------------- seals: known answers

def test_seal_known_answers():
    from circuitbook import seal

    key = bytes(range(32))
    assert seal.key_id(key) == hashlib.sha256(key).hexdigest()[:16] == "630dcd2966c43366"
    record = {"values": {"x": {"value": 1.5, "run": None}}, "label": "smoke", "status": "ok"}
    sha = "ab" * 32
    expected = hmac.new(key, (canonical_json(record) + "\n" + sha).encode(), hashlib.sha256).hexdigest()
    assert seal.seal_of(record, sha, key) == expected
    sealed = seal.apply(record, sha, key)
    assert sealed["seal"] == {"key": "630dcd2966c43366", "hmac": expected} and "seal" not in record
    keys = {seal.key_id(key): key}
    assert seal.verify(sealed, sha, keys) is None
    assert seal.seal_of(sealed, sha, key) == expected, "the seal covers the record without its seal"
    assert "not sealed" in seal.verify(record, sha, keys)
    assert "unknown key 630dcd2966c43366" in seal.verify(sealed, sha, {})
    assert "does not verify" in seal.verify(sealed, "cd" * 32, keys), "the executed notebook is covered"
    forged = json.loads(json.dumps(sealed))
    forged["values"]["x"]["value"] = 2.5
    assert "does not verify" in seal.verify(forged, sha, keys)


def test_seal_hmac_matches_a_fixed_vector():
    """A fixed vector (computed once with Python's hmac module and kept): the format cannot drift silently."""
    from circuitbook import seal

    assert seal.seal_of({"a": 1}, "0" * 64, b"\x01" * 32) == \
        "64cd7b4029b5ebb79f0e7a7cecba1aa6a9648a21203c59052cf029dba46d51fe"


def test_the_store_key_is_private_made_once_and_a_damaged_one_is_never_replaced(runs_dir, monkeypatch):
    from circuitbook import seal

    assert seal.store_key() is None, "reading never creates a key"
    key = seal.store_key(create=True)
    path = runs_dir / ".keys" / "seal.key"
    assert len(key) == 32 and path.read_bytes() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert seal.store_key(create=True) == key and seal.store_key() == key
    path.write_bytes(key[:5])
    with pytest.raises(seal.SealError, match=str(path)):
        seal.store_key(create=True)
    assert path.read_bytes() == key[:5], "never silently replaced"
    monkeypatch.setenv("CIRCUITBOOK_SEAL_KEY", "11" * 32)
    assert seal.store_key() == b"\x11" * 32, "a visit seals with the key it was given"
    settings.check_environment()
    monkeypatch.setenv("CIRCUITBOOK_SEAL_KEY", "xyz")
    with pytest.raises(settings.SettingError, match="CIRCUITBOOK_SEAL_KEY.*64 hexadecimal"):
        settings.check_environment()


# ---------------------------------------------------------------- probe 1: forgery with recomputed digests

def _forge(path, executed, edit):
    """Edit a results file and recompute the two digests stored beside it in the store (the executed
    notebook's results digest, the cache record's SHA-256): the files agree with each other again."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    nb = nbformat.read(executed, as_version=4)
    nb.metadata["circuitbook"]["results_sha256"] = context.results_digest(data)
    nbformat.write(nb, executed)
    record = executed.with_suffix(".json")
    meta = json.loads(record.read_text())
    meta["sha256"] = hashlib.sha256(executed.read_bytes()).hexdigest()
    record.write_text(json.dumps(meta))


def test_forged_values_with_recomputed_digests_are_not_graded_and_are_executed_again(mini_book, runs_dir, tmp_path):
    _set_smoke_value(mini_book, 0.5)
    build.build("smoke", log=quiet)
    assert _rows()["D-1"]["status"] == "not reproduced"
    path = context.results_path("demo", "01_make", "smoke")
    _forge(path, context.executed_notebook_path("demo", "01_make", "smoke"),
           lambda d: d["values"]["demo_value"].update(value=2.5))
    status = _rows()["D-1"]["status"]
    assert status.startswith("not run: ") and "not sealed by this store" in status and str(path) in status, status
    assert "its values are not graded" in status
    with pytest.raises(claims.NotRecorded, match="not sealed by this store"):
        claims.recorded_values("demo", "01_make", "smoke")
    exported = transfer.export_results("smoke", tmp_path / "out")
    assert exported["notebooks"] == ["demo/02_use"] and any("demo/01_make" in s and "not sealed" in s
                                                            for s in exported["left_out"]), exported
    lines = []
    build.build("smoke", log=lines.append)
    assert "[1/2] chapters/demo/01_make.ipynb" in _executing(lines)
    assert any("not sealed by this store" in line for line in lines), lines
    row = _rows()["D-1"]
    assert row["status"] == "not reproduced" and row["measured"] == "demo_value = 0.5"


def _forge_values(files, manifest):
    files["results/smoke/demo/01_make.json"]["values"]["demo_value"]["value"] = 9.0


def _script_output(files, manifest):
    name = "executed/smoke/chapters/demo/02_use.ipynb"
    nb = nbformat.reads(files[name].decode(), as_version=4)
    nb.cells[-1].outputs.append(nbformat.v4.new_output("display_data", data={
        "text/html": "<script>alert('cb-probe')</script>", "text/plain": "x"}))
    files[name] = nbformat.writes(nb).encode()


@pytest.mark.parametrize("change, trusted, needle", [
    (_forge_values, True, "results/smoke/demo/01_make.json is not sealed by a key this store knows"),
    (_script_output, True, "results/smoke/demo/02_use.json is not sealed by a key this store knows"),
    (None, False, "sealed by an unknown key"),
], ids=["forged values", "script output", "unknown key"])
def test_a_forged_or_unknown_archive_is_refused_whole(clone_a, clone_b, tmp_path, change, trusted, needle):
    if trusted:
        _trust_a(clone_a, tmp_path)
    bad = sealing.repack(clone_a[2][0], tmp_path / "bad.tar.gz", change)
    with pytest.raises(transfer.TransferError) as e:
        transfer.import_results([bad])
    assert needle in str(e.value) and str(bad) in str(e.value), str(e.value)
    assert _nothing_written(tmp_path)


# ---------------------------------------------------------------- probe 2: a copy from another label

def test_a_result_copied_from_another_label_is_not_graded(mini_book, runs_dir):
    _set_smoke_value(mini_book, 0.5)
    build.run_one("demo/01_make", "smoke", {}, log=quiet)
    build.run_one("demo/01_make", "smoke", {"value": 3.0}, label="x", log=quiet)
    assert _rows()["D-1"]["status"] == "not reproduced" and _rows(label="smoke+x")["D-1"]["status"] == "reproduced"
    results = runs_dir / "results"
    executed = runs_dir / "executed"
    shutil.copy(results / "smoke+x" / "demo" / "01_make.json", results / "smoke" / "demo" / "01_make.json")
    for suffix in (".ipynb", ".json"):
        shutil.copy(executed / "smoke+x" / "chapters" / "demo" / f"01_make{suffix}",
                    executed / "smoke" / "chapters" / "demo" / f"01_make{suffix}")
    status = _rows()["D-1"]["status"]
    assert status.startswith("not run: ") and "records demo/01_make at smoke+x, not at smoke" in status, status
    with pytest.raises(claims.NotRecorded, match="at smoke\\+x, not at smoke"):
        claims.recorded_values("demo", "01_make", "smoke")
    lines = []
    build.build("smoke", log=lines.append)
    assert "[1/2] chapters/demo/01_make.ipynb" in _executing(lines)
    assert _rows()["D-1"]["status"] == "not reproduced"


# ---------------------------------------------------------------- seals across machines: visits and imports

def test_a_visit_key_seals_a_visit_and_an_import_is_resealed_keeping_its_provenance(mini_book, tmp_path, monkeypatch,
                                                                                    capsys):
    from circuitbook import seal

    home, visit = tmp_path / "home", tmp_path / "visit"
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(home))
    code, out, err = cli(["visit-key"], capsys)
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("CIRCUITBOOK_SEAL_KEY=")]
    hexkey = line.split("=", 1)[1]
    key = bytes.fromhex(hexkey)
    visit_id = seal.key_id(key)
    keyfile = home / ".keys" / "visits" / f"{visit_id}.key"
    assert keyfile.read_bytes() == key and stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    # the visit: its own store, sealing with the key it was given
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(visit))
    monkeypatch.setenv("CIRCUITBOOK_SEAL_KEY", hexkey)
    build.run_one("demo/01_make", "smoke", {}, log=quiet)
    there = json.loads(context.results_path("demo", "01_make", "smoke").read_text())
    assert there["seal"]["key"] == visit_id
    prov = there["provenance"]
    assert {"machine", "environment", "commit", "date", "seconds", "sealed_by"} <= set(prov)
    assert prov["sealed_by"] == visit_id and not (visit / ".keys").exists(), "the visit keeps no key file"
    archives = transfer.export_results("smoke", tmp_path / "out")["archives"]
    for archive in archives:
        for name, data in sealing.members(archive).items():
            assert key not in data and hexkey.encode() not in data and ".keys" not in name, name
    # home: the import verifies by the visit key, then seals by its own
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(home))
    monkeypatch.delenv("CIRCUITBOOK_SEAL_KEY")
    code, out, err = cli(["import-results", *map(str, archives)], capsys)
    assert code == 0 and "1 current" in out, (out, err)
    here = json.loads(context.results_path("demo", "01_make", "smoke").read_text())
    own = seal.key_id(seal.store_key())
    assert here["seal"]["key"] == own != visit_id and here["provenance"] == prov
    row = _rows()["D-1"]
    assert row["status"] == "reproduced"
    assert row["provenance"] == f"{prov['machine']} · {prov['environment']} · {prov['commit']}", row["provenance"]
    keyfile.unlink()  # a visit this store no longer knows
    context.results_path("demo", "01_make", "smoke").unlink()
    with pytest.raises(transfer.TransferError, match=f"sealed by an unknown key {visit_id}"):
        transfer.import_results(archives)


def test_no_archive_carries_a_key(clone_a):
    key = sealing.store_key_of(clone_a[1])
    for archive in clone_a[2]:
        for name, data in sealing.members(archive).items():
            assert key not in data and key.hex().encode() not in data, name
            assert ".keys" not in name and not name.endswith(".key"), name


def test_every_record_the_build_writes_carries_its_provenance(mini_book, runs_dir):
    build.run_one("demo/01_make", "smoke", {}, log=quiet)
    data = json.loads(context.results_path("demo", "01_make", "smoke").read_text())
    prov = data["provenance"]
    assert prov["environment"].startswith("declared") and prov["seconds"] > 0 and prov["date"]
    assert prov["machine"] and "commit" in prov
    assert _rows()["D-1"]["provenance"].count(" · ") == 2


# ---------------------------------------------------------------- probe 3: script in the rendered book

HOSTILE_OUTPUTS = [
    nbformat.v4.new_output("display_data", data={
        "text/html": '<script>alert("cb-probe")</script><b onmouseover="alert(1)">kept bold</b>'
                     '<a href="javascript:alert(2)">link</a><iframe src="https://example.org"></iframe>'
                     '<table><tr><td>kept cell</td></tr></table><img src=x onerror="alert(3)">',
        "text/plain": "kept plain"}),
    nbformat.v4.new_output("display_data", data={"application/javascript": "alert('cb-js')",
                                                 "text/plain": "<IPython.core.display.Javascript object>"}),
    nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "x"},
                                                 "text/plain": "widget"}),
    nbformat.v4.new_output("display_data", data={
        "image/svg+xml": '<svg xmlns="http://www.w3.org/2000/svg"><script>alert("cb-svg")</script>'
                         '<rect width="5" height="5" onload="alert(4)"/></svg>'}),
    nbformat.v4.new_output("display_data", data={"text/markdown": "<script>alert('cb-md')</script>"}),
]


def test_active_content_of_stored_notebooks_is_never_staged_or_rendered(mini_book, runs_dir):
    build.build("smoke", log=quiet)
    executed = context.executed_notebook_path("demo", "02_use", "smoke")
    nb = nbformat.read(executed, as_version=4)
    nb.cells[-1].outputs.extend(HOSTILE_OUTPUTS)
    nb.cells.append(nbformat.v4.new_markdown_cell("Not the book's text <script>alert('cb-cell')</script>"))
    nbformat.write(nb, executed)
    sealing.reseal("demo", "02_use", "smoke")  # sealed as the store's own (or an imported visit's)
    assert _rows()["D-2"]["status"] == "reproduced"
    lines = []
    html = build.build("smoke", log=lines.append, execute_missing=False)
    assert any("02_use.ipynb: unchanged, cached" in line for line in lines), lines
    staged = nbformat.read(mini_book / "_build" / "smoke" / "src" / "chapters" / "demo" / "02_use.ipynb", 4)
    outputs = json.dumps([c.get("outputs", []) for c in staged.cells])
    for active in ("<script", "javascript:", "onmouseover", "onerror", "onload", "<iframe", "application/javascript",
                   "widget-view", "text/markdown"):
        assert active not in outputs, active
    for kept in ("kept bold", "kept cell", "kept plain", "twice 4.0", "image/svg+xml", "<rect"):
        assert kept in outputs, kept
    (foreign,) = [c for c in staged.cells if "cb-cell" in c.source]
    assert foreign.cell_type == "markdown" and foreign.source.startswith("```text\n"), "shown as text, not read"
    page = (html / "chapters" / "demo" / "02_use.html").read_text()
    for active in ('alert("cb-probe")', "alert('cb-js')", 'alert("cb-svg")', "alert('cb-md')", "onerror=",
                   "javascript:alert", "<script>alert('cb-cell')"):
        assert active not in page, active
    assert "kept bold" in page and "twice 4.0" in page


# ---------------------------------------------------------------- probe 4: reading outside the store

def _loop(tmp_path):
    link = tmp_path / "loop"
    link.symlink_to(link)
    return link


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    return tmp_path / "pipe"


def _big_folder(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    for i in range(60):
        (folder / f"f{i}").write_text("x")
    return folder


def _folder_with_fifo(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_text("x")
    os.mkfifo(folder / "pipe")
    return folder


PLACES = [
    (lambda t: "/", "the whole filesystem"),
    (lambda t: "/proc", "/proc"),
    (lambda t: "/sys/kernel", "/sys"),
    (lambda t: "/dev/zero", "/dev"),
    (_fifo, "not a regular file or folder"),
    (_loop, "symlink loop"),
    (_big_folder, "more than 50 entries"),
    (_folder_with_fifo, "pipe is not a regular file"),
]


@pytest.mark.parametrize("place, needle", PLACES, ids=["root", "proc", "sys", "device", "fifo", "loop", "big folder",
                                                       "fifo inside"])
def test_a_file_a_parameter_names_is_never_hashed_unless_safe(tmp_path, monkeypatch, place, needle):
    monkeypatch.setattr(params, "MAX_FOLDER_ENTRIES", 50)
    monkeypatch.setattr(params, "_file_digest", lambda p: pytest.fail(f"{p} was read"))
    path = place(tmp_path)
    with pytest.raises(params.ParameterError) as e:
        params.content_digest(path)
    assert needle in str(e.value) and "not read" in str(e.value), str(e.value)


def test_run_refuses_a_path_outside_the_limits_before_the_kernel(mini_book, runs_dir, capsys):
    _with_data_parameter(mini_book)
    code, _, err = cli(["run", "demo/01_make", "--profile", "smoke", "-p", "data", "/proc"], capsys)
    assert code == 2 and "'data'" in err and "/proc" in err and "not read" in err, err
    assert not (runs_dir / "results").exists()


def test_an_archive_naming_a_huge_folder_imports_stale_without_reading_it(clone_a, clone_b, tmp_path, monkeypatch):
    visit_id = _trust_a(clone_a, tmp_path)

    def usr(files, manifest):
        data = files["results/smoke/demo/01_make.json"]
        data["overrides"] = {"data": "/usr"}
        data["inputs"]["files"] = {"data": "sha256:" + "0" * 64 + ":1"}
        data["input_hash"] = book.inputs_hash(data["inputs"])
        record = "executed/smoke/chapters/demo/01_make.json"
        files[record] = json.dumps({**json.loads(files[record]), "input_hash": data["input_hash"]}).encode()

    archive = sealing.repack(clone_a[2][0], tmp_path / "usr.tar.gz", usr, key=sealing.store_key_of(clone_a[1]))
    assert visit_id
    monkeypatch.setattr(params, "_file_digest", lambda p: pytest.fail(f"{p} was read"))
    done = transfer.import_results([archive])
    assert set(done.stale) == {"demo/01_make", "demo/02_use"} and not done.current, done
    assert done.stale["demo/02_use"] == ["upstream 01_make was executed again"]
    (why,) = done.stale["demo/01_make"]
    assert "/usr" in why and "not read" in why, why
    status = _rows()["D-1"]["status"]
    assert status.startswith("stale: ") and "/usr" in status, status


# ---------------------------------------------------------------- probe 5: writing outside the store

def test_an_import_writes_into_the_checkout_only_allowed_benchmark_results(clone_a, clone_b, tmp_path, monkeypatch):
    _trust_a(clone_a, tmp_path)
    monkeypatch.setattr(transfer, "MAX_BENCHMARK_BYTES", 100)
    extra = {"benchmarks/gpu_cuda.json": b'{"speedup": 3}', "benchmarks/evil_cuda.sh": b"rm -rf ~",
             "benchmarks/x_cuda.json": b"not json", "benchmarks/Upper_cuda.json": b"{}",
             "benchmarks/big_cuda.txt": b"x" * 200, "benchmarks/cuda": b"{}", "logs/cuda_notes.txt": b"log"}
    archive = sealing.repack(clone_a[2][0], tmp_path / "bench.tar.gz", extra=extra)
    before = sorted(p.relative_to(clone_b).as_posix() for p in clone_b.rglob("*"))
    done = transfer.import_results([archive])
    after = sorted(p.relative_to(clone_b).as_posix() for p in clone_b.rglob("*"))
    assert set(after) - set(before) == {"benchmarks", "benchmarks/results", "benchmarks/results/gpu_cuda.json"}
    assert done.files == [clone_b / "benchmarks" / "results" / "gpu_cuda.json"]
    assert {n for n, _ in done.not_placed} == {"evil_cuda.sh", "x_cuda.json", "Upper_cuda.json", "big_cuda.txt", "cuda"}
    kept = tmp_path / "runs_b" / "imported" / "smoke" / "benchmarks"
    assert (kept / "evil_cuda.sh").exists(), "everything else stays in the store"


# ---------------------------------------------------------------- other failures: sizes

def _with_member(clone_a, tmp_path, name, size):
    src = sealing.members(clone_a[2][0])
    dest = tmp_path / "big.tar.gz"
    with tarfile.open(dest, "w:gz", compresslevel=1) as tar:
        for n, data in src.items():
            info = tarfile.TarInfo(n)
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))
        info = tarfile.TarInfo(name)
        info.size = size

        class Zeros:
            def __init__(self):
                self.left = size

            def read(self, n=-1):
                n = self.left if n is None or n < 0 else min(n, self.left)
                self.left -= n
                return bytes(n)

        tar.addfile(info, Zeros())
    return dest


def test_an_oversized_member_is_refused_before_anything_is_written(clone_a, clone_b, tmp_path, monkeypatch):
    _trust_a(clone_a, tmp_path)
    big = _with_member(clone_a, tmp_path, "logs/huge.txt", 65 * 2 ** 20)
    assert big.stat().st_size < 2 ** 20
    with pytest.raises(transfer.TransferError, match="logs/huge.txt is 65.0 MiB; a member may be at most 64 MiB"):
        transfer.import_results([big])
    assert _nothing_written(tmp_path)
    monkeypatch.setattr(transfer, "MAX_TOTAL_BYTES", 20_000)
    small = _with_member(clone_a, tmp_path, "logs/more.txt", 30_000)
    with pytest.raises(transfer.TransferError, match="logs/more.txt takes the archives past 0.0 MiB uncompressed"):
        transfer.import_results([small])
    assert _nothing_written(tmp_path)


# ---------------------------------------------------------------- other failures: a worse import replaces nothing

@pytest.mark.parametrize("status", ["failed", "running"])
def test_a_failed_or_running_import_never_replaces_a_current_local_result(clone_a, clone_b, tmp_path, status):
    _trust_a(clone_a, tmp_path)
    build.run_one("demo/01_make", "smoke", {}, log=quiet)
    local = context.read_results("demo", "01_make", "smoke")

    def worse(files, manifest):
        data = files["results/smoke/demo/01_make.json"]
        data["status"] = status
        data.pop("seal", None)

    archive = sealing.repack(clone_a[2][0], tmp_path / "worse.tar.gz", worse)
    done = transfer.import_results([archive])
    assert done.kept_local == ["demo/01_make"] and "demo/01_make" not in done.failed, done
    assert context.read_results("demo", "01_make", "smoke")["execution"] == local["execution"]
    assert _rows()["D-1"]["status"] == "reproduced"


# ---------------------------------------------------------------- other failures: values of the wrong type

BAD_VALUES = [("true", True), ("a dict", {"a": 1.0}), ("null", None), ("a nested list", [[1.0, 2.0]]),
              ("an empty list", []), ("1e400", "1e400"), ("a list with text", [1.0, "x"]),
              ("a list with 1e400", ["1e400"])]


@pytest.mark.parametrize("name, value", BAD_VALUES, ids=[n for n, _ in BAD_VALUES])
def test_a_value_that_is_not_a_number_makes_its_rows_not_run_and_the_rest_renders(mini_book, runs_dir, name, value):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 2.0)
    sealing.finish()
    path = context.results_path("demo", "01_make", "smoke")
    data = json.loads(path.read_text())
    literal = value in ("1e400", ["1e400"])
    data["values"]["demo_value"]["value"] = [float("inf")] if value == ["1e400"] else float("inf") if literal else value
    path.write_text(json.dumps(data))
    sealing.reseal("demo", "01_make", "smoke")
    if literal:  # the same number to a parser, sealed as such; written as no JSON writer writes it
        path.write_text(path.read_text().replace("Infinity", "1e400"))
    rows = _rows()
    expected = (f"not run: results file {path} holds a value of demo_value that is not a number, text or list of "
                "numbers")
    assert rows["D-1"]["status"].startswith(expected), rows["D-1"]["status"]
    assert rows["D-2"]["status"].startswith("not run: demo/02_use not executed")
    with pytest.raises(claims.NotRecorded, match="holds a value of demo_value that is not a number"):
        claims.recorded_values("demo", "01_make", "smoke")


def test_an_infinity_as_record_writes_it_is_a_number(mini_book, runs_dir):
    """record() writes an infinity as `Infinity` (algorithmic_cores records "no dimension suffices" so): it is
    graded by the rules like any number, unlike a literal too large for a float."""
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", [float("inf"), 3.0, float("inf")])
    sealing.finish()
    assert _rows()["D-1"]["status"] == "reproduced" and claims.recorded_values("demo", "01_make", "smoke")


@pytest.mark.parametrize("interval, ok", [([2.0, 2.5], True), ([2.5, 1.5], False), ([1.0], False),
                                          (["a", 2.0], False), ([1.0, float("nan")], False), ([True, 2.0], False)])
def test_an_interval_beside_a_value_is_accepted_and_checked(mini_book, runs_dir, interval, ok):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 2.0)
    sealing.finish()
    path = context.results_path("demo", "01_make", "smoke")
    data = json.loads(path.read_text())
    data["values"]["demo_value"]["interval"] = interval
    path.write_text(json.dumps(data))
    sealing.reseal("demo", "01_make", "smoke")
    status = _rows()["D-1"]["status"]
    assert (status == "reproduced") if ok else ("interval of demo_value" in status and status.startswith("not run"))


# ---------------------------------------------------------------- other failures: export-results

def test_export_keeps_the_archives_in_out_until_it_has_something_to_export(mini_book, runs_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    old = out / "circuitbook-results-cpu-1.tar.gz"
    old.write_bytes(b"an earlier export")
    code, _, err = cli(["export-results", "--label", "cpu", "--out", str(out)], capsys)
    assert code == 2 and "no results under" in err
    assert old.read_bytes() == b"an earlier export"


class _FullDisk:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, path, room):
        self.f, self.room = open(path, "wb"), room

    def write(self, data):
        if self.f.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_leaves_no_truncated_archive_under_the_final_name(mini_book, runs_dir, tmp_path, monkeypatch,
                                                                      capsys):
    build.run_one("demo/01_make", "smoke", {}, log=quiet)
    out = tmp_path / "out"
    out.mkdir()
    old = out / "circuitbook-results-smoke-1.tar.gz"
    old.write_bytes(b"an earlier export")
    monkeypatch.setattr(transfer, "open", lambda path, mode="r", *a, **k: _FullDisk(path, 700)
                        if "w" in mode else open(path, mode, *a, **k), raising=False)
    code, _, err = cli(["export-results", "--label", "smoke", "--out", str(out)], capsys)
    assert code == 1 and "No space left on device" in err, err
    assert sorted(p.name for p in out.iterdir()) == [old.name] and old.read_bytes() == b"an earlier export"


# ---------------------------------------------------------------- other failures: a downstream of a re-executed upstream

READS_UPSTREAM = """from circuitbook import claims
try:
    v = claims.recorded_values("demo", "01_make", cfg.profile)["demo_value"]
    why = None
except claims.NotRecorded as e:
    v, why = float("nan"), str(e)
cb.record("demo_twice", 2 * v, why=why)"""


def test_a_downstream_is_executed_again_when_the_upstream_it_read_is(mini_book, runs_dir):
    nbformat.write(mini_notebook("demo", "02_use", READS_UPSTREAM), mini_book / "chapters" / "demo" / "02_use.ipynb")
    build.run_one("demo/02_use", "smoke", {}, log=quiet)  # the upstream is not executed yet
    status = _rows()["D-2"]["status"]
    assert status.startswith("not measured: demo/01_make has not been executed at smoke"), status
    lines = []
    build.build("smoke", log=lines.append)  # no --force
    assert _executing(lines) == ["[1/2] chapters/demo/01_make.ipynb", "[2/2] chapters/demo/02_use.ipynb"], lines
    assert _rows()["D-2"]["status"] == "reproduced"
    lines = []
    build.build("smoke", log=lines.append)
    assert _executing(lines) == [], "and cached after that"
    build.run_one("demo/01_make", "smoke", {}, log=quiet, force=True)  # executed again: D-2 read the old one
    assert _rows()["D-2"]["status"].startswith("stale: upstream 01_make was executed again"), _rows()["D-2"]["status"]


# ---------------------------------------------------------------- other failures: the environment as installed

def _installed(monkeypatch, versions, python=None):
    real = book.installed_version
    monkeypatch.setattr(book, "installed_version", lambda name: versions.get(name, real(name)))
    if python:
        monkeypatch.setattr(book, "python_version", lambda: python)


def test_results_of_a_shadowed_package_are_stale_and_executed_again(mini_book, runs_dir, monkeypatch):
    (mini_book / "requirements.lock").write_text("# the lock\nPyYAML==6.0.4\n")
    with monkeypatch.context() as m:
        _installed(m, {"pyyaml": "5.1"})
        build.build("smoke", log=quiet)
        assert book.installed_environment()["pyyaml"] == "5.1"
    data = json.loads(context.results_path("demo", "01_make", "smoke").read_text())
    undeclared = "undeclared (pyyaml 5.1 installed, requirements.lock says 6.0.4)"
    assert data["provenance"]["environment"] == undeclared
    _installed(monkeypatch, {"pyyaml": "6.0.4"})
    for row in _rows().values():
        assert row["status"] == f"stale: recorded in an undeclared environment ({undeclared[12:-1]})", row["status"]
    lines = []
    build.build("smoke", log=lines.append)
    assert len(_executing(lines)) == 2, lines
    assert {r["status"] for r in _rows().values()} == {"reproduced"}


def _device_book(root, numpy_here):
    (root / "requirements.lock").write_text(f"numpy=={numpy_here}\ntorch==2.13.0\n")
    (root / "scripts" / "device").mkdir(parents=True)
    (root / "scripts" / "device" / "packages.yml").write_text(
        "python: '3.12'\ncarried: {}\nimage:\n  torch: 2.11.0\n  numpy: 2.5.2\n  scipy: null\n")


@pytest.mark.parametrize("numpy, current", [("2.5.2", True), ("2.6.0", False)])
def test_gpu_archives_are_current_only_under_the_images_declared_versions(mini_book, tmp_path, monkeypatch, numpy,
                                                                         current):
    from circuitbook import seal

    import importlib.metadata as md

    _device_book(mini_book, md.version("numpy"))
    key = os.urandom(32)
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "visit"))
    monkeypatch.setenv("CIRCUITBOOK_SEAL_KEY", key.hex())
    with monkeypatch.context() as m:
        _installed(m, {"torch": "2.11.0+cu130", "numpy": numpy}, python="3.12.3")
        build.run_one("demo/01_make", "smoke", {}, log=quiet)
        archives = transfer.export_results("smoke", tmp_path / "out")["archives"]
    monkeypatch.delenv("CIRCUITBOOK_SEAL_KEY")
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "home"))
    sealing.trust(tmp_path / "home", key)
    assert seal.store_key() is None
    done = transfer.import_results(archives)
    row = _rows()["D-1"]
    if current:
        assert done.current == ["demo/01_make"] and row["status"] == "reproduced", row["status"]
        assert "device image" in row["provenance"] and "torch 2.11.0+cu130" in row["provenance"], row["provenance"]
    else:
        why = "recorded in an undeclared environment (numpy 2.6.0 installed, the device image declares 2.5.2"
        assert any(why in w for w in done.stale["demo/01_make"]), done.stale
        assert row["status"].startswith(f"stale: {why}"), row["status"]


def test_the_environment_identity_is_the_declared_one_on_every_machine(mini_book, monkeypatch):
    """What enters a notebook's inputs is what the book declares (the lock and the image's versions), so a CPU
    result and a GPU result of the same code are both current; editing a declaration changes it."""
    import importlib.metadata as md

    _device_book(mini_book, md.version("numpy"))
    here = book.environment_hash()
    with monkeypatch.context() as m:
        _installed(m, {"torch": "2.11.0+cu130", "numpy": "2.5.2"}, python="3.12.3")
        assert book.environment_hash() == here
        assert book.environment_verdict().startswith("declared: device image")
    assert book.environment_verdict().startswith("declared: the locked environment")
    packages = mini_book / "scripts" / "device" / "packages.yml"
    packages.write_text(packages.read_text().replace("2.5.2", "2.5.3"))
    assert book.environment_hash() != here


# ---------------------------------------------------------------- other failures: release and the visit script

def _release(tmp_path):
    from test_release import synthetic_release

    return synthetic_release(tmp_path / "release")


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.symlink_to(p), "is a symlink loop"),
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: os.mkfifo(p), "is not a regular file"),
], ids=["symlink loop", "folder", "fifo"])
def test_a_release_refuses_checkpoint_named_links_folders_and_fifos(tmp_path, runs_dir, capsys, make, needle):
    from circuitbook.models.loading import read_release

    folder = _release(tmp_path)
    make(folder / "checkpoint_step_61.pth")
    with pytest.raises(ValueError) as e:
        read_release(folder)
    assert "checkpoint_step_61.pth" in str(e.value) and needle in str(e.value), str(e.value)
    code, _, err = cli(["release", "assign_add", str(folder), "--profile", "smoke"], capsys)
    assert code == 2 and "checkpoint_step_61.pth" in err and needle in err, err
    assert not runs_dir.exists()


def test_a_pair_split_that_is_no_file_of_pairs_is_refused_before_any_kernel(tmp_path, runs_dir, capsys):
    folder = _release(tmp_path)
    first_line = open("/etc/passwd").readline().strip()
    for args in (["release", "assign_add", str(folder)], ["run", "assign_add/03_generalization"]):
        code, out, err = cli(args + ["--profile", "smoke", "-p", "pair_split", "/etc/passwd"], capsys)
        assert code == 2, (out, err)
        assert "pair_split" in err and "/etc/passwd" in err and "'authors'" in err and "'book'" in err, err
        assert "a file of training pairs" in err and first_line not in err + out, err
    assert not runs_dir.exists(), "no kernel started"


@pytest.fixture
def script_checkout(tmp_path):
    """A checkout with the visit script and a chapter, without .whl/."""
    (tmp_path / "co" / "scripts").mkdir(parents=True)
    (tmp_path / "co" / "chapters" / "assign_add").mkdir(parents=True)
    (tmp_path / "co" / "chapters" / "assign_add" / "profiles.yml").write_text("{}\n")
    script = tmp_path / "co" / "scripts" / "device-run.sh"
    script.write_bytes((ROOT / "scripts" / "device-run.sh").read_bytes())
    return script


@pytest.mark.parametrize("args, needle", [
    (["--out", "FILE"], "--out FILE is a file, not a folder"),
    (["--budget-s", "5"], "--budget-s 5: a visit needs at least 40 s"),
    (["--chapter", "nope"], "--chapter nope is not a chapter; chapters: assign_add"),
    (["--no-key"], "CIRCUITBOOK_SEAL_KEY is not set"),
    (["--bad-key"], "CIRCUITBOOK_SEAL_KEY must be 64 hexadecimal digits"),
], ids=["out is a file", "budget", "chapter", "no key", "bad key"])
def test_the_visit_script_refuses_bad_input_before_installing_anything(script_checkout, tmp_path, args, needle):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["CIRCUITBOOK_SEAL_KEY"] = "ab" * 32
    if args == ["--no-key"]:
        args = []
        del env["CIRCUITBOOK_SEAL_KEY"]
    if args == ["--bad-key"]:
        args, env["CIRCUITBOOK_SEAL_KEY"] = [], "xyz"
    (tmp_path / "FILE").write_text("a file")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(["bash", str(script_checkout), *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and needle.replace("FILE", str(tmp_path / "FILE")) in text, text
    assert "no wheels" not in text and "Traceback" not in text, text


def test_a_copy_without_git_history_names_the_commit_it_was_given(tmp_path, monkeypatch):
    """A GPU visit's working tree travels without .git: its provenance names the commit the visit was given."""
    from circuitbook import seal, settings

    (tmp_path / "_toc.yml").write_text("root: intro\n")
    monkeypatch.setenv("CIRCUITBOOK_ROOT", str(tmp_path))
    monkeypatch.delenv("CIRCUITBOOK_COMMIT", raising=False)
    assert seal.commit().startswith("unknown")
    monkeypatch.setenv("CIRCUITBOOK_COMMIT", "0123abcd4567 (clean)")
    assert seal.commit() == "0123abcd4567 (clean)"
    with pytest.raises(settings.SettingError, match="is not a git commit"):
        settings.check_environment({"CIRCUITBOOK_COMMIT": "HEAD; rm -rf /"})
