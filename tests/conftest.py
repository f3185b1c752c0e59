from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


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
