"""The samplers' fused CPU kernels (`circuitbook.tasks.native`): the very batches of the torch form, used only
where they are known to be, and the torch form wherever they cannot be had."""
import ctypes
import re
import shutil

import pytest
import torch

from circuitbook import settings
from circuitbook.tasks import native
from circuitbook.tasks.assign_add import AssignAddTask
from circuitbook.tasks.assign_add_bursty import BurstyAssignAddTask
from circuitbook.tasks.base import data_key, make_sampler
from circuitbook.tasks.blocklist import KINDS, BlockListTask

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache, nothing said yet, and the lines said collected."""
    monkeypatch.setenv("CIRCUITBOOK_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CIRCUITBOOK_NATIVE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    said = []
    monkeypatch.setattr(native.log, "info", said.append)
    monkeypatch.setattr(native, "_said", set())
    native.library.cache_clear()
    yield said
    native.library.cache_clear()


def direct(tasks, keys):
    """The batched sampler itself (make_sampler wraps it in a Prefetch of one int step at a time)."""
    sampler = make_sampler(tasks, keys)
    return getattr(sampler, "sampler", sampler)


def kernels(sampler) -> list:
    return [g.native for g in sampler.groups] if hasattr(sampler, "groups") else [sampler.native]


ASSIGN_ADD = {
    "default": lambda: [AssignAddTask()],
    "sweep": lambda: [AssignAddTask(train_fraction=0.1), AssignAddTask(train_fraction=0.9, two_var_ratio=0.0),
                      AssignAddTask(two_var_ratio=2.0), AssignAddTask(train_fraction=0.5, pair_split="book")],
    "bursty": lambda: [BurstyAssignAddTask(repeats=r) for r in (1, 2, 3)],
}
BLOCK_LISTS = {f"{kind}-fill-rare-bos": (lambda kind=kind: [
    BlockListTask(kind, n_pairs=12, n_rare=5, n_blocks=4, hops=2, ngram=3, f_r=0.3, f_v=0.4, n_fill=2,
                  n_fill_tokens=2, bos=True)]) for kind in KINDS}
BLOCK_LISTS.update({
    "recall-bursty-zipf": lambda: [BlockListTask("recall", n_pairs=10, n_blocks=6, burstiness=3, zipf=1.0, f_v=0.7)],
    "recall-fixed-tokens": lambda: [BlockListTask("recall", n_pairs=6, n_blocks=2, burstiness=2, offsets="fixed",
                                                  input_ids="tokens")],
    "khop-3": lambda: [BlockListTask("khop", hops=3, n_pairs=12, n_blocks=5, f_v=1.0, bos=True)],
    "conditional-fill": lambda: [BlockListTask("conditional", n_pairs=20, n_blocks=5, n_fill=3, n_fill_tokens=3,
                                               f_v=0.2)],
    "many-pairs": lambda: [BlockListTask("recall", n_pairs=100, n_rare=300, n_blocks=3, f_r=0.5, f_v=0.5)],
    "members-of-other-knobs": lambda: [
        BlockListTask("recall", n_pairs=16, n_rare=4, n_blocks=6, f_r=r, f_v=v, burstiness=b)
        for r, v, b in ((0.0, 0.1, 1), (0.5, 0.0, 1), (0.2, 0.8, 1), (0.0, 1.0, 3), (0.0, 0.5, 3), (0.0, 0.5, 6))],
    "n16": lambda: [BlockListTask("recall", n_pairs=32, n_blocks=16, f_v=1.0, bos=True)] * 2,
})
TASKS = {**ASSIGN_ADD, **BLOCK_LISTS}


@needs_compiler
@pytest.mark.parametrize("name", TASKS)
def test_the_kernel_makes_the_torch_forms_batches_bit_for_bit(name):
    tasks = TASKS[name]()
    sampler = direct(tasks, [data_key(s) for s in range(len(tasks))])
    assert all(k is not None for k in kernels(sampler)), "a sampler on the CPU uses the kernel where cc is"
    reference = sampler.torch_form
    for step, batch in [(0, 1), (7, 33), ([3, 4, 5], 64), ([2 ** 32 - 1], 17), (123_456, 256)]:
        for made, expected in zip(sampler(step, batch), reference(step, batch)):
            assert made.dtype == expected.dtype and torch.equal(made, expected), (name, step, batch)


@needs_compiler
def test_a_tensor_step_is_made_by_the_torch_form(monkeypatch):
    sampler = direct([AssignAddTask()], [5])
    assert sampler.native is not None
    monkeypatch.setattr(native.AssignAddKernel, "__call__", lambda *a: pytest.fail("the kernel read a tensor step"))
    tokens, labels = sampler(torch.tensor(9), 8)
    assert torch.equal(tokens, sampler.torch_form(9, 8)[0])


def test_switched_off_the_torch_form_makes_the_batches_and_says_so(fresh, monkeypatch):
    monkeypatch.setenv("CIRCUITBOOK_NATIVE", "0")
    sampler = direct([AssignAddTask()], [5])
    assert sampler.native is None
    assert any("CIRCUITBOOK_NATIVE=0" in line for line in fresh)
    assert torch.equal(sampler(3, 16)[0], sampler.torch_form(3, 16)[0])


@pytest.mark.parametrize("compiler, reason", [("no-such-compiler-xyz", "not found"), ("false", "not compiled")])
def test_without_a_working_compiler_the_torch_form_makes_the_batches(fresh, monkeypatch, compiler, reason):
    monkeypatch.setenv("CC", compiler)
    tasks = BLOCK_LISTS["n16"]()
    sampler = direct(tasks, [1, 2])
    assert kernels(sampler) == [None]
    assert len(fresh) == 1 and reason in fresh[0] and "torch ops" in fresh[0], fresh
    direct([AssignAddTask()], [5])
    assert len(fresh) == 1, "said once"


@needs_compiler
def test_a_damaged_cached_library_is_reported_removed_and_compiled_again(fresh):
    cached = native.library_path("cc")  # damaged before any process loaded it (a loaded one is never rewritten)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\x7fELF half a library")
    lib = native.library()
    assert lib is not None and any(str(cached) in line and "damaged" in line for line in fresh), fresh
    assert cached.read_bytes()[:4] == b"\x7fELF" and len(cached.read_bytes()) > 1000
    assert not [p for p in native.cache_dir().iterdir() if p != cached], "no half-written file left beside it"


@needs_compiler
def test_a_kernel_that_disagrees_with_the_torch_form_is_never_used(fresh, monkeypatch):
    real = native.BlockListKernel.__call__

    def off_by_one(self, step, batch_size):
        tokens, targets = real(self, step, batch_size)
        tokens[..., -1] += 1
        return tokens, targets

    monkeypatch.setattr(native.BlockListKernel, "__call__", off_by_one)
    sampler = direct(BLOCK_LISTS["n16"](), [1, 2])
    assert kernels(sampler) == [None]
    assert any("disagrees" in line and "tokens differ" in line for line in fresh), fresh
    assert torch.equal(sampler(4, 8)[0], sampler.torch_form(4, 8)[0])


@needs_compiler
def test_a_task_the_kernel_cannot_make_is_made_by_the_torch_form(fresh, monkeypatch):
    monkeypatch.setattr(native, "MAX_ROW", 20)  # rows of 97 choices
    sampler = direct(BLOCK_LISTS["n16"](), [1, 2])
    assert kernels(sampler) == [None]
    assert any("cannot make these batches" in line and "at most 20" in line for line in fresh), fresh
    assert set(native.KIND_CODES) == set(KINDS), "native.c knows every kind"


def test_the_kernels_read_only_contiguous_int64_cpu_tensors():
    with pytest.raises(ValueError, match="contiguous int64"):
        native._ptr(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous int64"):
        native._ptr(torch.zeros(3, 4, dtype=torch.long).T)


@needs_compiler
def test_bad_steps_are_refused_before_the_kernel_runs():
    sampler = direct([AssignAddTask()], [5])
    for step in (-1, 2 ** 32, [0, -3]):
        with pytest.raises(ValueError, match="step must be an integer"):
            sampler(step, 4)


@needs_compiler
def test_the_kernels_struct_layouts_match_native_c():
    """ctypes reads the C structs by their fields' order: every field native.c declares, in its order."""
    source = re.sub(r"/\*.*?\*/", "", native.SOURCE.read_text(), flags=re.S)  # no comments
    for struct, fields in (("aa_tables", native._AssignAddTables._fields_),
                           ("blocklist_task", native._BlockListTask._fields_)):
        body = source[source.index(f"struct {struct} {{") + len(f"struct {struct} {{"):]
        declarations = body[:body.index("};")].split(";")[:-1]
        declared = [name.split()[-1].strip("*") for d in declarations for name in d.split(",")]
        assert declared == [f for f, _ in fields], struct
    assert ctypes.sizeof(native._AssignAddTables) == 8 * len(native._AssignAddTables._fields_)


def test_the_kernel_settings_are_known_checked_and_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"CIRCUITBOOK_NATIVE": "0", "CIRCUITBOOK_NATIVE_CACHE": "kernels"}
    settings.check_environment(env)
    assert env == {"CIRCUITBOOK_NATIVE": "0", "CIRCUITBOOK_NATIVE_CACHE": str(tmp_path / "kernels")}
    with pytest.raises(settings.SettingError, match="CIRCUITBOOK_NATIVE='2'.*0.*1"):
        settings.check_environment({"CIRCUITBOOK_NATIVE": "2"})
