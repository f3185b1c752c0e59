"""Executed notebooks rendered without active content.

The book renders executed notebooks from the run store: its own cached executions, and those that
`import-results` placed there from another machine. Whoever produced them, nothing they show may run in a
reader's browser, so every executed notebook staged from the store passes through `clean_notebook`:

- outputs keep plain text, streams, errors, PNG/JPEG/GIF images, and HTML and SVG rebuilt from an
  allowlist of elements and attributes (no `<script>`, no event handlers, no `javascript:` or external
  URLs, no iframes, objects, embeds, forms or animations, CSS without `url()` or `@import`); JavaScript,
  widgets, Markdown and LaTeX outputs (which the renderer would parse as text of the book) are dropped;
- markdown and raw cells are the book's own: a cell whose text is one of the checkout's notebook's cells is
  taken from there (with its attachments and metadata); any other is shown as literal text;
- cell and notebook metadata (which the renderer reads as configuration: captions, widget state) come from
  the checkout's notebook, or are reduced to the tags the book uses.
"""
from __future__ import annotations

import html
import math
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import nbformat

GLUE_PREFIX = "application/papermill.record/"  # myst_nb.glue's values (display=False)
IMAGES = ("image/png", "image/jpeg", "image/gif")
SAFE_TAGS = {"hide-input", "hide-output", "hide-cell", "parameters", "injected-parameters", "cb-rerun"}

# ---------------------------------------------------------------- HTML

HTML_TAGS = {"a", "abbr", "b", "blockquote", "br", "caption", "cite", "code", "col", "colgroup", "dd", "del",
             "details", "dfn", "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2", "h3", "h4", "h5", "h6",
             "hr", "i", "img", "ins", "kbd", "li", "mark", "ol", "p", "pre", "q", "s", "samp", "small", "span",
             "strong", "style", "sub", "summary", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u",
             "ul", "var"}
DROPPED_WITH_CONTENT = {"script", "iframe", "frame", "frameset", "object", "embed", "applet", "noscript", "template",
                        "form", "button", "select", "textarea", "svg", "math", "head", "title", "audio", "video",
                        "canvas", "portal", "noembed", "noframes", "xmp", "plaintext"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track",
        "wbr"}
HTML_ATTRIBUTES = {"class", "title", "align", "valign", "colspan", "rowspan", "border", "width", "height",
                   "scope", "headers", "span", "start", "type", "open", "style", "href", "src", "alt", "dir",
                   "lang"}
_UNSAFE_CSS = re.compile(r"url\s*\(\s*(?!['\"]?#)|@import|expression\s*\(|javascript:|behaviou?r\s*:|-moz-binding|<",
                         re.I)  # url(#id) names something in the same image; any other URL would load from elsewhere
_DATA_IMAGE = re.compile(r"data:image/(png|jpe?g|gif);base64,[a-z0-9+/=\s]*", re.I)


def _plain_url(value: str) -> str:
    """A URL as a browser reads its scheme: entities already decoded, control characters and spaces gone."""
    return re.sub(r"[\x00-\x20\x7f]+", "", value).lower()


def _safe_href(value: str) -> bool:
    url = _plain_url(value)
    scheme = re.match(r"([a-z][a-z0-9+.-]*):", url)
    return scheme is None or scheme.group(1) in ("http", "https", "mailto")


def _safe_src(value: str) -> bool:
    """An image source that loads nothing from elsewhere: an inline PNG/JPEG/GIF or a path in the book."""
    url = _plain_url(value)
    return bool(_DATA_IMAGE.fullmatch(value.strip())) or not (re.match(r"[a-z][a-z0-9+.-]*:", url)
                                                             or url.startswith("//"))


class _HTMLCleaner(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip = 0  # depth inside an element dropped with its content
        self.style = False  # inside a kept <style>: its text is checked as a whole

    def handle_starttag(self, tag, attrs):
        self._start(tag, attrs, closed=False)

    def handle_startendtag(self, tag, attrs):
        self._start(tag, attrs, closed=True)

    def _start(self, tag, attrs, closed):
        if self.skip or tag in DROPPED_WITH_CONTENT:
            if tag not in VOID and not closed:
                self.skip += 1
            return
        if tag not in HTML_TAGS:
            return  # the tag goes, its text stays
        kept = []
        for name, value in attrs:
            value = value or ""
            if name not in HTML_ATTRIBUTES or (name == "style" and _UNSAFE_CSS.search(value)) \
                    or (name == "href" and (tag != "a" or not _safe_href(value))) \
                    or (name == "src" and (tag != "img" or not _safe_src(value))):
                continue
            kept.append(f' {name}="{html.escape(value, quote=True)}"')
        self.out.append(f"<{tag}{''.join(kept)}{' /' if closed else ''}>")
        self.style = tag == "style" and not closed
        if self.style:
            self.out.append("")  # its text goes here once checked

    def handle_endtag(self, tag):
        if self.skip:
            if tag in DROPPED_WITH_CONTENT or tag not in VOID:
                self.skip -= 1
            return
        if tag in HTML_TAGS and tag not in VOID:
            self.style = False
            self.out.append(f"</{tag}>")

    def handle_data(self, data):
        if self.skip:
            return
        if self.style:
            self.out[-1] += "" if _UNSAFE_CSS.search(data) else data  # CSS is not escaped, so it is checked
        else:
            self.out.append(html.escape(data, quote=False))


def clean_html(text: str) -> str:
    """HTML rebuilt from an allowlist: formatting, lists, tables and inline images, nothing that runs."""
    cleaner = _HTMLCleaner()
    cleaner.feed(text)
    cleaner.close()
    return "".join(cleaner.out)


# ---------------------------------------------------------------- SVG

SVG_NS = "http://www.w3.org/2000/svg"
XLINK_NS = "http://www.w3.org/1999/xlink"
SVG_TAGS = {"svg", "g", "defs", "path", "rect", "circle", "ellipse", "line", "polyline", "polygon", "text", "tspan",
            "textPath", "clipPath", "mask", "pattern", "marker", "symbol", "use", "image", "title", "desc", "style",
            "linearGradient", "radialGradient", "stop", "filter", "feGaussianBlur", "feOffset", "feBlend",
            "feFlood", "feComposite", "feMerge", "feMergeNode", "feColorMatrix"}


def clean_svg(text: str) -> str | None:
    """SVG with only drawing elements and presentation attributes, None if it is not readable SVG."""
    text = re.sub(r"<!DOCTYPE[^\[>]*>", "", text, count=1)  # matplotlib's plain doctype; no internal subset
    if "<!" in text.replace("<!--", ""):  # entities, CDATA and other declarations are not read
        return None
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return None
    if _local(root.tag) != "svg" or not _clean_svg_element(root):
        return None
    ET.register_namespace("", SVG_NS)
    ET.register_namespace("xlink", XLINK_NS)
    return ET.tostring(root, encoding="unicode")


def _local(name: str) -> str:
    return name.rsplit("}", 1)[-1]


def _clean_svg_element(el) -> bool:
    """Clean `el` in place; False if it must go with its content."""
    if not isinstance(el.tag, str) or _local(el.tag) not in SVG_TAGS or \
            (el.tag.startswith("{") and not el.tag.startswith("{" + SVG_NS + "}")):
        return False
    for name in list(el.attrib):
        value, local = el.attrib[name], _local(name).lower()
        if local.startswith("on") or _UNSAFE_CSS.search(value) \
                or (local in ("href", "src") and not (value.startswith("#") or _DATA_IMAGE.fullmatch(value.strip()))) \
                or "javascript:" in _plain_url(value):
            del el.attrib[name]
    if _local(el.tag) == "style" and el.text and _UNSAFE_CSS.search(el.text):
        el.text = ""
    for child in list(el):
        if not _clean_svg_element(child):
            el.remove(child)
    return True


# ---------------------------------------------------------------- outputs and cells

def clean_bundle(data: dict) -> dict:
    """A display's MIME bundle with only what renders without running: see the module docstring."""
    out = {}
    for mime, value in (data or {}).items():
        prefix = GLUE_PREFIX if mime.startswith(GLUE_PREFIX) else ""
        kind = mime[len(prefix):]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = "".join(value)
        if not isinstance(value, str):
            continue
        if kind == "text/plain":
            out[mime] = value
        elif kind == "text/html":
            out[mime] = clean_html(value)
        elif kind == "image/svg+xml":
            svg = clean_svg(value)
            if svg is not None:
                out[mime] = svg
        elif kind in IMAGES and re.fullmatch(r"[A-Za-z0-9+/=\s]*", value):
            out[mime] = value
    return out


def _clean_output_metadata(metadata: dict, bundle: dict) -> dict:
    out = {}
    scrapbook = (metadata or {}).get("scrapbook")
    if isinstance(scrapbook, dict) and isinstance(scrapbook.get("name"), str) \
            and isinstance(scrapbook.get("mime_prefix", ""), str):
        out["scrapbook"] = {"name": scrapbook["name"], "mime_prefix": scrapbook.get("mime_prefix", "")}
    for mime in bundle:
        sizes = (metadata or {}).get(mime)
        if isinstance(sizes, dict):
            kept = {k: v for k, v in sizes.items() if k in ("width", "height") and isinstance(v, (int, float))
                    and not isinstance(v, bool) and math.isfinite(v)}
            if kept:
                out[mime] = kept
    return out


def clean_output(output: dict) -> dict | None:
    """One output as it may render, or None when nothing of it may."""
    kind = output.get("output_type")
    if kind == "stream":
        text = output.get("text")
        text = "".join(text) if isinstance(text, list) else text
        name = output.get("name") if output.get("name") in ("stdout", "stderr") else "stdout"
        return nbformat.v4.new_output("stream", name=name, text=text) if isinstance(text, str) else None
    if kind == "error":
        trace = [t for t in output.get("traceback") or [] if isinstance(t, str)]
        return nbformat.v4.new_output("error", ename=str(output.get("ename", "")), evalue=str(output.get("evalue", "")),
                                      traceback=trace)
    if kind in ("display_data", "execute_result"):
        bundle = clean_bundle(output.get("data"))
        if not bundle:
            return None
        new = nbformat.v4.new_output(kind, data=bundle, metadata=_clean_output_metadata(output.get("metadata"), bundle))
        if kind == "execute_result":
            count = output.get("execution_count")
            new["execution_count"] = count if isinstance(count, int) and not isinstance(count, bool) else None
        return new
    return None


def _literal(text: str) -> str:
    """Markdown that shows `text` as it is: a fenced block longer than any run of backticks in it."""
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}text\n{text}\n{fence}"


def clean_notebook(executed: nbformat.NotebookNode, source: nbformat.NotebookNode | None) -> nbformat.NotebookNode:
    """The executed notebook as the book may render it (module docstring); `source`: the checkout's notebook."""
    own = {}  # the checkout's cells by (type, text)
    for cell in (source.cells if source is not None else []):
        own.setdefault((cell.cell_type, cell.source), cell)
    cells = []
    for cell in executed.cells:
        text = cell.get("source", "")
        text = "".join(text) if isinstance(text, list) else str(text)
        trusted = own.get((cell.get("cell_type"), text))
        if cell.get("cell_type") == "code":
            new = nbformat.v4.new_code_cell(text)
            new.metadata = _copy(trusted.metadata) if trusted is not None else _safe_metadata(cell.get("metadata"))
            new.outputs = [o for o in (clean_output(o) for o in cell.get("outputs") or []) if o is not None]
            count = cell.get("execution_count")
            new.execution_count = count if isinstance(count, int) and not isinstance(count, bool) else None
        elif trusted is not None:
            new = _copy(trusted)
        else:  # text that is not the book's: shown, never interpreted
            new = nbformat.v4.new_markdown_cell(_literal(text))
        cells.append(new)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = _copy(source.metadata) if source is not None else {}
    language = (executed.get("metadata") or {}).get("language_info")
    if isinstance(language, dict):  # the kernel's, for highlighting: plain strings only
        nb.metadata["language_info"] = {k: v for k, v in language.items() if isinstance(v, str)}
    meta = (executed.get("metadata") or {}).get("circuitbook")
    if isinstance(meta, dict) and isinstance(meta.get("results_sha256"), str):
        nb.metadata["circuitbook"] = {"results_sha256": meta["results_sha256"]}
    return nb


def _safe_metadata(metadata) -> dict:
    tags = (metadata or {}).get("tags") if isinstance(metadata, dict) else None
    kept = [t for t in tags if t in SAFE_TAGS] if isinstance(tags, list) else []
    return {"tags": kept} if kept else {}


def _copy(node):
    return nbformat.from_dict(_plain(node))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def stage_executed(executed: Path, dest: Path, source: Path | None, banner: str | None = None) -> None:
    """Write the executed notebook at `executed` to `dest` as the book renders it (`clean_notebook`), with
    `banner` (a markdown cell) first if given. `source`: the checkout's notebook."""
    nb = clean_notebook(nbformat.read(executed, as_version=4),
                        nbformat.read(source, as_version=4) if source is not None and source.exists() else None)
    if banner:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(banner))
    nbformat.write(nb, dest)
