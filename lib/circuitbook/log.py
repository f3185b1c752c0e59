"""Lines for whoever runs the book, kept off the reader's page.

The library says what it does ("training assign_add/main ...", "cached run ...", "resuming from step
20") through `info()`. In a notebook that the build executes, those lines (and training progress bars)
go to that notebook's log file in the run store, `<runs>/logs/<label>/<chapter>/<notebook>.log`, so the
rendered page shows the science and no store paths; anywhere else (a terminal, a test, a notebook opened
by hand) they are printed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

_file: Path | None = None


def to_file(path: Path | None) -> None:
    """Send the lines of this process to `path` (None: print them again)."""
    global _file
    _file = Path(path) if path is not None else None
    if _file is not None:
        _file.parent.mkdir(parents=True, exist_ok=True)


def path() -> Path | None:
    return _file


def info(message: str) -> None:
    line = f"[circuitbook] {message}"
    if _file is None:
        print(line, flush=True)
        return
    with open(_file, "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def progress_stream():
    """Where a progress bar writes: the log file under a build, else stderr (the caller closes a file)."""
    return open(_file, "a") if _file is not None else sys.stderr
