"""Where training runs: the device (argument, $CIRCUITBOOK_DEVICE, CUDA when available, else CPU) and
its name for messages. Never part of a run's key: a run has the same numbers (to float rounding) on any
device."""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import torch

# cuBLAS reproduces its results only with a fixed workspace; it must be set before the first cuBLAS call of the
# process, hence here, on import (CPU training ignores it). See device_policy.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


# glibc's mallopt options (malloc.h) and the values keep_freed_host_memory sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
HOST_MEMORY_KEPT = {M_MMAP_THRESHOLD: 32 << 20, M_TOP_PAD: 64 << 20, M_TRIM_THRESHOLD: 128 << 20}
_host_memory_kept: bool | None = None


def keep_freed_host_memory() -> bool:
    """Let this process keep the host memory it frees (glibc only; elsewhere nothing, False).

    A batched sampler makes a few MB of fresh tensors per call and frees them. With glibc's defaults those
    pages go back to the kernel and are faulted in again on the next call (measured: 936 page faults per
    call of assign_add's sampler at K = 3, batch 512 x 10 steps; 30 with these settings), which cost as
    much as making the batch (benchmarks/data_vs.py). Blocks up to 32 MB now come from the heap, and the
    heap keeps 64-128 MB of freed memory at its top instead of returning it. Process-wide and for good
    (glibc has no way back to its adaptive thresholds); values are untouched, so it is no part of a run key.
    """
    global _host_memory_kept
    if _host_memory_kept is None:
        _host_memory_kept = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                mallopt = ctypes.CDLL(None).mallopt
                _host_memory_kept = all(mallopt(option, value) == 1 for option, value in HOST_MEMORY_KEPT.items())
    return _host_memory_kept


def default_device(device: str | None = None) -> torch.device:
    """The device to train on: the argument, $CIRCUITBOOK_DEVICE, CUDA if available, else CPU."""
    choice = device or os.environ.get("CIRCUITBOOK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(choice)
    except RuntimeError as e:
        raise ValueError(f"device {choice!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1'): {e}") from None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


@contextlib.contextmanager
def device_policy(device: torch.device):
    """What training on `device` fixes about its arithmetic, the same for every chapter.

    fp32 matrix products run in full fp32 (`set_float32_matmul_precision("highest")`: no TF32 on a
    GPU), so a run trained on CUDA matches the same run on a CPU to float rounding (tests/test_cuda.py
    states the tolerances). On CUDA, deterministic algorithms are switched on (warn_only): the
    scatter-adds in the backward of gathers, index_select and embeddings, which are atomic adds in an
    arbitrary order otherwise, take their deterministic implementations, so a resumed or repeated CUDA
    run ends with the same numbers as its uninterrupted self; an op with no deterministic implementation
    warns instead of failing. The previous settings are restored on exit. A CPU is deterministic as it is.
    On every device the process keeps the host memory it frees (`keep_freed_host_memory`), for good.
    """
    keep_freed_host_memory()
    if device.type != "cuda":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.get_float32_matmul_precision())
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.set_float32_matmul_precision(before[2])
