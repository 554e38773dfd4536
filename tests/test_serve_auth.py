"""edge-client serve behind its API key and over HTTPS: the OpenAI API refuses a missing or
wrong key in the OpenAI error shape; the keyboard WebSocket, which a browser cannot give
headers, takes the key as a subprotocol entry (``edgespec.bearer.<key>``, never echoed) or
the header, and otherwise accepts only to close with 1008 (which a page can tell from an
unreachable server); the page at / needs no key and, opened with
``#key=``, connects and suggests in headless Chromium; HTTPS serves the same greedy text
as HTTP to the openai client that trusts the CA, and plain HTTP to its port fails."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import openai
import pytest
from browser import browser_page, wait_for_status
from tls_certs import make_pki
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.serve.openai_api import ServeOptions
from edge_client.serve.runner import (
    BindRefused,
    ServerThread,
    build_app,
    check_api_key,
    require_key,
)

KEY = "s3cret-Key_1.x"
PROMPT = "t5 t6 t7 t8"


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=16,
                                                 max_draft_len=8)) as v:
        yield v


def app(verifier, tiny_llama_pair, api_key=KEY):
    return require_key(build_app(verifier.address, tiny_llama_pair.draft_dir, {},
                                 ServeOptions(draft_len=3)), api_key)


@pytest.fixture(scope="module")
def keyed(verifier, tiny_llama_pair):
    with ServerThread(app(verifier, tiny_llama_pair)) as s:
        yield s


def ws_url(server) -> str:
    return server.base_url.replace("http", "ws", 1) + "/v1/keyboard"


def first_suggestion(ws) -> dict:
    ws.send(json.dumps({"seq": 1, "text": PROMPT}))
    while True:
        msg = json.loads(ws.recv(timeout=30))
        assert "error" not in msg, msg
        if msg.get("final"):
            return msg


def get(url: str, headers=None, context=None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}])
def test_the_api_refuses_a_missing_or_wrong_key(keyed, headers):
    status, body = get(keyed.base_url + "/v1/models", headers)
    assert status == 401
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's shape
    assert error["code"] == "invalid_api_key" and error["message"]


def test_the_api_answers_the_openai_client_with_the_key(keyed):
    api = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=KEY, max_retries=0)
    model = api.models.list().data[0].id
    out = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="wrong",
                      max_retries=0).models.list()


def test_the_page_itself_needs_no_key(keyed):
    status, body = get(keyed.base_url + "/")
    assert status == 200 and "edgespec.bearer." in body


@pytest.mark.parametrize("protocols", [None, ["edgespec.keyboard"],
                                       ["edgespec.keyboard", "edgespec.bearer.wrong"],
                                       ["edgespec.keyboard", f"edgespec.bearer.{KEY}x"],
                                       [f"edgespec.bearer.{KEY}x", "edgespec.keyboard"]])
def test_the_socket_refuses_a_missing_or_wrong_key_with_1008(keyed, protocols):
    with connect(ws_url(keyed), subprotocols=protocols, open_timeout=10) as ws:
        # Accepted with the page's protocol, or none if none was offered; never a key.
        assert ws.subprotocol == ("edgespec.keyboard" if protocols else None)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1008
    assert "API key" in closed.value.rcvd.reason


def test_the_socket_takes_the_key_as_a_subprotocol_and_never_echoes_it(keyed):
    with connect(ws_url(keyed), subprotocols=["edgespec.keyboard", f"edgespec.bearer.{KEY}"],
                 open_timeout=10) as ws:
        assert ws.subprotocol == "edgespec.keyboard"
        msg = first_suggestion(ws)
    assert msg["text"] or msg["unverified"]


def test_the_socket_takes_the_key_as_a_header(keyed):
    with connect(ws_url(keyed), additional_headers={"Authorization": f"Bearer {KEY}"},
                 open_timeout=10) as ws:
        assert ws.subprotocol is None  # none offered, none chosen
        msg = first_suggestion(ws)
    assert msg["text"] or msg["unverified"]


@pytest.mark.parametrize("bad", ["has space", "comma,key", "quote\"", "ключ", ""])
def test_a_key_that_cannot_travel_as_a_subprotocol_is_refused_at_start(bad):
    with pytest.raises(BindRefused, match="http-api-key"):
        check_api_key(bad)
    check_api_key(KEY)


def test_the_keyboard_page_with_the_key_in_its_fragment_suggests(keyed):
    with browser_page(keyed.base_url + "/") as (page, errors):
        wait_for_status(page, "refused: this server needs its API key")  # no key
        page.goto(keyed.base_url + "/#key=wrong")
        page.reload()  # a new fragment alone does not reload the page
        wait_for_status(page, "refused: wrong API key")
        page.goto(keyed.base_url + f"/#key={KEY}")
        page.reload()
        wait_for_status(page, "connected")
        page.focus("#input")
        page.keyboard.type(PROMPT + " ", delay=30)
        page.wait_for_function("document.getElementById('ghost').textContent.length +"
                               "document.getElementById('ghost-draft').textContent.length"
                               " > 0", timeout=10_000)
        assert page.evaluate("document.getElementById('status').textContent") \
            .startswith("suggestion in")
    assert errors == [], errors


def test_https_serves_the_same_text_and_refuses_plain_http(verifier, tiny_llama_pair,
                                                           tmp_path):
    pki = make_pki(tmp_path)
    texts = []
    with ServerThread(app(verifier, tiny_llama_pair)) as plain, \
            ServerThread(app(verifier, tiny_llama_pair), ssl_certfile=pki.server_cert,
                         ssl_keyfile=pki.server_key) as tls:
        assert tls.base_url.startswith("https://")
        trusting = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki.ca))
        for server, http_client in ((plain, None), (tls, trusting)):
            api = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY,
                                max_retries=0, http_client=http_client)
            model = api.models.list().data[0].id
            texts.append(api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                temperature=0).choices[0].message.content)
        key = {"Authorization": f"Bearer {KEY}"}
        assert get(tls.base_url + "/v1/models", key,
                   ssl.create_default_context(cafile=pki.ca))[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            get(tls.base_url.replace("https", "http", 1) + "/v1/models", key)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(tls.base_url + "/v1/models", key, ssl.create_default_context(cafile=pki.rogue_ca))
    assert texts[0] == texts[1] and texts[0]
