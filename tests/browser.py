"""Open a local HTML file in headless Chromium (Debian's, which ``make test`` installs), as a user would."""

from __future__ import annotations

import queue
import shutil
import threading
from collections.abc import Callable
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


class _Chromium:
    """One headless Chromium for this process (its launch costs 1.5 CPU seconds; a page in a fresh context of a
    running one, 0.6), driven from a thread of its own: Playwright's sync API leaves an asyncio loop running in the
    thread that started it, and ``asyncio.run()`` in a later test of that thread raised "cannot be called from a
    running event loop"."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="chromium", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium(), args=ARGS)
                try:
                    while (job := self.jobs.get()) is not None:
                        work, answer = job
                        if not browser.is_connected():  # it crashed or was closed: a new one for this page
                            browser = p.chromium.launch(executable_path=chromium(), args=ARGS)
                        try:
                            answer.put((True, work(browser)))
                        except BaseException as exc:  # the visit's own failure, raised in the test
                            answer.put((False, exc))
                finally:
                    browser.close()
        except BaseException as exc:  # Chromium did not start: every visit says why
            while (job := self.jobs.get()) is not None:
                job[1].put((False, exc))

    def run(self, work: Callable[[Any], Any], timeout: float = 300) -> Any:
        answer: queue.Queue = queue.Queue(maxsize=1)
        self.jobs.put((work, answer))
        try:
            ok, value = answer.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"Chromium did not answer within {timeout} s") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(60)


_chromium: Optional[_Chromium] = None


def close() -> None:
    """Close this process's Chromium (the suite's conftest, at the end of the session)."""
    global _chromium
    if _chromium is not None:
        _chromium.close()
        _chromium = None


def visit(page_file: Path, screenshot: Path, measure: Optional[str] = None) -> Visit:
    """Open ``page_file`` as a reader would, in a fresh browser context (nothing kept from another page);
    ``measure``: a JavaScript function (``() => ...``) run in the page once it has loaded, its JSON-able result kept
    as ``measured``."""
    global _chromium
    seen = Visit()
    url = page_file.resolve().as_uri()

    def open_page(browser: Any) -> Visit:
        context = browser.new_context(viewport={"width": 1200, "height": 900})
        try:
            page = context.new_page()
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
            context.close()
        return seen

    if _chromium is None or not _chromium.thread.is_alive():
        _chromium = _Chromium()
    return _chromium.run(open_page)
