"""A tiny book written into a temporary folder, for build and CLI tests."""
import shutil
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def notebook(chapter: str, name: str, body: str) -> nbformat.NotebookNode:
    params = nbformat.v4.new_code_cell('profile = "cpu"\nparams = {}')
    params.metadata["tags"] = ["parameters"]
    setup = nbformat.v4.new_code_cell(f'import circuitbook as cb\ncfg = cb.load_params("{chapter}", "{name}", profile, **params)')
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {name}"), params, setup,
                                         nbformat.v4.new_code_cell(body)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def write(root: Path) -> Path:
    (root / "book").mkdir(parents=True)
    (root / "chapters" / "demo").mkdir(parents=True)
    shutil.copy(ROOT / "_config.yml", root / "_config.yml")
    (root / "book" / "references.bib").write_text("")
    (root / "_toc.yml").write_text(
        "format: jb-book\nroot: book/intro\nchapters:\n  - file: book/scorecard\n"
        "  - file: chapters/demo/index\n    sections:\n      - file: chapters/demo/01_make\n"
        "      - file: chapters/demo/02_use\n")
    (root / "book" / "intro.md").write_text("# Mini book\n\nA test.\n")
    (root / "book" / "scorecard.md").write_text("<!-- scorecard -->\n")
    (root / "chapters" / "demo" / "index.md").write_text("# Demo chapter\n\n<!-- claims-table -->\n")
    (root / "chapters" / "demo" / "profiles.yml").write_text(
        "parameters:\n  value: {type: float, min: 0, max: 10, help: a number}\n"
        "  fail: {type: bool, help: raise an error}\n"
        "defaults: {value: 1.0, fail: false}\nsmoke: {value: 2.0}\ncpu: {}\nfull: {}\n"
        "notebooks:\n  02_use:\n    needs: [01_make]\n    estimate_s: {smoke: 3}\n")
    (root / "chapters" / "demo" / "claims.yml").write_text(
        "title: Demo\n"
        "labels:\n  demo_value: {label: the value, unit: ''}\n  demo_twice: {label: twice the value, unit: ''}\n"
        "claims:\n"
        "  - {id: D-1, statement: value is big, paper: '2', notebook: 01_make, measured: [demo_value],"
        " reproduced_if: ['demo_value >= 2'], partial_if: ['demo_value >= 1'], expected: [smoke]}\n"
        "  - {id: D-2, statement: twice is four, paper: '4', notebook: 02_use, measured: [demo_twice],"
        " reproduced_if: ['demo_twice within 4 +- 0.01'], expected: [smoke, cpu]}\n")
    nbformat.write(notebook("demo", "01_make", 'if cfg.fail:\n    raise RuntimeError("planned failure")\n'
                                               'cb.record("demo_value", cfg.value)'),
                   root / "chapters" / "demo" / "01_make.ipynb")
    nbformat.write(notebook("demo", "02_use", 'cb.record("demo_twice", 2 * cfg.value)\nprint("twice", 2 * cfg.value)'),
                   root / "chapters" / "demo" / "02_use.ipynb")
    return root
