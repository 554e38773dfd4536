"""Timing work on the device that runs it, without adding a host sync.

CUDA kernels run asynchronously: ``time.perf_counter`` around a forward measures how long the
host took to queue it, not how long it ran. On CUDA, ``ForwardTimer`` records events on the
current stream around the work and reads their elapsed time once the caller has synchronized
anyway (the verifier reads its decisions right after the forward, which waits for the
stream); ``elapsed_ns`` synchronizes on the end event itself only if the caller has not. On
the CPU it is ``perf_counter_ns``, since CPU ops run synchronously.
"""

from __future__ import annotations

import time

import torch


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._stop = torch.cuda.Event(enable_timing=True)
        self._t0 = self._t1 = 0

    def start(self) -> None:
        if self._cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter_ns()

    def stop(self) -> None:
        if self._cuda:
            self._stop.record()
        else:
            self._t1 = time.perf_counter_ns()

    def elapsed_ns(self) -> int:
        """Nanoseconds from ``start`` to ``stop`` on the device."""
        if self._cuda:
            self._stop.synchronize()  # returns at once when the stream has passed it
            return int(self._start.elapsed_time(self._stop) * 1e6)
        return self._t1 - self._t0
