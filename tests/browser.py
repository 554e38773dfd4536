"""Headless Chromium (Debian's, driven by Playwright) for the keyboard page's tests.

``browser_page(url)`` opens the page and yields it with the list of errors it logged.
Under CI (``CI`` set) a missing chromium or playwright fails the test: .ci/run installs
them; elsewhere the test skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def _missing(message: str):
    (pytest.fail if os.environ.get("CI") else pytest.skip)(message)


def chromium_path() -> str:
    path = os.environ.get("EDGESPEC_CHROMIUM") or shutil.which("chromium") or \
        shutil.which("chromium-browser")
    if path is None:
        _missing("chromium is not installed (apt-get install chromium chromium-driver)")
    return path


@contextlib.contextmanager
def browser_page(url: str):
    """(page, errors): the page at ``url``, console errors and page exceptions collected."""
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (the dev extra)")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()


def wait_for_status(page, prefix: str, timeout_ms: int = 10_000) -> None:
    page.wait_for_function(f"document.getElementById('status').textContent"
                           f".startsWith({prefix!r})", timeout=timeout_ms)
