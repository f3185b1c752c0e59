"""Pages the build generates: the scorecard, and each chapter's "what was run" and claims.

The verdict comes first: per chapter a one-line summary (a badge per status with its count), then a
table whose first columns are Claim and Status, then Paper and Measured (labels and formatted values,
`presentation`; a row that is not reproduced names the part that failed, its rule in words and the
measured value); the statement, the rules, the raw recorded keys, per-seed values, the profile's
deviations from the paper and the run keys fold into a detail under each row. The
HTML is plain (classes `cb-*`, styled by `book/_static/circuitbook.css`) so it stays readable in
the Markdown source and in any theme.
"""
from __future__ import annotations

import html
import time

from . import claims, context, params, presentation

STATUS_CLASS = {"reproduced": "reproduced", "partial": "partial", "not reproduced": "failed",
                "not measured": "unmeasured", "not run": "notrun", "stale": "stale"}


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def badge(status: str) -> str:
    kind = claims.status_kind(status)
    detail = status[len(kind):].lstrip(": ")
    title = f' title="{_e(detail)}"' if detail else ""
    return f'<span class="cb-badge cb-{STATUS_CLASS[kind]}"{title}>{_e(kind)}</span>'


def summary_line(rows: list[dict]) -> str:
    """Counts by status as badges: the verdict at a glance."""
    counts = claims.counts(rows)
    items = [f'<span class="cb-badge cb-{STATUS_CLASS[s]}">{n} {_e(s)}</span>' for s, n in counts.items() if n]
    return f'<p class="cb-summary">{" ".join(items)} <span class="cb-of">of {len(rows)} claims</span></p>'


def _detail(r: dict, items_shown: list[dict]) -> str:
    items = [("Claim", r["statement"]), ("Status", r["status"]), ("Reproduced if", r["rule"])]
    if r.get("partial_rule"):
        items.append(("Partial if", r["partial_rule"]))
    if r.get("rule_note"):
        items.append(("Why this rule", r["rule_note"]))
    per_seed = "; ".join(f"{m['label']}: {m['seeds']}" for m in items_shown if m["seeds"])
    if per_seed:
        items.append(("Per seed", per_seed))
    if r.get("seeds"):
        items.append(("Seeds", r["seeds"]))
    if r.get("measured"):
        items.append(("Recorded keys", r["measured"]))
    if r.get("baselines"):
        items.append(("Baselines", r["baselines"]))
    if r.get("note"):
        items.append(("How it is measured", r["note"]))
    items.append((f"Deviations of {r['label']} from the paper",
                  "; ".join(r["deviations"]) if r["deviations"] else "none listed"))
    items.append(("Expected at", ", ".join(r["expected"]) or "no profile (needs external weights)"))
    items.append(("Notebook", f"{r['chapter']}/{r['notebook']}"))
    if r.get("provenance"):
        items.append(("Produced on", r["provenance"]))
    if r["runs"]:
        items.append(("Runs", ", ".join(r["runs"])))
    body = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items)
    return f"<details><summary>details</summary><dl class=\"cb-detail\">{body}</dl></details>"


def _measured_item(m: dict) -> str:
    """One labelled value of the Measured cell, with its sampling interval where one was recorded."""
    seeds = " (median of seeds)" if m["seeds"] else ""
    interval = f" (sampling interval {_e(m['interval'])})" if m.get("interval") else ""
    return (f'<li><span class="cb-label">{_e(m["label"])}</span>: <span class="cb-value">{_e(m["value"])}</span>'
            f"{seeds}{interval}</li>")


def _measured_cell(r: dict) -> tuple[str, list[dict]]:
    """The Measured cell (labelled values, then what failed) and the entries it shows."""
    claim = next(c for c in claims.load_claims(r["chapter"])["claims"] if c["id"] == r["id"])
    labels = presentation.chapter_labels(r["chapter"])
    values = presentation.row_values(r) if r.get("measured") else {}
    intervals = presentation.row_intervals(r) if r.get("measured") else {}
    shown = presentation.measured_items(claim, labels, values, intervals)
    cell = "".join(_measured_item(m) for m in shown)
    cell = f'<ul class="cb-values">{cell}</ul>' if cell else "-"
    failed = presentation.failed_parts(r, claim, labels, values)
    if failed:
        cell += '<div class="cb-failed-part"><strong>Failed</strong>: ' + _e(" | ".join(failed)) + "</div>"
    return cell, shown


def claims_table(rows: list[dict]) -> str:
    out = ['<table class="cb-scorecard">',
           '<colgroup><col class="cb-col-id"><col class="cb-col-status"><col class="cb-col-paper">'
           '<col class="cb-col-measured"></colgroup>',
           "<thead><tr><th>Claim</th><th>Status</th><th>Paper</th><th>Measured</th></tr></thead>", "<tbody>"]
    for r in rows:
        cell, shown = _measured_cell(r)
        out.append(f'<tr id="claim-{_e(r["id"])}"><td class="cb-id">{_e(r["id"])}</td><td>{badge(r["status"])}'
                   f'</td><td>{_e(r["paper"])}</td><td class="cb-measured">{cell}{_detail(r, shown)}</td></tr>')
    out += ["</tbody>", "</table>"]
    return "\n".join(out)


def scorecard_markdown(profile: str, label: str | None = None) -> str:
    label = label or profile
    rows = claims.scorecard(profile, label)
    lines = [f"# Scorecard ({label})", "",
             "Every claim of the four papers with the paper's value, this book's measured value and an honest "
             f"status, for the **{label}** results. Generated by `circuitbook scorecard --profile {profile}` from "
             "each chapter's `claims.yml` and the values its notebooks recorded; open *details* under a row for "
             "the claim, the rule, the profile's deviations from the paper and the run.", "",
             summary_line(rows), ""]
    for chapter in claims.claim_chapters():
        data = claims.load_claims(chapter)
        ch_rows = [r for r in rows if r["chapter"] == chapter]
        lines += [f"## {data.get('title', chapter)}", "", summary_line(ch_rows), "", claims_table(ch_rows), ""]
    return "\n".join(lines)


CLAIMS_MARKER = "<!-- claims-table -->"


def chapter_header(chapter: str, profile: str, seconds: dict[str, float | None], built: str | None = None,
                   rows: list[dict] | None = None) -> str:
    """What was run: the profile, its deviations from the paper (those of every notebook once, then each
    notebook's own), wall time and date, and the chapter's verdicts at a glance."""
    rows = rows if rows is not None else [r for r in claims.scorecard(profile) if r["chapter"] == chapter]
    total = sum(s for s in seconds.values() if s)
    when = built or time.strftime("%Y-%m-%d %H:%M")
    devs = {nb: params.deviations(chapter, nb, profile) + _deviations_found(chapter, nb, profile)
            for nb in params.notebooks(chapter)}
    shared = [d for d in next(iter(devs.values()), []) if len(devs) > 1 and all(d in v for v in devs.values())]
    lines = ["```{admonition} What was run in this build", ":class: note",
             f"Profile **{profile}**, built {when}; this chapter's notebooks took {total / 60:.1f} min."
             if total else f"Profile **{profile}**, built {when}; no notebook of this chapter was executed.",
             "Deviations from the paper (generated from `profiles.yml`):", ""]
    if shared:
        lines.append("- every notebook: " + "; ".join(shared))
    for nb, own in devs.items():
        own = [d for d in own if d not in shared]
        secs = seconds.get(nb)
        timing = f" ({secs:.0f} s)" if secs else " (not executed)"
        lines.append(f"- `{nb}`{timing}: " + ("; ".join(own) if own else "nothing else" if shared else "the paper's settings"))
    lines += ["```", "", summary_line(rows) if rows else ""]
    return "\n".join(lines)


def _deviations_found(chapter: str, notebook: str, profile: str) -> list[str]:
    """What the notebook's execution at `profile` noted at run time (`context.note_deviation`)."""
    try:
        return context.deviations_found(context.read_results(chapter, notebook, profile))
    except context.DamagedResultsError:
        return []  # the scorecard row names the damaged file


def place_chapter_header(index_text: str, chapter: str, profile: str, seconds: dict, built: str | None = None,
                         figure: str | None = None, rows: list[dict] | None = None) -> str:
    """The chapter's landing page with "what was run" and its verdicts right under the title, and its
    claims table (verdict first) and the summary figure (`figure`: its path relative to the page) where
    `<!-- claims-table -->` stands. `rows`: the chapter's scorecard rows, if the caller has them."""
    rows = rows if rows is not None else [r for r in claims.scorecard(profile) if r["chapter"] == chapter]
    header = chapter_header(chapter, profile, seconds, built, rows)
    lines = index_text.splitlines()
    title = next((i for i, line in enumerate(lines) if line.startswith("# ")), -1)
    lines.insert(title + 1, "\n" + header + "\n")
    text = "\n".join(lines) + "\n"
    table = claims_table(rows) if rows else ""
    if figure:
        table += ("\n\n```{figure} " + figure + f"\n:name: summary-{chapter}\n:alt: paper against book, "
                  f"{chapter}\n:class: cb-summary-figure\n\n{presentation.SUMMARY_CAPTION}\n```\n")
    return text.replace(CLAIMS_MARKER, table)


# ---------------------------------------------------------------- the published book (`publish.build_published`)

BESIDE = ("cpu", "full")  # the scorecard of the published book shows these side by side for every claim


def provenance_banner(profile: str, results: dict) -> str:
    """The note on top of a notebook page: the profile, machine, environment, commit and date its numbers
    came from."""
    prov = results.get("provenance") if isinstance(results.get("provenance"), dict) else {}
    if not prov:
        return (f"```{{note}}\nThe numbers on this page are of profile **{profile}**; the record says nothing of the "
                "machine or commit that produced them.\n```")
    secs = prov.get("seconds")
    took = f", in {float(secs) / 60:.1f} min" if isinstance(secs, (int, float)) else ""
    return ("```{note}\n"
            f"The numbers on this page are of profile **{profile}**, executed on {_e(prov.get('machine', '?'))} "
            f"on {_e(str(prov.get('date', '?'))[:10])}{took}, at commit `{_e(prov.get('commit', '?'))}`, in the "
            f"environment {_e(prov.get('environment', '?'))}.\n```")


def _profile_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    cell, _ = _measured_cell(r) if r.get("measured") else ("", [])
    origin = f'<div class="cb-origin">{_e(r["provenance"])}</div>' if r.get("provenance") else ""
    return f"{badge(r['status'])}{cell}{origin}"


def claims_table_beside(rows: dict[str, list[dict]]) -> str:
    """One row per claim: the paper's value, then each profile's status and measured values side by side
    (the details under the first profile's row)."""
    first = rows[BESIDE[0]]
    by_id = {p: {r["id"]: r for r in rs} for p, rs in rows.items()}
    head = "".join(f"<th>{_e(p)}</th>" for p in rows)
    out = ['<table class="cb-scorecard cb-beside">', f"<thead><tr><th>Claim</th><th>Paper</th>{head}</tr></thead>",
           "<tbody>"]
    for r in first:
        cells = "".join(f'<td class="cb-measured">{_profile_cell(by_id[p].get(r["id"]))}</td>' for p in rows)
        _, shown = _measured_cell(r)
        out.append(f'<tr id="claim-{_e(r["id"])}"><td class="cb-id">{_e(r["id"])}{_detail(r, shown)}</td>'
                   f"<td>{_e(r['paper'])}</td>{cells}</tr>")
    out += ["</tbody>", "</table>"]
    return "\n".join(out)


def scorecard_beside(rows: dict[str, list[dict]]) -> str:
    """The published book's scorecard: every claim graded at each profile of `rows`, side by side."""
    lines = ["# Scorecard", "",
             "Every claim of the four papers (and the book's own questions) with the paper's value and, side by side, "
             f"what the {' and '.join(f'**{p}**' for p in rows)} profiles measured, each with its status and where "
             "its numbers were produced (machine, environment, commit). A result published from another machine is "
             "graded only while its inputs are this book's current sources; otherwise it says `stale`. Open "
             "*details* under a claim for the rule and the deviations.", ""]
    for p, rs in rows.items():
        lines.append(f"**{p}**: " + summary_line(rs))
    lines.append("")
    for chapter in claims.claim_chapters():
        data = claims.load_claims(chapter)
        ch = {p: [r for r in rs if r["chapter"] == chapter] for p, rs in rows.items()}
        lines += [f"## {data.get('title', chapter)}", "", claims_table_beside(ch), ""]
    return "\n".join(lines)


def place_published_header(index_text: str, chapter: str, shown: dict, seconds: dict, built: str,
                           rows: dict[str, list[dict]], figure: str | None = None) -> str:
    """A chapter's landing page in the published book: which profile and machine each notebook page shows,
    the verdicts per profile, and the claims side by side where `<!-- claims-table -->` stands."""
    lines = ["```{admonition} What these pages show", ":class: note",
             f"Built {built} from the published results (`published/`) and this checkout; each notebook page shows the "
             "largest profile whose result is current:", ""]
    for nb in params.notebooks(chapter):
        profile, results = shown.get(f"{chapter}/{nb}", (None, None))
        if profile is None:
            lines.append(f"- `{nb}`: not shown (no result)")
            continue
        prov = claims.provenance_text((results or {}).get("provenance")) if results else ""
        devs = "; ".join(params.deviations(chapter, nb, profile)) or "the paper's settings"
        lines.append(f"- `{nb}`: **{profile}**" + (f", {prov}" if prov else " (stale or not executed: not graded)")
                     + f". Deviations: {devs}")
    lines += ["```", ""] + [f"**{p}**: " + summary_line(rs) for p, rs in rows.items()]
    header = "\n".join(lines)
    text_lines = index_text.splitlines()
    title = next((i for i, line in enumerate(text_lines) if line.startswith("# ")), -1)
    text_lines.insert(title + 1, "\n" + header + "\n")
    text = "\n".join(text_lines) + "\n"
    table = claims_table_beside(rows)
    if figure:
        table += ("\n\n```{figure} " + figure + f"\n:name: summary-{chapter}\n:alt: paper against book, "
                  f"{chapter}\n:class: cb-summary-figure\n\n{presentation.SUMMARY_CAPTION}\n```\n")
    return text.replace(CLAIMS_MARKER, table)
