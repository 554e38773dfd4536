"""The keyboard demo page of edge-client serve in headless Chromium (Debian's, driven by
Playwright): typed key by key, a suggestion within 1 s of a key on loopback, Tab accepts
it, the unverified marker follows the draft-only text, and the page logs no errors.

The page is warmed up first (one word typed, its whole answer awaited, the field cleared): the
budget is for a key in a page in use, not for the browser's first paint of the field or the
document's first session open on a fresh machine.

Under CI (``CI`` set) a missing chromium fails the test: .ci/run installs it."""

from __future__ import annotations

import time

import pytest
from browser import browser_page, wait_for_status

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.serve.openai_api import ServeOptions
from edge_client.serve.runner import ServerThread, build_app

SENTENCE = "t5 t6 t7 t8 "
SUGGESTION_WITHIN_MS = 1000  # loopback, tiny models: the demo's promise
ANY_SUGGESTION = """() => document.getElementById('ghost').textContent.length > 0
    || document.getElementById('ghost-draft').textContent.length > 0"""


@pytest.fixture(scope="module")
def server(target, tiny_llama_pair):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=16,
                                                 max_draft_len=8)) as verifier, \
            ServerThread(build_app(verifier.address, tiny_llama_pair.draft_dir, {},
                                   ServeOptions(draft_len=3))) as s:
        yield s


# The warm-up's end: the first text's whole answer came (maybe empty: what the tiny random
# target says after "t1 " may round differently on another host), or the page shows an error.
WARMED_UP = """() => document.getElementById('ghost').dataset.final === 'yes'
    || document.getElementById('status').textContent.startsWith('error')"""


@pytest.fixture()
def page(server):
    with browser_page(server.base_url + "/") as (page, errors):
        wait_for_status(page, "connected")
        page.focus("#input")
        page.keyboard.type("t1 ")
        wait_for(page, WARMED_UP, 30_000, "the warm-up's whole answer")
        status = page.evaluate("document.getElementById('status').textContent")
        assert not status.startswith("error"), f"the warm-up's suggestion failed: {status!r}"
        page.fill("#input", "")
        yield page, errors


def shown(page) -> tuple[str, str, bool]:
    return page.evaluate("""() => [document.getElementById('ghost').textContent,
        document.getElementById('ghost-draft').textContent,
        document.getElementById('marker').classList.contains('on')]""")


def wait_for(page, condition: str, timeout_ms: int, what: str) -> None:
    """``condition`` true in the page; on a timeout, what the page showed and said, so that a
    failure tells a slow answer from an error or an empty one."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, timeout=timeout_ms)
    except PlaywrightTimeout:
        status = page.evaluate("document.getElementById('status').textContent")
        final = page.evaluate("document.getElementById('ghost').dataset.final")
        pytest.fail(f"no {what} within {timeout_ms} ms of the key for "
                    f"{page.input_value('#input')!r}: shown {shown(page)}, final {final!r}, "
                    f"status {status!r}")


def wait_for_suggestion(page, timeout_ms: int) -> None:
    """A suggestion shown (verified or marked draft-only)."""
    wait_for(page, ANY_SUGGESTION, timeout_ms, "suggestion")


def test_typing_gets_suggestions_and_tab_accepts_them(page):
    page, errors = page
    page.focus("#input")
    waits_ms = []
    for key in SENTENCE:
        page.keyboard.type(key)
        if key == " ":  # after a word the user looks for the suggestion
            t0 = time.perf_counter()
            wait_for_suggestion(page, SUGGESTION_WITHIN_MS)
            waits_ms.append((time.perf_counter() - t0) * 1000)
        verified, draft_only, marker = shown(page)
        assert marker == bool(draft_only)  # the marker shows exactly when draft text does
    assert len(waits_ms) == SENTENCE.count(" ")
    # Tab takes what is shown; wait for the whole suggestion so that it is what we read.
    page.wait_for_function("document.getElementById('ghost').dataset.final === 'yes'",
                           timeout=10_000)
    verified, draft_only, _ = shown(page)
    assert verified or draft_only
    page.keyboard.press("Tab")
    value = page.input_value("#input")
    assert value == SENTENCE + verified + draft_only
    assert page.evaluate("document.activeElement.id") == "input"  # Tab did not move focus
    assert errors == [], errors
