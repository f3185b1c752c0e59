"""The claims ledger: `record()` in notebooks, the scorecard from claims.yml.

`chapters/<slug>/claims.yml` has one entry per claim id of PAPERS.md:

    - id: AA-5
      statement: Held-out (n1, n2) pairs are answered with about 99.4% accuracy.
      paper: "99.4%"
      notebook: 03_generalization
      measured: [aa5_heldout_pair_acc]          # keys shown in the measured column
      reproduced_if: ["aa5_heldout_pair_acc >= 0.97"]
      partial_if: ["aa5_heldout_pair_acc >= 0.8"]
      expected: [cpu, full]                     # profiles at which it should hold

Rules are `KEY OP NUMBER` (OP one of >= <= > < == !=), `KEY in [LO, HI]` or
`KEY within VALUE +- TOL`. All rules of a list must hold. A recorded string
that starts with "not run" makes the claim "not run" with that reason.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import yaml

from . import context
from .params import PROFILES, check_profile, chapter_dir, chapters, notebooks

STATUSES = ("reproduced", "partial", "not reproduced", "not run")
CLAIM_KEYS = {"id", "statement", "paper", "notebook", "measured", "reproduced_if", "partial_if", "expected",
              "note", "figure"}


# ---------------------------------------------------------------- record

def _plain(value):
    """A plain Python float, int-valued float or str (numpy and torch scalars too)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"record(): value must be a float or str (or a numpy/torch scalar), got {type(value).__name__}")


def record(key: str, value, *, run=None, display: bool = False):
    """Glue `value` under `key` for the text and write it to this notebook's results.

    The scorecard reads these values. `run` (a Run or run key) says which run
    the value came from; by default the last run this notebook trained or loaded.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key or ""):
        raise ValueError(f"record(): key {key!r} must be a Python-style identifier (letters, digits, _)")
    value = _plain(value)
    ctx = context.current()
    if run is None and ctx and ctx["runs"]:
        run_key = ctx["runs"][-1]["key"]
    else:
        run_key = getattr(run, "key", run)
    context.set_value(key, value, run_key)
    _glue(key, value, display)
    return value


def _glue(key: str, value, display: bool) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:
        return
    from myst_nb import glue

    glue(key, round(value, 4) if isinstance(value, float) else value, display=display)


# ---------------------------------------------------------------- rules

_RULE = re.compile(r"^\s*(?P<key>[A-Za-z_]\w*)\s*(?:(?P<op>>=|<=|==|!=|>|<)\s*(?P<num>\S+)"
                   r"|in\s*\[\s*(?P<lo>[^,\]]+)\s*,\s*(?P<hi>[^\]]+)\]"
                   r"|within\s+(?P<center>\S+)\s*\+-\s*(?P<tol>\S+))\s*$")


def parse_rule(rule: str) -> dict:
    m = _RULE.match(rule)
    if not m:
        raise ValueError(f"claim rule {rule!r} is not of the form 'KEY OP NUMBER', 'KEY in [LO, HI]' "
                         f"or 'KEY within VALUE +- TOL'")
    d = {k: v for k, v in m.groupdict().items() if v is not None}
    for k in ("num", "lo", "hi", "center", "tol"):
        if k in d:
            try:
                d[k] = float(d[k])
            except ValueError:
                d[k] = d[k].strip("'\"")
    return d


def rule_holds(rule: str, values: dict) -> bool:
    r = parse_rule(rule)
    x = values[r["key"]]
    if "op" in r:
        y = r["num"]
        if isinstance(x, str) or isinstance(y, str):
            return {"==": x == y, "!=": x != y}.get(r["op"], False)
        if math.isnan(x):
            return False
        return {">=": x >= y, "<=": x <= y, ">": x > y, "<": x < y, "==": x == y, "!=": x != y}[r["op"]]
    if isinstance(x, str) or math.isnan(x):
        return False
    if "lo" in r:
        return r["lo"] <= x <= r["hi"]
    return abs(x - r["center"]) <= r["tol"]


def rule_keys(rules: list[str]) -> list[str]:
    return [parse_rule(r)["key"] for r in rules]


# ---------------------------------------------------------------- the ledger

def load_claims(chapter: str) -> dict:
    """Parse and check a chapter's claims.yml."""
    path = chapter_dir(chapter) / "claims.yml"
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ValueError(f"{path}: needs a 'claims' list")
    known_nbs = set(notebooks(chapter))
    for c in data["claims"]:
        where = f"{path}: claim {c.get('id', '?')}"
        if set(c) - CLAIM_KEYS:
            raise ValueError(f"{where}: unknown keys {sorted(set(c) - CLAIM_KEYS)}; allowed: {sorted(CLAIM_KEYS)}")
        for k in ("id", "statement", "paper", "notebook", "measured", "reproduced_if", "expected"):
            if k not in c:
                raise ValueError(f"{where}: missing {k!r}")
        for rule in c["reproduced_if"] + c.get("partial_if", []):
            parse_rule(rule)
        bad = [p for p in c["expected"] if p not in PROFILES]
        if bad:
            raise ValueError(f"{where}: expected profiles {bad} are not in {PROFILES}")
        if known_nbs and c["notebook"] not in known_nbs:
            raise ValueError(f"{where}: notebook {c['notebook']!r} is not one of {sorted(known_nbs)}")
    return data


def claim_chapters() -> list[str]:
    """Chapters with a claims.yml, in the order of the book's table of contents."""
    from .build import toc_files

    toc = toc_files()
    order = {c: next((i for i, f in enumerate(toc) if f.startswith(f"chapters/{c}/")), len(toc)) for c in chapters()}
    return sorted((c for c in chapters() if (chapter_dir(c) / "claims.yml").exists()), key=lambda c: (order[c], c))


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def evaluate_claim(chapter: str, claim: dict, profile: str) -> dict:
    """One scorecard row for `claim` at `profile`."""
    row = {"id": claim["id"], "chapter": chapter, "statement": claim["statement"], "paper": str(claim["paper"]),
           "measured": "", "status": "", "profile": profile, "notebook": claim["notebook"],
           "runs": [], "rule": " and ".join(claim["reproduced_if"]), "expected": list(claim["expected"])}
    where = f"{chapter}/{claim['notebook']}"
    if claim["notebook"] not in notebooks(chapter):
        return {**row, "status": f"not run: notebook {where} is not written yet"}
    results = context.read_results(chapter, claim["notebook"], profile)
    if results is None:
        why = (f"{where} not executed at profile {profile}" if profile in claim["expected"]
               else f"not expected at profile {profile} and {where} not executed")
        return {**row, "status": f"not run: {why}"}
    if results.get("status") == "failed":
        return {**row, "status": f"not run: {where} failed at profile {profile}"}
    values = {k: v["value"] for k, v in results.get("values", {}).items()}
    row["runs"] = sorted({v["run"] for k, v in results.get("values", {}).items()
                          if v.get("run") and k in claim["measured"]})
    row["measured"] = "; ".join(f"{k} = {_fmt(values[k])}" for k in claim["measured"] if k in values)
    reasons = [values[k] for k in claim["measured"] if isinstance(values.get(k), str) and values[k].startswith("not run")]
    if reasons:
        return {**row, "status": reasons[0]}
    needed = set(rule_keys(claim["reproduced_if"] + claim.get("partial_if", []))) | set(claim["measured"])
    missing = sorted(k for k in needed if k not in values)
    if missing:
        state = "still running or stopped early" if results.get("status") == "running" else "finished"
        return {**row, "status": f"not run: {where} did not record {', '.join(missing)} ({state})"}
    if all(rule_holds(r, values) for r in claim["reproduced_if"]):
        status = "reproduced"
    elif claim.get("partial_if") and all(rule_holds(r, values) for r in claim["partial_if"]):
        status = "partial"
    else:
        status = "not reproduced"
    return {**row, "status": status}


def scorecard(profile: str) -> list[dict]:
    check_profile(profile)
    return [evaluate_claim(ch, c, profile) for ch in claim_chapters() for c in load_claims(ch)["claims"]]


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def scorecard_markdown(profile: str) -> str:
    rows = scorecard(profile)
    counts = {s: sum(r["status"].startswith(s) for r in rows) for s in STATUSES}
    lines = [f"# Scorecard ({profile} profile)", "",
             "Every claim of the four papers, with the paper's value, this book's measured value and an honest "
             f"status, for the **{profile}** profile. Generated by `circuitbook scorecard --profile {profile}` "
             "from each chapter's `claims.yml` and the values its notebooks recorded.", "",
             "Summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(rows)} claims.", ""]
    for chapter in claim_chapters():
        data = load_claims(chapter)
        lines += [f"## {data.get('title', chapter)}", "",
                  "| Claim | Statement | Paper | Measured | Rule | Status |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in (r for r in rows if r["chapter"] == chapter):
            expected = "" if profile in r["expected"] else f" (expected at: {', '.join(r['expected']) or 'none'})"
            lines.append("| " + " | ".join(_md_escape(x) for x in (
                r["id"], r["statement"], r["paper"], r["measured"] or "-", r["rule"], r["status"] + expected)) + " |")
        lines.append("")
    return "\n".join(lines)


def claims_table_markdown(chapter: str) -> str:
    """The landing page's table: every claim, the paper's value, how it is judged."""
    data = load_claims(chapter)
    lines = ["| Claim | Statement | Paper | Judged by | Expected at | Notebook |", "| --- | --- | --- | --- | --- | --- |"]
    for c in data["claims"]:
        lines.append("| " + " | ".join(_md_escape(x) for x in (
            c["id"], c["statement"], c["paper"], " and ".join(c["reproduced_if"]),
            ", ".join(c["expected"]) or "none (needs external weights)", c["notebook"])) + " |")
    return "\n".join(lines)
