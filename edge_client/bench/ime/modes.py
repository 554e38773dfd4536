"""The three ways an IME can get its suggestions, behind one small interface, and the record
each keystroke leaves.

- ``edit``: one edit session per text field (``AsyncEdgeClient.document``). Every keystroke
  is an edit of the same session: the verifier and the draft keep their caches up to the
  first changed token, and a new suggestion cancels the one in flight.
- ``reopen``: what an IME does today: a new session per keystroke
  (``AsyncEdgeClient.generate`` on Verify rounds) over the field's whole text, relying on the
  verifier's prefix cache; the keystroke cancels the generation in flight.
- ``cloud-only``: the same, but the target decodes every token (protocol ``cloud``, the
  Generate stream): no draft on the device.

Each mode runs the product's client (``edge_client.client``) over the run's emulated network;
it adds no protocol logic of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from edge_client.bench.fleet.device import failure_name
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.errors import EdgeError
from edge_client.typing_pace import TypingPace

log = logging.getLogger(__name__)

MODES = ("edit", "reopen", "cloud-only")
_PROTOCOL = {"reopen": "rounds", "cloud-only": "cloud", "edit": "rounds"}


def edit_sessions_available() -> bool:
    """Whether this client has the edit-session API (``AsyncEdgeClient.document``)."""
    return callable(getattr(AsyncEdgeClient, "document", None))


@dataclass
class KeyRecord:
    """What one keystroke's suggestion did. Times are milliseconds after the key press, as
    the device has the tokens (after the emulated network)."""

    mode: str
    phase: str  # "typing" (the measured run), or the outage drill's "before" / "down" / "after"
    field: int  # index of the field in its phase
    key: int  # index of the key in its field
    at: float  # time.perf_counter() of the key press
    max_new_tokens: int
    kind: str = ""  # where the key left the text (typist.key_kind)
    context_tokens: int = 0
    first_ms: float | None = None  # first suggested token (verified or not) shown
    # The draft's preview shown while the suggestion waits for the typing (edit sessions;
    # not counted in first_ms: nothing of it is verified, and it is shown with no RPC).
    preview_ms: float | None = None
    full_ms: float | None = None  # the whole suggestion shown
    tokens: int = 0  # verified tokens shown
    unverified: int = 0  # unverified (draft-only) tokens shown
    cancelled: bool = False  # the next key (or the end of the field) came first
    error: str | None = None  # the status of a failure raised to the IME
    error_message: str | None = None
    target_forwards: int = 0  # as the client saw them
    fed_tokens: int | None = None  # tokens the target's forwards computed (edit sessions)
    kept_tokens: int | None = None  # committed tokens the edit kept (edit sessions)
    reused_tokens: int = 0  # verified tokens of the last suggestion the key kept (type-through)
    replaced_tokens: int = 0  # earlier unverified tokens the verifier replaced (edit sessions)
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    network_ms: float = 0.0
    verify_ms: float = 0.0  # the verifier's own queue + forward time
    retried: dict[str, int] = field(default_factory=dict)  # attempts lost and retried
    reopens: int = 0  # sessions the client reopened after a lost attempt


class Mode:
    """One IME strategy over one client. The runner calls ``open_field`` when a text field
    is opened, ``suggest`` after every key (as a task), ``supersede`` when a key arrives
    while the last suggestion still runs, and ``close_field`` when the message is sent."""

    name: str

    def __init__(self, name: str, client: AsyncEdgeClient, config: GenerationConfig) -> None:
        self.name = name
        self.client = client
        self.config = config
        self.pace = TypingPace(config.word_settle_ms)

    async def open_field(self) -> None:
        # As a document learns its typist's pace inside words afresh per text field.
        self.pace = TypingPace(self.config.word_settle_ms)

    async def suggest(self, text: str, max_new_tokens: int, record: KeyRecord) -> None:
        raise NotImplementedError

    def supersede(self, task: asyncio.Task, record: KeyRecord, final: bool = False) -> None:
        """A key came while ``task`` (``record``'s suggestion) runs; ``final``: the field
        is being closed, so no next suggestion will replace it."""
        raise NotImplementedError

    async def close_field(self) -> None:
        pass

    async def close(self) -> None:
        await self.client.close()


def _failed(record: KeyRecord, err: EdgeError) -> None:
    record.error, record.error_message = failure_name(err), str(err)
    log.warning("%s: a suggestion failed: %s: %s", record.mode, type(err).__name__, err)


def _room(client: AsyncEdgeClient, context: int, wanted: int) -> int:
    return max(0, min(wanted, client.info.max_context - context - 1))


class ReopenMode(Mode):
    """A new generation per keystroke (``reopen``, and ``cloud-only`` on protocol cloud)."""

    async def suggest(self, text: str, max_new_tokens: int, record: KeyRecord) -> None:
        client = self.client
        ids = client.tokenizer.encode(text)
        record.context_tokens = len(ids)
        n = _room(client, len(ids), max_new_tokens)
        if not ids or n == 0:
            return
        # A document's rule (settle_ms, and the typist's pace inside a word); the key
        # cancels the wait.
        wait = max(self.config.settle_ms, self.pace.key(text, time.perf_counter()))
        if wait:
            await asyncio.sleep(wait / 1000)
        config = replace(self.config, max_new_tokens=n)
        stops = set(config.stop_token_ids or client.info.eos_token_ids)
        generation = client.generate(ids, config, chat=False)
        try:
            async for chunk in generation:
                ms = (time.perf_counter() - record.at) * 1000
                if chunk and record.first_ms is None:
                    record.first_ms = ms
                record.tokens = len(generation.token_ids)
                # The generation ends its stream after its last token (a half-close and
                # the server's end): the suggestion is whole before that.
                if record.full_ms is None and (record.tokens >= n or (
                        generation.token_ids and generation.token_ids[-1] in stops)):
                    record.full_ms = ms
        except EdgeError as err:
            _failed(record, err)
        finally:
            s = generation.stats
            record.target_forwards = s.target_forwards
            record.drafted, record.accepted = s.drafted, s.accepted
            record.draft_ms = s.draft_s * 1000
            record.verify_ms = s.verify_s * 1000
            record.network_ms = max(0.0, s.wait_s - s.verify_s) * 1000
            record.retried = dict(s.lost_attempts)
            record.reopens = s.reopens

    def supersede(self, task: asyncio.Task, record: KeyRecord, final: bool = False) -> None:
        if record.full_ms is None:
            record.cancelled = True
        task.cancel()  # closes the stream, and so the server's session, at once


class EditMode(Mode):
    """One edit session per field (``AsyncEdgeClient.document``): a new ``suggest`` cancels
    the one in flight by itself, on both sides."""

    def __init__(self, name: str, client: AsyncEdgeClient, config: GenerationConfig,
                 budget_ms: float | None) -> None:
        super().__init__(name, client, config)
        self.budget_ms = budget_ms
        self.document = None

    async def open_field(self) -> None:
        self.document = self.client.document(self.config)
        await self.document.__aenter__()

    async def suggest(self, text: str, max_new_tokens: int, record: KeyRecord) -> None:
        ids = self.client.tokenizer.encode(text)
        record.context_tokens = len(ids)
        if not ids:  # a backspace emptied the field: nothing to continue
            return
        def shown(partial) -> None:  # the document streams its tokens as they come
            if partial.preview:
                if record.preview_ms is None:
                    record.preview_ms = (time.perf_counter() - record.at) * 1000
            elif record.first_ms is None and (partial.token_ids or partial.unverified_ids):
                record.first_ms = (time.perf_counter() - record.at) * 1000

        try:
            s = await self.document.suggest(text, max_new_tokens=max_new_tokens,
                                            budget_ms=self.budget_ms, on_update=shown)
        except EdgeError as err:
            _failed(record, err)
            return
        ms = (time.perf_counter() - record.at) * 1000
        st = s.stats
        record.target_forwards = st.target_forwards
        record.fed_tokens = st.fed_tokens
        record.kept_tokens = st.kept_tokens
        record.reused_tokens = st.reused_tokens
        record.replaced_tokens = st.replaced_tokens
        record.reopens = st.reopens
        record.drafted, record.accepted = st.drafted, st.accepted
        record.draft_ms, record.network_ms, record.verify_ms = (st.draft_ms, st.network_ms,
                                                                st.verify_ms)
        # A cancelled suggestion still had the tokens it streamed (report: tokens_shown).
        record.tokens, record.unverified = len(s.token_ids), len(s.unverified_ids)
        if s.cancelled:
            record.cancelled = True
            return
        if record.tokens or record.unverified:
            record.full_ms = ms
            if record.first_ms is None:
                record.first_ms = ms

    def supersede(self, task: asyncio.Task, record: KeyRecord, final: bool = False) -> None:
        # The next suggest() cancels this one by itself, and its Suggestion says so.
        if final:
            self.document.cancel()

    async def close_field(self) -> None:
        document, self.document = self.document, None
        if document is not None:
            document.cancel()
            await document.__aexit__(None, None, None)


def generation_config(mode: str, draft_len: int, fallback: bool,
                      follow_suggested_k: bool = True, settle_ms: float = 0.0,
                      word_settle_ms: float | None = None,
                      heal: bool = True, preview: bool = True) -> GenerationConfig:
    """Greedy suggestions (an IME shows the target's most likely continuation). Edit
    sessions fall back to the draft alone when the verifier is away, if asked to, and
    follow the verifier's suggested K unless told not to (then they draft K every round,
    as the other modes do). Every mode waits ``settle_ms`` after a key before asking, and
    after a key inside a word as a document does (edge_client.typing_pace, from
    ``word_settle_ms``; None: edit sessions the product's default,
    GenerationConfig.word_settle_ms; the others, today's clients, none)."""
    if word_settle_ms is None:
        word_settle_ms = GenerationConfig.word_settle_ms if mode == "edit" else 0.0
    config = GenerationConfig(max_new_tokens=12, draft_len=draft_len,
                              follow_suggested_draft_len=None if follow_suggested_k else False,
                              settle_ms=settle_ms, word_settle_ms=word_settle_ms, heal=heal,
                              preview=preview)
    if mode == "edit" and fallback:
        config = replace(config, fallback="draft-only")
    return config


def make_mode(name: str, address: str, draft_dir, link, retry, draft_len: int,
              fallback: bool, budget_ms: float | None,
              intra_op_threads: int | None, follow_suggested_k: bool = True,
              settle_ms: float = 0.0, word_settle_ms: float | None = None,
              heal: bool = True, preview: bool = True) -> Mode:
    config = generation_config(name, draft_len, fallback, follow_suggested_k, settle_ms,
                               word_settle_ms, heal, preview)
    # The client's fallback too: a typist whose verifier is down at the start still gets
    # (unverified) suggestions.
    client = AsyncEdgeClient(address, draft_dir, protocol=_PROTOCOL[name], link=link,
                             retry=retry, intra_op_threads=intra_op_threads,
                             fallback=config.fallback)
    if name == "edit":
        return EditMode(name, client, config, budget_ms)
    return ReopenMode(name, client, config)
