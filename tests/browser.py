"""Open a local HTML file in headless Chromium (Debian's, which ``make test`` installs), as a user would."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from playwright.sync_api import sync_playwright

# offline and quiet: this machine's network is closed, and nothing in a report may need it
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is missing: `make test` installs Debian's chromium (apt-get install chromium)"
    return path


@dataclass
class Visit:
    text: str = ""
    console_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # anything but the page itself
    svg_count: int = 0
    scroll_width: int = 0  # the page's width as laid out in the 1200 px window (more: it scrolls sideways)
    measured: Any = None  # what the caller's script found in the laid-out page (element boxes, say)


def visit(page_file: Path, screenshot: Path, measure: Optional[str] = None) -> Visit:
    """Open ``page_file`` as a reader would; ``measure``: a JavaScript function (``() => ...``) run in the page
    once it has loaded, its JSON-able result kept as ``measured``."""
    seen = Visit()
    url = page_file.resolve().as_uri()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: seen.console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen.console_errors.append(str(e)))
            page.on("dialog", lambda d: (seen.dialogs.append(d.message), d.dismiss()))
            page.on("request", lambda r: seen.requests.append(r.url) if r.url != url else None)
            page.goto(url, wait_until="load")
            page.screenshot(path=str(screenshot), full_page=True)
            seen.text = page.inner_text("body")
            seen.svg_count = page.locator("svg").count()
            seen.scroll_width = page.evaluate("document.documentElement.scrollWidth")
            if measure is not None:
                seen.measured = page.evaluate(measure)
        finally:
            browser.close()
    return seen
