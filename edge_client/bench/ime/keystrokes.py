"""Keystrokes a typist saves by taking the suggestions, through the product's documents (token
healing and type-through on, or off) and a real verifier, on the typing benchmark's messages.

    python -m edge_client.bench.ime.keystrokes --messages 8 --tokens 6 --threads 1

The typist types each message into an empty field. Before every key it reads the suggestion
for the text so far, waiting for the whole of it (no key timing: this measures what the
suggestions are worth, not how fast they come). When the suggestion begins with the rest of the
word being typed, or after a space with the next word, it takes that word with one tap;
otherwise it types the next character. Reported per setting (``--settings``: ``healed``,
the product's default, and ``plain``, ``GenerationConfig(heal=False)``):

- ``keystrokes_per_char``: keys and taps over the characters of the messages (1 minus the
  keystroke savings rate);
- ``taps`` and the characters they entered;
- ``no_rpc``: suggestions the document served from the last one with no RPC at all
  (type-through: a tap types along the suggestion), and ``reused_tokens``;
- ``forwards_per_keystroke``: the target forwards the suggestions committed (the client's
  count; nothing is cancelled here).

The messages share no 8-word shingle with any training source (``tests/test_bench_ime.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from edge_client.bench.ime.type_through import next_word

SETTINGS = ("healed", "plain")


@dataclass
class Tally:
    messages: int = 0
    chars: int = 0
    keystrokes: int = 0  # characters typed plus taps
    taps: int = 0
    tapped_chars: int = 0
    suggestions: int = 0
    no_rpc: int = 0  # served from the last suggestion, no RPC
    reused_tokens: int = 0
    target_forwards: int = 0
    wall_s: float = 0.0

    def report(self) -> dict:
        def per(n: int, d: int) -> float | None:
            return round(n / d, 4) if d else None

        return {**asdict(self), "wall_s": round(self.wall_s, 1),
                "keystrokes_per_char": per(self.keystrokes, self.chars),
                "keystroke_savings": per(self.chars - self.keystrokes, self.chars),
                "forwards_per_keystroke": per(self.target_forwards, self.keystrokes)}


def type_message(message: str, suggest: Callable[[str], object], tally: Tally) -> None:
    """Types ``message`` taking every suggestion that spells the next word exactly.
    ``suggest(text)`` returns a ``Suggestion`` (edge_client.document) for the text so far."""
    text = message[:1]  # the first key: an empty field has nothing to suggest after
    tally.keystrokes += 1
    while text != message:
        s = suggest(text)
        tally.suggestions += 1
        tally.target_forwards += s.stats.target_forwards
        tally.reused_tokens += s.stats.reused_tokens
        tally.no_rpc += s.stats.reused_tokens > 0 and s.stats.target_forwards == 0
        want = next_word(message, len(text))
        if want.strip() and s.text.startswith(want):
            text += want
            tally.taps += 1
            tally.tapped_chars += len(want)
        else:
            text += message[len(text)]
        tally.keystrokes += 1
    tally.messages += 1
    tally.chars += len(message)


def measure(messages: Sequence[str], document, tokens: int) -> Tally:
    """One document per message (one text field each), as the typing benchmark opens them."""
    tally = Tally()
    t0 = time.perf_counter()
    for message in messages:
        with document() as doc:
            type_message(message, lambda text: doc.suggest(text, max_new_tokens=tokens), tally)
        logging.info("%d/%d messages, %.3f keystrokes a character", tally.messages,
                     len(messages), tally.keystrokes / tally.chars)
    tally.wall_s = time.perf_counter() - t0
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edge_client.bench.ime.keystrokes",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=8, help="the first N messages")
    p.add_argument("--tokens", type=int, default=6, help="suggestion length")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    p.add_argument("--model", default=None, help="target checkpoint (default: prepared)")
    p.add_argument("--draft-dir", default=None, help="ONNX draft (default: shipped)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the verifier")
    p.add_argument("--draft-threads", type=int, default=1)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    import torch

    from cloud_verifier.server import EmbeddedVerifier, load_served_target
    from edge_client.bench.ime.typist import load_messages
    from edge_client.client import EdgeClient, GenerationConfig

    torch.set_num_threads(args.threads)
    messages = load_messages()[:args.messages]
    report: dict = {"messages": len(messages), "tokens": args.tokens, "settings": {}}
    with EmbeddedVerifier(load_served_target(args.model)) as verifier, \
            EdgeClient(verifier.address, args.draft_dir,
                       intra_op_threads=args.draft_threads) as client:
        for name in args.settings:
            config = GenerationConfig(heal=name == "healed", word_settle_ms=0)
            tally = measure(messages, partial(client.document, config), args.tokens)
            report["settings"][name] = tally.report()
            logging.info("%s: %s", name, report["settings"][name])
    print(json.dumps(report, indent=1))
    if args.json:
        from edge_client.bench.ime.report import write_json

        write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
