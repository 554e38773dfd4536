"""Would type-through pay? How often the next key continues the suggestion shown after the
previous one, measured with the target's own greedy suggestion, before building it.

    python -m edge_client.bench.ime.type_through --messages 10 --tokens 12 --threads 1

For every key of the typing benchmark's messages (each message typed character by character,
no typos), the target suggests ``--tokens`` greedy tokens after the text before the key, and
the key's text is checked against it two ways:

- ``exact``: the new text tokenizes to the old text's tokens plus a prefix of the suggestion.
  Only then is the rest of the suggestion what a fresh session over the new text produces, so
  a client could keep it and send nothing.
- ``first_char``: the key's character is the suggestion's next character. A client could keep
  showing the rest as text, but after a re-tokenized word it is no longer the target's
  continuation of the new text (a fresh session may say something else).

``--heal`` also compares what the suggestions are worth to the typist, plain (the text's own
tokens, as above) against healed (``GenerationConfig.heal``: the text backed up over its
partial word, the target's masked greedy continuation; ``shared.token_spelling``): for every
key, whether the suggestion shown after it begins with the next character typed, and whether
it spells the rest of the word being typed, or the next word after a space, exactly (a
one-tap completion the IME could offer).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TypeThrough:
    keys: int
    exact: int
    first_char: int

    def rates(self) -> dict:
        return {**asdict(self), "exact_rate": self.exact / self.keys if self.keys else None,
                "first_char_rate": self.first_char / self.keys if self.keys else None}


def count_type_through(messages: Sequence[str], encode: Callable[[str], list[int]],
                       decode: Callable[[list[int]], str],
                       suggest: Callable[[list[int]], list[int]]) -> TypeThrough:
    """``suggest(ids)``: the suggestion's token ids after ``ids``. Keys from the second
    character of each message on (the first has no suggestion before it)."""
    keys = exact = first_char = 0
    for message in messages:
        before = encode(message[:1])
        shown = suggest(before)
        for i in range(2, len(message) + 1):
            now = encode(message[:i])
            whole = before + shown
            keys += 1
            exact += len(now) > len(before) and whole[:len(now)] == now
            head = decode(before)
            text = decode(whole)
            rest = text[len(head):] if text.startswith(head) else ""
            typed = message[len(head):i] if message[:i].startswith(head) else ""
            first_char += bool(rest and typed) and rest.startswith(typed)
            before, shown = now, suggest(now)
    return TypeThrough(keys, exact, first_char)


@dataclass(frozen=True)
class SuggestionHits:
    keys: int
    first_char: int  # the suggestion begins with the next character typed
    word: int  # it spells the rest of the current word (or the next word) exactly

    def rates(self) -> dict:
        return {**asdict(self), "first_char_rate": _rate(self.first_char, self.keys),
                "word_rate": _rate(self.word, self.keys)}


def _rate(n: int, keys: int) -> float | None:
    return round(n / keys, 4) if keys else None


def next_word(message: str, i: int) -> str:
    """What the typist types after ``message[:i]`` up to the end of the word it is in, or of
    the next word when ``i`` is at a space (its leading spaces included)."""
    j = i
    while j < len(message) and message[j] == " ":
        j += 1
    while j < len(message) and (message[j].isalnum() or message[j] in "'-"):
        j += 1
    return message[i:j]


def count_hits(messages: Sequence[str], suggest_text: Callable[[str], str]) -> SuggestionHits:
    """``suggest_text(text)``: the suggestion's text after ``text``. Keys from the first
    character on, the last excepted (nothing is typed after it)."""
    keys = first_char = word = 0
    for message in messages:
        for i in range(1, len(message)):
            shown = suggest_text(message[:i])
            want = next_word(message, i)
            keys += 1
            first_char += shown.startswith(message[i])
            word += bool(want.strip()) and shown.startswith(want)
    return SuggestionHits(keys, first_char, word)


def healed_suggestion(target, spelling, tokenizer, tokens: int) -> Callable[[str], str]:
    """The target's greedy suggestion after a text backed up over its partial word: each step
    restricted to the tokens that can spell what is left of it, as the verifier does."""
    import torch
    from transformers import DynamicCache

    def suggest(text: str) -> str:
        ctx, rest = spelling.heal(tokenizer.encode(text, add_special_tokens=False))
        cache, feed, out = DynamicCache(), list(ctx), []
        for _ in range(tokens):
            with torch.inference_mode():
                logits = target.model(input_ids=torch.tensor([feed]), past_key_values=cache,
                                      use_cache=True, logits_to_keep=1).logits[0, -1].float()
            if rest:
                allowed = torch.from_numpy(spelling.allowed(rest))
                logits = torch.full_like(logits, float("-inf")).index_copy_(
                    0, allowed, logits[allowed])
            token = int(logits.argmax())
            rest = spelling.advance(rest, token) if rest else b""
            out.append(token)
            feed = [token]
        whole = tokenizer.decode(ctx + out, skip_special_tokens=True)
        return whole[len(text):] if whole.startswith(text) else ""

    return suggest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edge_client.bench.ime.type_through",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=10, help="the first N messages")
    p.add_argument("--tokens", type=int, default=12, help="suggestion length")
    p.add_argument("--model", default=None, help="target checkpoint (default: prepared)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--heal", action="store_true",
                   help="also count suggestion hits, plain against healed")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    import torch

    from cloud_verifier.target_model import load_target
    from edge_client.bench.acceptance import target_greedy_path
    from edge_client.bench.ime.typist import load_messages

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, device="cpu")
    tok = target.tokenizer
    messages = load_messages()[:args.messages]
    result = count_type_through(
        messages, lambda s: tok.encode(s, add_special_tokens=False), tok.decode,
        lambda ids: target_greedy_path(target, ids, args.tokens, frozenset())[0])
    report = {"messages": len(messages), "tokens": args.tokens, **result.rates()}
    if args.heal:
        from shared.token_spelling import spelling_of

        spelling = spelling_of(tok.backend_tokenizer.to_str())

        def plain(text: str) -> str:
            ids = tok.encode(text, add_special_tokens=False)
            path = target_greedy_path(target, ids, args.tokens, frozenset())[0]
            whole = tok.decode(ids + path, skip_special_tokens=True)
            return whole[len(text):] if whole.startswith(text) else ""

        report["hits"] = {
            "plain": count_hits(messages, plain).rates(),
            "healed": count_hits(messages, healed_suggestion(target, spelling, tok,
                                                             args.tokens)).rates()}
    print(json.dumps(report, indent=1))
    if args.json:
        from edge_client.bench.ime.report import write_json

        write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
