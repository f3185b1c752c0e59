from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# the book's TinyStories sample in ../shared beside the checkout (the Makefile and .ci/run name it)
SHARED_TINYSTORIES = ROOT.parent / "shared" / "data" / "tinystories" / "tinystories_lower_4MB.txt"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where torch sees a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """A private artifact store for one test."""
    d = tmp_path / "runs"
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(d))
    return d


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("CIRCUITBOOK_PROGRESS", "0")
    torch.manual_seed(0)


@pytest.fixture
def mini_book(tmp_path, monkeypatch, runs_dir):
    """A two-notebook book in a temporary folder, with CIRCUITBOOK_ROOT pointing at it."""
    from minibook import write

    root = write(tmp_path / "book")
    monkeypatch.setenv("CIRCUITBOOK_ROOT", str(root))
    return root


def run_cli(args, capsys):
    """`circuitbook ARGS` in this process: (exit code, stdout, stderr)."""
    from circuitbook.cli import main

    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def kill_after_checkpoint(proc, store, pattern: str, step: int, timeout: float) -> None:
    """SIGKILL `proc` once a checkpoint marker under `store` matching `pattern` (step_*.json) reaches `step`."""
    import signal
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        markers = [p for p in store.glob(pattern) if not p.name.startswith("step_00000000")]
        if any(int(p.stem[5:]) >= step for p in markers):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


def assert_same_run(killed, clean, name: str = "t/kill"):
    """The one run `name` of store `killed` equals that of store `clean` bit for bit (metrics and weights)."""
    import pandas as pd

    import circuitbook as cb

    (a,) = [cb.Run(cb.runs.RunDir(p, name, p.name)) for p in killed.glob(f"{name}/*")]
    (b,) = [cb.Run(cb.runs.RunDir(p, name, p.name)) for p in clean.glob(f"{name}/*")]
    pd.testing.assert_frame_equal(a.metrics(), b.metrics(), check_exact=True)
    for key, t in a.state().items():
        assert torch.equal(t, b.state()[key]), key
    return a
