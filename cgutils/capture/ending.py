"""Ending a capture that an error interrupted, so that nothing is left capturing or routed to a pool."""

from __future__ import annotations

from typing import Any

import torch


def end_abandoned_capture(graph: torch.cuda.CUDAGraph, capture_stream: torch.cuda.Stream, pool: Any,
                          release: bool = False) -> None:
    """End ``graph``'s capture after an error, and stop the allocator routing to the memory pool ``pool``
    (the handle the capture began with).

    ``CUDAGraph::capture_end`` calls ``cudaStreamEndCapture`` first and raises when it fails, as it does for
    an invalidated capture, before it tells the caching allocators that the capture is over
    (aten/src/ATen/cuda/CUDAGraph.cpp, torch 2.11). The device allocator's recording is ended here, as
    ``torch.cuda.memory``'s ``use_mem_pool`` ends its own. The pinned-host allocator's cannot be (no Python
    binding in torch 2.11), and it refuses every later capture into ``pool`` with "beginAllocateToPool:
    already recording to mempool_id" (measured on the H200): after a failed capture, capture into a new pool.

    Args:
        release: also drop the capture's reference to ``pool`` (for a pool made for this capture alone),
            so its blocks return to the allocator once their tensors are freed.
    """
    with torch.cuda.stream(capture_stream):
        try:
            graph.capture_end()
        except RuntimeError:
            pass  # an invalidated capture ends with an error; ended is what matters
    device = capture_stream.device.index
    try:
        torch._C._cuda_endAllocateToPool(device, tuple(pool))
    except RuntimeError:
        pass  # capture_end got that far itself: nothing is recording any more
    if release:
        try:
            torch._C._cuda_releasePool(device, tuple(pool))
        except RuntimeError:
            pass
