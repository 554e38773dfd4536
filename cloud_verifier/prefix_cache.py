"""Prefix caching: closed sessions' KV caches, kept so that new sessions skip recomputing them.

An IME client opens a new session for every completion over text that has only grown since
the last one, and a chat client re-sends the whole conversation each turn; both prompts
start with tokens the verifier has just computed keys and values for. When a session closes,
its KV buffer (covering ``committed[:kv.length]``) is kept here instead of being freed. A new
session whose prompt shares a prefix with a kept buffer gets a fresh buffer with that prefix's
keys and values copied in and ``kv.length`` set to the prefix length, so its first forward
feeds only the rest of the prompt (the engine always feeds ``committed[kv.length:]``).

Rules:

- **Per owner.** A session only ever reuses what sessions opened with its own credentials
  computed: another tenant's text cannot leak, not even through timing.
- **Copy, not move.** Kept buffers are never written to; a new session copies the prefix
  (``length x bytes_per_token``, a memory copy: far cheaper than the forward that would
  recompute those keys and values), so any number of
  sessions can start from one kept prompt, such as a shared system prompt.
- **The last prompt token is always fed**, since its logits start the first round: at most
  ``len(prompt) - 1`` tokens are reused.
- **Memory.** Kept buffers count against the KV budget like sessions' buffers. The cache
  holds at most ``max_bytes``, drops its least recently used buffers first, drops them before
  any session is evicted or preempted under KV pressure (``free``), and after ``ttl_s``.
  Evicted sessions (which close to free memory) are not kept.

Reuse changes no output: keys and values are a function of the tokens and their positions,
so a copied prefix holds what a recomputation would (up to float rounding of a different
forward shape, the same as between any two batchings of one session).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cloud_verifier import torch_thread
from cloud_verifier.kv_store import KVBudgetExceeded, KVStore, SessionKV


@dataclass
class _Entry:
    owner: str
    tokens: np.ndarray  # the kv.length tokens the buffer holds keys and values for
    kv: SessionKV
    last_used: float


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    def __init__(self, store: KVStore, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.store = store
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._keys = itertools.count()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, owner: str, committed: list[int], kv: SessionKV) -> None:
        """Takes over a closing session's buffer (``committed[:kv.length]`` cached), or frees
        it when it holds nothing or cannot fit in ``max_bytes``."""
        if kv.length == 0 or kv.nbytes > self.max_bytes or self.max_bytes == 0:
            self.store.release(kv)
            return
        tokens = np.asarray(committed[:kv.length], dtype=np.int64)
        # A kept prefix of these tokens is now redundant.
        for key, entry in list(self._entries.items()):
            if entry.owner == owner and len(entry.tokens) <= len(tokens) \
                    and common_prefix_len(entry.tokens, tokens) == len(entry.tokens):
                self._drop(key)
        self._entries[next(self._keys)] = _Entry(owner, tokens, kv, self._clock())
        self.nbytes += kv.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def restore(self, owner: str, prompt: list[int]) -> SessionKV | None:
        """A new buffer for ``prompt`` holding the longest prefix of it (at most
        ``len(prompt) - 1`` tokens) that one of ``owner``'s kept buffers covers, or None when
        none covers any, or the buffer does not fit the KV budget right now."""
        self.expire()
        wanted = np.asarray(prompt[:-1], dtype=np.int64)
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            if entry.owner == owner:
                n = common_prefix_len(entry.tokens, wanted)
                if n > best_len:
                    best_key, best_len = key, n
        if best_key is None:
            return None
        source = self._entries[best_key]
        needed = self.store.growth_bytes(None, len(prompt))
        self.free(lambda: self.store.fits(needed), spare=best_key)
        try:
            kv = self.store.ensure(None, len(prompt))
        except KVBudgetExceeded:
            return None
        # On the torch thread, before the session's first forward (torch_thread docstring).
        torch_thread.submit(kv.buffer[:, :, :, :best_len].copy_,
                            source.kv.buffer[:, :, :, :best_len])
        kv.length = best_len
        source.last_used = self._clock()
        self._entries.move_to_end(best_key)
        return kv

    def free(self, enough: Callable[[], bool], spare: int | None = None) -> int:
        """Drops least recently used buffers (but not the one keyed ``spare``) until
        ``enough()``; returns how many."""
        dropped = 0
        for key in list(self._entries):
            if enough():
                break
            if key != spare:
                self._drop(key)
                dropped += 1
        return dropped

    def expire(self) -> int:
        """Drops buffers unused for ``ttl_s``; returns how many."""
        now = self._clock()
        stale = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
        for key in stale:
            self._drop(key)
        return len(stale)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.kv.nbytes
        self.store.release(entry.kv)
