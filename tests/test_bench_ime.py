"""The typing benchmark (edgespec-bench ime): the simulated typist, the messages it types, and
one short run on the tiny pair against a real verifier process, with the outage drill."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_client.bench.eval_set import EvalPrompt, overlaps
from edge_client.bench.ime.typist import BACKSPACE, Script, TypingProfile, type_message
from edge_client.client import GenerationConfig

MESSAGE = "Are we still on for coffee at ten, or should we push it?"


def test_a_typed_message_ends_as_the_message_with_keys_at_human_intervals():
    profile = TypingProfile(typo_rate=0.2)
    field = type_message(MESSAGE, 0, np.random.default_rng(3), profile)
    assert field.text == MESSAGE
    backspaces = [k for k in field.keys if k.key == BACKSPACE]
    assert backspaces, "a typo rate of 0.2 over 40 letters made no typo"
    assert len(field.keys) == len(MESSAGE) + 2 * len(backspaces)
    times = [0.0] + [k.at_s for k in field.keys]
    gaps = np.diff(times) * 1000
    lo, hi = profile.key_ms
    longest_pause = max(profile.word_pause_ms[1], profile.sentence_pause_ms[1])
    assert gaps.min() >= min(lo, profile.reaction_ms[0])
    assert gaps.max() <= hi + longest_pause
    # Pauses come after spaces and punctuation, not inside words.
    after_space = [g for g, k in zip(gaps[1:], field.keys, strict=False) if k.key == " "]
    assert np.mean(after_space) > np.mean(gaps)
    assert all(4 <= k.max_new_tokens <= 12 for k in field.keys)
    for before, key in zip(field.keys, field.keys[1:], strict=False):
        expected = before.text[:-1] if key.key == BACKSPACE else before.text + key.key
        assert key.text == expected


def test_a_script_is_reproducible_and_fills_the_duration():
    messages = ["one two three", "four five six seven", "eight nine"]
    a = Script(messages, 5).fields_for(20.0)
    b = Script(messages, 5).fields_for(20.0)
    assert a == b
    assert sum(f.duration_s for f in a) >= 20.0
    assert sum(f.duration_s for f in a[:-1]) < 20.0
    assert {f.message for f in a} == {0, 1, 2}  # every message before any repeats


def test_the_messages_are_kept_apart_from_training_data():
    from test_eval_set import committed_texts, generator_texts

    from edge_client.bench.ime.typist import load_messages

    messages = load_messages()
    assert len(messages) >= 60 and len(set(messages)) == len(messages)
    prompts = [EvalPrompt(f"ime-bench-{i}", "ime", raw=m) for i, m in enumerate(messages)]
    assert overlaps(generator_texts() + committed_texts(), prompts) == []


def test_a_short_run_reports_every_mode_and_the_outage(tiny_llama_pair, tmp_path):
    from edge_client.bench.cli import main
    from edge_client.bench.ime.modes import edit_sessions_available

    # Words of the tiny vocabulary, so that every prefix tokenizes to real ids.
    messages = tmp_path / "messages.txt"
    messages.write_text("t5 t12 t7, t30 t41.\nt60 t61 t3 t17?\nt14 t15 t16 t50.\n")
    out = tmp_path / "ime.json"
    drilled = "edit" if edit_sessions_available() else "reopen"
    code = main(["ime", "--embedded", "--model", str(tiny_llama_pair.target_dir),
                 "--draft-dir", str(tiny_llama_pair.draft_dir), "--messages", str(messages),
                 "--profile", "wifi", "--duration", "4", "--outage-modes", drilled,
                 "--outage-after", "1.5", "--outage", "1", "--recovery", "3",
                 # The last key of each message waits long enough to see its suggestion
                 # whole even on a loaded machine.
                 "--linger-ms", "5000", "--verifier-arg=--threads=1",
                 "--no-progress", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert set(modes) == {"edit", "reopen", "cloud-only"}
    if not edit_sessions_available():
        assert modes["edit"]["available"] is False and modes["edit"]["reason"]
    ran = [name for name, m in modes.items() if m["available"]]
    assert {"reopen", "cloud-only"} <= set(ran)
    keys = {modes[name]["aggregate"]["keystrokes"] for name in ran}
    assert len(keys) == 1 and keys.pop() > 10  # every mode typed the same keys
    for name in ran:
        agg = modes[name]["aggregate"]
        assert agg["forwards_source"] == "server"
        assert agg["forwards_per_keystroke"] > 0 and agg["tokens_computed_per_keystroke"] > 0
        assert agg["suggestions_full"] >= 1, name
        assert agg["suggest_ms_p95"] >= agg["suggest_ms_p50"] > 0
        assert agg["first_token_ms_p95"] >= agg["first_token_ms_p50"] > 0
        assert agg["suggestions_shown"] >= agg["suggestions_full"]
        by_key = agg["client_forwards_by_key"]
        assert sum(k["keys"] for k in by_key.values()) == agg["keystrokes"]
        assert agg["cancelled"]["suggestions"] <= agg["keystrokes"]
        assert agg["errors"] == {}
        assert len(modes[name]["samples"]["suggest_ms"]) == agg["suggestions_full"]
        parts = {"draft", "network", "verify", "other", "suggestions"}
        assert set(agg["breakdown_ms"]) == set(agg["breakdown_ms_p95_tail"]) == parts
        assert agg["breakdown_ms"]["suggestions"] == agg["suggestions_full"]
        assert 1 <= agg["breakdown_ms_p95_tail"]["suggestions"] <= agg["suggestions_full"]
        # Every key of the measured phase gets one record; each either ends whole, is
        # cancelled, or was still without a whole suggestion when the field closed.
        assert agg["suggestions_full"] + agg["cancelled"]["suggestions"] <= agg["keystrokes"]
    assert modes["cloud-only"]["aggregate"]["breakdown_ms"]["draft"] == 0
    assert modes["cloud-only"]["aggregate"]["acceptance"] is None

    outage = modes[drilled]["outage"]
    assert outage is not None and outage["down_s"] >= 1.0
    phases = outage["phases"]
    assert phases["before"]["keystrokes"] > 0 and phases["down"]["keystrokes"] > 0
    assert phases["after"]["keystrokes"] > 0
    assert outage["client_errors"] == 0 and outage["errors"] == {}
    assert outage["reopens"] > 0, "the verifier was restarted, yet no session was reopened"
    if drilled == "edit":
        # Draft-only suggestions go on, marked; once the verifier is back, all is verified.
        assert outage["suggestions_continued"]
        assert phases["down"]["unverified_suggestions"] > 0
        assert outage["all_verified_after_recovery"]
    else:
        # Today's client shows nothing while the verifier is away: it retries until the
        # next key cancels it (suggestions that were in flight at the kill aside).
        assert phases["down"]["unverified_suggestions"] == 0
    for name in ran:
        if name != drilled:
            assert modes[name]["outage"] is None
    assert report["verifier"]["outage_drill"] == "ran"
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_edge_client_bench_ime_is_the_benchmark(capsys):
    from edge_client.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench-ime", "--help"])
    assert exc.value.code == 0
    assert "usage: edgespec-bench ime" in capsys.readouterr().out


def test_the_settle_time_reaches_every_modes_config_and_is_checked():
    from edge_client.bench.ime.modes import generation_config
    from edge_client.bench.ime.run import ImeConfig

    for mode in ("edit", "reopen", "cloud-only"):
        assert generation_config(mode, 4, True, settle_ms=150).settle_ms == 150
    assert generation_config("edit", 4, True).settle_ms == 0
    # Inside a word: edit sessions wait the product's default, today's clients do not,
    # unless the run sets one value for every mode.
    assert generation_config("edit", 4, True).word_settle_ms == GenerationConfig.word_settle_ms > 0
    for mode in ("reopen", "cloud-only"):
        assert generation_config(mode, 4, True).word_settle_ms == 0
    for mode in ("edit", "reopen", "cloud-only"):
        assert generation_config(mode, 4, True, word_settle_ms=90).word_settle_ms == 90
    for bad in ({"settle_ms": -1}, {"word_settle_ms": -1}):
        with pytest.raises(ValueError, match="settle"):
            ImeConfig(modes=("edit",), **bad)
    # --no-heal and --no-preview reach the edit sessions' config.
    assert generation_config("edit", 4, True).preview and generation_config("edit", 4, True).heal
    off = generation_config("edit", 4, True, heal=False, preview=False)
    assert not off.preview and not off.heal


def test_type_through_counts_exact_and_first_character_matches():
    """Characters are tokens here, and a suggester that always says "bc": after "a" the key
    "b" is an exact match, and so on along "abc"; in "axc" no key matches."""
    from edge_client.bench.ime.type_through import count_type_through

    def encode(s: str) -> list[int]:
        return [ord(c) for c in s]

    def decode(ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def suggest(ids: list[int]) -> list[int]:  # the next two letters of the alphabet
        return [ids[-1] + 1, ids[-1] + 2]

    along = count_type_through(["abcd"], encode, decode, suggest)
    assert (along.keys, along.exact, along.first_char) == (3, 3, 3)
    off = count_type_through(["axc"], encode, decode, suggest)
    assert (off.keys, off.exact, off.first_char) == (2, 0, 0)
    assert off.rates()["exact_rate"] == 0.0


def test_suggestion_hits_count_the_next_character_and_the_whole_word():
    """A suggester that knows the message: every key is a hit both ways; one that always
    says " the": a first-character hit only before a space it predicts, a word hit only
    where the next word is "the"."""
    from edge_client.bench.ime.type_through import count_hits, next_word

    message = "go to the park"
    assert next_word(message, 2) == " to" and next_word(message, 4) == "o"
    assert next_word(message, len(message) - 1) == "k"
    oracle = count_hits([message], lambda text: message[len(text):])
    assert oracle.keys == len(message) - 1 == oracle.first_char
    assert oracle.word == oracle.keys  # every key: the rest of its word, spelled exactly
    the = count_hits([message], lambda text: " the")
    assert the.word == 1  # only after "go to": the next word is " the"
    assert the.first_char == 3  # the keys before a space: "go", "go to", "go to the"
    assert the.rates()["word_rate"] == round(1 / the.keys, 4)


def test_the_tapping_typist_takes_only_suggestions_that_spell_the_word():
    """A suggester that knows the message: one tap a word after the first key (typing
    "go to the park" takes 5 keystrokes); one that always says " the": a tap only after "go to";
    one that never fits: a key a character. Forwards and no-RPC suggestions come from stats."""
    from types import SimpleNamespace

    from edge_client.bench.ime.keystrokes import Tally, type_message

    message = "go to the park"

    def suggester(say, forwards=1, reused=0):
        stats = SimpleNamespace(target_forwards=forwards, reused_tokens=reused)
        return lambda text: SimpleNamespace(text=say(text), stats=stats)

    oracle = Tally()
    type_message(message, suggester(lambda text: message[len(text):]), oracle)
    # "g", then taps: "o", " to", " the", " park"
    assert (oracle.keystrokes, oracle.taps, oracle.chars) == (5, 4, len(message))
    assert oracle.tapped_chars == len(message) - 1
    assert oracle.report()["keystroke_savings"] == round(1 - 5 / len(message), 4)
    the = Tally()
    type_message(message, suggester(lambda text: " the", forwards=0, reused=2), the)
    assert the.taps == 1 and the.keystrokes == len(message) - len(" the") + 1
    assert the.no_rpc == the.suggestions == the.keystrokes - 1 and the.target_forwards == 0
    never = Tally()
    type_message(message, suggester(lambda text: "x"), never)
    assert never.keystrokes == len(message) and never.taps == 0
    assert never.target_forwards == never.suggestions == len(message) - 1


def test_keys_are_told_apart_by_where_they_leave_the_text_and_forwards_split_by_it():
    from edge_client.bench.ime.modes import KeyRecord
    from edge_client.bench.ime.report import forwards_by_kind
    from edge_client.bench.ime.typist import BACKSPACE, Keystroke, key_kind

    kinds = [key_kind(Keystroke(0.0, key, text, 4)) for key, text in
             (("i", "Hi"), (" ", "Hi "), (",", "Hi,"), ("7", "at 7"), (BACKSPACE, "H"))]
    assert kinds == ["word", "space", "punct", "word", "backspace"]
    records = [KeyRecord("edit", "typing", 0, i, 0.0, 4, kind, target_forwards=f)
               for i, (kind, f) in enumerate([("word", 0), ("word", 1), ("space", 3)])]
    assert forwards_by_kind(records) == {"word": {"keys": 2, "forwards_per_key": 0.5},
                                         "space": {"keys": 1, "forwards_per_key": 3.0}}


def test_a_cancelled_edit_suggestion_counts_the_tokens_it_had_shown():
    """The report's ``cancelled.tokens_shown``: a suggestion the next key cancelled had
    streamed its verified (and unverified) tokens, and the edit mode records them, as the
    reopen mode does; it is neither whole nor counted in the latencies."""
    import asyncio
    from types import SimpleNamespace

    from edge_client.bench.ime.modes import EditMode, KeyRecord
    from edge_client.bench.ime.report import aggregate
    from edge_client.document import Suggestion

    class Document:  # the document's answer when the next key came first
        def __init__(self, cancelled: bool) -> None:
            self.cancelled = cancelled

        async def suggest(self, text, max_new_tokens, budget_ms, on_update):
            return Suggestion([5, 6], [7], " t5 t6", " t7", self.cancelled)

    client = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text: [1, 2]))
    mode = EditMode("edit", client, GenerationConfig(), budget_ms=None)
    records = [KeyRecord("edit", "typing", 0, i, 0.0, 4, "space") for i in range(2)]
    for record, cancelled in zip(records, (True, False), strict=True):
        mode.document = Document(cancelled)
        asyncio.run(mode.suggest("t1 t2 ", 4, record))
    cut, whole = records
    assert cut.cancelled and cut.full_ms is None and (cut.tokens, cut.unverified) == (2, 1)
    assert not whole.cancelled and whole.full_ms is not None
    agg = aggregate(records, None)
    assert agg["cancelled"] == {"suggestions": 1, "fraction": 0.5, "target_forwards": 0,
                                "tokens_shown": 3}
    assert agg["suggestions_full"] == 1


def test_the_breakdown_splits_each_whole_suggestion_and_its_tail_is_the_slowest():
    """``breakdown_ms`` is the mean of each whole suggestion's draft, network and verifier
    time and the rest of its latency (``other``); ``breakdown_ms_p95_tail`` the same over
    the suggestions at or above the p95 (here 20 suggestions: the slowest one)."""
    from edge_client.bench.ime.modes import KeyRecord
    from edge_client.bench.ime.report import aggregate

    records = []
    for i in range(20):
        slow = i == 7
        records.append(KeyRecord("edit", "typing", 0, i, 0.0, 4, "space",
                                 full_ms=900.0 if slow else 100.0 + i, draft_ms=10.0,
                                 network_ms=5.0, verify_ms=600.0 if slow else 60.0))
    records.append(KeyRecord("edit", "typing", 0, 20, 0.0, 4, "word", cancelled=True,
                             verify_ms=50.0))  # not whole: in neither
    agg = aggregate(records, None)
    whole = agg["breakdown_ms"]
    assert whole["suggestions"] == 20
    assert whole["verify"] == pytest.approx((19 * 60 + 600) / 20)
    assert whole["other"] == pytest.approx(sum(r.full_ms - 10 - 5 - r.verify_ms
                                               for r in records[:20]) / 20)
    tail = agg["breakdown_ms_p95_tail"]
    assert tail == {"draft": 10.0, "network": 5.0, "verify": 600.0, "other": 285.0,
                    "suggestions": 1}
