"""Which memory pool the capture running in this thread records into.

A conditional node's body is captured on a stream of its own, which the capture's allocator routing does
not cover; :mod:`.control` routes that stream to the same pool and needs to know which pool that is.
torch 2.11 cannot say during capture (``CUDAGraph.pool()`` raises until ``capture_end``), so
:func:`~cgutils.capture.graph.capture_graph` and piecewise capture announce it here. Kept apart from
:mod:`.control` so that every capture depends only on this small module. It also keeps
:func:`fresh_cublas_workspaces`, which every capture calls so that cuBLAS's workspace lives in that capture's pool.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

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


def fresh_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces, so that the next capture allocates its own, in its own memory pool.

    cuBLAS keeps one workspace per (handle, stream), made on first use. One made during a capture comes from
    that capture's pool and outlives the graph; a later capture on the same stream (``torch.cuda.graph``'s
    capture stream is shared) reuses it and bakes its address in. When ``torch.compile(mode="reduce-overhead")``
    then clears the workspaces (``clear_cublas_manager`` in torch/_inductor/cudagraph_trees.py) and the first
    graph's pool is gone, that memory is returned to CUDA and the later graph's next replay fails with "an
    illegal memory access" (BERT-base fp16, H200, torch 2.11: docs/pytorch-cublas-workspace-fault.md). Called
    before and after every cgutils capture, as CUDA graph trees do around theirs: each graph's workspace then
    lives in its own pool, for as long as the graph."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
