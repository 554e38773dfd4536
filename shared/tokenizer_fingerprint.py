"""A stable fingerprint of a tokenizer's id <-> token mapping.

Speculative decoding is only meaningful when the draft and the target agree on what every
token id means. The verifier advertises this fingerprint and the edge client refuses to run
against a different one. Only the vocabulary (including added/special tokens) is hashed:
that is what both sides must agree on, and it reads the same from the `tokenizers` library
on the edge and from a transformers tokenizer in the cloud.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """``sha256:<hex>`` over the vocabulary sorted by id."""
    pairs = sorted(((int(i), tok) for tok, i in vocab.items()))
    blob = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "sha256:" + hashlib.sha256(blob).hexdigest()
