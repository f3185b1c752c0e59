"""The samplers' fused CPU kernels (`native.c`): the same batches as their torch ops, several times faster.

On a CPU a sampler's torch form streams every intermediate tensor through memory once per op (dozens of small
elementwise ops a row); `native.c` makes a row at a time with its words, choices and tokens in registers. It is
plain C (no torch headers), compiled once per machine with the system's C compiler (`$CC`, else `cc`) into a
cache folder (`$CIRCUITBOOK_NATIVE_CACHE`, else `~/.cache/circuitbook/native`) under the source's hash, and
loaded with ctypes.

The torch form is the definition; the kernel is used only where it is known to agree with it:
- a sampler built on the CPU makes a few of its batches both ways first, and uses the kernel only if they are
  equal bit for bit (else it says why and keeps the torch form);
- no compiler, a failed compile or `CIRCUITBOOK_NATIVE=0` keep the torch form, and say so once;
- a tensor step (a captured step) and every other device use the torch form.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from .. import log
from .draws import check_step

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")  # portable: BMI2 code is chosen at run time (native.c)
_said: set[str] = set()


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info(message)


def cache_dir() -> Path:
    return Path(os.environ.get("CIRCUITBOOK_NATIVE_CACHE") or Path.home() / ".cache" / "circuitbook" / "native")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (the reason said once) where they cannot be had. A cached library that does
    not load or lacks a kernel is damaged: it is reported by path, removed and compiled again."""
    if os.environ.get("CIRCUITBOOK_NATIVE", "1") == "0":
        say_once("native sampler kernels off (CIRCUITBOOK_NATIVE=0): batches made by torch ops")
        return None
    if not SOURCE.is_file():
        say_once(f"native sampler kernels: no {SOURCE.name} in this installation: batches made by torch ops")
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        say_once(f"no C compiler ({compiler!r} not found): batches made by torch ops on the CPU")
        return None
    target = library_path(compiler)
    for _ in range(2):
        if not target.exists() and not _compile(compiler, target):
            return None
        try:
            lib = ctypes.CDLL(str(target))
            for kernel in KERNELS:
                getattr(lib, kernel).restype = None
            return lib
        except (OSError, AttributeError) as e:
            say_once(f"native sampler kernels: {target} is damaged ({e}); removed, compiled again")
            target.unlink(missing_ok=True)
    return None


KERNELS = ("assign_add_batches", "blocklist_batches")


def library_path(compiler: str) -> Path:
    """Where the library of this source, compiler and flags is cached."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler,) + FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"native-{digest}.so"


def _compile(compiler: str, target: Path) -> bool:
    """Compile native.c to `target` (aside, then renamed: a reader never sees half a library)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(built, target)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        why = getattr(e, "stderr", None) or str(e)
        say_once(f"native sampler kernels not compiled ({compiler}: {why.strip()[:300]}): batches made by torch "
                 "ops on the CPU")
        return False


def _ptr(x: torch.Tensor) -> ctypes.c_void_p:
    if x.dtype != torch.long or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"native kernels read contiguous int64 CPU tensors, got {x.dtype} {tuple(x.shape)} on "
                         f"{x.device}")
    return ctypes.c_void_p(x.data_ptr())


i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _AssignAddTables(ctypes.Structure):
    _fields_ = [(name, i64) for name in ("modulus", "pad", "var0", "plus", "eq", "pair_width")] + [
        (name, ptr) for name in ("type_thresholds", "pairs", "n_pairs", "repeats", "row_vars", "n_row_vars",
                                 "left_table", "left_count", "subsets", "subset_start", "subset_count", "layouts",
                                 "layout_start", "layout_count")]


def agrees(native_call, torch_call, batch_size: int = 64, steps=(0, 1)) -> str:
    """'' when the kernel makes the very batches of the torch form at a few steps, else what differs."""
    for step in (list(steps), steps[-1]):
        made, expected = native_call(step, batch_size), torch_call(step, batch_size)
        for name, x, y in zip(("tokens", "labels"), made, expected):
            if x.shape != y.shape or not torch.equal(x, y):
                return f"{name} differ at step {step} (batch {batch_size})"
    return ""


def kernel_for(sampler, kind, *args):
    """kind(sampler, library, *args) where the sampler works on the CPU and the kernel makes the very batches of
    its torch form (`sampler.torch_form`), else None (the reason said once)."""
    if sampler.device.type != "cpu" or (lib := library()) is None:
        return None
    try:
        kernel = kind(sampler, lib, *args)
    except ValueError as e:  # a task the kernel does not know
        say_once(f"native {kind.__name__} cannot make these batches ({e}): batches made by torch ops")
        return None
    why = agrees(kernel, sampler.torch_form)
    if why:
        say_once(f"native {kind.__name__} disagrees with the torch form ({why}): batches made by torch ops")
        return None
    return kernel


class _Kernel:
    """A sampler's batches made by native.c's `entry` from `args` (a ctypes struct over tables that `keep`
    holds alive): tokens [K, S * B, seq_len] and labels [K, S * B] of S host steps (an int or a list)."""

    entry: str

    def __init__(self, stream, site: int, args: ctypes.Structure, keep, seq_len: int, lib: ctypes.CDLL):
        self.stream, self.site, self.args, self.keep, self.seq_len = stream, site, args, keep, seq_len
        self.function = getattr(lib, self.entry)
        self.lanes = [stream.a.to("cpu", torch.long).contiguous(), stream.b.to("cpu", torch.long).contiguous()]

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.tensor([check_step(s) for s in (step if isinstance(step, (list, tuple, range)) else [step])],
                             dtype=torch.long)
        K, S, B = self.stream.n_members, len(steps), batch_size
        tokens = torch.empty(K, S * B, self.seq_len, dtype=torch.long)
        labels = torch.empty(K, S * B, dtype=torch.long)
        self.function(ctypes.byref(self.args), i64(K), i64(S), i64(B), _ptr(steps), _ptr(self.lanes[0]),
                      _ptr(self.lanes[1]), i64(self.site), _ptr(tokens), _ptr(labels))
        return tokens, labels


class AssignAddKernel(_Kernel):
    """`AssignAddSampler`'s batches made by `assign_add_batches` (the sampler's tables)."""

    entry = "assign_add_batches"

    def __init__(self, sampler, lib: ctypes.CDLL, site: int):
        t, task = sampler.tables, sampler.task
        cpu = lambda x: x.to("cpu", torch.long).contiguous()  # noqa: E731
        keep = {name: cpu(x) for name, x in (
            ("type_thresholds", sampler.type_thresholds), ("pairs", sampler.pairs), ("n_pairs", sampler.n_pairs),
            ("repeats", sampler.repeats), ("row_vars", sampler.row_vars), ("n_row_vars", sampler.n_row_vars),
            ("left_table", sampler.left_table), ("left_count", sampler.left_count), *t.items())}
        tables = _AssignAddTables(sampler.modulus, task.PAD, task.VAR0, task.PLUS, task.EQ, sampler.pairs.shape[1],
                                  *(_ptr(keep[name]) for name, _ in _AssignAddTables._fields_[6:]))
        super().__init__(sampler.stream, site, tables, keep, task.seq_len, lib)


class _BlockListTask(ctypes.Structure):
    _fields_ = [(name, i64) for name in (
        "kind", "n_pairs", "n_rare", "n_blocks", "burstiness", "n_fill", "bos", "bos_token", "composite", "has_rare",
        "chain_len", "block_len", "query_len", "n_distractors", "common_draws", "n_common", "n_tokens", "seq_len",
        "n_choices", "col_pair0", "col_rare", "col_canon", "col_order", "col_gap", "col_offset")] + [
        (name, ptr) for name in ("sizes", "law_start", "law_count", "laws")] + [("law_width", i64)]


MAX_ROW = 1024  # native.c's largest row (choices, tokens)
KIND_CODES = {"recall": 0, "khop": 1, "ngram": 2, "ioi": 3, "conditional": 4}  # native.c's enum of kinds


class BlockListKernel(_Kernel):
    """A `BlockListSampler` group's batches made by `blocklist_batches`: the choices of a row drawn from its
    words (`draws.below`, or `draws.categorical` with the member's thresholds where the group has laws), then
    `BlockListTask.assemble` and `model_inputs`, row by row."""

    entry = "blocklist_batches"

    def __init__(self, group, lib: ctypes.CDLL, site: int):
        t, names = group.task, group.names
        if t.kind not in KIND_CODES:
            raise ValueError(f"kind {t.kind!r} is not one of native.c's {sorted(KIND_CODES)}")
        if max(len(names), t.seq_len) > MAX_ROW:
            raise ValueError(f"rows of {len(names)} choices and {t.seq_len} tokens: native.c makes at most {MAX_ROW}")
        col = {name: j for j, name in enumerate(names)}
        # the layout native.c reads (BlockListTask.choices); checked, so that a new choice cannot go unnoticed
        expected = [f"{p}{j}" for j in range(t.common_draws) for p in ("pair", "orient")]
        expected += (["rare"] + [f"rare{j}" for j in range(t.chain_len)]) if t.f_r > 0 else []
        expected += [f"canon{i}" for i in range(1 + t.n_distractors)] + [f"order{j}" for j in range(t.n_blocks)]
        expected += [f"{p}{f}" for f in range(t.n_fill) for p in ("gap", "fill")] + ["offset"]
        if names != expected:
            raise ValueError(f"BlockListTask.choices() changed ({names[:8]}...): native.c reads {expected[:8]}...")
        K, C = group.stream.n_members, len(names)
        law_start, law_count, laws = [0] * C, [0] * C, []
        for cols, thresholds, _ in group.laws:
            for j in range(cols.start, cols.stop):
                law_start[j], law_count[j] = sum(x.shape[1] for x in laws), thresholds.shape[-1]
                laws.append(thresholds.reshape(K, -1).cpu())
        law_table = torch.cat(laws, 1) if laws else torch.zeros(K, 1, dtype=torch.long)
        keep = [x.to(torch.long).contiguous() for x in (group.sizes.cpu(), torch.tensor(law_start),
                                                       torch.tensor(law_count), law_table)]
        task = _BlockListTask(
            KIND_CODES[t.kind], t.n_pairs, t.n_rare, t.n_blocks, t.burstiness, t.n_fill, int(t.bos),
            t.bos_token if t.bos else -1, int(t.input_ids == "composite"), int(t.f_r > 0), t.chain_len,
            t.block_len, t.query_len, t.n_distractors, t.common_draws, t.n_common, t.n_tokens, t.seq_len, C,
            col["pair0"], col.get("rare", -1), col["canon0"], col["order0"], col.get("gap0", -1), col["offset"],
            *(_ptr(x) for x in keep), law_table.shape[1])
        super().__init__(group.stream, site, task, keep, t.seq_len, lib)
