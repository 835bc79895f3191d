"""The cgutils exception tree.

Every error cgutils raises on purpose derives from :class:`CgutilsError`, so a caller can catch the
whole family in one ``except``. Each message says what happened, the likely cause and the fix.
"""

from __future__ import annotations


class CgutilsError(Exception):
    """Root of every error raised by cgutils."""


class InputError(CgutilsError, ValueError):
    """An argument given to a cgutils object cannot be used (wrong device, dtype, rank, or value)."""


class CaptureError(CgutilsError, RuntimeError):
    """CUDA graph capture failed, or the replayed graph disagrees with eager execution.

    Attributes:
        original: the exception raised during capture, if any.
        explanation: cause and fix in words.
        max_rel_error: for a validation failure, the largest relative error found (else ``None``).
        sync_points: for a failed capture, the CPU-GPU syncs found by running the function eagerly
            (a ``pandas.DataFrame`` from :func:`cgutils.diagnose.find_sync_points`), else ``None``.
        cause: a short key for the diagnosed cause, e.g. ``"sync"``, ``"stale_input"``,
            ``"overwritten_output"``, ``"baked_value"`` (empty when unknown).
    """

    def __init__(self, message: str, *, original: BaseException | None = None,
                 explanation: str = "", max_rel_error: float | None = None,
                 sync_points=None, cause: str = ""):
        super().__init__(message)
        self.original = original
        self.explanation = explanation
        self.max_rel_error = max_rel_error
        self.sync_points = sync_points
        self.cause = cause


class RecordingError(CgutilsError):
    """A recording in ``results/`` is missing or unreadable."""


class RecordedCellError(CgutilsError):
    """Recorded mode: a ``%%recorded --raises`` cell failed on the GPU; the message is the recorded error."""


class StaleRecordingError(RecordingError):
    """A notebook cell changed since its outputs were recorded on a GPU: re-record with ``make record``."""


class DependencyError(CgutilsError, ImportError):
    """An optional package that this feature needs is not installed: the message names it and how to install it."""


class NoCudaError(CgutilsError, RuntimeError):
    """The operation needs a CUDA device and none is visible."""


class TraceFormatError(CgutilsError, ValueError):
    """A trace file cannot be read as a Chrome/Kineto trace: the message names the file and the problem."""


def exception_chain(exc: BaseException | None, limit: int = 16) -> list[BaseException]:
    """``exc`` and the errors behind it, newest first: each one's ``__cause__`` (``raise ... from``), else its
    ``__context__`` (raised while handling), at most ``limit`` of them, a cycle cut where it closes.

    The oldest error (last) is usually the one that says what went wrong: ``torch.cuda.graph``'s exit ends a
    failed capture, and that raises an error of its own ("operation failed due to a previous error during
    capture", torch 2.11) with the user's error as its context."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not e for e in chain) and len(chain) < limit:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def first_cgutils_error(exc: BaseException) -> CgutilsError | None:
    """``exc`` if it is a cgutils error, else the first (oldest) cgutils error in its :func:`exception_chain`,
    else ``None``.

    A check of ours inside a captured function (a conditional node's body refused for a sync) raises first;
    ending the capture then raises an error of its own with ours as its context. Ours says what went wrong;
    the other is its consequence."""
    if isinstance(exc, CgutilsError):
        return exc
    return next((e for e in reversed(exception_chain(exc)) if isinstance(e, CgutilsError)), None)
