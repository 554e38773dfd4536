"""Per-session KV memory for the target, bounded by a byte budget.

Each session owns one contiguous buffer ``[2 (k/v), layers, kv_heads, capacity, head_dim]``
and a ``length``: positions ``[0, length)`` hold the keys and values of committed tokens.
A round writes new positions past ``length`` and then sets ``length`` to what was committed,
so rolling back rejected drafts moves no data (positions past ``length`` are never read and
get overwritten). Capacity grows by doubling, so appends are amortised O(1) per token.

Buffers are allocated from the torch thread (a round's room) and from the event
loop (prefix-cache restores), and freed from the event loop: the byte count and the budget
check that guards it change under one lock, so the budget holds whichever thread allocates.
"""

from __future__ import annotations

import threading

import torch

from cloud_verifier import torch_thread


class KVBudgetExceeded(Exception):
    """Raised when a buffer cannot grow without passing the byte budget."""


class SessionKV:
    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # [2, layers, kv_heads, capacity, head_dim]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.buffer.shape[3]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def keys(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]  # [kv_heads, capacity, head_dim]

    def values(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def crop(self, n: int) -> None:
        """Keeps positions [0, n): the rollback after an edit of the committed text. Moves no
        data; positions past ``length`` are never read and get overwritten."""
        if n < 0:
            raise ValueError(f"crop length {n} < 0")
        self.length = min(self.length, n)


class KVStore:
    MIN_CAPACITY = 64

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int | None, max_context: int) -> None:
        self.shape = (2, num_layers, kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.budget_bytes = budget_bytes
        self.max_context = max_context
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * (
            torch.finfo(dtype).bits // 8)
        self.bytes_in_use = 0
        self._lock = threading.Lock()

    def _capacity_for(self, kv: SessionKV | None, length: int) -> int:
        """Double (amortised appends), unless only the exact length fits the budget."""
        held = kv.nbytes if kv is not None else 0
        capacity = max(self.MIN_CAPACITY, kv.capacity * 2 if kv is not None else 0, length)
        capacity = min(capacity, self.max_context)
        if not self.fits(capacity * self.bytes_per_token - held):
            capacity = length
        return capacity

    def growth_bytes(self, kv: SessionKV | None, length: int) -> int:
        """Bytes ``ensure(kv, length)`` would add."""
        if kv is not None and kv.capacity >= length:
            return 0
        return (self._capacity_for(kv, length) * self.bytes_per_token
                - (kv.nbytes if kv is not None else 0))

    def fits(self, extra: int) -> bool:
        return self.budget_bytes is None or self.bytes_in_use + extra <= self.budget_bytes

    def ensure(self, kv: SessionKV | None, length: int) -> SessionKV:
        """A buffer with room for ``length`` positions, growing (and copying) if needed."""
        if kv is not None and kv.capacity >= length:
            return kv
        with self._lock:
            capacity = self._capacity_for(kv, length)
            extra = self.growth_bytes(kv, length)
            if not self.fits(extra):
                raise KVBudgetExceeded(
                    f"KV cache budget of {self.budget_bytes} bytes is in use "
                    f"({self.bytes_in_use} bytes); {extra} more are needed")
            self.bytes_in_use += extra
        two, layers, heads, head_dim = self.shape
        try:
            buffer = torch.empty((two, layers, heads, capacity, head_dim), dtype=self.dtype,
                                 device=self.device)
        except BaseException:
            with self._lock:
                self.bytes_in_use -= extra
            raise
        if kv is None:
            grown = SessionKV(buffer)
        else:
            # On the torch thread, and waited for: a prefix-cache restore may still have its
            # copy into ``kv`` queued there, and this copy must read what that one wrote
            # (torch_thread runs work in submission order); the caller may use the buffer
            # as soon as this returns. From the event loop this waits for a forward in
            # progress, which only happens when a round must grow under a KV budget.
            torch_thread.run(buffer[:, :, :, :kv.length].copy_, kv.buffer[:, :, :, :kv.length])
            grown = SessionKV(buffer)
            grown.length = kv.length
        return grown

    def release(self, kv: SessionKV | None) -> None:
        if kv is not None:
            with self._lock:
                self.bytes_in_use -= kv.nbytes
            kv.buffer = kv.buffer[:, :, :, :0]
            kv.length = 0
