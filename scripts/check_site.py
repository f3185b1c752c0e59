"""Check a built book the way a reader sees it, at any profile, and keep screenshots.

    .venv/bin/python scripts/check_site.py _build/cpu/html [--width 1280]

Opens every page in headless Chromium (the site tests do the same for the smoke build in CI) and reports:
tracebacks, unresolved glue, broken images, figures without a caption, clipped code, pages that scroll
sideways, scorecard tables wider than their container and status badges outside the window; and what a
reader should never see or always find: a path of the builder's machine or a `[circuitbook]` log line on
any page, a Measured cell in variable names, a row that is not reproduced without its failed part, a
chapter page without its summary figure, a notebook page without its re-run box. Saves
screenshots of the scorecard and of every chapter's landing page to `_build/screenshots/` (named after
the build folder's profile). Exit status 1 when a problem was found.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PAGE_CHECKS = {
    "traceback": "return /Traceback \\(most recent call last\\)|An Exception was encountered/"
                 ".test(document.body ? document.body.innerText : '') ? 1 : 0",
    "unresolved glue": "return (document.body ? document.body.innerText : '').includes('{glue') ? 1 : 0",
    "broken images": "return Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).length",
    "figures without a caption": "return Array.from(document.querySelectorAll('article img')).filter(i => "
                                 "{ const f = i.closest('figure'); return !(f && f.querySelector('figcaption')); })"
                                 ".length",
    "clipped code blocks": "return Array.from(document.querySelectorAll('article pre')).filter(p => "
                           "p.offsetParent !== null && p.scrollWidth > p.clientWidth + 1).length",
}


# the Measured cells' visible text (details folded away) may not show a raw recorded key such as `aa1_step_gap = `
RAW_KEY = r"/\b[a-z]+[0-9]*_[a-z0-9_]+ = /"
SCORECARD_CHECKS = {
    "Measured cells in variable names": "return Array.from(document.querySelectorAll('td.cb-measured')).filter(td => {"
        " const c = td.cloneNode(true); c.querySelectorAll('details').forEach(d => d.remove());"
        f" return {RAW_KEY}.test(c.innerText) || !(c.querySelector('ul.cb-values') || c.innerText.trim() === '-'); }}).length",
    "rows not reproduced without their failed part": "return Array.from(document.querySelectorAll('table.cb-scorecard tbody tr'))"
        ".filter(tr => tr.querySelector('.cb-badge.cb-failed, .cb-badge.cb-partial')"
        " && !tr.querySelector('div.cb-failed-part')).length",
}


def machine_paths() -> list[str]:
    """Paths of the machine that built the book, which no page may show: the checkout, the run store, home."""
    import os

    found = {str(ROOT), os.path.expanduser("~")}
    if os.environ.get("CIRCUITBOOK_RUNS"):
        found.add(str(Path(os.environ["CIRCUITBOOK_RUNS"]).resolve()))
    return sorted(p for p in found if p not in ("", "/"))


FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def browser():
    """Headless Chromium through selenium (Debian's chromium and chromium-driver)."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        sys.exit("check_site: needs chromium and chromedriver (bash scripts/setup-browser.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in FLAGS:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def wait_until_loaded(driver, timeout: float = 30.0) -> str:
    deadline = time.time() + timeout
    while (state := driver.execute_script("return document.readyState")) != "complete" and time.time() < deadline:
        time.sleep(0.1)
    return state


def load(driver, page: Path) -> str:
    driver.get(page.as_uri())
    return wait_until_loaded(driver)


def pages(html: Path) -> list[Path]:
    """Every page of a built book (not the theme's static files or the page sources)."""
    return sorted(p for p in html.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)


def page_kind(page: Path, html: Path) -> str:
    """scorecard, chapter (a chapter's landing page), notebook (an executed notebook's page) or other."""
    rel = page.relative_to(html)
    if rel.as_posix() == "book/scorecard.html":
        return "scorecard"
    if rel.parts[0] == "chapters" and page.name == "index.html":
        return "chapter"
    source = html.parent / "src" / rel.with_suffix(".ipynb")
    return "notebook" if source.exists() else "other"


def check_page(driver, page: Path, width: int, kind: str = "other") -> list[str]:
    problems = [f"{n} {what}" for what, js in PAGE_CHECKS.items() if (n := driver.execute_script(js))]
    text = driver.execute_script("return document.body ? document.body.innerText : ''")
    problems += [f"shows the builder's path {p}" for p in machine_paths() if p in text]
    if "[circuitbook]" in text:
        problems.append("shows a [circuitbook] log line")
    if kind == "chapter" and not driver.execute_script(
            "return document.querySelectorAll('img.cb-summary-figure, .cb-summary-figure img').length"):
        problems.append("no summary figure (paper against book)")
    if kind == "notebook" and not driver.execute_script("return document.querySelectorAll('.cb-rerun').length"):
        problems.append("no re-run box")
    wide = driver.execute_script("return document.documentElement.scrollWidth")
    if wide > width + 1:
        problems.append(f"the page is {wide} px wide")
    if page.name == "scorecard.html":
        tables = driver.execute_script(
            "return Array.from(document.querySelectorAll('table.cb-scorecard')).filter(t => "
            "t.scrollWidth > t.parentElement.clientWidth + 1).length")
        badges = driver.execute_script(
            f"return Array.from(document.querySelectorAll('.cb-badge')).filter(b => "
            f"b.getBoundingClientRect().left < 0 || b.getBoundingClientRect().right > {width}).length")
        problems += [f"{tables} scorecard table(s) overflow"] * bool(tables)
        problems += [f"{badges} status badge(s) outside the window"] * bool(badges)
    if page.name == "scorecard.html" or kind == "chapter":
        problems += [f"{n} {what}" for what, js in SCORECARD_CHECKS.items() if (n := driver.execute_script(js))]
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path, help="a built book's html folder, e.g. _build/cpu/html")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "screenshots")
    args = ap.parse_args(argv)
    html = args.html.resolve()
    if not (html / "book" / "scorecard.html").exists():
        sys.exit(f"check_site: {args.html} is not a built book (no book/scorecard.html)")
    profile = html.parent.name
    all_pages = pages(html)
    driver = browser()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    try:
        driver.set_window_size(args.width, 900)
        width = driver.execute_script("return window.innerWidth")
        for page in all_pages:
            load(driver, page)
            rel = page.relative_to(html).as_posix()
            problems = check_page(driver, page, width, page_kind(page, html))
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {rel}" + (": " + "; ".join(problems) if problems else ""))
            if page.name == "scorecard.html" or (page.name == "index.html" and "chapters" in page.parts):
                name = "scorecard" if page.name == "scorecard.html" else f"chapter-{page.parent.name}"
                shot = args.out / f"{name}-{profile}-{args.width}.png"
                driver.set_window_size(args.width, max(900, min(6000, driver.execute_script(
                    "return document.documentElement.scrollHeight"))))
                driver.save_screenshot(str(shot))
                driver.set_window_size(args.width, 900)
                print(f"     screenshot {shot}")
    finally:
        driver.quit()
    print(f"{len(all_pages)} pages, {failed} with problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
