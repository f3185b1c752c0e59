"""A visit to a GPU machine: the wheels it needs, the groups it runs within its budget, the dry run CI does."""
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import device_pack  # noqa: E402

ENV = device_pack.target_environment("3.12")


def test_requirements_are_met_by_carried_or_image_packages_known_answers():
    carried = {"a": ("1.0", ["b>=2", "c<3", "d; extra == 'docs'", "e; python_version < '3.11'", "gone"]),
               "b": ("2.5", [])}
    problems, notes = device_pack.check_requirements(carried, {"c": "2.9"}, {"gone": "never imported"}, ENV)
    assert problems == [] and notes == ["a needs gone: not carried (never imported)"]
    problems, _ = device_pack.check_requirements(carried, {"c": "3.1"}, {}, ENV)
    assert problems == ["a 1.0 needs c<3 but c 3.1 is in the image",
                        "a 1.0 needs gone, which is neither carried nor in the image (add it to carried, or to "
                        "not_carried with the reason it is never imported)"]
    problems, notes = device_pack.check_requirements({"a": ("1", ["b>=3"]), "b": ("2", [])}, {"c": None}, {}, ENV)
    assert problems == ["a 1 needs b>=3 but b 2 is carried"]
    _, notes = device_pack.check_requirements({"a": ("1", ["c>=1"])}, {"c": None}, {}, ENV)
    assert notes == ["a needs c>=1: the image's c version is not known here"]


def test_the_spec_is_consistent_and_small():
    spec = device_pack.load_spec()
    assert spec["python"] == "3.12" and spec["max_mib"] <= 40
    assert "torch" in spec["image"] and "torch" not in spec["carried"], "torch is the image's"
    for name in ("transformer-lens", "papermill", "nbclient", "ipykernel", "myst-nb"):
        assert name in spec["carried"], name
    assert not set(spec["not_carried"]) & (set(spec["carried"]) | set(spec["image"]))
    assert "jupyter-book" not in spec["carried"], "the HTML is rendered back here"


def test_a_broken_spec_is_refused(tmp_path):
    bad = tmp_path / "packages.yml"
    bad.write_text("python: '3.12'\nplatforms: []\nmax_mib: 1\ncarried: {torch: 2.0}\nimage: {torch: 2.11.0}\n")
    with pytest.raises(device_pack.PackError, match=r"\['torch'\] are both carried and in the image"):
        device_pack.load_spec(bad)


def _fake_dist(site: Path, name: str, version: str, requires=()):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                         + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_installed_check_uses_the_interpreters_real_versions(tmp_path):
    spec = {"carried": {"demo-a": "1.0"}, "not_carried": {}, "image": {}}
    site = tmp_path / "site"
    _fake_dist(site, "demo-a", "1.0", ["packaging>=1", "torch>=99"])
    with pytest.raises(device_pack.PackError) as e:
        device_pack.check_installed(spec, site)
    assert "demo-a 1.0 needs torch>=99 but torch" in str(e.value) and "packaging" not in str(e.value)
    spec["carried"]["demo-b"] = "2.0"
    with pytest.raises(device_pack.PackError, match="demo-b is not installed in"):
        device_pack.check_installed(spec, site)


PROBE = """
import json, sys
import nbformat, papermill as pm
from circuitbook.visit import loaded_distributions

probe, kernel_dump, dump = sys.argv[1:4]
cells = ["profile = 'smoke'\\nparams = {}",
         "import circuitbook as cb, pkgutil, importlib\\n"
         "for m in pkgutil.walk_packages(cb.__path__, 'circuitbook.'):\\n"
         "    if m.name != 'circuitbook.cluster':\\n"
         "        importlib.import_module(m.name)\\n"
         "cfg = cb.load_params('book', 'tour', profile)\\ncb.record('probe', 1.0)\\n"
         "fig, ax = cb.plotting.figure()\\nax.plot([0, 1])",
         "import json\\nfrom circuitbook.visit import loaded_distributions\\n"
         f"json.dump(sorted(loaded_distributions()), open({kernel_dump!r}, 'w'))"]
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
nb.cells[0].metadata["tags"] = ["parameters"]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbformat.write(nb, probe)
pm.execute_notebook(probe, probe + ".out.ipynb", kernel_name="python3", progress_bar=False, parameters={"profile": "smoke"})
json.dump(sorted(loaded_distributions()), open(dump, "w"))
"""


def test_the_wheels_cover_every_distribution_a_notebook_execution_imports(tmp_path, runs_dir):
    """Execute a notebook that imports the whole library, records and plots, from a fresh process as a visit
    does; every distribution the kernel or the executing process imported must travel, be in the image,
    or be listed as absent there (scripts/device/packages.yml)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    kernel, parent = tmp_path / "kernel.json", tmp_path / "parent.json"
    subprocess.run([sys.executable, str(script), str(tmp_path / "probe.ipynb"), str(kernel), str(parent)],
                   check=True, capture_output=True, timeout=600, cwd=tmp_path)
    used = set(json.loads(kernel.read_text())) | set(json.loads(parent.read_text()))
    spec = device_pack.load_spec()
    known = set(spec["carried"]) | set(spec["image"]) | set(spec["absent_there"]) | {"circuitbook"}
    missing = sorted(used - known)
    assert not missing, (f"imported while executing a notebook, but neither carried, in the image, nor listed as "
                         f"absent there (scripts/device/packages.yml): {missing}")
    assert {"transformer-lens", "papermill", "ipykernel", "myst-nb", "docutils"} <= used


def test_groups_past_their_deadline_execute_nothing_and_say_why(tmp_path, runs_dir):
    from circuitbook.visit import run_groups

    summary = tmp_path / "groups.json"
    assert run_groups("smoke", time.time() - 1, ["assign_add"], summary) == 0
    data = json.loads(summary.read_text())
    assert data["groups"] == [] and data["skipped"]
    assert all("not planned: the planning budget is spent" in s["why"] for s in data["skipped"])
    assert not (runs_dir / "executed").exists()


@pytest.mark.parametrize("args, needle", [(["--budget-s", "abc"], "is not a number of seconds"),
                                          (["--frobnicate"], "unknown argument --frobnicate")])
def test_the_run_script_refuses_bad_arguments(args, needle):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device-run.sh"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr


def test_without_wheels_the_real_run_says_how_to_make_them(tmp_path):
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "device-run.sh"
    script.write_bytes((ROOT / "scripts" / "device-run.sh").read_bytes())  # a checkout without .whl/
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["CIRCUITBOOK_SEAL_KEY"] = "ab" * 32  # a real visit needs one (`circuitbook visit-key`)
    proc = subprocess.run(["bash", str(script), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "no wheels in .whl/ (run 'make device-pack'" in proc.stdout + proc.stderr
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "no output folder: set $OUT or pass --out DIR" in proc.stderr


@pytest.mark.slow
def test_dry_run_visit_packs_what_comes_back_and_imports_elsewhere(tmp_path, monkeypatch):
    """What CI runs: the whole visit at smoke on a CPU, within a budget, then the import on a fresh store."""
    from circuitbook import seal

    out = tmp_path / "out"
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "home-runs"))
    key = seal.new_visit_key()  # `circuitbook visit-key` at home: the visit seals with it
    env = {**os.environ, "CIRCUITBOOK_RUNS": str(tmp_path / "device-runs"), "CIRCUITBOOK_SEAL_KEY": key.hex()}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device-run.sh"), "--dry-run", "--budget-s", "240",
                           "--out", str(out), "--chapter", "algorithmic_cores"],
                          capture_output=True, text=True, timeout=600, env=env)
    log = (out / "device-run.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    files = sorted(out.iterdir())
    assert 2 <= len(files) <= 8 and all(f.is_file() and f.stat().st_size < 16 * 2 ** 20 for f in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f.name) for f in files), "names $OUT can return"
    assert "device-run: python" in log and "| torch" in log and "cuda tests: exit 0" in log
    archives = [f for f in files if f.name.startswith("circuitbook-results-smoke-")]
    with tarfile.open(archives[0]) as tar:
        names = tar.getnames()
        groups = json.loads(tar.extractfile("logs/groups.json").read())
    assert "benchmarks/gpu_cpu.json" in names and "logs/pytest-cuda.txt" in names and "logs/machine.json" in names
    assert not [n for n in names if n.endswith((".safetensors", ".pt"))], "no weights travel"
    done = [g for g in groups["groups"] if g["status"] == "done"]
    assert done and groups["groups"][0]["claims"] == max(g["claims"] for g in groups["groups"]), "largest value first"
    assert "visit done in" in log
    from circuitbook import claims, transfer

    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "home-runs"))
    imported = transfer.import_results(archives, benchmarks_dir=tmp_path / "bench")
    assert not (tmp_path / "bench").exists(), "only a GPU's results (*cuda*) go to benchmarks/results"
    assert (tmp_path / "home-runs" / "imported" / "smoke" / "benchmarks" / "gpu_cpu.json").exists()
    ran = [r["notebook"] for g in done for r in g["notebooks"] if r["status"] == "ok"]
    assert sorted(imported.current) == sorted(ran) and not imported.stale
    rows = [r for r in claims.scorecard("smoke") if r["chapter"] == "algorithmic_cores"
            and f"algorithmic_cores/{r['notebook']}" in ran]
    assert rows and not [r for r in rows if r["status"].startswith(("not run", "stale"))]


FAKE_GROUP = """
import json, sys, time
args = sys.argv[sys.argv.index("--spec") + 1], sys.argv[sys.argv.index("--summary") + 1]
spec = json.load(open(args[0]))
t0 = time.time()
time.sleep(1.0)
json.dump({"name": spec["name"], "claims": spec["claims"], "status": "done", "t0": t0, "t1": time.time(),
           "notebooks": [{"notebook": n, "status": "ok", "estimate_s": 1.0, "seconds": 1.0} for n in spec["notebooks"]],
           "estimates": spec["estimates"]},
          open(args[1], "w"))
"""


def test_groups_run_side_by_side_as_many_as_the_slots_and_wait_for_what_they_read(mini_book, tmp_path):
    """The scheduling of a visit, with a stand-in for the process that executes a group."""
    from circuitbook.plan import NOTEBOOK_OVERHEAD_S as host
    from circuitbook.plan import Group
    from circuitbook.visit import execute_side_by_side

    fake = tmp_path / "fake_python.sh"
    (tmp_path / "group.py").write_text(FAKE_GROUP)
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'group.py'} \"$@\"\n")
    fake.chmod(0o755)

    def group(name, after=()):
        return Group([name], [], 1, host + 1.0, {name: host + 1.0}, [], list(after), {"num_cpus": 1, "num_gpus": 0.25})
    chosen = [group("demo/01_make"), group("x/a"), group("x/b"), group("demo/02_use", after=["demo/01_make"])]
    summary = tmp_path / "groups.json"
    out = {"groups": []}
    assert execute_side_by_side(chosen, "smoke", time.time() + 60, 2, out, summary, python=str(fake)) == 0
    runs = {g["name"]: g for g in json.loads(summary.read_text())["groups"]}
    assert [g["name"] for g in out["groups"]] == ["demo/01_make", "x/a", "x/b", "demo/02_use"], "started in order"
    assert all(g["status"] == "done" for g in runs.values())
    first, second, third = (runs[n] for n in ("demo/01_make", "x/a", "x/b"))
    assert first["t0"] < second["t1"] and second["t0"] < first["t1"], "two slots: the first two overlap"
    assert third["t0"] >= min(first["t1"], second["t1"]) - 0.2, "the third waits for a free slot"
    assert runs["demo/02_use"]["t0"] >= first["t1"] - 0.2, "02 reads 01's values: it starts after 01 ends"
    # every group's runs share the device with another group (the first's too: the second starts beside it)
    from circuitbook.visit import _device_type, plan_throughput
    shared = 2 / plan_throughput(2, _device_type())
    assert first["estimates"]["demo/01_make"] == pytest.approx(host + shared)
    assert second["estimates"]["x/a"] == pytest.approx(host + shared)
    # a group that reads values nobody makes here and nothing current holds is not run, and says why
    out = {"groups": []}
    execute_side_by_side([group("demo/02_use", after=["demo/01_make"])], "smoke", time.time() + 60, 2, out,
                         summary, python=str(fake))
    assert out["groups"][0]["status"].startswith("not run: it reads values of notebooks with no current result")


def test_a_visit_continues_from_what_is_published(mini_book, runs_dir, tmp_path, monkeypatch):
    """Published results current for this checkout are placed in the visit's store and not planned again;
    notebooks marked `runs_on: cpu` are left to a CPU machine."""
    from circuitbook import build, publish
    from circuitbook.visit import continue_published, cpu_only

    assert continue_published("smoke") == set(), "nothing published: every group is a candidate"
    build.build("smoke", log=lambda m: None)
    publish.publish("smoke", log=lambda m: None)
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "visit-store"))
    assert continue_published("smoke") == {"demo/01_make", "demo/02_use"}
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("  02_use:\n", "  02_use:\n    runs_on: cpu\n"))
    assert cpu_only("smoke") == {"demo/02_use"}
    # a notebook edited since it was published is executed again (and what reads its values with it)
    source = mini_book / "chapters" / "demo" / "01_make.ipynb"
    source.write_text(source.read_text().replace('"# 01_make"', '"# 01_make, edited"'))
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "visit-store-2"))
    assert continue_published("smoke") == set()


def test_a_notebooks_estimate_beside_others_slows_its_runs_not_its_allowance():
    from circuitbook.plan import NOTEBOOK_OVERHEAD_S as host
    from circuitbook.visit import shared_estimate

    assert shared_estimate(host + 100.0, 1.0, 2.0) == pytest.approx(host + 200.0)  # the runs take twice as long
    assert shared_estimate(host + 100.0, 1.5, 2.0) == pytest.approx(1.5 * (host + 200.0))  # and as slow as the visit so far
    assert shared_estimate(host + 100.0, 1.0, 1.0) == pytest.approx(host + 100.0)  # alone: the plan's own
    assert shared_estimate(host / 2, 1.0, 4.0) == pytest.approx(host / 2)  # nothing but allowance: not slowed
