"""Capture diagnostics: turn a CUDA error raised during graph capture into a cause and a fix.

The patterns below match the error texts that PyTorch and the CUDA runtime raise when a captured
region does something a graph cannot hold. CUDA's meaning of each error code is from the CUDA Runtime
API reference, "Graph Management" and "Stream Management" (``cudaStreamBeginCapture``,
``cudaErrorStreamCaptureUnsupported``, ``cudaErrorStreamCaptureInvalidated``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Explanation:
    """Cause and fix for a recognised capture failure.

    Attributes:
        cause: what most likely happened, in words.
        fix: what to change.
        pattern: the regular expression that matched the error text.
    """

    cause: str
    fix: str
    pattern: str

    def __str__(self) -> str:
        return f"Likely cause: {self.cause}\nFix: {self.fix}"


_SYNC_FIX = ("move the sync out of the captured function: keep values on the GPU (torch.where, "
             "masking instead of boolean indexing, fixed-size outputs), or run that part eagerly "
             "outside the graph. To find the syncs in your code, run it once eagerly under "
             "torch.cuda.set_sync_debug_mode('error'): each sync then raises at its own line.")

_RULES: list[tuple[str, str, str]] = [
    (r"operation not permitted when stream is capturing|cudaErrorStreamCaptureUnsupported",
     "the captured code made a call that is illegal during capture, most often a CPU-GPU "
     "synchronisation: .item(), .cpu(), .tolist(), print() of a CUDA tensor, torch.nonzero, "
     "boolean-mask indexing, or torch.cuda.synchronize()", _SYNC_FIX),
    (r"capture.*invalidated|cudaErrorStreamCaptureInvalidated",
     "an earlier illegal call (usually a sync) invalidated the capture; the error you see is "
     "a consequence, not the first failure", _SYNC_FIX),
    (r"cudaErrorStreamCaptureImplicit|legacy stream|default stream",
     "work was issued on the legacy default stream while another stream was capturing",
     "capture on a side stream (torch.cuda.graph does this) and do not use the default stream or "
     "cudaDeviceSynchronize-style calls inside the captured region"),
    (r"[Gg]enerator|philox|seed",
     "a random-number generator was used in a way the graph cannot replay (a CPU generator, or a "
     "generator not registered with the graph)",
     "call model.eval() so dropout is off; for intentional randomness use the default CUDA "
     "generator, which torch.cuda.graph registers, not a custom or CPU torch.Generator"),
    (r"cudaErrorStreamCaptureUnjoined|unjoined",
     "work forked onto another stream during capture was not joined back",
     "make the capture stream wait on every side stream (stream.wait_stream) before capture ends"),
    (r"pin_memory|pinned|non_blocking|cudaHostAlloc|cudaMemcpy.*Host|to\(.*cpu",
     "a host-device copy happened inside the captured region",
     "copy inputs into static buffers before replay, and read outputs after it"),
]


def explain(exc: BaseException | str) -> Explanation | None:
    """Map a capture-time error (or its text) to a cause and a fix.

    Args:
        exc: the exception raised during capture, or its message.

    Returns:
        The first matching :class:`Explanation`, or ``None`` when the text matches no known pattern.
    """
    text = str(exc)
    seen = 0
    while isinstance(exc, BaseException) and seen < 10:  # the first failure is often in the chain
        exc = exc.__cause__ or exc.__context__
        if exc is not None:
            text += "\n" + str(exc)
        seen += 1
    for pattern, cause, fix in _RULES:
        if re.search(pattern, text, flags=re.IGNORECASE):
            return Explanation(cause, fix, pattern)
    return None
