"""Which memory pool the capture running in this thread records into.

A conditional node's body is captured on a stream of its own, which the capture's allocator routing does
not cover; :mod:`.control` routes that stream to the same pool and needs to know which pool that is.
torch 2.11 cannot say during capture (``CUDAGraph.pool()`` raises until ``capture_end``), so
:func:`~cgutils.capture.graph.capture_graph` and piecewise capture announce it here. Kept apart from
:mod:`.control` so that every capture depends only on this small module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_local = threading.local()


@contextlib.contextmanager
def capture_pool(pool: Any) -> Iterator[None]:
    """Announce, for the code run inside, the memory pool (a pair from ``torch.cuda.graph_pool_handle()``)
    that the capture in this thread records into."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(tuple(pool))
    try:
        yield
    finally:
        stack.pop()


def current_pool() -> tuple[int, int] | None:
    """The innermost announced pool of this thread, or ``None``."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None
