"""Token healing's spelling table (shared.token_spelling): which tokens may spell what is
left of a text, how a text is backed up, and the table of the shipped tokenizer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shared.token_spelling import MAX_CONTINUE_WITH, TokenSpelling, spelling_of

# A toy vocabulary: ids 0..10. id 0 is special (spells nothing); 9 and 10 are the two bytes
# of "é".
TOY = [None, b" ", b" t", b" to", b" tom", b" tomorrow", b"o", b"rrow", b"x", b"\xc3", b"\xa9"]


def toy() -> TokenSpelling:
    return TokenSpelling(TOY)


def test_tokens_that_complete_the_rest_are_allowed_and_parts_only_when_none_does():
    sp = toy()
    # " tomo" is completed by " tomorrow" alone: " to" and " tom" would spell parts of it.
    assert sp.allowed(b" tomo").tolist() == [5]
    assert sp.allowed(b" to").tolist() == [3, 4, 5]
    assert sp.allowed(b" ").tolist() == [1, 2, 3, 4, 5]
    # Nothing starts with "orrowx": the tokens it starts with spell a part of it.
    assert sp.allowed(b"orrowx").tolist() == [6]
    assert sp.allowed(b"zz").tolist() == []


def test_advance_follows_allowed_and_spells_the_rest_out():
    sp = toy()
    for rest in (b" tomo", b" to", b" ", b"orrowx", b"o"):
        allowed = set(sp.allowed(rest).tolist())
        for token in range(len(TOY)):
            assert (sp.advance(rest, token) is not None) == (token in allowed), (rest, token)
    assert sp.advance(b" tomo", 5) == b""
    assert sp.advance(b"orrowx", 6) == b"rrowx"
    assert sp.advance(b"", 0) == b""  # nothing left to spell: anything goes
    assert sp.advance_all(b"orrowx", [6, 7, 8, 2]) == (4, b"")  # then anything goes
    assert sp.advance_all(b"orrowx", [6, 8]) == (1, b"rrowx")
    assert sp.advance_all(b" tomo", [4, 6]) == (0, b" tomo")


def test_heal_backs_up_the_last_partial_word():
    sp = toy()
    # "x tom" + "o": the partial word " tomo" is backed over.
    assert sp.heal([8, 4, 6]) == ([8], b" tomo")
    # A trailing space alone.
    assert sp.heal([8, 5, 1]) == ([8, 5], b" ")
    # The first token is never backed over; a special token ends the text as it is.
    assert sp.heal([6]) == ([6], b"")
    assert sp.heal([8, 0]) == ([8, 0], b"")
    # A cut inside a UTF-8 character backs up further; with nothing before, no healing.
    assert sp.heal([8, 9, 10]) == ([8], b"\xc3\xa9")
    assert sp.heal([10, 10]) == ([10, 10], b"")


def test_heal_backs_up_at_most_a_few_tokens():
    sp = toy()
    ids = [8, 2] + [6] * 5
    kept, rest = sp.heal(ids)
    assert len(ids) - len(kept) == 3 and rest == b"ooo"
    assert sp.spell(kept) + rest == sp.spell(ids)


def test_the_shipped_tokenizer_spells_every_text_as_its_bytes():
    from edge_client.tokenizer import EdgeTokenizer
    from shared.paths import default_draft_dir

    tok = EdgeTokenizer(default_draft_dir())
    sp = tok.spelling
    assert sp is not None and sp.vocab_size == 49152
    for text in ["Can we meet ", "see you tomo", "Ça va très bi", "x = f(y)\n\t", "emoji 🙂 ok"]:
        ids = tok.encode(text)
        assert sp.spell(ids) == text.encode()
        kept, rest = sp.heal(ids)
        assert sp.spell(kept) + rest == text.encode()
        assert len(rest) <= MAX_CONTINUE_WITH
        if rest:  # some token can always go on spelling it
            assert sp.allowed(rest).size
    kept, rest = sp.heal(tok.encode("Can we meet tomo"))
    assert tok.decode(kept) == "Can we meet" and rest == b" tomo"
    assert {tok.decode([int(i)]) for i in sp.allowed(rest)} >= {" tomorrow"}
    # Special tokens never spell anything.
    eos = tok.eos_token_ids[0]
    assert sp.token_bytes(eos) == b"" and eos not in set(sp.allowed(b" ").tolist())


def test_a_word_level_tokenizer_has_no_spelling(tiny_llama_pair):
    text = (tiny_llama_pair.target_dir / "tokenizer.json").read_text()
    assert spelling_of(text) is None


@pytest.mark.parametrize("rest", [b"a", b"\xff", b"ab\xff\xff"])
def test_completion_ranges_include_bytes_above_the_rest(rest):
    sp = TokenSpelling([rest, rest + b"\xff", rest + b"\x00", b"b", b"\xff\xff\xff"])
    got = set(sp.allowed(rest).tolist())
    want = {i for i, b in enumerate(sp._bytes) if b.startswith(rest)}
    assert got == want
    assert isinstance(sp.allowed(rest), np.ndarray)


def test_narrows_only_when_the_new_allowed_set_is_inside_the_old():
    """Type-through keeps a token only where ``narrows`` holds: it must never hold where
    the new rest allows a token the old one did not (checked on every pair of these rests
    that types further), and it holds in the common cases."""
    sp = toy()
    rests = [b"", b" ", b" t", b" to", b" tom", b" tomo", b" tomorrow", b"o", b"or", b"orrowx"]
    for old, new in itertools.product(rests, rests):
        if new.startswith(old) and sp.narrows(old, new):
            assert not old or set(sp.allowed(new).tolist()) <= set(sp.allowed(old).tolist())
    # " tomo" is completed (by " tomorrow"). "orrowx" is not, so narrows refuses it: a rest
    # with no completion allows its parts, which the shorter rest may not (here both happen
    # to allow only "o": narrows is sufficient, not exact).
    assert sp.narrows(b"", b"x") and sp.narrows(b" to", b" tomo")
    assert not sp.narrows(b"or", b"orrowx")
