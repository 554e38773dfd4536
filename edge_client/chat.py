"""``edge-client chat``: an interactive, multi-turn chat in the terminal.

Each turn renders the whole conversation with the tokenizer's chat template (as ``generate
--prompt`` does for one message) and generates the answer speculatively, streaming its
tokens as they are verified (with ``--fallback draft-only``, the draft's unverified ones
too, dim, until the verifier replaces them: edge_client.live_text). The conversation is
re-sent every turn, which is what the verifier's prefix cache is for: the kept KV of the
previous turn covers it, so only the new message is fed. Every turn carries the chat's one
routing key, so that a gateway sends them all to the replica holding that cache.

Commands: ``/reset`` (forget the conversation), ``/stats`` (speculative statistics of the
last answer and of the chat), ``/quit``. Ctrl-C cancels the answer in progress (the
verifier's session closes at once) and keeps what was shown as the answer; a Ctrl-C at the
prompt right after that, or two in a row there, or Ctrl-D, leaves.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from dataclasses import dataclass, field

from edge_client.errors import EdgeError

log = logging.getLogger(__name__)

PROMPT = "you> "
ANSWER = "bot> "
HELP = "commands: /reset (forget the conversation), /stats, /quit; Ctrl-C stops an answer"


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None,
                   help="a system message starting the conversation (default: the chat "
                        "template's own, if it has one)")


@dataclass
class ChatStats:
    """The speculative statistics of the chat's answers, summed."""

    answers: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_trips: int = 0
    wall_s: float = 0.0
    last: dict = field(default_factory=dict)

    def add(self, stats: dict) -> None:
        self.answers += 1
        for name in ("new_tokens", "rounds", "drafted", "accepted", "round_trips", "wall_s"):
            setattr(self, name, getattr(self, name) + stats[name])
        self.last = stats

    def line(self) -> str:
        if not self.answers:
            return "[stats] no answer yet"
        s = self.last
        total = (f"chat: {self.answers} answers, {self.new_tokens} tokens, acceptance "
                 f"{self.accepted / self.drafted if self.drafted else 0.0:.2f}, "
                 f"{self.new_tokens / self.rounds if self.rounds else 0.0:.2f} tokens/round, "
                 f"{self.round_trips} round trips, "
                 f"{self.new_tokens / self.wall_s if self.wall_s else 0.0:.1f} tokens/s")
        return (f"[stats] acceptance {s['acceptance_rate']:.2f}, {s['tokens_per_round']:.2f} "
                f"tokens/round, {s['round_trips']} round trips, {s['tokens_per_s']:.1f} "
                f"tokens/s ({s['new_tokens']} tokens in {s['wall_s']:.2f} s, "
                f"{s['unverified_tokens']} unverified, {s['reopens']} reopens); {total}")


class Conversation:
    """The messages so far, and the prompt ids for the next answer, trimmed to fit."""

    def __init__(self, tokenizer, system: str | None = None) -> None:
        if tokenizer.chat_template is None:
            raise EdgeError("the draft's tokenizer has no chat template; edge-client chat "
                            "needs one")
        self.tokenizer = tokenizer
        self.system = system
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        self.messages = []

    def prompt_ids(self, user_text: str, max_context: int, max_new_tokens: int) -> list[int]:
        """The conversation with ``user_text`` as the next message, in the chat template;
        the oldest turns are dropped while it and the answer would not fit the context."""
        self.messages.append({"role": "user", "content": user_text})
        while True:
            head = [{"role": "system", "content": self.system}] if self.system else []
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(head + self.messages))
            if len(ids) + max_new_tokens < max_context or len(self.messages) <= 1:
                return ids
            log.info("the conversation is longer than the context; dropping its oldest turn")
            del self.messages[:2]

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def forget_last_question(self) -> None:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


def cmd_chat(args: argparse.Namespace) -> int:
    from edge_client.cli_args import verifier_address
    from edge_client.client import EdgeClient, GenerationConfig
    from edge_client.connection import ClientTls, RetryPolicy, document_routing_key
    from edge_client.offline_start import offline_wait_s

    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("edge-client: --tls-cert and --tls-key go together")
    if (args.drafter == "feature") != (args.feature_head is not None):
        raise SystemExit("edge-client: --drafter feature and --feature-head DIR go together")
    if args.max_new_tokens < 1:
        raise SystemExit("edge-client: --max-new-tokens must be >= 1")
    if args.budget_ms is not None and not args.budget_ms > 0:
        raise SystemExit("edge-client: --budget-ms must be > 0")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, draft_len=args.draft_len, drafter=args.drafter,
        stop_confidence=args.stop_confidence, fallback=args.fallback, budget_ms=args.budget_ms)
    tls = (ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
           if args.tls_ca or args.tls_cert else None)
    with verifier_address(args) as address, EdgeClient(
            address, args.draft_dir, api_key=args.api_key, tls=tls, insecure=args.insecure,
            rtt_ms=args.rtt_ms, protocol=args.protocol, fallback=args.fallback,
            retry=RetryPolicy(budget_s=args.retry_budget_s),
            feature_head=args.feature_head,
            offline_after_s=offline_wait_s(args.budget_ms)) as client:
        chat = Chat(client, config, Conversation(client.tokenizer, args.system),
                    document_routing_key(secrets.token_hex(16)))
        return chat.run()


class Chat:
    """The read-answer loop on the terminal (its own UI output is print, not logging)."""

    def __init__(self, client, config, conversation: Conversation, routing_key: str) -> None:
        self.client = client
        self.config = config
        self.conversation = conversation
        self.routing_key = routing_key
        self.stats = ChatStats()

    def run(self) -> int:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        print(f"edgespec chat with {self._target()}. {HELP}; Ctrl-D leaves.", flush=True)
        interrupted = False
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print(flush=True)
                return 0
            except KeyboardInterrupt:
                if interrupted:
                    print(flush=True)
                    return 0
                interrupted = True
                print("\n(Ctrl-C again or Ctrl-D to leave)", flush=True)
                continue
            interrupted = False
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line):
                    return 0
                continue
            try:
                # A Ctrl-C right after an answer was cancelled is the "second" one: it leaves.
                interrupted = not self.answer(line)
            except KeyboardInterrupt:  # between the answer's end and the next prompt
                print("\n[cancelled]", flush=True)
                interrupted = True

    def _target(self) -> str:
        info = self.client.info
        return info.target_model if info is not None else "the draft alone (no verifier yet)"

    def command(self, line: str) -> bool:
        """Runs a /command; True to leave."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit"):
            return True
        if name == "/reset":
            self.conversation.reset()
            print("[conversation cleared]", flush=True)
        elif name == "/stats":
            print(self.stats.line(), flush=True)
        elif name == "/help":
            print(HELP, flush=True)
        else:
            print(f"unknown command {name}; {HELP}", flush=True)
        return False

    def answer(self, question: str) -> bool:
        """Streams the answer to ``question``; False when Ctrl-C cancelled it."""
        from edge_client.live_text import LiveText

        client = self.client
        max_context = client.info.max_context if client.info is not None else 1 << 20
        ids = self.conversation.prompt_ids(question, max_context, self.config.max_new_tokens)
        live = LiveText(client.tokenizer, sys.stdout)
        generation = None
        sys.stdout.write(ANSWER)
        try:
            generation = client.generate(ids, self.config, routing_key=self.routing_key)
            for chunk in generation.chunks():
                live.push(chunk.token_ids, chunk.verified, chunk.replaces)
        except KeyboardInterrupt:
            # Leaving the iteration cancelled the generation (its session closes at once);
            # what was shown stays the answer, so the history matches the screen.
            if generation is not None:
                generation.cancel()
            live.finish()
            print("[cancelled]", flush=True)
            completed = False
        except EdgeError as err:
            live.finish()
            print(f"[error: {type(err).__name__}: {err}]", flush=True)
            self.conversation.forget_last_question()
            return True
        else:
            live.finish()
            completed = True
        if generation is not None:
            self.stats.add(generation.stats.to_dict())
        self.conversation.answered(live.text)
        return completed
