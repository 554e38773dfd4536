"""Which tokens can spell a given text: the constraint behind token healing.

A keyboard asks for a suggestion after text that often ends inside a word ("see you tomo")
or with a space ("Can we meet "). Its tokens then end in a piece the model rarely saw in
training (" tom" + "o", or a lone " "), and the model's continuation of them is poor: after
"Can we meet " SmolLM2 suggests "10 times?", after "Can we meet" it suggests " in a room".
Token healing (Guidance's name for it) backs the text up to its last whole word and asks for
a continuation that *begins with* the bytes it backed over: the target then re-spells the
partial word itself (" tomorrow", " in").

The protocol carries that as ``continue_with`` (bytes): until the new tokens have spelled
those bytes out, the target's distribution at each position is restricted to the tokens
consistent with what is left of them, renormalised. A token is consistent with the rest r
when its bytes start with r (it completes r); only when no token of the vocabulary does, a
token whose bytes r starts with (it spells a part of r). Letting short tokens spell a part
of a word that some token completes invites spellings the model never writes: under
" tom" SmolLM2's greedy choice among all consistent tokens is " to" + "mm" + "orrow".
Special tokens and empty tokens are never consistent: the text must go on. The verifier masks
its logits with ``TokenSpelling.allowed``; both sides advance the rest with ``advance``.

Only byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) spell every text as the
concatenation of their tokens' bytes; ``spelling_of`` returns None for any other tokenizer,
and the verifier then advertises no support (GetInfo.max_continue_with 0).

numpy and the standard library only: both the edge and the cloud import it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence

import numpy as np

# The longest continue_with a verifier accepts (GetInfo.max_continue_with): a word or two.
MAX_CONTINUE_WITH = 64
# heal() backs up at most this many tokens of a partial word.
MAX_HEALED_TOKENS = 3


def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte (GPT-2's table): printable bytes
    stand for themselves, the others are shifted above 255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


class TokenSpelling:
    """Each token's bytes, indexed for prefix queries. ``token_bytes[i]`` is None (or
    empty) for a token that spells nothing a user types (special tokens)."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.vocab_size = len(token_bytes)
        self._bytes = [b or b"" for b in token_bytes]
        pairs = sorted((b, i) for i, b in enumerate(self._bytes) if b)
        self._sorted = [b for b, _ in pairs]
        self._ids = np.array([i for _, i in pairs], dtype=np.int64)
        self._exact: dict[bytes, list[int]] = {}
        for b, i in pairs:
            self._exact.setdefault(b, []).append(i)
        self._cache: dict[bytes, np.ndarray] = {}

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes; b"" for a special token or an id outside the table."""
        return self._bytes[token] if 0 <= token < self.vocab_size else b""

    def spell(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def _completions(self, rest: bytes) -> tuple[int, int]:
        """The range of ``_sorted`` whose tokens start with ``rest``."""
        lo = bisect.bisect_left(self._sorted, rest)
        after = _successor(rest)
        return lo, bisect.bisect_left(self._sorted, after) if after else len(self._sorted)

    def allowed(self, rest: bytes) -> np.ndarray:
        """Sorted int64 ids of the tokens consistent with ``rest`` (non-empty): those that
        complete it, or if there are none, those that spell a part of it."""
        hit = self._cache.get(rest)
        if hit is not None:
            return hit
        lo, hi = self._completions(rest)
        if hi > lo:
            out = np.sort(self._ids[lo:hi])
        else:
            out = np.unique(np.array([i for end in range(1, len(rest))
                                      for i in self._exact.get(rest[:end], ())],
                                     dtype=np.int64))
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[rest] = out
        return out

    def advance(self, rest: bytes, token: int) -> bytes | None:
        """What ``token`` leaves of ``rest`` to spell (b"" once spelled out), or None if it
        is not consistent with it. Any token is consistent with an empty rest."""
        if not rest:
            return b""
        b = self.token_bytes(token)
        if not b:
            return None
        if b.startswith(rest):
            return b""
        if rest.startswith(b):
            lo, hi = self._completions(rest)
            return rest[len(b):] if hi == lo else None
        return None

    def narrows(self, old: bytes, new: bytes) -> bool:
        """Whether every token consistent with ``new`` is consistent with ``old``, for an
        ``old`` that is a prefix of ``new`` (the same text, typed further). True when
        ``old`` is empty, equal, or ``new`` has a token that completes it (then so does
        ``old``, and anything starting with ``new`` starts with ``old``). Otherwise ``new``
        allows parts that ``old`` (which some token completes, or whose parts are fewer)
        does not."""
        if not old or old == new:
            return True
        lo, hi = self._completions(new)
        return hi > lo

    def advance_all(self, rest: bytes, tokens: Sequence[int]) -> tuple[int, bytes]:
        """How many of ``tokens`` are consistent with ``rest`` in turn, and what they leave."""
        for n, token in enumerate(tokens):
            after = self.advance(rest, token)
            if after is None:
                return n, rest
            rest = after
        return len(tokens), rest

    def heal(self, ids: Sequence[int]) -> tuple[list[int], bytes]:
        """Backs ``ids`` up over their last, possibly partial, word: (the ids kept, the bytes
        a continuation must begin with). Backs up the last token, and more of the same word
        (a piece that does not start with a space or a punctuation mark), at most
        MAX_HEALED_TOKENS and never the first token; more if the cut would split a UTF-8
        character. A text ending in a special token is left as it is."""
        ids = list(ids)
        cut = len(ids)
        while cut > 1:
            piece = self.token_bytes(ids[cut - 1])
            if not piece:
                break
            cut -= 1
            if piece[0] & 0xC0 == 0x80:  # inside a UTF-8 character: keep going
                continue
            if len(ids) - cut >= MAX_HEALED_TOKENS or not _inside_word(piece):
                break
        rest = self.spell(ids[cut:])
        if len(rest) > MAX_CONTINUE_WITH or (rest and rest[0] & 0xC0 == 0x80):
            return ids, b""
        return ids[:cut], rest


def _successor(prefix: bytes) -> bytes:
    """The least byte string above every string that starts with ``prefix`` (b"" if none)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b""


def _inside_word(piece: bytes) -> bool:
    """Whether a token's bytes continue a word (start with a letter or digit)."""
    return piece[:1].isalnum() or piece[0] >= 0x80


def spelling_of(tokenizer_json: str | dict) -> TokenSpelling | None:
    """The spelling table of a `tokenizers` tokenizer (its JSON, as ``Tokenizer.to_str()``
    or tokenizer.json hold it), or None when it is not byte-level BPE."""
    spec = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    decoder = spec.get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    model = spec.get("model") or {}
    if "ByteLevel" not in kinds or model.get("type") != "BPE":
        return None
    alphabet = _byte_level_alphabet()
    vocab: dict[str, int] = dict(model.get("vocab", {}))
    added = {t["content"]: (t["id"], t.get("special", False))
             for t in spec.get("added_tokens", [])}
    size = max([*vocab.values(), *(i for i, _ in added.values()), -1]) + 1
    table: list[bytes | None] = [None] * size
    for text, i in vocab.items():
        if text in added:
            continue
        try:
            table[i] = bytes(alphabet[c] for c in text)
        except KeyError:  # not a byte-level token: spells nothing we can match
            table[i] = None
    for text, (i, special) in added.items():
        table[i] = None if special else text.encode("utf-8")
    return TokenSpelling(table)
