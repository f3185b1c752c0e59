"""Every glue key a notebook's text uses is recorded on every path the notebook can take.

An unresolved glue key fails the build (`build.render`), so a notebook that could not measure something
(no pretrained model here, no modulus sweep at this profile, no emergence in any seed) must still record
every key its markdown quotes: as NaN with a `why`, or as a phrase. Two checks:

- statically, for every notebook of the book: each key its markdown quotes (`{glue:text}`key:fmt``,
  `{glue}`key``, `{glue:figure}` ..., and `key_seeds` for a per-seed list) is one its code can record
  (`cb.record(...)` with a literal key, a key from a loop over literals, or an f-string pattern; keys
  built in the chapter's package are found among its string literals), and a per-seed key the code also
  records as a scalar NaN has its `_seeds` phrase recorded too (a scalar NaN glues no `_seeds`);
- by executing, at smoke, the paths where a measurement cannot be made, and checking that the executed
  notebook's glue outputs cover every key its markdown quotes.

A notebook that cannot run at all (leading_terms on a corpus shorter than n_samples under
`short_corpus: error` stops with CorpusError) fails; it has no glue to check, and its page shows the failure.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest

from circuitbook import build
from conftest import ROOT

GLUE_ROLE = re.compile(r"\{glue(?::\w+)?\}`([^`]+)`")
GLUE_DIRECTIVE = re.compile(r"^```\{glue(?::\w+)?\}\s+(\S+)", re.M)
NOTEBOOKS = list(build.book_notebooks(ROOT))
RECORDERS = {"record"}  # cb.record, claims.record
NAN_FORMS = {"float('nan')", 'float("nan")', "np.nan", "math.nan", "numpy.nan", "nan"}


def glue_keys_used(nb: nbformat.NotebookNode) -> set[str]:
    """The glue keys the notebook's markdown quotes (formats stripped)."""
    used = set()
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            used |= {m.split(":")[0].strip() for m in GLUE_ROLE.findall(cell.source)}
            used |= set(GLUE_DIRECTIVE.findall(cell.source))
    return used


def glued(executed: Path) -> set[str]:
    """The glue keys an executed notebook holds (myst-nb's glue outputs)."""
    nb = json.loads(Path(executed).read_text())
    return {o["metadata"]["scrapbook"]["name"] for c in nb["cells"] for o in c.get("outputs", [])
            if "scrapbook" in o.get("metadata", {})}


# ---------------------------------------------------------------- what the code can record (static)

def _code(nb) -> str:
    lines = [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
             if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


class _Keys(ast.NodeVisitor):
    """Keys of record(...) calls: literals, names bound by loops over literals or by literal assignments,
    and f-strings (each unresolved field a `\\w*` pattern); and the keys recorded as a scalar NaN."""

    def __init__(self, tree: ast.AST):
        self.bound: dict[str, set[str]] = {}
        dicts = {node.targets[0].id: node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                 and isinstance(node.value, ast.Dict)}
        self.open: set[str] = set()  # names also bound to something not a literal (resolved as a pattern too)
        for node in ast.walk(tree):  # names bound to literal strings anywhere (loop targets, assignments)
            if isinstance(node, (ast.For, ast.comprehension)):
                targets = [node.target] if isinstance(node.target, ast.Name) else \
                    node.target.elts if isinstance(node.target, ast.Tuple) else []
                values = [_literals(node.iter)] if isinstance(node.target, ast.Name) else _pairs(node.iter, dicts)
                for k, target in enumerate(targets):
                    if isinstance(target, ast.Name):
                        found = values[k] if k < len(values) else set()
                        self.bound.setdefault(target.id, set()).update(found)
                        if not found:
                            self.open.add(target.id)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant) \
                            and isinstance(node.value.value, str):
                        self.bound.setdefault(target.id, set()).add(node.value.value)
                    elif isinstance(target, ast.Name):
                        self.open.add(target.id)
        self.keys: set[str] = set()
        self.patterns: set[str] = set()
        self.nan_keys: set[str] = set()
        self.visit(tree)

    def visit_Call(self, node: ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in RECORDERS and node.args:
            keys, pattern = self._resolve(node.args[0])
            self.keys |= keys
            if pattern:
                self.patterns.add(pattern)
            if len(node.args) > 1 and ast.unparse(node.args[1]) in NAN_FORMS:
                self.nan_keys |= keys
        self.generic_visit(node)

    def _resolve(self, expr) -> tuple[set[str], str | None]:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}, None
        if isinstance(expr, ast.Name) and self.bound.get(expr.id):
            return set(self.bound[expr.id]), (r"\w*" if expr.id in self.open else None)
        if isinstance(expr, ast.IfExp):  # `prefix + key if prefix else key`: either
            (a, pa), (b, pb) = self._resolve(expr.body), self._resolve(expr.orelse)
            return a | b, "|".join(p for p in (pa, pb) if p) or None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            (a, pa), (b, pb) = self._resolve(expr.left), self._resolve(expr.right)
            if a and b and not (pa or pb):
                return {x + y for x in a for y in b}, None
            return set(), None
        if isinstance(expr, ast.JoinedStr):
            parts = []
            for v in expr.values:
                if isinstance(v, ast.Constant):
                    parts.append([re.escape(v.value)])
                elif isinstance(v.value, ast.Name) and self.bound.get(v.value.id) and v.format_spec is None:
                    parts.append([re.escape(b) for b in sorted(self.bound[v.value.id])]
                                 + ([r"\w*"] if v.value.id in self.open else []))
                else:
                    parts.append([r"\w*"])
            alternatives = ["".join(p) for p in _product(parts)]
            literal = {re.sub(r"\\(.)", r"\1", a) for a in alternatives if r"\w*" not in a}
            patterns = [a for a in alternatives if r"\w*" in a]
            return literal, "|".join(f"(?:{a})" for a in patterns) or None
        return set(), None


def _literals(node) -> set[str]:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "items":
        return _literals(node.func.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literals(node.left) | _literals(node.right)
    return set()


def _pairs(node, dicts: dict) -> list[set[str]]:
    """For `for a, b in D.items()` (D a dict literal, or a name assigned one): [keys, values]; for
    `for a, b in ((x, y), (z, w))`: [{x, z}, {y, w}]; else []."""
    if isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, (ast.Tuple, ast.List)) for e in node.elts):
        width = max((len(e.elts) for e in node.elts), default=0)
        return [{e.elts[k].value for e in node.elts if k < len(e.elts) and isinstance(e.elts[k], ast.Constant)
                 and isinstance(e.elts[k].value, str)} for k in range(width)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "items":
        d = node.func.value
        d = dicts.get(d.id) if isinstance(d, ast.Name) else d
        if isinstance(d, ast.Dict):
            strs = [lambda n: {n.value} if isinstance(n, ast.Constant) and isinstance(n.value, str) else set()]
            return [set().union(*(strs[0](k) for k in d.keys if k is not None)),
                    set().union(*(strs[0](v) for v in d.values))]
    return []


def _product(parts):
    out = [""]
    for options in parts:
        out = [o + p for o in out for p in options]
    return out


def _package_strings(chapter: str) -> set[str]:
    """String literals of the chapter's package: keys its records.py (or another module) builds for the
    notebook to record in a loop (`for key, value in ea.phase_records(...).items(): cb.record(key, ...)`)."""
    folder = ROOT / "lib" / "circuitbook" / "experiments" / chapter
    out = set()
    for path in folder.glob("*.py") if folder.exists() else []:
        out |= {n.value for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return out


def recordable(nb_path: str, chapter: str) -> tuple[_Keys, set[str]]:
    nb = nbformat.read(ROOT / nb_path, as_version=4)
    code = _code(nb)
    keys = _Keys(ast.parse(code))
    strings = {n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return keys, strings | _package_strings("book" if chapter == "book" else chapter)


def unrecordable(nb_path: str, chapter: str) -> list[str]:
    """Keys the markdown quotes that no record(...) of the notebook (or string of its chapter's package) names."""
    nb = nbformat.read(ROOT / nb_path, as_version=4)
    keys, strings = recordable(nb_path, chapter)

    def can(key: str) -> bool:
        if key in keys.keys or any(re.fullmatch(p, key) for p in keys.patterns):
            return True
        if key in strings:  # built in a loop from literals elsewhere (records.py, a dict of the notebook)
            return True
        return key.endswith("_seeds") and can(key[:-len("_seeds")])

    return sorted(k for k in glue_keys_used(nb) if not can(k))


def seeds_lost_to_nan(nb_path: str, chapter: str) -> list[str]:
    """Per-seed keys the markdown quotes as `key_seeds` that the code also records as a scalar NaN (which
    glues no `_seeds`) without recording `key_seeds` itself on some path."""
    nb = nbformat.read(ROOT / nb_path, as_version=4)
    keys, _ = recordable(nb_path, chapter)
    used = glue_keys_used(nb)
    return sorted(f"{k}_seeds" for k in keys.nan_keys
                  if f"{k}_seeds" in used and f"{k}_seeds" not in keys.keys
                  and not any(re.fullmatch(p, f"{k}_seeds") for p in keys.patterns))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.path for nb in NOTEBOOKS])
def test_every_glue_key_the_text_quotes_can_be_recorded(nb):
    assert glue_keys_used(nbformat.read(ROOT / nb.path, as_version=4)) or nb.chapter == "book", \
        f"{nb.path} quotes no glue key: is the pattern right?"
    assert unrecordable(nb.path, nb.chapter) == [], f"{nb.path} quotes keys its code never records"
    assert seeds_lost_to_nan(nb.path, nb.chapter) == [], \
        f"{nb.path}: a per-seed key recorded as a scalar NaN glues no `_seeds`; record the phrase too"


def test_the_static_check_finds_what_it_should(tmp_path):
    """The checks fail on a typo'd key, and on a per-seed key whose NaN path glues no `_seeds`."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("for key in ('a_x', 'a_y'):\n    cb.record(key, 1.0)\n"
                                  "for m in ('p', 'q'):\n    cb.record(f'b_{m}_rate', [1.0, 2.0])\n"
                                  "cb.record(f'c_{model.name}', 1.0)\n"
                                  "if ok:\n    cb.record('d', [1.0, 2.0])\nelse:\n    cb.record('d', float('nan'), why='no')\n"),
        nbformat.v4.new_markdown_cell("{glue:text}`a_x:.2f` {glue:text}`b_q_rate_seeds` {glue}`c_anything` "
                                      "{glue:text}`d_seeds` {glue:text}`a_z`\n\n```{glue:figure} b_p_rate\n```")])
    path = tmp_path / "chapters" / "nochapter" / "01_x.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    rel = str(path.relative_to(tmp_path))
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert glue_keys_used(nb) == {"a_x", "b_q_rate_seeds", "c_anything", "d_seeds", "a_z", "b_p_rate"}
        assert unrecordable(rel, "nochapter") == ["a_z"]
        assert seeds_lost_to_nan(rel, "nochapter") == ["d_seeds"]
    finally:
        ROOT = old


# ---------------------------------------------------------------- the paths that cannot measure, executed

FAILURE_PATHS = [
    # AC-9 on a machine without any of its pretrained models (a GPU visit): nothing is measured
    ("algorithmic_cores/05_agreement", {"model_names": ["no-such-model"]}),
    # AC-8 without the modulus sweep (the cpu profile's setting): its p part is not measured
    ("algorithmic_cores/04_delay_law", {"sweep_p_run": False}),
    # LT-3 on a corpus shorter than n_samples, taken whole (the full profile on the book's sample), whose
    # vocabulary holds none of the book's listed adjectives, entities or word classes
    ("leading_terms/01_corpus", {"n_samples": 10 ** 6, "short_corpus": "all", "tinystories_path": "STORIES"}),
]


def made_up_stories(path: Path) -> str:
    """200 stories of 30 three-letter made-up words (80 distinct, none of them English)."""
    import random

    rng = random.Random(0)
    words = [a + b + c for a in "qxz" for b in "qwxzk" for c in "jqvwxz"][:80]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(30)) for _ in range(200)))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("notebook, overrides", FAILURE_PATHS, ids=[n for n, _ in FAILURE_PATHS])
def test_a_notebook_that_cannot_measure_still_glues_every_key(notebook, overrides, runs_dir, tmp_path):
    if overrides.get("tinystories_path") == "STORIES":
        overrides = {**overrides, "tinystories_path": made_up_stories(tmp_path / "stories.txt")}
    executed, _ = build.run_one(notebook, "smoke", overrides, log=lambda m: None)
    chapter, name = notebook.split("/")
    used = glue_keys_used(nbformat.read(ROOT / "chapters" / chapter / f"{name}.ipynb", as_version=4))
    missing = sorted(used - glued(executed))
    assert not missing, f"{notebook} with {overrides} glues no value for {missing}"
