"""Token healing and type-through in documents, end to end over real gRPC: every suggestion is
the target's masked greedy continuation of the healed text (an independent step-by-step
reference), whether the document generated it or kept it from the last suggestion.

Tiny random models whose ids get a byte spelling of their own (words over "ab", some with a
leading space), and the real SmolLM2 target with the shipped draft."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import replace

import pytest
import torch
from test_continue_with import masked_reference
from test_editing import one_torch_thread  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, EdgeClient, GenerationConfig
from shared.token_spelling import TokenSpelling

SEQUENCES = 40
CONFIG = GenerationConfig(draft_len=3, ignore_eos=True, word_settle_ms=0)


def toy_spelling(vocab: int = 96) -> TokenSpelling:
    words = [(lead + "".join(w)).encode() for n in (1, 2, 3, 4, 5) for lead in ("", " ")
             for w in itertools.product("ab", repeat=n)]
    return TokenSpelling([None, None, None, b" "] + words[:vocab - 4])


TOY = toy_spelling()


def masked_greedy(model, spelling: TokenSpelling, ids: list[int], n: int) -> list[int]:
    """The target's greedy tokens after ``ids`` healed (tests/test_continue_with.py's
    step-by-step reference)."""
    ctx, rest = spelling.heal(ids)
    return masked_reference(model, ctx, rest, n, spelling)


@pytest.fixture(scope="module")
def spelled(target):
    """A verifier whose tokenizer spells the tiny ids as TOY says (clients: ``spell``)."""
    with EmbeddedVerifier(replace(target, spelling=TOY),
                          VerifierConfig(port=0, max_sessions=16, max_draft_len=8)) as v:
        yield v


def spell(client):
    """The client's tokenizer spells the tiny ids as TOY says (its cached table)."""
    client.tokenizer._spelling = TOY
    return client


def typing_edit(rng: random.Random, text: list[int], ctx: list[int], shown: list[int]
                ) -> list[int]:
    """The next text: mostly typing along the suggestion shown, else another edit."""
    kind = rng.choice(["along", "along", "along", "type", "backspace"])
    if kind == "along" and shown:
        return ctx + shown[:rng.randint(1, len(shown))]
    if kind == "backspace" and len(text) > 2:
        return text[:-1]
    return text + [rng.randrange(3, 96)]


def test_healed_suggestions_are_the_masked_greedy_path_kept_or_not(spelled, tiny_llama_pair,
                                                                   target):
    """SEQUENCES random typing sequences of 6 suggestions each, mostly typing along the last
    suggestion: every suggestion equals the reference; some keep tokens of the last one
    (type-through), some of those send nothing at all."""

    async def run() -> tuple[int, int]:
        kept = silent = 0
        async with AsyncEdgeClient(spelled.address, tiny_llama_pair.draft_dir) as client:
            spell(client)
            assert client.info.max_continue_with > 0
            for seq in range(SEQUENCES):
                rng = random.Random(7000 + seq)
                text = [1] + [rng.randrange(3, 96) for _ in range(rng.randint(3, 8))]
                shown: list[int] = []
                async with client.document(CONFIG) as doc:
                    for number in range(6):
                        if number:
                            text = typing_edit(rng, text, TOY.heal(text)[0], shown)
                        n = rng.randint(1, 6)
                        s = await doc.suggest(text, max_new_tokens=n)
                        assert s.token_ids == masked_greedy(target.model, TOY, text, n), \
                            (seq, number)
                        assert not s.cancelled
                        kept += s.stats.reused_tokens > 0
                        silent += s.stats.reused_tokens > 0 and s.stats.target_forwards == 0
                        shown = s.token_ids
        return kept, silent

    kept, silent = asyncio.run(run())
    assert kept >= 10 and silent >= 3, (kept, silent)


def test_heal_off_sends_the_texts_own_tokens(spelled, tiny_llama_pair, target):
    with EdgeClient(spelled.address, tiny_llama_pair.draft_dir) as client, \
            spell(client).document(replace(CONFIG, heal=False)) as doc:
        text = [1, 40, 41, 42]
        s = doc.suggest(text, max_new_tokens=4)
        with torch.no_grad():
            want = target.model.generate(torch.tensor([text]), max_new_tokens=4,
                                         min_new_tokens=4, do_sample=False, pad_token_id=0)
        assert s.token_ids == want[0, len(text):].tolist()
        assert s.stats.reused_tokens == 0


def test_real_target_heals_a_partial_word_and_keeps_it_while_typed(real_assets):
    """SmolLM2 and the shipped draft: after "Could you send me the rep" the suggestion is the
    masked greedy path (it begins with the rest of a word that starts " rep"); typing it
    along, every suggestion is still the reference, and some keys keep it with no RPC."""
    from cloud_verifier.server import load_served_target

    target_dir, _ = real_assets
    target = load_served_target(target_dir)
    with EmbeddedVerifier(target) as verifier, EdgeClient(verifier.address) as client, \
            client.document(replace(CONFIG, ignore_eos=False)) as doc:
        tok, spelling = client.tokenizer, client.tokenizer.spelling
        def reference(text: str) -> list[int]:
            want = masked_greedy(target.model, spelling, tok.encode(text), 6)
            return want[:next((i + 1 for i, t in enumerate(want)
                               if t in target.eos_token_ids), len(want))]

        text = "Could you send me the rep"
        s = doc.suggest(text, max_new_tokens=6)
        assert s.token_ids == reference(text)
        ctx, rest = spelling.heal(tok.encode(text))
        assert rest == b" rep" and tok.decode(ctx + s.token_ids) == text + s.text
        free = 0
        for ch in s.text[:8]:
            text += ch
            s = doc.suggest(text, max_new_tokens=6)
            assert s.token_ids == reference(text), text
            free += s.stats.reused_tokens > 0 and s.stats.target_forwards == 0
        assert free >= 1


def test_a_healed_preview_spells_the_word_being_typed(spelled, tiny_llama_pair, target):
    """A text ending inside a word, with a wait: the preview (the draft's own tokens, shown
    before any forward) begins by spelling the bytes healing backed over, as the verified
    suggestion after it does."""
    text = [1, 40, 87, 7]  # ends in " b", a word begun
    ctx, rest = TOY.heal(text)
    assert rest

    async def run():
        async with AsyncEdgeClient(spelled.address, tiny_llama_pair.draft_dir) as client:
            spell(client)
            seen = []
            async with client.document(replace(CONFIG, drafter="model")) as doc:
                s = await doc.suggest(text, 4, settle_ms=50, on_update=seen.append)
            return seen, s

    seen, s = asyncio.run(run())
    preview = seen[0]
    assert preview.preview and preview.token_ids == [] and preview.unverified_ids
    assert TOY.advance_all(rest, preview.unverified_ids)[0] == len(preview.unverified_ids)
    assert not s.preview and s.token_ids == masked_greedy(target.model, TOY, text, 4)
