"""The book's settings outside its parameters: `CIRCUITBOOK_*` environment variables and results labels.

Every variable the library reads is declared here with the values it allows, and `check_environment()`
refuses a bad or unknown one before any compute (the command line calls it first, `load_params` again
in a kernel that plain papermill started), so a typo is never read as "not set" and a bad value never
waits for the first training step to fail. Paths are made absolute, so a kernel that runs in a
notebook's folder reads the same files as the command that started it.

A results label is `PROFILE` or `PROFILE+NAME`; `check_label` is the one rule for every command that
takes or makes one, and it keeps a label a single folder inside the run store.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass
from typing import Callable

PREFIX = "CIRCUITBOOK_"
PROFILES = ("smoke", "cpu", "full")
LABEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class SettingError(ValueError):
    """A CIRCUITBOOK_* variable or a results label that cannot be used; the message says what is allowed."""


# ---------------------------------------------------------------- values

def parse_chunk(text) -> int | str:
    """`auto`, `all` or an integer >= 1 (how many ensemble members train together)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 1:
        return text
    if isinstance(text, str) and text.strip() in ("auto", "all"):
        return text.strip()
    if isinstance(text, str) and text.strip().isdigit() and int(text) >= 1:
        return int(text)
    raise SettingError(f"chunk {text!r} is not allowed; expected 'auto', 'all' or an integer >= 1")


def _positive_number(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise SettingError(f"{text!r} is not allowed; expected {expected}")
    return value


def parse_seconds(text: str) -> float:
    return _positive_number(text, "a number of seconds > 0")


def _unix_time(text: str) -> float:
    return _positive_number(text, "a unix time in seconds")


def _flag(text: str) -> str:
    if text not in ("0", "1"):
        raise SettingError(f"{text!r} is not allowed; expected 0 or 1")
    return text


def _device(text: str) -> str:
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise SettingError(f"{text!r} is not a torch device; expected e.g. 'cpu', 'cuda' or 'cuda:1'") from None
    return text


def _existing_path(text: str) -> str:
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.exists(path):
        raise SettingError(f"{text!r} does not exist; give an existing file or folder")
    return path


def _absolute(text: str) -> str:
    return os.path.abspath(os.path.expanduser(text))


def _book_root(text: str) -> str:
    path = _absolute(text)
    if not os.path.isfile(os.path.join(path, "_toc.yml")):
        raise SettingError(f"{text!r} is not a book's root; expected a folder holding _toc.yml")
    return path


def _label(text: str) -> str:
    return check_label(text)


def _commit(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{7,40}( \((clean|dirty)\))?", text.strip()):
        raise SettingError(f"{text!r} is not a git commit (7 to 40 hex digits, optionally ' (clean)' or ' (dirty)')")
    return text


def _seal_key(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text.strip()):
        raise SettingError("a seal key is 64 hexadecimal digits (32 bytes), as `circuitbook visit-key` prints "
                           f"it; got {len(text)} characters")
    return text


def _any(text: str) -> str:
    return text


@dataclass(frozen=True)
class Setting:
    name: str
    check: Callable[[str], object]
    help: str
    internal: bool = False  # set by the build for the kernels it starts, not by a user
    secret: bool = False  # never repeated in a message


SETTINGS = {s.name: s for s in [
    Setting("CIRCUITBOOK_RUNS", _absolute, "the run store (default: <book>/runs)"),
    Setting("CIRCUITBOOK_ROOT", _book_root, "the book's root (default: the checkout holding the library)"),
    Setting("CIRCUITBOOK_TINYSTORIES", _existing_path, "the TinyStories text the leading_terms chapter reads"),
    Setting("CIRCUITBOOK_MODEL_CACHE", _absolute, "where converted pretrained models are kept (default "
                                                   "~/.cache/circuitbook/models)"),
    Setting("CIRCUITBOOK_DEVICE", _device, "where to train (default: CUDA when available, else CPU)"),
    Setting("CIRCUITBOOK_CHUNK", parse_chunk, "how many ensemble members train together: auto, all or N"),
    Setting("CIRCUITBOOK_LOCK_LEASE_S", parse_seconds, "seconds before another host takes over a silent lock"),
    Setting("CIRCUITBOOK_PROGRESS", _flag, "1 (default) shows training progress bars, 0 hides them"),
    Setting("CIRCUITBOOK_DEADLINE", _unix_time, "unix time after which train() starts no new run (a GPU visit)"),
    Setting("CIRCUITBOOK_SEAL_KEY", _seal_key, "the key results are sealed with instead of <runs>/.keys/seal.key "
                                               "(a GPU visit's, from `circuitbook visit-key`)", secret=True),
    Setting("CIRCUITBOOK_COMMIT", _commit, "the commit of a checkout copied without its git history (a GPU "
            "visit's working tree): what a result's provenance names"),
    Setting("CIRCUITBOOK_CAPTURE", _flag, "1 replays the training step from a CUDA graph on a GPU (a visit sets it "
            "once the captured step's CUDA tests pass there); 0 (default) trains eagerly"),
    Setting("CIRCUITBOOK_NATIVE", _flag, "1 (default) makes training batches on a CPU with the samplers' fused C "
            "kernels (the same batches); 0 makes them with torch ops"),
    Setting("CIRCUITBOOK_NATIVE_CACHE", _absolute, "where the compiled sampler kernels are kept (default "
                                                    "~/.cache/circuitbook/native)"),
    Setting("CIRCUITBOOK_RAY_ADDRESS", _any, "the Ray cluster of a Ray build", internal=True),
    Setting("CIRCUITBOOK_RAY_RESOURCES", _any, "the resources of a notebook's Ray tasks", internal=True),
    Setting("CIRCUITBOOK_RESULTS_LABEL", _label, "the results label of the execution", internal=True),
    Setting("CIRCUITBOOK_EXECUTION_ID", _any, "the id of the execution", internal=True),
]}
PATH_SETTINGS = ("CIRCUITBOOK_RUNS", "CIRCUITBOOK_ROOT", "CIRCUITBOOK_TINYSTORIES", "CIRCUITBOOK_MODEL_CACHE",
                 "CIRCUITBOOK_NATIVE_CACHE")


def check_environment(environ=None) -> None:
    """Refuse an unknown CIRCUITBOOK_* variable or a value its setting does not allow (SettingError
    naming the variable, the value and what is allowed); make the path settings absolute."""
    env = os.environ if environ is None else environ
    for name in sorted(k for k in env if k.startswith(PREFIX)):
        value = env[name]
        setting = SETTINGS.get(name)
        if setting is None:
            close = difflib.get_close_matches(name, list(SETTINGS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(n for n, s in SETTINGS.items() if not s.internal)
            raise SettingError(f"environment variable {name}={value!r} is not a circuitbook setting{hint}; "
                               f"settings: {known}")
        if value == "" and name in PATH_SETTINGS:
            continue  # set but empty: the same as unset
        try:
            checked = setting.check(value)
        except SettingError as e:
            shown = "(hidden)" if setting.secret else repr(value)
            raise SettingError(f"environment variable {name}={shown}: {e} ({setting.help})") from None
        if name in PATH_SETTINGS:
            env[name] = checked


def ray_build() -> bool:
    """True in a process that a Ray build asked to send work to the cluster."""
    return bool(os.environ.get("CIRCUITBOOK_RAY_ADDRESS"))


# ---------------------------------------------------------------- results labels

def check_label(label: str) -> str:
    """A results label, `PROFILE` or `PROFILE+NAME` (NAME: letters, digits, '.', '_', '-', not '.' or
    '..'): one folder name under the store's results/, so no label reads or writes outside it."""
    profile, plus, name = str(label).partition("+")
    ok = profile in PROFILES and (not plus or (LABEL_NAME.fullmatch(name) and name not in (".", "..")))
    if not ok:
        raise SettingError(f"label {label!r} is not a results label; expected PROFILE or PROFILE+NAME with PROFILE "
                           f"one of {', '.join(PROFILES)} and NAME of letters, digits, '.', '_' or '-'")
    return label


def check_label_name(name: str) -> str:
    """The NAME a user gives `circuitbook run --label NAME` (the label is PROFILE+NAME)."""
    if not LABEL_NAME.fullmatch(str(name)) or name in (".", ".."):
        raise SettingError(f"--label {name!r}: use letters, digits, '.', '_' or '-'")
    return name
