"""``edgespec-bench serve``: what edge-client serve's HTTP layer costs the first token.

On the same prompts (shared.prompts, chat template), interleaved so that host load falls on
both alike:

- **library**: ``EdgeClient.generate(...).text()``, time to its first text piece;
- **openai**: the official ``openai`` client streaming from ``edge-client serve`` over
  loopback HTTP, time from ``create()`` to the first content delta;
- **follow-up**: a second chat turn (the first turn's prompt and answer, then a new
  question) against the first turn of a conversation the verifier has not seen: the
  follow-up's prompt is mostly in the verifier's prefix cache.

Each prompt is first generated once (one token) so that the library and the openai runs both
start from the verifier's prefix cache, never one warm and one cold. Prints medians.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time

from shared.prompts import CHAT_PROMPTS

log = logging.getLogger(__name__)
FOLLOW_UP = "Thanks. Can you say that again in one short sentence?"


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="HOST:PORT", help="a running verifier (default: "
                       "start one with the prepared SmolLM2 on a loopback port)")
    p.add_argument("--prompts", type=int, default=10, help="how many chat prompts (each "
                   "measured once per path)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per generation")
    p.add_argument("--draft-len", type=int, default=4)


def _first_openai(api, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    first, text = None, []
    stream = api.chat.completions.create(model=model, messages=messages,
                                         max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
    return first if first is not None else float("nan"), "".join(text)


def _first_library(client, prompt: str, config) -> float:
    # Runs to the end like the openai path: leaving at the first piece would cancel a round
    # the verifier may still be computing, and the next request (the other path's) would wait
    # for it.
    t0 = time.perf_counter()
    first = None
    for _piece in client.generate(prompt, config).text():
        first = first if first is not None else time.perf_counter() - t0
    return first if first is not None else float("nan")


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.1f} ms (n={len(values)})"


def cmd_serve_bench(args: argparse.Namespace) -> int:
    import openai

    from edge_client.client import EdgeClient, GenerationConfig
    from edge_client.local_verifier import local_verifier
    from edge_client.serve.openai_api import ServeOptions
    from edge_client.serve.runner import ServerThread, build_app

    if not 1 <= args.prompts <= len(CHAT_PROMPTS):
        raise SystemExit(f"--prompts must be in [1, {len(CHAT_PROMPTS)}]")
    prompts = CHAT_PROMPTS[:args.prompts]
    config = GenerationConfig(max_new_tokens=args.max_tokens, draft_len=args.draft_len)
    with contextlib.ExitStack() as stack:
        address = args.server or stack.enter_context(local_verifier())
        client = stack.enter_context(EdgeClient(address))
        server = stack.enter_context(ServerThread(build_app(
            address, None, {}, ServeOptions(draft_len=args.draft_len))))
        api = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
        model = api.models.list().data[0].id
        library, http, first_turn, follow_up = [], [], [], []
        for i, prompt in enumerate(prompts):
            messages = [{"role": "user", "content": prompt}]
            _first_library(client, prompt, GenerationConfig(max_new_tokens=1))  # warm both
            order = ("library", "openai") if i % 2 == 0 else ("openai", "library")
            for path in order:
                if path == "library":
                    library.append(_first_library(client, prompt, config))
                else:
                    http.append(_first_openai(api, model, messages, args.max_tokens)[0])
            # A conversation the verifier has not seen, then its second turn.
            fresh = [{"role": "user", "content": f"Question {i + 1}. {prompt}"}]
            ttft, answer = _first_openai(api, model, fresh, args.max_tokens)
            first_turn.append(ttft)
            fresh += [{"role": "assistant", "content": answer},
                      {"role": "user", "content": FOLLOW_UP}]
            follow_up.append(_first_openai(api, model, fresh, args.max_tokens)[0])
    ratio = statistics.median(http) / statistics.median(library)
    log.info("done: %d prompts", len(prompts))
    print(f"first token, library (EdgeClient):        {_ms(library)}")
    print(f"first token, openai client via serve:     {_ms(http)}  ({ratio:.3f}x the library)")
    print(f"first token, first chat turn (cold):      {_ms(first_turn)}")
    print(f"first token, follow-up turn (prefix hit): {_ms(follow_up)}  "
          f"({statistics.median(follow_up) / statistics.median(first_turn):.3f}x)")
    return 0
