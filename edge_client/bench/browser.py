"""Headless Chromium (Debian's, driven by Playwright) for the keyboard page: the page tests
and ``edgespec-bench keyboard`` open it the same way.

Playwright cannot download its own browsers here (no internet), so it drives the system's
chromium (``EDGESPEC_CHROMIUM``, else ``chromium`` or ``chromium-browser`` on PATH).
"""

from __future__ import annotations

import contextlib
import os
import shutil

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    return (os.environ.get("EDGESPEC_CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser"))


@contextlib.contextmanager
def open_page(url: str, executable: str, viewport: dict | None = None):
    """(page, errors): the page at ``url``, its console errors and exceptions collected."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=viewport)
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()


def wait_for_status(page, prefix: str, timeout_ms: int = 10_000) -> None:
    page.wait_for_function(f"document.getElementById('status').textContent"
                           f".startsWith({prefix!r})", timeout=timeout_ms)
