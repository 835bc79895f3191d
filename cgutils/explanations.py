"""Capture errors explained: map the text of an error raised during graph capture to a cause and a fix
(:func:`explain`). :mod:`cgutils.diagnose` adds the other half, the syncs found by an eager rerun.

The patterns below match the error texts that PyTorch and the CUDA runtime raise when a captured
region does something a graph cannot hold. CUDA's meaning of each error code is from the CUDA Runtime
API reference, "Graph Management" and "Stream Management" (``cudaStreamBeginCapture``,
``cudaErrorStreamCaptureUnsupported``, ``cudaErrorStreamCaptureInvalidated``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InputError, exception_chain


@dataclass(frozen=True)
class Explanation:
    """Cause and fix for a recognised capture failure.

    Attributes:
        key: short name of the cause: ``sync``, ``invalidated``, ``default_stream``, ``rng``,
            ``capture_merge``, ``captured_event``, ``wrong_thread``, ``unmatched``,
            ``unjoined``, ``host_copy``, ``allocation``.
        cause: what most likely happened, in words.
        fix: what to change.
        pattern: the regular expression that matched the error text.
    """

    key: str
    cause: str
    fix: str
    pattern: str

    def __str__(self) -> str:
        return f"Likely cause: {self.cause}\nFix: {self.fix}"


_SYNC_FIX = ("move the sync out of the captured function: keep values on the GPU (torch.where, "
             "masking instead of boolean indexing, fixed-size outputs), or run that part eagerly "
             "outside the graph. cgutils.diagnose.find_sync_points(fn, *args) lists each sync with "
             "your file and line.")

# (key, pattern, cause, fix); the first match wins, so specific texts come before general ones.
_RULES: list[tuple[str, str, str, str]] = [
    ("default_stream", r"non-default stream|cudaErrorStreamCaptureImplicit|legacy stream",
     "capture was started on the default (legacy) stream, or work was issued on it while another "
     "stream was capturing; the legacy stream synchronises with every other stream, which a graph "
     "cannot record",
     "capture on a side stream: use torch.cuda.graph(g) (it switches to one) or "
     "`with torch.cuda.stream(torch.cuda.Stream()):` around capture_begin/capture_end"),
    ("rng", r"CPU generator|generator.{0,80}(captur|graph|regist)|philox|offset increment|"
            r"register_generator_state|graphsafe|set_current_seed",
     "a random-number generator was used in a way the graph cannot replay (a CPU generator, or a "
     "CUDA generator that was not registered with the graph)",
     "call model.eval() so dropout is off; for intentional randomness use the default CUDA "
     "generator, which torch.cuda.graph registers, or register yours with "
     "graph.register_generator_state(gen)"),
    ("unforked_stream", r"cudaErrorStreamCaptureIsolation|uncaptured work|crosses the capture sequence boundary",
     "the capture stream waited on work from a stream that was not part of the capture: a side stream "
     "used inside capture without being forked from the capture stream first, so joining it back "
     "(wait_stream) would depend on work outside the graph",
     "fork before you use a side stream inside capture: side.wait_stream(torch.cuda.current_stream()), "
     "then launch on it and join back with torch.cuda.current_stream().wait_stream(side)"),
    ("unjoined", r"cudaErrorStreamCaptureUnjoined|unjoined",
     "work forked onto another stream during capture was not joined back",
     "make the capture stream wait on every side stream (stream.wait_stream) before capture ends"),
    # Texts of cudaGetErrorString (CUDA 12/13 runtime) for the three codes below, with their enum names
    ("capture_merge", r"cudaErrorStreamCaptureMerge|merge of two independent capture sequences",
     "a stream that belongs to one capture waited on work of another capture (an event or wait_stream "
     "across two graphs being captured at once, e.g. two threads capturing, or a side stream shared by both)",
     "give each capture its own side streams and events, and do not make one capture wait on another"),
    ("captured_event", r"cudaErrorCapturedEvent|event last recorded in a capturing stream",
     "the host queried or waited on a CUDA event recorded inside the capture (event.query(), "
     "event.synchronize(), elapsed_time): an event in a graph being built has not happened",
     "time and query events outside the captured function: record them around graph.replay() instead"),
    ("wrong_thread", r"cudaErrorStreamCaptureWrongThread|capture sequence from another thread",
     "a capture begun in one thread (thread-local capture mode) was ended or joined from another thread",
     "begin and end each capture in the same thread (GraphRunner does; with torch.cuda.graph keep the whole "
     "`with` block in one thread)"),
    ("unmatched", r"cudaErrorStreamCaptureUnmatched|capture was not initiated in this stream",
     "capture was ended on a stream other than the one it began on (the current stream changed inside the "
     "captured region and was not put back)",
     "use `with torch.cuda.stream(side):` blocks inside the capture, so the current stream is restored"),
    ("sync", r"operation not permitted when stream is capturing|cudaErrorStreamCaptureUnsupported"
             r"|cannot be called during (CUDA graph )?capture|synchroniz\w* .*captur",
     "the captured code made a call that is illegal during capture, most often a CPU-GPU "
     "synchronisation: .item(), .cpu(), .tolist(), print() of a CUDA tensor, torch.nonzero, "
     "boolean-mask indexing, a Python `if` on a CUDA tensor, or torch.cuda.synchronize()", _SYNC_FIX),
    ("invalidated", r"capture.*invalidated|cudaErrorStreamCaptureInvalidated|previous error during capture",
     "an earlier illegal call invalidated the capture, and the error you see is a consequence, not "
     "the first failure. Usually a CPU-GPU sync; without warm-up it is often one-time setup instead "
     "(cuBLAS handle or workspace creation, cuDNN autotuning with cudnn.benchmark)",
     "warm up with the real shapes before capture (GraphRunner and capture_graph do); then " + _SYNC_FIX),
    ("host_copy", r"pin_memory|pinned|cudaHostAlloc|cudaMemcpy.*Host",
     "a host-device copy happened inside the captured region",
     "copy inputs into static buffers before replay, and read outputs after it"),
    ("allocation", r"out of memory|cudaErrorMemoryAllocation",
     "the GPU ran out of memory during warm-up or capture (each graph keeps its memory pool alive)",
     "share one memory pool between graphs (GraphRunner does), capture fewer shapes (buckets), "
     "or free other graphs first"),
]


def explain(exc: BaseException | str) -> Explanation | None:
    """Map a capture-time error (or its text) to a cause and a fix.

    Args:
        exc: the exception raised during capture, or its message.

    Returns:
        The first matching :class:`Explanation`, or ``None`` when the text matches no known pattern.

    Raises:
        InputError: ``exc`` is neither an exception nor a string.
    """
    if not isinstance(exc, (BaseException, str)):
        raise InputError(f"explain takes an exception or its message, got {type(exc).__name__}")
    # the first failure is often further down the chain
    text = exc if isinstance(exc, str) else "\n".join(str(e) for e in exception_chain(exc, limit=11))
    for key, pattern, cause, fix in _RULES:
        if re.search(pattern, text, flags=re.IGNORECASE):
            return Explanation(key, cause, fix, pattern)
    return None
