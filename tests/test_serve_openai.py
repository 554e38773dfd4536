"""edge-client serve's OpenAI API (edge_client.serve), driven by the official ``openai``
package and by curl, over a real in-process verifier and the tiny ONNX draft: greedy output
identical to the library's, the SSE wire format, ``usage`` and the ``edgespec`` extension,
OpenAI-shaped errors for bad input, the prefix cache on a follow-up turn, and the generation
cancelled when the HTTP client goes away."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import EdgeClient, GenerationConfig
from edge_client.serve.openai_api import ServeOptions
from edge_client.serve.runner import BindRefused, ServerThread, build_app, check_bind

PROMPT = "t5 t6 t7 t8"
DRAFT_LEN = 3


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=16,
                                                 max_draft_len=8)) as v:
        yield v


def serve(verifier, tiny_llama_pair, **client_options) -> ServerThread:
    return ServerThread(build_app(verifier.address, tiny_llama_pair.draft_dir, client_options,
                                  ServeOptions(draft_len=DRAFT_LEN)))


@pytest.fixture(scope="module")
def server(verifier, tiny_llama_pair):
    with serve(verifier, tiny_llama_pair) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(api) -> str:
    return api.models.list().data[0].id


@pytest.fixture(scope="module")
def library(verifier, tiny_llama_pair):
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
        yield client


def library_text(library, prompt: str, max_tokens: int, chat: bool) -> tuple[str, int]:
    gen = library.generate(prompt, GenerationConfig(max_new_tokens=max_tokens,
                                                    draft_len=DRAFT_LEN), chat=chat)
    return "".join(gen.text()), len(gen.token_ids)


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models_lists_the_one_served_model(api, model_id):
    models = api.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert isinstance(model_id, str) and model_id


def test_streaming_chat_is_the_librarys_greedy_output(api, model_id, library):
    expected, n_tokens = library_text(library, PROMPT, 20, chat=True)
    stream = api.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPT}], max_tokens=20,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert finals[0].choices[0].finish_reason == ("length" if n_tokens == 20 else "stop")
    stats = finals[0].model_extra["edgespec"]
    assert stats["round_trips"] >= 1 and 0 <= stats["acceptance_rate"] <= 1
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices
    assert chunks[-1].choices == []
    assert usage.completion_tokens == n_tokens
    assert usage.total_tokens == usage.prompt_tokens + n_tokens


def test_completion_is_the_librarys_greedy_output(api, model_id, library):
    expected, n_tokens = library_text(library, PROMPT, 12, chat=False)
    done = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    assert done.object == "text_completion"
    assert done.choices[0].text == expected
    assert done.usage.completion_tokens == n_tokens
    assert done.usage.prompt_tokens == len(library.tokenizer.encode(PROMPT))
    stats = done.model_extra["edgespec"]
    assert stats["rounds"] >= 1 and stats["tokens_per_round"] >= 1
    # Token ids work as a prompt, as in OpenAI's API.
    by_ids = api.completions.create(model=model_id, prompt=library.tokenizer.encode(PROMPT),
                                    max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_reads_the_sse_stream(server, model_id, api):
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "stream": True}
    done = subprocess.run(["curl", "-sSN", "--max-time", "60", "-H",
                           "Content-Type: application/json", "-d", json.dumps(body),
                           server.base_url + "/v1/completions"],
                          capture_output=True, text=True, timeout=90, check=True)
    events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line]
    assert all(line.startswith("data: ") for line in done.stdout.splitlines() if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    whole = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                   temperature=0)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    assert chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)


CHAT_OK = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
BAD_CHATS = [  # (what is wrong, status, param, code)
    ({"temperature": 2.5}, 400, "temperature", "invalid_value"),
    ({"temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"top_p": 0}, 400, "top_p", "invalid_value"),
    ({"n": 2}, 400, "n", "unsupported_value"),
    ({"n": "1"}, 400, "n", "invalid_type"),
    ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"max_tokens": 4.5}, 400, "max_tokens", "invalid_type"),
    ({"max_tokens": True}, 400, "max_tokens", "invalid_type"),
    ({"max_tokens": 10_000}, 400, "max_tokens", "context_length_exceeded"),
    ({"max_completion_tokens": -1}, 400, "max_completion_tokens", "invalid_value"),
    ({"stream": "yes"}, 400, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    ({"stop": ["\n"]}, 400, "stop", "unsupported_value"),
    ({"seed": -3}, 400, "seed", "invalid_type"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty", "unsupported_value"),
    ({"tools": []}, 400, "tools", "unknown_parameter"),
    ({"messages": []}, 400, "messages", "invalid_type"),
    ({"messages": "hi"}, 400, "messages", "invalid_type"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "invalid_type"),
    ({"model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"model": 7}, 400, "model", "invalid_type"),
]


@pytest.mark.parametrize("change,status,param,code", BAD_CHATS,
                         ids=[next(iter(c[0])) + "-" + str(i) for i, c in enumerate(BAD_CHATS)])
def test_bad_chat_requests_get_openai_errors(server, model_id, change, status, param, code):
    got_status, body = post(server, "/v1/chat/completions",
                            {"model": model_id, **CHAT_OK, **change})
    assert got_status == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("body,param", [
    (b"{not json", None), (b"[1, 2]", None), ({"max_tokens": 3}, "prompt"),
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"), ({"prompt": PROMPT, "echo": True}, "echo"),
])
def test_bad_completion_requests_get_openai_errors(server, model_id, body, param):
    if isinstance(body, dict):
        body = {"model": model_id, **body}
    status, answer = post(server, "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["message"]


def test_unknown_routes_and_methods_get_openai_errors(server, api, model_id):
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
        req = urllib.request.Request(server.base_url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == status
        assert json.loads(err.value.read())["error"]["code"]
    with pytest.raises(openai.NotFoundError):  # the openai package reads the shape too
        api.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)


def test_a_follow_up_turn_hits_the_verifiers_prefix_cache(api, model_id, verifier):
    hits = verifier.server.metrics.prefix_cache_hits._value  # counted in tokens
    messages = [{"role": "user", "content": "t11 t12 t13 t14 t15"}]
    first = api.chat.completions.create(model=model_id, messages=messages, max_tokens=6,
                                        temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "t9 t10"}]
    before = hits.get()
    second = api.chat.completions.create(model=model_id, messages=messages, max_tokens=6,
                                         temperature=0)
    # The second prompt starts with the first turn's prompt and answer: the verifier copies
    # at least the first prompt's keys and values instead of recomputing them.
    assert hits.get() - before >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 2


def test_a_client_that_disconnects_cancels_the_generation(verifier, tiny_llama_pair):
    # 40 ms a round trip: 100 tokens take seconds, so the disconnect comes mid-generation.
    with serve(verifier, tiny_llama_pair, rtt_ms=40) as slow:
        counters = slow.app.state.serve.counters
        model = openai.OpenAI(base_url=slow.base_url + "/v1", api_key="-").models.list()
        for stream in (True, False):
            body = {"model": model.data[0].id, "prompt": PROMPT, "max_tokens": 100,
                    "temperature": 0, "stream": stream}
            before = counters.cancelled
            host, port = slow.base_url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            if stream:
                resp = conn.getresponse()
                assert resp.status == 200
                assert resp.read1(65536).startswith(b"data: ")  # the stream has begun
            else:
                deadline = time.monotonic() + 10
                while counters.active == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert counters.active == 1
            conn.sock.shutdown(2)
            conn.close()
            deadline = time.monotonic() + 10
            while counters.cancelled == before and time.monotonic() < deadline:
                time.sleep(0.02)
            assert counters.cancelled == before + 1, (stream, counters)
            assert counters.active == 0
            assert counters.last_stats["completion_tokens"] < 100  # stopped before the end


def test_binding_off_loopback_needs_tls_and_a_key():
    check_bind("127.0.0.1", https=False, insecure=False, api_key=None)
    check_bind("::1", https=False, insecure=False, api_key=None)
    with pytest.raises(BindRefused, match="plain HTTP"):
        check_bind("0.0.0.0", https=False, insecure=False, api_key="k")
    with pytest.raises(BindRefused, match="api-key"):
        check_bind("0.0.0.0", https=True, insecure=False, api_key=None)
    check_bind("0.0.0.0", https=False, insecure=True, api_key="k")
