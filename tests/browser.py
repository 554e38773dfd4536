"""The keyboard page's tests open it through edge_client.bench.browser. Under CI (``CI``
set) a missing chromium or playwright fails the test: .ci/run installs them; elsewhere the
test skips."""

from __future__ import annotations

import contextlib
import os

import pytest

from edge_client.bench.browser import chromium_path, open_page, wait_for_status

__all__ = ["browser_page", "wait_for_status"]


def _missing(message: str):
    (pytest.fail if os.environ.get("CI") else pytest.skip)(message)


@contextlib.contextmanager
def browser_page(url: str):
    """(page, errors), as ``open_page``, or the test skips (fails under CI)."""
    executable = chromium_path()
    if executable is None:
        _missing("chromium is not installed (apt-get install chromium chromium-driver)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("playwright is not installed (the dev extra)")
    with open_page(url, executable) as opened:
        yield opened
