"""Known answers for `circuitbook.sanitize`: what an executed notebook from the store may show."""
import nbformat
import pytest

from circuitbook import sanitize


@pytest.mark.parametrize("dirty, clean", [
    ("<b>bold</b> & <i>it</i>", "<b>bold</b> &amp; <i>it</i>"),
    ("<script>alert(1)</script>after", "after"),
    ('<b onmouseover="alert(1)" class="x">t</b>', '<b class="x">t</b>'),
    ('<a href="https://example.org/a?b=1&amp;c=2">l</a>', '<a href="https://example.org/a?b=1&amp;c=2">l</a>'),
    ('<a href="JaVaScRiPt:alert(1)">l</a>', "<a>l</a>"),
    ('<a href="java\tscript:alert(1)">l</a>', "<a>l</a>"),
    ('<a href="  jav&#x61;script:alert(1)">l</a>', "<a>l</a>"),
    ('<a href="data:text/html,x">l</a>', "<a>l</a>"),
    ('<iframe src="x"><p>inside</p></iframe><p>out</p>', "<p>out</p>"),
    ('<object data="x"></object><embed src="x"><p>k</p>', "<p>k</p>"),
    ('<img src="x" onerror="alert(1)">', '<img src="x">'),
    ('<img src="https://tracker.example/p.gif">', "<img>"),
    ('<img src="data:image/png;base64,iVBORw0KGgo=">', '<img src="data:image/png;base64,iVBORw0KGgo=">'),
    ('<img src="data:image/svg+xml;base64,PHN2Zz4=">', "<img>"),
    ("<style scoped>.df td {color: red}</style>", "<style>.df td {color: red}</style>"),
    ("<style>td {background: url(https://x/y)}</style>", "<style></style>"),
    ("<style>td {fill: url(#pattern)}</style>", "<style>td {fill: url(#pattern)}</style>"),
    ('<p style="color: red">x</p><p style="background:url(x)">y</p>', '<p style="color: red">x</p><p>y</p>'),
    ("<font color=red>text</font>", "text"),
    ("<svg><script>alert(1)</script></svg>text", "text"),
    ("&lt;script&gt;", "&lt;script&gt;"),
    ('<table border="1" class="dataframe"><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>',
     '<table border="1" class="dataframe"><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>'),
])
def test_html_keeps_formatting_and_tables_and_nothing_that_runs(dirty, clean):
    assert sanitize.clean_html(dirty) == clean


def test_svg_keeps_drawing_and_case_and_drops_what_runs():
    svg = ('<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" viewBox="0 0 5 5">'
           '<defs><clipPath id="c"><rect width="5" height="5"/></clipPath></defs>'
           '<script>alert(1)</script><rect width="5" height="5" onload="alert(2)" clip-path="url(#c)"/><rect fill="url(https://tracker/x#y)"/>'
           '<use xlink:href="#c"/><use xlink:href="https://example.org/x.svg#a"/>'
           '<foreignObject><div xmlns="http://www.w3.org/1999/xhtml">x</div></foreignObject>'
           '<animate attributeName="href" to="javascript:alert(3)"/><a href="javascript:alert(4)"><text>t</text></a>'
           '</svg>')
    clean = sanitize.clean_svg(svg)
    assert 'viewBox="0 0 5 5"' in clean and "<clipPath" in clean and 'xlink:href="#c"' in clean
    assert 'clip-path="url(#c)"' in clean and "tracker" not in clean, "url(#id) only: nothing loads from elsewhere"
    for gone in ("script", "onload", "example.org", "foreignObject", "animate", "javascript"):
        assert gone not in clean, gone
    assert sanitize.clean_svg('<!DOCTYPE svg [<!ENTITY x "y">]><svg xmlns="http://www.w3.org/2000/svg"/>') is None
    assert sanitize.clean_svg("<svg><unclosed></svg>") is None
    assert sanitize.clean_svg('<html xmlns="http://www.w3.org/1999/xhtml"/>') is None


def test_bundles_keep_text_images_html_and_svg_only():
    bundle = {"text/plain": ["a", "b"], "text/html": "<b onclick='x'>b</b>", "image/png": "iVBORw0KGgo=\n",
              "application/javascript": "alert(1)", "application/vnd.jupyter.widget-view+json": {"model_id": "m"},
              "text/markdown": "<script>x</script>", "text/latex": "$x$", "image/png+bad": "x",
              "application/papermill.record/text/plain": "0.5",
              "application/papermill.record/text/html": "<script>x</script><i>k</i>"}
    assert sanitize.clean_bundle(bundle) == {
        "text/plain": "ab", "text/html": "<b>b</b>", "image/png": "iVBORw0KGgo=\n",
        "application/papermill.record/text/plain": "0.5", "application/papermill.record/text/html": "<i>k</i>"}
    assert sanitize.clean_bundle({"image/jpeg": "<svg onload=x>"}) == {}


def test_a_notebook_keeps_the_books_own_text_and_shows_any_other_as_text():
    source = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Title", attachments={"a.png": {"image/png": "iVBORw0KGgo="}}),
        nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["hide-input"], "mystnb": {"figure": {"caption": "ok"}}}),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    executed = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Title", attachments={"a.png": {"image/svg+xml": "<svg onload=x/>"}}),
        nbformat.v4.new_code_cell("y = 2", metadata={"tags": ["hide-input", "remove-cell"],
                                                     "mystnb": {"figure": {"caption": "<script>x</script>"}}},
                                  outputs=[nbformat.v4.new_output("stream", name="stdout", text="hi"),
                                           nbformat.v4.new_output("display_data",
                                                                  data={"application/javascript": "x"})]),
        nbformat.v4.new_code_cell("x = 1", metadata={"mystnb": {"figure": {"caption": "<script>"}}}),
        nbformat.v4.new_markdown_cell("not ours ```` <script>x</script>"),
        nbformat.v4.new_raw_cell("<script>raw</script>"),
    ], metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {"x": 1}}},
                 "circuitbook": {"results_sha256": "ab" * 32}, "language_info": {"name": "python", "x": {"y": 1}}})
    clean = sanitize.clean_notebook(executed, source)
    title, foreign_code, own_code, foreign_md, raw = clean.cells
    assert title.attachments == {"a.png": {"image/png": "iVBORw0KGgo="}}, "the checkout's cell, attachments and all"
    assert foreign_code.source == "y = 2" and foreign_code.metadata == {"tags": ["hide-input"]}
    assert [o["output_type"] for o in foreign_code.outputs] == ["stream"]
    assert own_code.metadata["mystnb"]["figure"]["caption"] == "ok", "metadata from the checkout's cell"
    assert foreign_md.cell_type == "markdown" and foreign_md.source == "`````text\nnot ours ```` <script>x</script>\n`````"
    assert raw.cell_type == "markdown" and raw.source.startswith("```text\n")
    assert "widgets" not in clean.metadata and clean.metadata["kernelspec"]["name"] == "python3"
    assert clean.metadata["circuitbook"] == {"results_sha256": "ab" * 32}
    assert clean.metadata["language_info"] == {"name": "python"}
    nbformat.validate(clean)
