"""The book on a real two-node Ray cluster started on this machine (no mocks).

`ray start --head` and a second `ray start --address` with one CPU each, loopback only, a small
object store, stopped at the end by pid. A build through it records the same results as a local
build; killing the worker node's processes (SIGKILL) while a split sweep is running still ends in a
complete build, each part trained to the end once, and no partial run published.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from circuitbook import runs
from circuitbook.training import events

ray = pytest.importorskip("ray")
from minibook import notebook, write  # noqa: E402
from raycluster import AUTH, LocalCluster  # noqa: E402

SWEEP = '''from circuitbook.training import Evaluator
from circuitbook.tasks.modular import ModularAddition
tasks = [ModularAddition(p=23, train_fraction=0.5, split_seed=s) for s in range(4)]
model = cb.ToyConfig(d_vocab=24, n_ctx=3, d_model=32, n_layers=1, n_heads=2, d_mlp=64, d_vocab_out=23)
tc = cb.TrainConfig(steps=int(cfg.steps), batch_size=64, seeds=(0, 1, 2, 3), lr=3e-3,
                    weight_decay=(0.1, 0.3, 1.0, 3.0), eval_every=20, checkpoint_every=20, log_checkpoints=2)
run = cb.train("demo/sweep", model, tasks, tc, evaluate=Evaluator({"test": [t.test for t in tasks]}))
last = run.metrics().query("step == step.max()").sort_values("member")
cb.record("sweep_loss", last.train_loss.tolist(), run=run)
cb.record("sweep_acc", last.acc_test.tolist(), run=run)
print("parts", run.manifest.get("parts"))'''


def ray_book(root: Path, steps: int) -> Path:
    """The mini book plus a notebook that trains a 4-member sweep."""
    write(root)
    toc = root / "_toc.yml"
    toc.write_text(toc.read_text() + "      - file: chapters/demo/03_sweep\n")
    prof = root / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("  fail: {type: bool, help: raise an error}\n",
                                             "  fail: {type: bool, help: raise an error}\n"
                                             "  steps: {type: int, min: 1, help: sweep steps}\n")
                    .replace("defaults: {value: 1.0, fail: false}", f"defaults: {{value: 1.0, fail: false, steps: {steps}}}")
                    + "  03_sweep:\n    resources: {num_cpus: 1}\n")
    nbformat.write(notebook("demo", "03_sweep", SWEEP), root / "chapters" / "demo" / "03_sweep.ipynb")
    return root


def build(root: Path, store: Path, *extra, chunk="2", background=False):
    env = {**os.environ, **AUTH, "CIRCUITBOOK_ROOT": str(root), "CIRCUITBOOK_RUNS": str(store), "CIRCUITBOOK_CHUNK": chunk,
           "CIRCUITBOOK_PROGRESS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "circuitbook.cli", "build", "--profile", "smoke", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc if background else _finish(proc)


def _finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def values(store: Path) -> dict:
    out = {}
    for f in sorted((store / "results" / "smoke").rglob("*.json")):
        data = json.loads(f.read_text())
        assert data["status"] == "ok", (f, data.get("error"))
        out[f"{data['chapter']}/{data['notebook']}"] = {k: v["value"] for k, v in data["values"].items()}
    return out


def assert_same_values(a: dict, b: dict, tol=1e-5):
    assert a.keys() == b.keys()
    for nb in a:
        assert a[nb].keys() == b[nb].keys(), nb
        for key, va in a[nb].items():
            vb = b[nb][key]
            if isinstance(va, list):
                assert len(va) == len(vb) and all(abs(x - y) <= tol for x, y in zip(va, vb)), (nb, key, va, vb)
            else:
                assert va == vb, (nb, key, va, vb)


STEPS = 400  # long enough that the worker node is still training a part when it is killed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The book built locally, the sweep trained as one ensemble: what every Ray build must record."""
    root = ray_book(tmp_path_factory.mktemp("book"), steps=STEPS)
    store = tmp_path_factory.mktemp("local")
    code, out = build(root, store, chunk="all")
    assert code == 0, out
    return root, values(store)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster().start()
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_a_build_through_two_nodes_records_what_a_local_build_records(cluster, reference, tmp_path):
    root, local = reference
    code, out = build(root, tmp_path / "ray", "--ray", cluster.address)
    assert code == 0, out
    assert f"Ray cluster at {cluster.address}" in out
    assert "executing as a Ray task (num_cpus=1)" in out
    assert_same_values(local, values(tmp_path / "ray"))
    html = root / "_build" / "smoke" / "html" / "chapters" / "demo" / "03_sweep.html"
    assert html.exists() and "parts [[0, 2], [2, 4]]" in html.read_text()
    # the cache rules hold: a second Ray build executes nothing
    code, out = build(root, tmp_path / "ray", "--ray", cluster.address)
    assert code == 0 and "(3 cached)" in out and "executing" not in out, out


@pytest.mark.slow
def test_killing_a_worker_node_mid_sweep_still_completes_the_same_build(cluster, reference, tmp_path):
    root, local = reference
    store = tmp_path / "ray"
    proc = build(root, store, "--ray", cluster.address, chunk="1", background=True)
    killed, premature, seen = set(), [], []
    t0 = time.time()

    def holders():
        """(pid, part tag, checkpoints written) of every part being trained now."""
        out = []
        for lock in store.glob(".locks/demo__sweep.*.members_*.lock.*"):
            holder = json.loads(lock.read_text() or "{}")
            tag = lock.name.split(".")[-3]
            out.append((holder.get("pid"), tag, len(list(store.glob(f"demo/sweep/*/parts/{tag}/ckpt/step_*.json")))))
        return out

    def hold_back(pids, seconds=2.0, between=0.1):
        """Stop `pids` for `seconds`, then let them run for `between`: about 5% of their speed."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        time.sleep(between)

    def watch():
        # Which process claims a part is a race. When the notebook runs on the worker node, its own process holds
        # a part there and is killed with it. When it runs on the head node, it trains parts too and, on a loaded
        # machine, can finish all four before the worker node's Ray worker (busy with 02_use first) has started.
        # So while the worker node holds no part, the part holders elsewhere are held back to ~5% of their speed,
        # never stopped outright: the notebook's process owns the parts' Ray tasks, and a stopped owner never
        # hands its queued tasks to the worker node (a 45 s SIGSTOP once left nothing to kill on CI). Each stop
        # is 2 s, far inside the 60 s lock lease; holding back ends once a part has been killed, or after 240 s.
        deadline = time.time() + 900
        while proc.poll() is None and time.time() < deadline:
            worker = cluster.worker_node_pids()  # its Ray workers start as tasks arrive
            held = holders()
            on_worker = [h for h in held if h[0] in worker]
            state = (bool(worker), [(pid, tag, pid in worker) for pid, tag, _ in held])
            if not seen or seen[-1][1:] != state:
                seen.append((round(time.time() - t0, 1), *state))
            # a part held (trained) by a process of the worker node, past its first checkpoints
            if not killed and any(n >= 2 for _, _, n in on_worker):
                killed.update(cluster.kill_worker_node())
            elif not killed and not on_worker and time.time() - t0 < 240:
                hold_back({pid for pid, _, _ in held if pid})
            for manifest in store.glob("demo/sweep/*/manifest.json"):
                finished = [e for e in events(runs.RunDir(manifest.parent, "demo/sweep", manifest.parent.name))
                            if e["event"] == "finish"]
                if len(finished) < 4:
                    premature.append(len(finished))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    code, out = _finish(proc)
    watcher.join()
    assert code == 0, out
    assert killed, ("no part ran on the worker node, so nothing was killed:\n" + out + "\n(seconds, worker node up, "
                    "[(part holder's pid, part, on the worker node)]) as they changed:\n" + "\n".join(map(str, seen)))
    assert not premature, "the run was published before every part was in"
    (rundir,) = [runs.RunDir(p, "demo/sweep", p.name) for p in store.glob("demo/sweep/*")]
    kinds = [(e["part"], e["event"]) for e in events(rundir)]
    for lo in range(4):
        tag = f"members_{lo:05d}_{lo + 1:05d}"
        assert kinds.count((tag, "finish")) == 1, (tag, kinds)
    assert kinds.count(("run", "publish")) == 1
    assert any(e == "resume" for _, e in kinds) or sum(e == "start" for _, e in kinds) > 4, \
        "the killed part was taken over (resumed from its checkpoint)"
    assert_same_values(local, values(store))


def test_an_unreachable_address_is_a_clear_error_before_any_compute(mini_book, runs_dir, capsys):
    from circuitbook.cli import main
    from raycluster import free_port

    address = f"127.0.0.1:{free_port()}"
    assert main(["build", "--profile", "smoke", "--ray", address]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"circuitbook build: error: cannot reach the Ray cluster at {address}")
    assert "ray start --head" in err and len(err.splitlines()) == 1
    assert not (runs_dir / "results").exists() and not (runs_dir / "executed").exists()
    assert main(["build", "--profile", "smoke", "--ray", "nohost"]) == 1
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_without_ray_nothing_imports_it(mini_book, runs_dir):
    code = ("import sys, circuitbook as cb\nfrom circuitbook import build, cli, train\n"
            "from circuitbook.tasks.modular import ModularAddition\n"
            "t = ModularAddition(p=7, train_fraction=0.5)\n"
            "cb.train('t/x', cb.ToyConfig(d_vocab=8, n_ctx=3, d_model=8, n_layers=1, n_heads=1, d_mlp=8, d_vocab_out=7),"
            " t, cb.TrainConfig(steps=3, batch_size=4, seeds=(0, 1)))\n"
            "build.build('smoke', log=lambda m: None)\n"
            "assert 'ray' not in sys.modules, [m for m in sys.modules if m.startswith('ray')]\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CIRCUITBOOK_RUNS": str(runs_dir)})


@pytest.mark.slow
def test_run_one_notebook_with_its_sweep_on_the_cluster(cluster, reference, tmp_path):
    root, local = reference
    env = {**os.environ, **AUTH, "CIRCUITBOOK_ROOT": str(root), "CIRCUITBOOK_RUNS": str(tmp_path / "run"),
           "CIRCUITBOOK_CHUNK": "2", "CIRCUITBOOK_PROGRESS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-m", "circuitbook.cli", "run", "demo/03_sweep", "--profile", "smoke",
                           "--ray", cluster.address], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorded = json.loads((tmp_path / "run" / "results" / "smoke" / "demo" / "03_sweep.json").read_text())
    assert recorded["status"] == "ok"
    assert_same_values({"demo/03_sweep": local["demo/03_sweep"]},
                       {"demo/03_sweep": {k: v["value"] for k, v in recorded["values"].items()}})
    (rundir,) = [runs.RunDir(p, "demo/sweep", p.name) for p in (tmp_path / "run").glob("demo/sweep/*")]
    assert json.loads((rundir.path / "manifest.json").read_text())["parts"] == [[0, 2], [2, 4]]
