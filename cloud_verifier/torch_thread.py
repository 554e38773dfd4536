"""One thread for all of the verifier's tensor work.

torch's CPU kernels run on an OpenMP team owned by the thread that calls them. Once a second
thread has run parallel torch work, both threads' forwards get much slower: the two OpenMP
teams compete for the same cores (it shows whichever thread loads the model and whichever
runs the forwards). ``asyncio.to_thread``, which the batcher used, also spreads calls over a
pool of threads.

So the model is loaded, packed and run on this one thread, and so are the copies the event
loop asks for (a prefix-cache restore copied on the event loop thread slows every session
down): ``run`` calls a function on it and waits, ``call`` awaits it from an event
loop, ``submit`` queues it. Work here runs in submission order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_NAME = "edgespec-torch"
_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_NAME)


def on_torch_thread() -> bool:
    return threading.current_thread().name.startswith(_NAME)


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the torch thread (directly when already on it)."""
    if on_torch_thread():
        return fn(*args, **kwargs)
    return _EXECUTOR.submit(fn, *args, **kwargs).result()


def submit(fn: Callable[..., object], *args) -> None:
    """Queues ``fn(*args)`` on the torch thread without waiting (directly when already on
    it). Work submitted later, such as a forward, runs after it."""
    if on_torch_thread():
        fn(*args)
    else:
        _EXECUTOR.submit(fn, *args)


async def call(fn: Callable[..., T], *args) -> T:
    """Awaits ``fn(*args)`` run on the torch thread, without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)
