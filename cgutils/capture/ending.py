"""Ending a capture that an error interrupted, so that nothing is left capturing or routed to a pool."""

from __future__ import annotations

import warnings
from typing import Any

import torch


def end_abandoned_capture(graph: torch.cuda.CUDAGraph, capture_stream: torch.cuda.Stream, pool: Any, *,
                          capture_ended: bool = False) -> None:
    """End ``graph``'s capture after an error, stop the allocator routing to the memory pool ``pool`` (the
    handle the capture began with), and drop the capture's reference to ``pool`` if the graph never will.

    ``CUDAGraph::capture_end`` calls ``cudaStreamEndCapture`` first and raises when it fails, as it does for
    an invalidated capture, before it tells the caching allocators that the capture is over
    (aten/src/ATen/cuda/CUDAGraph.cpp, torch 2.11). The device allocator's recording is ended here, as
    ``torch.cuda.memory``'s ``use_mem_pool`` ends its own. The pinned-host allocator's cannot be (no Python
    binding in torch 2.11), and it refuses every later capture into ``pool`` with "beginAllocateToPool:
    already recording to mempool_id" (measured on the H200): after a failed capture, capture into a new pool.

    The capture's begin took a reference to ``pool``. A graph whose ``capture_end`` succeeded drops it when
    destroyed; one whose ``capture_end`` failed never does, so it is dropped here: a pool made for this
    capture returns its blocks once their tensors are freed, and a shared pool is not kept alive for ever.
    (Dropping it after a successful ``capture_end`` as well released the pool twice: an abort, H200.)

    Args:
        capture_ended: ``capture_end`` already ran and succeeded (``torch.cuda.graph``'s exit calls it even
            when the captured code raised); a second call would fail and look like a failed capture.
    """
    ended = capture_ended
    if not ended:
        with torch.cuda.stream(capture_stream), warnings.catch_warnings():
            # an abandoned capture is thrown away: whether it recorded any work says nothing to the user
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            try:
                graph.capture_end()
                ended = True
            except RuntimeError:
                pass  # an invalidated capture ends with an error; ended is what matters
    # capture_end can also raise after it marked the capture ended (its instantiate failing): the graph then
    # holds the pool's reference and drops it when destroyed, and a release here would be a second one
    ended = ended or _holds_pool(graph)
    device = capture_stream.device.index
    try:
        torch._C._cuda_endAllocateToPool(device, tuple(pool))
    except RuntimeError:
        pass  # capture_end got that far itself: nothing is recording any more
    if not ended:
        try:
            torch._C._cuda_releasePool(device, tuple(pool))
        except RuntimeError:
            pass


def _holds_pool(graph: torch.cuda.CUDAGraph) -> bool:
    """Whether ``graph``'s capture ended (``CUDAGraph::pool()`` raises until it has): it then releases its pool
    reference itself when destroyed (``CUDAGraph::reset``, aten/src/ATen/cuda/CUDAGraph.cpp)."""
    try:
        graph.pool()
    except RuntimeError:
        return False
    return True


def end_failed_begin(device: int, pool: Any) -> None:
    """After ``capture_begin`` raised: stop any routing of allocations to ``pool`` it had set up. Its reference to
    the pool is not dropped: whether it took one is unknown, and a pool kept alive is only memory, while a
    release too many corrupts the allocator's count (every later capture into the pool asserts)."""
    try:
        torch._C._cuda_endAllocateToPool(device, tuple(pool))
    except RuntimeError:
        pass  # nothing was routed
