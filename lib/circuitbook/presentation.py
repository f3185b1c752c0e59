"""How the scorecard speaks to a reader: labels and units for recorded keys, values formatted, the failed
part of a row in words, and each chapter's summary figure (paper against book).

Each chapter's `claims.yml` has a top-level `labels:` mapping, one entry per key a scorecard row shows
(measured keys, rule keys, baselines): `key: {label: "0-var accuracy when variables reach 50%", unit: ""}`.
The Measured column shows labels and formatted values (3 significant digits, steps as integers, the
median of per-seed values with the seeds folded into the row's details); the raw `key = value` text stays
in the details for people who grep. Nothing here is imported by a notebook: a change of presentation never
makes a result stale.
"""
from __future__ import annotations

import math
import statistics
from functools import lru_cache
from pathlib import Path

from . import claims, context
from .params import chapter_dir

UNITS = ("", "steps", "epochs", "s*eta", "nats", "windows", "dimensions", "count", "x", "fraction", "cosine", "R^2",
         "exponent")


@lru_cache(maxsize=32)
def _labels_cached(chapter: str, mtime: int) -> dict:
    data = claims.load_claims(chapter)
    path = chapter_dir(chapter) / "claims.yml"
    labels = data.get("labels") or {}
    if not isinstance(labels, dict):
        raise claims.ClaimsError(f"{path}: 'labels' must map recorded keys to {{label, unit}}")
    for key, v in labels.items():
        if not (isinstance(v, dict) and set(v) == {"label", "unit"} and isinstance(v["label"], str)
                and v["label"].strip() and v["unit"] in UNITS):
            raise claims.ClaimsError(f"{path}: labels.{key} must be {{label: non-empty text, unit: one of "
                                     f"{', '.join(repr(u) for u in UNITS)}}}; got {v!r}")
    shown = set()
    for c in data["claims"]:
        shown |= set(c["measured"]) | set((c.get("baselines") or {}).values())
        for part in claims.claim_parts(c):
            shown |= set(part.keys())
    missing = sorted(shown - set(labels))
    if missing:
        raise claims.ClaimsError(f"{path}: labels: has no label for {', '.join(missing)} (every key a scorecard "
                                 "row shows needs one)")
    return labels


def chapter_labels(chapter: str) -> dict[str, dict]:
    """The chapter's `labels:`, checked: every key a row shows has a label and a known unit."""
    path = chapter_dir(chapter) / "claims.yml"
    return _labels_cached(chapter, path.stat().st_mtime_ns)


def _number(v: float, unit: str) -> str:
    if math.isnan(v):
        return "not measured"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if unit == "steps" or (float(v).is_integer() and abs(v) < 1e6):
        return f"{round(v):,}"
    if v != 0 and not 1e-3 <= abs(v) < 1e5:
        return f"{v:.2e}"
    for digits in range(3, 7):  # a value just below 1 (a cosine of 0.9997) is not shown as "1"
        text = f"{v:.{digits}g}"
        if float(text) != round(float(text)) or float(text) == v:
            return text
    return text


def format_value(value, unit: str = "") -> str:
    """A recorded value as a reader reads it: 3 significant digits, steps as integers, a list of per-seed
    values as their median (NaN seeds left out, as the rules do), text as it is."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        finite = [float(v) for v in value if not math.isnan(float(v))]
        return _number(statistics.median(finite) if finite else float("nan"), unit)
    return _number(float(value), unit)


def with_unit(text: str, unit: str) -> str:
    return text if unit in ("", "fraction", "cosine", "R^2", "exponent") or text == "not measured" else f"{text} {unit}"


def _row_entries(row: dict) -> dict:
    try:
        results = context.read_results(row["chapter"], row["notebook"], row["label"])
    except context.DamagedResultsError:
        return {}
    return (results or {}).get("values") or {}


def row_values(row: dict) -> dict:
    """The values the row's notebook recorded (empty if it has none to show)."""
    return {k: v.get("value") for k, v in _row_entries(row).items()}


def row_intervals(row: dict) -> dict:
    """The sampling intervals recorded beside the row's values ({key: [lo, hi], or one per seed})."""
    return {k: v["interval"] for k, v in _row_entries(row).items() if v.get("interval") is not None}


def format_interval(interval, unit: str = "") -> str:
    """'[0.874, 0.926]', or one such pair per seed joined by commas."""
    if interval and isinstance(interval[0], list):
        return ", ".join(format_interval(i, unit) for i in interval)
    return f"[{format_value(float(interval[0]), unit)}, {format_value(float(interval[1]), unit)}]"


def measured_items(claim: dict, labels: dict, values: dict, intervals: dict | None = None) -> list[dict]:
    """The Measured column's entries: label, formatted value (with unit), per-seed values, raw key, and the
    sampling interval where one was recorded (empty text otherwise)."""
    out = []
    for key in claim["measured"]:
        if key not in values:
            continue
        lab = labels.get(key, {"label": key, "unit": ""})
        v = values[key]
        seeds = ", ".join(format_value(x, lab["unit"]) for x in v) if isinstance(v, list) and len(v) > 1 else ""
        interval = (intervals or {}).get(key)
        out.append({"key": key, "label": lab["label"], "value": with_unit(format_value(v, lab["unit"]), lab["unit"]),
                    "seeds": seeds, "interval": format_interval(interval, lab["unit"]) if interval else ""})
    return out


def rule_in_words(rule: str, labels: dict) -> str:
    """'aa5_heldout_pair_acc >= 0.974' -> '0-var accuracy on held-out pairs >= 0.974'."""
    r = claims.parse_rule(rule)
    name = labels.get(r["key"], {}).get("label", r["key"])
    if "op" in r:
        return f"{name} {r['op']} {r['num']:g}"
    if "lo" in r:
        return f"{name} in [{r['lo']:g}, {r['hi']:g}]"
    return f"{name} within {r['center']:g} +- {r['tol']:g}"


def failed_parts(row: dict, claim: dict, labels: dict, values: dict) -> list[str]:
    """For a row that is not reproduced or partial: each part that kept it from `reproduced`, as its rules in
    words with the measured values ("needs 0-var accuracy >= 0.974; measured 0.745"), or why it is not
    measured. Empty for any other row."""
    kind = claims.status_kind(row["status"])
    if kind not in ("not reproduced", "partial") or not row.get("parts"):
        return []
    out = []
    by_name = {p.name: p for p in claims.claim_parts(claim)}
    for part in row["parts"]:
        if part["status"] == "reproduced":
            continue
        prefix = f"{part['name']}: " if part["name"] else ""
        if part["status"] == "not measured":
            out.append(f"{prefix}not measured ({part['detail']})")
            continue
        rules = by_name[part["name"]].reproduced_if
        failing = [r for r in rules if not claims.rule_holds(r, values)]
        words = []
        for r in failing or rules:
            key = claims.parse_rule(r)["key"]
            unit = labels.get(key, {}).get("unit", "")
            measured = with_unit(format_value(values.get(key, float("nan")), unit), unit)
            words.append(f"needs {rule_in_words(r, labels)}; measured {measured}")
        if part["status"] == "partial":
            words.append(part["detail"] if "straddles" in part.get("detail", "") else "passes the looser partial rule")
        out.append(prefix + "; ".join(words))
    return out


# ---------------------------------------------------------------- the chapter's summary figure

def _numeric_rules(claim: dict) -> list[tuple[str, dict]]:
    return [(rule, claims.parse_rule(rule)) for part in claims.claim_parts(claim) for rule in part.reproduced_if]


def summary_figure(chapter: str, rows: list[dict], path: Path) -> int:
    """Every numeric rule of the chapter's graded claims as one line: the range the paper's claim allows
    (shaded; a threshold shades the side that passes), this build's value (dot: the median over seeds; bar:
    the seeds' range), coloured by the row's status. Saved to `path`; returns the number of lines drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import plotting

    plotting.use_style()
    labels = chapter_labels(chapter)
    by_id = {c["id"]: c for c in claims.load_claims(chapter)["claims"]}
    lines = []
    for row in rows:
        values = row_values(row) if row.get("measured") else {}
        for rule, r in _numeric_rules(by_id[row["id"]]):
            v = values.get(r["key"])
            if v is None or isinstance(v, str):
                continue
            seeds = [float(x) for x in (v if isinstance(v, list) else [v]) if not math.isnan(float(x))]
            lines.append((row, rule, r, seeds))
    colors = {"reproduced": "#2e7d32", "partial": "#e0a100", "not reproduced": "#c62828", "not measured": "#757575",
              "not run": "#9e9e9e", "stale": "#6d4c41"}
    n = max(len(lines), 1)
    fig, axes = plt.subplots(n, 1, figsize=(6.4, 0.8 * n + 0.6), squeeze=False)
    for ax, (row, rule, r, seeds) in zip(axes[:, 0], lines):
        kind = claims.status_kind(row["status"])
        target = [r["lo"], r["hi"]] if "lo" in r else [r["center"] - r["tol"], r["center"] + r["tol"]] \
            if "center" in r else [r["num"], r["num"]]
        pts = [x for x in seeds + target if math.isfinite(x)]
        lo, hi = min(pts), max(pts)
        pad = (hi - lo) * 0.15 or max(abs(hi), 1.0) * 0.15
        lo, hi = lo - pad, hi + pad
        if "op" in r and r["op"] in (">=", ">"):
            ax.axvspan(r["num"], hi, color="#9e9e9e", alpha=0.25, lw=0)
        elif "op" in r and r["op"] in ("<=", "<"):
            ax.axvspan(lo, r["num"], color="#9e9e9e", alpha=0.25, lw=0)
        else:
            ax.axvspan(target[0], target[1], color="#9e9e9e", alpha=0.25, lw=0)
        finite = [x for x in seeds if math.isfinite(x)]
        if finite:
            med = statistics.median(finite)
            ax.plot([min(finite), max(finite)], [0, 0], color=colors[kind], lw=2)
            ax.plot([med], [0], "o", color=colors[kind], ms=6)
        else:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", fontsize="small")
        ax.set_xlim(lo, hi)
        ax.set_yticks([])
        key_label = labels.get(r["key"], {}).get("label", r["key"])
        ax.set_title(f"{row['id']}  {key_label}  ({kind})", loc="left", fontsize="small", pad=2)
        ax.tick_params(axis="x", labelsize="x-small")
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
    if not lines:
        ax = axes[0, 0]
        ax.axis("off")
        ax.text(0.5, 0.5, "no claim of this chapter has a measured value in this build", ha="center", va="center")
    fig.tight_layout(h_pad=0.4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(lines)


SUMMARY_CAPTION = ("Paper against book: each numeric rule of this chapter's claims on its own axis. Grey: the "
                   "values the paper's claim allows (a threshold shades the side that passes); dot: this build's "
                   "median over seeds, bar: the seeds' range; colour: the row's status (green reproduced, amber "
                   "partial, red not reproduced). Generated from the recorded results by "
                   "`presentation.summary_figure`.")


# ---------------------------------------------------------------- re-run this page

def _spec_range(spec) -> str:
    if spec.choices is not None:
        return "one of " + ", ".join(repr(c) for c in spec.choices)
    if spec.min is not None or spec.max is not None:
        lo = "" if spec.min is None else f"{spec.min:g} <= "
        hi = "" if spec.max is None else f" <= {spec.max:g}"
        return f"{lo}value{hi}"
    return ""


def rerun_box(chapter: str, notebook: str, profile: str, filename: str) -> str:
    """The markdown of a notebook page's "Re-run this page" box: the command at each profile, the papermill
    form, the parameters a reader may vary (type, range, this build's value) and the executed notebook."""
    from . import params

    label = f"{chapter}/{notebook}"
    specs = params.specs(chapter, notebook)
    try:
        values = params.resolve(chapter, notebook, profile)
    except params.ParameterError:
        values = {}
    rows = ["| parameter | type | allowed | value at " + profile + " |", "|---|---|---|---|"]
    for name, spec in sorted(specs.items()):
        value = values.get(name, "")
        shown = repr(value) if isinstance(value, str) else str(value)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        rows.append(f"| `{name}` | {spec.type} | {_spec_range(spec) or '-'} | `{shown}` |".replace("\n", " "))
    path = f"chapters/{chapter}/{notebook}.ipynb" if chapter != params.BOOK_PSEUDO_CHAPTER else f"book/{notebook}.ipynb"
    commands = "\n".join(f"circuitbook run {label} --profile {p}" for p in ("smoke", "cpu", "full"))
    example = next((f" -y 'params: {{{n}: {values[n]}}}'" for n in sorted(specs)
                    if isinstance(values.get(n), (int, float)) and not isinstance(values.get(n), bool)), "")
    return "\n".join([
        "````{admonition} Re-run this page", ":class: dropdown cb-rerun", "",
        "Execute it again at a profile (cached runs are loaded, missing ones trained; the results go to the "
        "book's run store):", "", "```bash", commands, "```", "",
        f"or with papermill, overriding any parameter below (`circuitbook params {chapter}` lists every value "
        "per profile; `-p NAME VALUE` does the same for `circuitbook run`):", "",
        "```bash", f"papermill {path} out.ipynb -p profile {profile}{example}", "```", "",
        *rows, "",
        f"The notebook as this build executed it: {{download}}`{filename} <{filename}>`.", "````", ""])
