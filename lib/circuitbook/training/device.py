"""Where training runs: the device (argument, $CIRCUITBOOK_DEVICE, CUDA when available, else CPU) and
its name for messages. Never part of a run's key: a run has the same numbers (to float rounding) on any
device."""
from __future__ import annotations

import os

import torch


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
