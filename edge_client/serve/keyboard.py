"""The keyboard demo: a page at / and a WebSocket (/v1/keyboard) onto the editing-session
API (edge_client.document), one document per connection.

The page sends the field's whole text after every key, ``{"seq": n, "text": "..."}``; the
server answers with suggestions as they grow, ``{"seq", "text", "unverified", "preview",
"final", "cancelled"}``: ``text`` is verified (what the target itself writes next),
``unverified`` the draft's own continuation after it (a preview while the typing settles,
or the draft alone while the verifier is away), which the page marks as such. A newer text
supersedes the suggestion in flight (the document cancels it), so keys typed in a burst cost
the verifier nothing; the page shows only the answers to its latest ``seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from importlib.resources import files

from starlette.responses import HTMLResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from edge_client.client import GenerationConfig

log = logging.getLogger(__name__)

SUGGESTION_TOKENS = 8  # a keyboard shows a few words, not a paragraph
SUBPROTOCOL = "edgespec.keyboard"
MAX_TEXT_CHARS = 4000  # a text field, not a document: bounds the work one message asks for


async def page(request) -> HTMLResponse:
    html = files(__package__).joinpath("static", "keyboard.html").read_text(encoding="utf-8")
    return HTMLResponse(html)


def _message(raw: str) -> tuple[int, str] | str:
    """(seq, text), or the reason the message is refused."""
    try:
        msg = json.loads(raw)
    except json.JSONDecodeError:
        return "not JSON"
    if not isinstance(msg, dict):
        return "a message is an object {seq, text}"
    seq, text = msg.get("seq"), msg.get("text")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return "seq must be a non-negative integer"
    if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
        return f"text must be a string of at most {MAX_TEXT_CHARS} characters"
    return seq, text


def chosen_subprotocol(scope) -> str | None:
    """The page's protocol name when it offered it (beside, maybe, its key, never echoed): a
    browser that offered subprotocols fails a handshake that picks none."""
    return SUBPROTOCOL if SUBPROTOCOL in (scope.get("subprotocols") or ()) else None


async def keyboard_socket(ws: WebSocket) -> None:
    state = ws.app.state.serve
    await ws.accept(subprotocol=chosen_subprotocol(ws.scope))
    opts = state.options
    config = GenerationConfig(max_new_tokens=SUGGESTION_TOKENS, draft_len=opts.draft_len,
                              drafter=opts.drafter, stop_confidence=opts.stop_confidence)
    outbox: asyncio.Queue = asyncio.Queue()
    tasks: set[asyncio.Task] = set()

    async def send_all() -> None:
        while True:
            await ws.send_text(json.dumps(await outbox.get()))

    def answer(seq: int, s, final: bool) -> None:
        outbox.put_nowait({"seq": seq, "text": s.text, "unverified": s.unverified_text,
                           "preview": s.preview, "final": final, "cancelled": s.cancelled})

    async def suggest(doc, seq: int, text: str) -> None:
        try:
            s = await doc.suggest(text, SUGGESTION_TOKENS,
                                  on_update=lambda s: answer(seq, s, False))
            answer(seq, s, True)
        except Exception as err:  # noqa: BLE001 - reported to the page, the socket stays up
            log.warning("suggestion %d failed: %s", seq, err)
            outbox.put_nowait({"seq": seq, "error": str(err)})

    sender = asyncio.ensure_future(send_all())
    try:
        async with state.client.document(config) as doc:
            while True:
                parsed = _message(await ws.receive_text())
                if isinstance(parsed, str):
                    outbox.put_nowait({"error": parsed})
                    continue
                seq, text = parsed
                if not text:
                    continue
                # Not awaited: the next key must reach suggest() to supersede this one.
                task = asyncio.ensure_future(suggest(doc, seq, text))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    except WebSocketDisconnect:
        pass
    finally:
        for task in list(tasks):
            task.cancel()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.gather(sender, *tasks, return_exceptions=True)


ROUTES = [Route("/", page, methods=["GET"]), WebSocketRoute("/v1/keyboard", keyboard_socket)]
