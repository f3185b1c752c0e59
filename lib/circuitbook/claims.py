"""The claims ledger: `record()` in notebooks, the scorecard from claims.yml.

`chapters/<slug>/claims.yml` has one entry per claim id of PAPERS.md:

    - id: AA-8
      statement: Residual vectors ... are nearly identical.
      paper: "cosine similarity ~1"
      notebook: 04_mechanisms
      measured: [aa8_centred_cosine, aa8_centred_mismatched]   # keys shown in the measured column
      reproduced_if: ["aa8_centred_cosine >= 0.9"]
      partial_if: ["aa8_centred_cosine >= 0.7"]
      baselines: {aa8_centred_cosine: aa8_centred_mismatched} # shown beside the value
      expected: [cpu, full]                                    # profiles at which it should hold

or, for a claim with several parts, `parts:` instead of the two rule lists:

      parts:
        - {name: jump timing, reproduced_if: [...], partial_if: [...]}
        - {name: routing circuit, reproduced_if: [...], partial_if: [...]}

Rules are `KEY OP NUMBER` (OP one of >= <= > < == !=), `KEY in [LO, HI]` or
`KEY within VALUE +- TOL`; all rules of a list must hold. A part's `partial_if`
is the same part with a looser tolerance, so it must use every key of its
`reproduced_if`. A value recorded as a list (one per seed) passes a rule when
its median does and a majority of its seeds do; the row shows the values and
how many seeds pass.

Statuses: `reproduced`, `partial` (every part at least partial; or a named
part not measured while the others hold), `not reproduced`, `not measured:
why` (NaN values), `not run: why`, and `stale: what changed` when the result
was recorded by other code than the current (it is then not graded).
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from . import book, context, params
from .params import PROFILES, ParameterError, check_profile, chapter_dir, chapters, notebooks

STATUSES = ("reproduced", "partial", "not reproduced", "not measured", "not run", "stale")
CLAIM_KEYS = {"id", "statement", "paper", "notebook", "measured", "reproduced_if", "partial_if", "parts",
              "baselines", "expected", "note", "rule_note", "figure"}
PART_KEYS = {"name", "reproduced_if", "partial_if"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AUTO = object()  # record(run=...) default: the notebook's only run


class ClaimsError(ParameterError):
    """A claims.yml that cannot be used; the message names the file, the claim and what is allowed."""


# ---------------------------------------------------------------- record

def _plain(value):
    """A plain Python float or str (numpy and torch scalars too), or a list of floats."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1:
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("record(): a list of values (one per seed) must not be empty")
        return [_plain_number(v) for v in value]
    return _plain_number(value)


def _plain_number(value) -> float:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"record(): value must be a float or str, a list of floats (one per seed), or a numpy/torch "
                    f"scalar; got {type(value).__name__}")


def record(key: str, value, *, run=_AUTO, why: str | None = None, display: bool = False, interval=None):
    """Glue `value` under `key` for the text and write it to this notebook's results.

    value: a number, a str, or a list of numbers (one per seed: the scorecard judges the median).
    A NaN value means "could not be measured": say why (`why="no jump detected"`).
    interval: the value's sampling interval (lo, hi) where the draw of the evaluation (its probes, its
    pools) could move it across a rule's threshold; for a list, one (lo, hi) per seed. The rules read
    the whole interval (`rule_verdict`); it is stored as `interval: [lo, hi]` beside the value.
    run: the Run (or run key) the value measured, a list of them for a value computed from several
    runs, None for a value that comes from no training run. It may be left out only when the
    notebook used at most one run.
    """
    if not isinstance(key, str) or not _IDENT.fullmatch(key):
        raise ValueError(f"record(): key {key!r} must be a Python-style identifier (letters, digits, _)")
    value = _plain(value)
    if why is not None and not isinstance(why, str):
        raise TypeError(f"record(): why must be a str, got {type(why).__name__}")
    interval = _plain_interval(key, value, interval)
    ctx = context.current()
    if run is _AUTO:
        used = ctx["runs"] if ctx else []
        if len(used) > 1:
            names = ", ".join(f"{r['name']} ({r['key']})" for r in used)
            raise ValueError(f"record({key!r}): this notebook used {len(used)} runs ({names}); pass run= to say "
                             "which one this value measured (run=None if it comes from no training run)")
        run_key = used[0]["key"] if used else None
    elif isinstance(run, (list, tuple)):  # a value computed from several runs (e.g. one per modulus)
        run_key = [_run_key(key, r) for r in run]
        if not run_key:
            raise ValueError(f"record({key!r}): run=[] names no run; pass run=None for a value from no run")
    else:
        run_key = _run_key(key, run)
    context.set_value(key, value, run_key, why, interval=interval)
    _glue(key, value, display)
    if interval is not None:  # the text can quote it: `<key>_interval`
        _glue_text(f"{key}_interval", _fmt_interval(interval))
    return value


def _plain_interval(key: str, value, interval):
    """interval checked against value: [lo, hi] with lo <= value <= hi (NaN where the value is NaN), or
    one such pair per seed of a list value; None stays None."""
    if interval is None:
        return None
    if isinstance(value, str):
        raise ValueError(f"record({key!r}): a text value has no interval")
    if isinstance(value, list):
        if (not isinstance(interval, (list, tuple)) or len(interval) != len(value)
                or not all(isinstance(i, (list, tuple)) for i in interval)):
            raise ValueError(f"record({key!r}): a list of {len(value)} values needs one (lo, hi) per seed as its "
                             f"interval, got {interval!r}")
        return [_one_interval(key, v, i) for v, i in zip(value, interval)]
    return _one_interval(key, value, interval)


def _one_interval(key: str, value: float, interval) -> list[float]:
    try:
        lo, hi = (_plain_number(x) for x in interval)
    except (TypeError, ValueError):
        raise ValueError(f"record({key!r}): interval must be a pair (lo, hi) of numbers, got {interval!r}") from None
    if math.isnan(value):
        return [lo, hi]
    if math.isnan(lo) or math.isnan(hi) or not lo <= value <= hi:
        raise ValueError(f"record({key!r}): the interval [{lo:g}, {hi:g}] must hold the value {value:g} "
                         "(lo <= value <= hi)")
    return [lo, hi]


def _fmt_interval(interval) -> str:
    if interval and isinstance(interval[0], list):
        return ", ".join(_fmt_interval(i) for i in interval)
    return f"[{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _glue_text(key: str, text: str) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:
        return
    from myst_nb import glue

    glue(key, text, display=False)


def _run_key(key: str, run) -> str | None:
    run_key = getattr(run, "key", run)
    if run_key is not None and not isinstance(run_key, str):
        raise TypeError(f"record({key!r}): run must be a Run, a run key (str), a list of them, or None")
    return run_key


def _glue(key: str, value, display: bool) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:
        return
    from myst_nb import glue

    if isinstance(value, list):  # the text quotes the median; `<key>_seeds` lists every seed's value
        glue(f"{key}_seeds", ", ".join(_fmt(v) for v in value), display=False)
        value = _median(value)
    glue(key, round(value, 4) if isinstance(value, float) else value, display=display)


# ---------------------------------------------------------------- rules

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_RULE = re.compile(rf"^\s*(?P<key>[A-Za-z_]\w*)\s*(?:(?P<op>>=|<=|==|!=|>|<)\s*(?P<num>{_NUM})"
                   rf"|in\s*\[\s*(?P<lo>{_NUM})\s*,\s*(?P<hi>{_NUM})\s*\]"
                   rf"|within\s+(?P<center>{_NUM})\s*\+-\s*(?P<tol>{_NUM}))\s*$")


def parse_rule(rule: str) -> dict:
    if not isinstance(rule, str):
        raise ValueError(f"claim rule {rule!r} must be a string")
    m = _RULE.match(rule)
    if not m:
        raise ValueError(f"claim rule {rule!r} is not of the form 'KEY OP NUMBER', 'KEY in [LO, HI]' or "
                         f"'KEY within VALUE +- TOL' (OP one of >= <= > < == !=, numbers like 0.5 or 1e-3)")
    d = {k: (float(v) if k != "key" and k != "op" else v) for k, v in m.groupdict().items() if v is not None}
    if "lo" in d and d["lo"] > d["hi"]:
        raise ValueError(f"claim rule {rule!r}: the interval [{d['lo']:g}, {d['hi']:g}] is empty")
    if "tol" in d and d["tol"] < 0:
        raise ValueError(f"claim rule {rule!r}: the tolerance must be >= 0")
    return d


def _holds(r: dict, x: float) -> bool:
    if math.isnan(x):
        return False
    if "op" in r:
        y = r["num"]
        return {">=": x >= y, "<=": x <= y, ">": x > y, "<": x < y, "==": x == y, "!=": x != y}[r["op"]]
    if "lo" in r:
        return r["lo"] <= x <= r["hi"]
    return abs(x - r["center"]) <= r["tol"]


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else float("nan")


def rule_holds(rule: str, values: dict) -> bool:
    """Whether a rule holds for recorded values.

    A list (one value per seed) must pass by its median (over the seeds that measured it) and by a
    majority of all its seeds on their own (a seed that measured nothing does not pass): one seed
    far off cannot carry an interval rule, and missing seeds cannot be left out to make it pass.
    """
    r = parse_rule(rule)
    x = values[r["key"]]
    if isinstance(x, str):
        return False
    if isinstance(x, list):
        return _holds(r, _median(x)) and 2 * sum(_holds(r, v) for v in x) > len(x)
    return _holds(r, x)


def _extreme(r: dict, value: float, interval, worst: bool) -> float:
    """The point of a value's sampling interval [lo, hi] least (worst=True) or most favourable to rule r.
    Without an interval (or for a NaN value), the value itself."""
    if interval is None or math.isnan(value):
        return value
    lo, hi = interval
    if "op" in r:
        y, op = r["num"], r["op"]
        if op in (">=", ">"):
            return lo if worst else hi
        if op in ("<=", "<"):
            return hi if worst else lo
        inside = lo <= y <= hi
        other = lo if lo != y else hi  # a point of the interval that is not y (y itself if lo == hi == y)
        if op == "==":
            return other if worst else (y if inside else lo)
        return (y if inside else lo) if worst else other
    a, b = (r["lo"], r["hi"]) if "lo" in r else (r["center"] - r["tol"], r["center"] + r["tol"])
    if worst:  # an end outside [a, b] if there is one (inside, every point passes)
        return lo if lo < a else hi
    return min(max((a + b) / 2, lo), hi)


def _at_extremes(r: dict, values: dict, intervals: dict, worst: bool) -> dict:
    x, i = values[r["key"]], intervals.get(r["key"])
    if i is None or isinstance(x, str):
        return values
    x = [_extreme(r, v, iv, worst) for v, iv in zip(x, i)] if isinstance(x, list) else _extreme(r, x, i, worst)
    return {**values, r["key"]: x}


def rule_verdict(rule: str, values: dict, intervals: dict | None = None) -> str:
    """"pass", "fail" or "straddles": the rule read over the whole sampling interval of its key's value
    (`record(..., interval=...)`; per seed for a list). It passes only when it holds at every point of the
    interval(s), fails when it holds at none, and otherwise the interval straddles the threshold. A value
    without an interval is read as it is (pass or fail)."""
    r = parse_rule(rule)
    intervals = intervals or {}
    if rule_holds(rule, _at_extremes(r, values, intervals, worst=True)):
        return "pass"
    if not rule_holds(rule, _at_extremes(r, values, intervals, worst=False)):
        return "fail"
    return "straddles"


def entry_intervals(entries: dict) -> dict:
    """{key: [lo, hi] (or one per seed)} of a results file's entries recorded with a sampling interval: what
    `_part_status` and `_seed_agreement` read beside the values."""
    return {k: v["interval"] for k, v in entries.items() if isinstance(v, dict) and v.get("interval") is not None}


def _straddle_detail(rules: list[str], values: dict, intervals: dict) -> str:
    keys = list(dict.fromkeys(parse_rule(r)["key"] for r in rules
                              if rule_verdict(r, values, intervals) == "straddles"))
    return "; ".join(f"the sampling interval {_fmt_interval(intervals[k])} of {k} straddles the threshold"
                     for k in keys)


def rule_keys(rules: list[str]) -> list[str]:
    return [parse_rule(r)["key"] for r in rules]


# ---------------------------------------------------------------- the ledger

def load_claims(chapter: str) -> dict:
    """Parse and check a chapter's claims.yml: every mistake is refused here, naming the claim."""
    path = chapter_dir(chapter) / "claims.yml"
    data = params.load_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ClaimsError(f"{path}: needs a mapping with a 'claims' list")
    known_nbs = set(notebooks(chapter))
    seen: set[str] = set()
    for i, c in enumerate(data["claims"]):
        if not isinstance(c, dict):
            raise ClaimsError(f"{path}: claim #{i + 1} is a {type(c).__name__}, not a mapping of {sorted(CLAIM_KEYS)}")
        _check_claim(c, f"{path}: claim {c.get('id', f'#{i + 1}')}", known_nbs)
        if c["id"] in seen:
            raise ClaimsError(f"{path}: claim id {c['id']} appears twice")
        seen.add(c["id"])
    return data


def _string_list(c: dict, key: str, where: str, allow_empty: bool = False) -> list:
    v = c.get(key)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or (not v and not allow_empty):
        raise ClaimsError(f"{where}: {key!r} must be a {'' if allow_empty else 'non-empty '}list of strings, "
                          f"got {v!r}")
    return v


def _check_claim(c: dict, where: str, known_nbs: set[str]) -> None:
    if set(c) - CLAIM_KEYS:
        raise ClaimsError(f"{where}: unknown keys {sorted(set(c) - CLAIM_KEYS)}; allowed: {sorted(CLAIM_KEYS)}")
    for k in ("id", "statement", "paper", "notebook", "measured", "expected"):
        if k not in c:
            raise ClaimsError(f"{where}: missing {k!r}")
    for k in ("id", "statement", "notebook"):
        if not isinstance(c[k], str) or not c[k].strip():
            raise ClaimsError(f"{where}: {k!r} must be a non-empty string")
    if not isinstance(c["paper"], (str, int, float)):
        raise ClaimsError(f"{where}: 'paper' must be a string or a number")
    measured = _string_list(c, "measured", where)
    bad = [k for k in measured if not _IDENT.fullmatch(k)]
    if bad:
        raise ClaimsError(f"{where}: measured keys {bad} are not identifiers")
    expected = _string_list(c, "expected", where, allow_empty=True)
    if [p for p in expected if p not in PROFILES]:
        raise ClaimsError(f"{where}: expected profiles {[p for p in expected if p not in PROFILES]} are not in "
                          f"{list(PROFILES)}")
    if known_nbs and c["notebook"] not in known_nbs:
        raise ClaimsError(f"{where}: notebook {c['notebook']!r} is not one of {sorted(known_nbs)}")
    for part in claim_parts(c, where):
        pw = f"{where}, part {part.name!r}"
        for rule in part.reproduced_if + part.partial_if:
            try:
                parse_rule(rule)
            except ValueError as e:
                raise ClaimsError(f"{pw}: {e}") from None
        missing = set(rule_keys(part.reproduced_if)) - set(rule_keys(part.partial_if))
        if part.partial_if and missing:
            raise ClaimsError(f"{pw}: partial_if must be the whole part with a looser tolerance, so it must test "
                              f"every key of reproduced_if; it leaves out {sorted(missing)}")
    baselines = c.get("baselines") or {}
    if not isinstance(baselines, dict) or not all(isinstance(k, str) and isinstance(v, str) and _IDENT.fullmatch(v)
                                                  for k, v in baselines.items()):
        raise ClaimsError(f"{where}: 'baselines' must map measured keys to baseline keys, got {baselines!r}")
    if set(baselines) - set(measured):
        raise ClaimsError(f"{where}: baselines for {sorted(set(baselines) - set(measured))}, which are not measured")
    for k in ("note", "rule_note", "figure"):
        if k in c and not isinstance(c[k], str):
            raise ClaimsError(f"{where}: {k!r} must be a string")


@dataclass(frozen=True)
class Part:
    name: str
    reproduced_if: list
    partial_if: list

    def keys(self) -> list[str]:
        return list(dict.fromkeys(rule_keys(self.reproduced_if + self.partial_if)))


def claim_parts(c: dict, where: str = "claim") -> list[Part]:
    """The claim's parts: its `parts` list, or one unnamed part from reproduced_if/partial_if."""
    if "parts" in c:
        if "reproduced_if" in c or "partial_if" in c:
            raise ClaimsError(f"{where}: give either 'parts' or 'reproduced_if'/'partial_if', not both")
        if not isinstance(c["parts"], list) or not c["parts"]:
            raise ClaimsError(f"{where}: 'parts' must be a non-empty list of mappings {sorted(PART_KEYS)}")
        out = []
        for i, p in enumerate(c["parts"]):
            if not isinstance(p, dict) or set(p) - PART_KEYS or "name" not in p or "reproduced_if" not in p:
                raise ClaimsError(f"{where}: part #{i + 1} must be a mapping with name, reproduced_if and "
                                  f"optionally partial_if; got {p!r}")
            out.append(Part(str(p["name"]), _string_list(p, "reproduced_if", f"{where}, part #{i + 1}"),
                            _string_list(p, "partial_if", f"{where}, part #{i + 1}", True) if "partial_if" in p else []))
        return out
    if "reproduced_if" not in c:
        raise ClaimsError(f"{where}: missing 'reproduced_if' (or 'parts')")
    return [Part("", _string_list(c, "reproduced_if", where),
                 _string_list(c, "partial_if", where, True) if "partial_if" in c else [])]


def claim_chapters() -> list[str]:
    """Chapters with a claims.yml, in the order of the book's table of contents."""
    toc = book.toc_files()
    order = {c: next((i for i, f in enumerate(toc) if f.startswith(f"chapters/{c}/")), len(toc)) for c in chapters()}
    return sorted((c for c in chapters() if (chapter_dir(c) / "claims.yml").exists()), key=lambda c: (order[c], c))


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return f"{_fmt(_median(v))} (median of {len(v)}: {', '.join(_fmt(x) for x in v)})"
    if math.isnan(v):
        return "nan"
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def _is_nan(v) -> bool:
    if isinstance(v, list):
        return all(math.isnan(x) for x in v)
    return isinstance(v, float) and math.isnan(v)


def _part_status(part: Part, values: dict, whys: dict, intervals: dict | None = None) -> tuple[str, str]:
    """(status, detail) of one part: reproduced / partial / not reproduced / not measured.

    intervals: {key: [lo, hi] (or one per seed)} of the values recorded with their sampling interval: the
    part is reproduced only when every rule passes over the whole interval, not reproduced when its
    partial rules (else its rules) fail over the whole interval, and otherwise partial, saying which
    interval straddles the threshold."""
    intervals = intervals or {}
    unmeasured = [k for k in part.keys() if _is_nan(values[k])]
    if unmeasured:
        return "not measured", "; ".join(whys.get(k) or f"{k} could not be measured" for k in unmeasured)
    texts = [k for k in part.keys() if isinstance(values[k], str)]
    if texts:
        return "not reproduced", f"{', '.join(texts)} recorded as text, which no rule can judge"
    verdicts = [rule_verdict(r, values, intervals) for r in part.reproduced_if]
    if all(v == "pass" for v in verdicts):
        return "reproduced", ""
    if "fail" not in verdicts:
        return "partial", _straddle_detail(part.reproduced_if, values, intervals)
    looser = [rule_verdict(r, values, intervals) for r in part.partial_if]
    if part.partial_if and all(v == "pass" for v in looser):
        return "partial", ""
    if part.partial_if and "fail" not in looser:
        return "partial", _straddle_detail(part.partial_if, values, intervals)
    return "not reproduced", ""


def _seed_agreement(parts: list[Part], values: dict, intervals: dict | None = None) -> str:
    """For rules on per-seed values: how many seeds pass each rule on their own (and, for values recorded
    with sampling intervals, how many seeds' intervals straddle its threshold)."""
    intervals = intervals or {}
    out = []
    for part in parts:
        for rule in part.reproduced_if:
            r = parse_rule(rule)
            x = values.get(r["key"])
            if isinstance(x, list):
                text = f"{sum(_holds(r, v) for v in x)}/{len(x)} seeds pass {rule!r}"
                per_seed = intervals.get(r["key"])
                if per_seed is not None:
                    sure = sum(_holds(r, _extreme(r, v, i, True)) for v, i in zip(x, per_seed))
                    never = sum(not _holds(r, _extreme(r, v, i, False)) for v, i in zip(x, per_seed))
                    text += f" ({len(x) - sure - never} with a sampling interval across the threshold)"
                out.append(text)
    return "; ".join(out)


def _combine(statuses: list[tuple[str, str, str]]) -> str:
    """One claim status from its parts' (name, status, detail)."""
    measured = [s for s in statuses if s[1] != "not measured"]
    missing = [s for s in statuses if s[1] == "not measured"]
    if not measured:
        return "not measured: " + "; ".join(d for _, _, d in missing)
    if any(s == "not reproduced" for _, s, _ in measured):
        return "not reproduced"
    if missing:
        return "partial: " + "; ".join(f"{n or 'the claim'} not measured ({d})" for n, _, d in missing)
    return "partial" if any(s == "partial" for _, s, _ in measured) else "reproduced"


def evaluate_claim(chapter: str, claim: dict, label: str) -> dict:
    """One scorecard row for `claim` with the results recorded under `label` (a profile, or PROFILE+...)."""
    profile = context.label_profile(label)
    parts = claim_parts(claim)
    row = {"id": claim["id"], "chapter": chapter, "statement": claim["statement"], "paper": str(claim["paper"]),
           "measured": "", "status": "", "profile": profile, "label": label, "notebook": claim["notebook"],
           "runs": [], "rule": " and ".join(_part_rule(p, "reproduced_if") for p in parts),
           "partial_rule": " and ".join(_part_rule(p, "partial_if") for p in parts if p.partial_if),
           "rule_note": claim.get("rule_note", ""), "note": claim.get("note", ""),
           "expected": list(claim["expected"]), "deviations": [], "baselines": "", "seeds": "", "release": "",
           "provenance": ""}
    where = f"{chapter}/{claim['notebook']}"
    if claim["notebook"] not in notebooks(chapter):
        return {**row, "status": f"not run: notebook {where} is not written yet"}
    try:
        results = context.read_results(chapter, claim["notebook"], label)
    except context.DamagedResultsError as e:
        return {**row, "status": f"not run: {e}"}
    if results is None:
        why = (f"{where} not executed at {label}" if profile in claim["expected"]
               else f"not expected at profile {profile} and {where} not executed")
        return {**row, "status": f"not run: {why}"}
    problem = context.check_record(chapter, claim["notebook"], label, results)
    if problem:
        return {**row, "status": f"not run: {problem}; its values are not graded (re-execute {where})"}
    row["provenance"] = provenance_text(results.get("provenance"))
    overrides = results.get("overrides") or {}
    release = results.get("release")  # a released run: its name and what was evaluated, not our training
    if isinstance(release, dict):
        row["release"] = f"{release.get('name')} ({release.get('path')}): {release.get('evaluated')}"
    try:
        row["deviations"] = params.deviations(chapter, claim["notebook"], profile, overrides, release=bool(release))
    except ParameterError as e:
        row["deviations"] = [f"(cannot list: {e})"]
    row["deviations"] += context.deviations_found(results)  # found at run time (context.note_deviation)
    if results.get("status") == "failed":
        return {**row, "status": f"not run: {where} failed at {label} ({results.get('error') or 'no message'})"}
    if results.get("status") != "ok":
        return {**row, "status": f"not run: {where} is still running or was interrupted at {label} "
                                 f"(started {results.get('started', '?')}); its values are not graded"}
    try:
        current = book.notebook_inputs(chapter, claim["notebook"], profile, overrides)
    except ParameterError as e:
        return {**row, "status": f"stale: its parameters are no longer valid ({e})"}
    changed = book.stale_reasons(results, current)
    entries = results.get("values", {})
    values = {k: v["value"] for k, v in entries.items()}
    whys = {k: v.get("why") for k, v in entries.items()}
    keys = list(dict.fromkeys(claim["measured"] + [k for p in parts for k in p.keys()]))
    row["runs"] = sorted({r for k in keys if k in entries for r in _as_list(entries[k].get("run")) if r})
    row["measured"] = "; ".join(f"{k} = {_fmt(values[k])}" for k in claim["measured"] if k in values)
    baselines = claim.get("baselines") or {}
    row["baselines"] = "; ".join(f"{b} = {_fmt(values[b])} (baseline for {k})" if b in values
                                 else f"{b} not recorded (baseline for {k})" for k, b in baselines.items())
    if changed:
        return {**row, "status": "stale: " + book.describe_stale(changed)}
    reasons = [values[k] for k in keys if isinstance(values.get(k), str) and values[k].startswith("not run")]
    if reasons:
        return {**row, "status": reasons[0]}
    missing = sorted(k for k in keys if k not in values)
    if missing:
        return {**row, "status": f"not run: {where} finished without recording {', '.join(missing)}"}
    intervals = entry_intervals(entries)
    row["seeds"] = _seed_agreement(parts, values, intervals)
    statuses = [(p.name, *_part_status(p, values, whys, intervals)) for p in parts]
    return {**row, "status": _combine(statuses), "parts": [{"name": n, "status": s, "detail": d}
                                                            for n, s, d in statuses]}


class NotRecorded(LookupError):
    """Another notebook's values cannot be read: not executed, failed, damaged or stale (the message says which)."""


def recorded_values(chapter: str, notebook: str, label: str) -> dict:
    """{key: value} that `chapter/notebook` recorded under `label`, as the scorecard would grade them: only
    from a finished execution whose results match its executed notebook and whose inputs (notebook, parameters,
    library code) are still the current ones; otherwise NotRecorded says why. A value recorded as not
    measured is NaN (its reason in `recorded_whys`)."""
    return {k: v["value"] for k, v in _fresh_entries(chapter, notebook, label).items()}


def recorded_whys(chapter: str, notebook: str, label: str) -> dict:
    """{key: why} of the values `chapter/notebook` recorded as not measured under `label` (see recorded_values)."""
    return {k: v["why"] for k, v in _fresh_entries(chapter, notebook, label).items() if v.get("why")}


def _fresh_entries(chapter: str, notebook: str, label: str) -> dict:
    where = f"{chapter}/{notebook}"
    try:
        results = context.read_results(chapter, notebook, label)
    except context.DamagedResultsError as e:
        raise NotRecorded(str(e)) from None
    if results is None:
        raise NotRecorded(f"{where} has not been executed at {label}")
    problem = context.check_record(chapter, notebook, label, results)
    if problem:
        raise NotRecorded(f"{where}: {problem}")
    if results.get("status") != "ok":
        raise NotRecorded(f"{where} did not finish at {label} (status {results.get('status')!r})")
    try:
        current = book.notebook_inputs(chapter, notebook, context.label_profile(label), results.get("overrides") or {})
    except ParameterError as e:
        raise NotRecorded(f"{where}: its parameters are no longer valid ({e})") from None
    changed = book.stale_reasons(results, current)
    if changed:
        raise NotRecorded(f"{where} is stale at {label}: " + book.describe_stale(changed))
    return results.get("values", {})


def provenance_text(provenance) -> str:
    """A record's provenance for a reader: `machine · environment · commit`."""
    if not isinstance(provenance, dict):
        return ""
    return " · ".join(str(provenance.get(k, "?")) for k in ("machine", "environment", "commit"))


def _as_list(run) -> list:
    return run if isinstance(run, list) else [run]


def _part_rule(part: Part, kind: str) -> str:
    rules = " and ".join(getattr(part, kind))
    return f"{part.name}: {rules}" if part.name else rules


def scorecard(profile: str, label: str | None = None) -> list[dict]:
    """Every claim's row at `profile`, or with the results recorded under `label`."""
    label = label or profile
    check_profile(context.label_profile(label))
    return [evaluate_claim(ch, c, label) for ch in claim_chapters() for c in load_claims(ch)["claims"]]


def status_kind(status: str) -> str:
    """reproduced / partial / not reproduced / not measured / not run / stale."""
    return next(s for s in sorted(STATUSES, key=len, reverse=True) if status.startswith(s))


def counts(rows: list[dict]) -> dict[str, int]:
    return {s: sum(status_kind(r["status"]) == s for r in rows) for s in STATUSES}
