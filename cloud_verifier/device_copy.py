"""Host data to the device without a host sync.

``torch.tensor(data, device="cuda")`` copies with ``non_blocking=False``, which waits for every
kernel already queued on the stream: issued in the middle of a forward it stalls the host
until the forward is done, and the batch then costs more than its one sync. So index tensors
built from Python lists go through pinned memory and a non-blocking copy (the caching host
allocator keeps the pinned block until the copy has run). On the CPU it is ``torch.tensor``.
"""

from __future__ import annotations

import torch


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list or a CPU tensor) as a tensor on ``device``, queued, not waited for."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
