"""Capture diagnostics: list the CPU-GPU syncs a function makes, each at the user's own line
(:func:`find_sync_points`; which files are the user's is its ``user_files`` argument, or :func:`user_code`).
Turning a capture error's text into a cause and a fix is :func:`cgutils.explanations.explain`, re-exported here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sysconfig
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checks import require_cuda
from .errors import InputError, exception_chain
from .explanations import Explanation, explain  # noqa: F401  (cgutils.diagnose.explain, as before)

# --- sync points -----------------------------------------------------------------------------------

_SYNC_WARNING = "synchronizing CUDA operation"  # text of PyTorch's sync debug-mode warning
# Not the user's code by default: torch, the standard library, and cgutils' own machinery (subpackages too).
# Frames never reported: torch itself, the standard library and cgutils. Directory prefixes end with a
# separator, so that torchvision/ is not taken for torch/; site- and dist-packages inside the standard
# library's directory (conda, system Pythons) hold libraries, which are reported.
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_STDLIB_DIR = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
_CGUTILS_DIR = str(Path(__file__).resolve().parent) + os.sep
_LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
# The user's files for calls made without user_files= (GraphRunner's own diagnosis of a failed capture):
# set by user_code(); None means every frame that _skipped() does not drop.
_USER_FILES: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("cgutils_user_files",
                                                                                    default=None)

SYNC_COLUMNS = ["op", "file", "line", "code", "function", "caller"]
UserFiles = Iterable[str | os.PathLike]


def _file_key(filename: str) -> str:
    """A frame's file as compared: resolved for a real path, as is for ``<...>`` names (notebook cells)."""
    return filename if filename.startswith("<") else str(Path(filename).resolve())


def _user_file_set(user_files: UserFiles | None) -> frozenset[str] | None:
    if user_files is None:
        return _USER_FILES.get()
    if isinstance(user_files, (str, os.PathLike)):
        user_files = [user_files]  # one file, not its characters
    try:
        return frozenset(_file_key(os.fspath(f)) for f in user_files)
    except TypeError as exc:
        raise InputError(f"user_files must be file paths (str or pathlib.Path), e.g. [__file__]; got "
                         f"{user_files!r}") from exc


@contextmanager
def user_code(user_files: UserFiles) -> Iterator[None]:
    """Inside the block, sync points found without an explicit ``user_files`` argument (for instance by
    ``GraphRunner`` diagnosing a failed capture) are attributed to frames of ``user_files`` only.

    For code that calls cgutils on a user's behalf from inside cgutils (the pitfall catalogue), where
    the default, "everything outside torch, the standard library and cgutils", would skip the user's
    function. Applies to the current thread (a ``contextvars`` value).

    Args:
        user_files: paths (``str`` or ``pathlib.Path``) whose frames are the user's code, e.g. ``[__file__]``.

    Raises:
        InputError: ``user_files`` holds something that is not a path.
    """
    token = _USER_FILES.set(_user_file_set(user_files))
    try:
        yield
    finally:
        _USER_FILES.reset(token)


@dataclass(frozen=True)
class SyncPoint:
    """One CPU-GPU synchronisation hit while running user code eagerly.

    Attributes:
        op: the PyTorch call that synchronised, e.g. ``Tensor.item``, ``Tensor.__bool__`` (a Python
            ``if`` on a tensor), ``torch.nonzero``, ``Tensor.__getitem__`` (boolean-mask indexing),
            ``torch.cuda.synchronize``.
        file, line: the innermost frame of the user's code (see ``user_files`` of
            :func:`find_sync_points`): the user's line that made the call.
        code: the source text of that line (empty when unavailable).
        function: the function that line is in.
        caller: when ``file`` is a library's (an installed package: torchvision, transformers), the
            ``"file:line"`` of your own code that led there (the innermost frame outside installed
            packages); empty when ``file`` is your own.
    """

    op: str
    file: str
    line: int
    code: str
    function: str
    caller: str = ""

    def __str__(self) -> str:
        return f"{self.op} at {Path(self.file).name}:{self.line} ({self.code or self.function})"


def _skipped(name: str) -> bool:
    if name.startswith((_TORCH_DIR, _CGUTILS_DIR)):
        return True
    return name.startswith(_STDLIB_DIR) and not any(d in name[len(_STDLIB_DIR) - 1:] for d in _LIBRARY_DIRS)


def _below_torch(fr: traceback.FrameSummary) -> bool:
    """A frame of torch itself or of the standard library (not a package installed there)."""
    name = _file_key(fr.filename)
    return name.startswith(_TORCH_DIR) or (_skipped(name) and not name.startswith(_CGUTILS_DIR))


def _user_frame(stack: list[traceback.FrameSummary],
                user_files: frozenset[str] | None) -> traceback.FrameSummary | None:
    for fr in reversed(stack):
        name = _file_key(fr.filename)
        if user_files is not None:
            if name in user_files:
                return fr
        elif not (fr.filename.startswith("<frozen") or _skipped(name)):
            return fr
    return None


def _caller(stack: list[traceback.FrameSummary], user_files: frozenset[str] | None,
            found: traceback.FrameSummary) -> str:
    """For a sync found in a library's file, ``"file:line"`` of the innermost frame outside installed packages
    (the user's line that led there); empty when ``found`` is already that, or with ``user_files``."""
    if user_files is not None or not any(d in _file_key(found.filename) for d in _LIBRARY_DIRS):
        return ""
    for fr in reversed(stack):
        name = _file_key(fr.filename)
        if not (fr.filename.startswith("<frozen") or _skipped(name) or any(d in name for d in _LIBRARY_DIRS)):
            return f"{fr.filename}:{fr.lineno}"
    return ""


def _sync_point(op: str, stack: list[traceback.FrameSummary], user_files: frozenset[str] | None) -> SyncPoint | None:
    # A sync is never dropped for want of a frame of the user's code: a dropped one made a failed capture read as a
    # sync from outside PyTorch (``user_code`` naming a package's __init__.py instead of the module that synced).
    # Then the default user frame, else the innermost frame outside torch and the standard library (cgutils').
    fr = _user_frame(stack, user_files) or (_user_frame(stack, None) if user_files is not None else None) \
        or next((f for f in reversed(stack) if not (f.filename.startswith("<frozen") or _below_torch(f))), None)
    if fr is None:
        return None
    return SyncPoint(op, fr.filename, fr.lineno or 0, (fr.line or "").strip(), fr.name, _caller(stack, user_files, fr))


def failure_site(exc: BaseException, user_files: UserFiles | None = None) -> SyncPoint | None:
    """Where an error was raised in the user's code: the innermost frame of ``exc``'s traceback in the
    user's files (as for :func:`find_sync_points`: ``user_files``, else an enclosing :func:`user_code`,
    else every file outside torch, the standard library and cgutils), as a :class:`SyncPoint` whose ``op``
    is the exception type; ``None`` if no such frame. For a failed capture this is the line that made the
    call CUDA refused, which an eager rerun cannot tell apart from syncs that happen only when not capturing.

    The :func:`~cgutils.errors.exception_chain` is followed to the first error: ``torch.cuda.graph``'s exit
    ends the capture, and that raises an error of its own ("operation failed due to a previous error during
    capture") with the one from the user's line as its context."""
    files = _user_file_set(user_files)
    for e in reversed(exception_chain(exc)):  # the first error first
        fr = _user_frame(traceback.extract_tb(e.__traceback__), files)
        if fr is not None:
            return SyncPoint(type(e).__name__, fr.filename, fr.lineno or 0, (fr.line or "").strip(), fr.name)
    return None


_eager_only = threading.local()


@contextmanager
def eager_only_sync() -> Iterator[None]:
    """Mark the syncs made inside as ones that happen only when not capturing (a conditional node's eager loop
    reads its condition on the host; under capture the GPU reads it). :func:`find_sync_points` does not report
    them, and a conditional body's sync check allows them. Per thread."""
    before = getattr(_eager_only, "on", False)
    _eager_only.on = True
    try:
        yield
    finally:
        _eager_only.on = before


def in_eager_only_sync() -> bool:
    """Whether this thread is inside :func:`eager_only_sync`."""
    return getattr(_eager_only, "on", False)


class _OpTracker(torch.overrides.TorchFunctionMode):
    """Remembers the outermost torch function being called, to name the op that synchronised."""

    def __init__(self):
        super().__init__()
        self.current: str | None = None
        self.calls = 0  # outermost torch calls so far: one user call may sync several times inside

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer = self.current
        if outer is None:
            self.current = _op_name(func)
            self.calls += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


def _op_name(func: Any) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    head, _, tail = qual.rpartition(".")
    if head in ("_TensorBase", "TensorBase", "Tensor"):
        return f"Tensor.{tail}"
    if head in ("", "_VariableFunctionsClass", "_VariableFunctions"):
        return f"torch.{tail}"
    return qual


class SyncRecorder:
    """Context manager that records every CPU-GPU sync made inside it (see :func:`find_sync_points`).

    Works by turning on ``torch.cuda.set_sync_debug_mode("warn")`` (PyTorch docs,
    "torch.cuda.set_sync_debug_mode"), catching its warnings with the Python stack at the moment they
    are raised, and wrapping ``torch.cuda.synchronize``, which the debug mode does not report.
    ``points`` holds one :class:`SyncPoint` per sync, in order.

    Args:
        user_files: the files whose frames are the user's code; as in :func:`find_sync_points`.

    Raises:
        InputError: ``user_files`` holds something that is not a path.
    """

    def __init__(self, user_files: UserFiles | None = None):
        self.points: list[SyncPoint] = []
        # syncs made meanwhile by other threads (a data loader, a metrics thread): not the function's,
        # but a device-wide one breaks any capture in progress, so a diagnosis must name them
        self.other_threads: list[tuple[str, SyncPoint]] = []
        # joins of a side stream that never waited on the joining stream first: inside capture, the side
        # stream's work is not part of the graph, and CUDA refuses the join (cudaErrorStreamCaptureIsolation)
        self.unforked_joins: list[SyncPoint] = []
        # forks (side.wait_stream(capturing stream)) never joined back before the call ended: inside capture,
        # CUDA ends it with cudaErrorStreamCaptureUnjoined
        self.unjoined_forks: list[SyncPoint] = []
        self._forks: dict[int, SyncPoint] = {}  # forked stream -> its fork, until joined back
        self._captured: set[int] = set()  # the starting stream and the streams forked from it
        self._start: set[int] = set()  # the starting stream: it joins, it is never forked
        self._recorded_on: dict[int, tuple[Any, int]] = {}  # id(event) -> (event, the stream it was recorded on)
        self._in_wait_stream = False
        self._thread = threading.get_ident()
        self._user_files = _user_file_set(user_files)
        self._tracker = _OpTracker()
        self._last_call: int | None = None

    def _record(self, op: str | None, call: int | None = None) -> None:
        # One user-level call can sync many times inside (printing a tensor syncs once per piece it
        # formats); each user call is reported once.
        if in_eager_only_sync():
            return
        stack = traceback.extract_stack()[:-2]
        if threading.get_ident() != self._thread:
            fr = _user_frame(stack, self._user_files) or stack[-1]
            self.other_threads.append((threading.current_thread().name, SyncPoint(
                op or "unknown op", fr.filename, fr.lineno or 0, (fr.line or "").strip(), fr.name,
                _caller(stack, self._user_files, fr))))
            return
        if call is not None and call == self._last_call:
            return
        self._last_call = call
        point = _sync_point(op or "unknown op", stack, self._user_files)
        if point is not None:
            self.points.append(point)

    def __enter__(self) -> SyncRecorder:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _SYNC_WARNING in str(message):
                inside = self._tracker.current is not None
                self._record(self._tracker.current, self._tracker.calls if inside else None)
            elif "debug mode is a prototype" not in str(message):  # said on every switch: noise
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        self._orig_sync = torch.cuda.synchronize

        def synchronize(device=None):
            self._record("torch.cuda.synchronize")
            return self._orig_sync(device)

        torch.cuda.synchronize = synchronize
        self._orig_wait = torch.cuda.Stream.wait_stream
        self._orig_record, self._orig_event_wait = torch.cuda.Event.record, torch.cuda.Event.wait

        def wait_stream(stream_self, other):
            # wait_stream records an event on `other` and waits on it: one fork or join, named as the user wrote it
            if threading.get_ident() != self._thread:
                return self._orig_wait(stream_self, other)
            self._wait(stream_self.cuda_stream, other.cuda_stream)
            self._in_wait_stream = True
            try:
                return self._orig_wait(stream_self, other)
            finally:
                self._in_wait_stream = False

        def record(event, stream=None):
            if threading.get_ident() == self._thread:
                on = stream if stream is not None else torch.cuda.current_stream()
                self._recorded_on[id(event)] = (event, on.cuda_stream)  # the event kept: its id stays its own
            return self._orig_record(event, stream)

        def event_wait(event, stream=None):
            if threading.get_ident() == self._thread and not self._in_wait_stream and id(event) in self._recorded_on:
                waiter = stream if stream is not None else torch.cuda.current_stream()
                self._wait(waiter.cuda_stream, self._recorded_on[id(event)][1], "Event.wait")
            return self._orig_event_wait(event, stream)

        torch.cuda.Stream.wait_stream = wait_stream
        torch.cuda.Event.record, torch.cuda.Event.wait = record, event_wait
        if torch.cuda.is_available():
            self._old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            with contextlib.suppress(RuntimeError, AssertionError):  # the tests' stand-in for a CUDA machine
                self._start.add(torch.cuda.current_stream().cuda_stream)  # the stream a capture would run on
                self._captured |= self._start
        self._tracker.__enter__()
        return self

    def _wait(self, waiter: int, waited: int, op: str = "Stream.wait_stream") -> None:
        """One ``waiter.wait_stream(waited)`` (or a wait on an event recorded on ``waited``) as a capture would
        see it: waiting on a stream of the capture forks the waiter into it, or joins ``waited`` back if it is a
        forked stream not yet joined; a side stream that was joined and waits on the capture again is forked
        again (its later work must be joined once more); a stream of the capture waiting on one outside it is
        a join CUDA refuses (an unforked side stream)."""
        if waiter == waited:
            return
        if waited in self._captured:
            if waited in self._forks:
                self._forks.pop(waited)  # joined back
            elif waiter not in self._forks and waiter not in self._start:
                self._captured.add(waiter)
                point = self._point(op)
                if point is not None:
                    self._forks[waiter] = point
        elif waiter in self._captured:
            point = self._point(op)
            if point is not None:
                self.unforked_joins.append(point)

    def _point(self, op: str) -> SyncPoint | None:
        return _sync_point(op, traceback.extract_stack(), self._user_files)  # cgutils frames skipped

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(self._old_mode)
        torch.cuda.synchronize = self._orig_sync
        torch.cuda.Stream.wait_stream = self._orig_wait
        torch.cuda.Event.record, torch.cuda.Event.wait = self._orig_record, self._orig_event_wait
        self._recorded_on.clear()
        self._warnings.__exit__(*exc)
        self.unjoined_forks = list(self._forks.values())

    def to_frame(self):
        """The sync points as a ``pandas.DataFrame`` with columns ``SYNC_COLUMNS``; ``.attrs["other_threads"]``
        lists ``(thread name, SyncPoint)`` for syncs that other threads made meanwhile, and
        ``.attrs["unforked_joins"]`` the ``wait_stream`` joins of side streams that were never forked,
        ``.attrs["unjoined_forks"]`` the forks of side streams that were never joined back."""
        import pandas as pd

        df = pd.DataFrame([dataclasses.asdict(p) for p in self.points], columns=SYNC_COLUMNS)
        df.attrs["other_threads"] = list(self.other_threads)
        df.attrs["unforked_joins"] = list(self.unforked_joins)
        df.attrs["unjoined_forks"] = list(self.unjoined_forks)
        return df


def find_sync_points(fn: Callable[..., Any], *args: Any, user_files: UserFiles | None = None, **kwargs: Any):
    """Run ``fn(*args, **kwargs)`` once eagerly (under ``torch.no_grad()``) and list every CPU-GPU
    synchronisation it makes: each one is a call that cannot be captured into a CUDA graph.

    Found: ``.item()``, ``.cpu()``, ``.tolist()``, ``print``/``str`` of a CUDA tensor, ``torch.nonzero``,
    boolean-mask indexing, a Python ``if``/``while`` on a CUDA tensor value, ``torch.cuda.synchronize``
    (called as ``torch.cuda.synchronize``; an alias imported before the call is not seen), and any other
    op that PyTorch's sync debug mode reports.

    Args:
        fn: the function or module to run; its tensors must be on the GPU for syncs to exist.
        args, kwargs: its arguments (a keyword argument named ``user_files`` is taken as the one below,
            not passed to ``fn``).
        user_files: the files that hold the user's code, as paths (``str`` or ``pathlib.Path``; one path
            or an iterable of them); each sync is reported at the innermost frame from one of these files,
            and a sync made with none of them on the stack is not listed. Frames of code typed into a
            notebook cell or ``exec`` are named as Python names them (``"<recorded cell ...>"``). Default
            ``None``: the files set by an enclosing :func:`user_code` block, else every file outside
            torch, the standard library and cgutils.

    Returns:
        ``pandas.DataFrame`` with columns ``op`` (e.g. ``Tensor.item``), ``file``, ``line`` (the user's
        line, not a torch frame), ``code`` (that line's text) and ``function``; one row per sync, in
        order; empty when the function never syncs.

    Raises:
        NoCudaError: no CUDA device is visible (without one nothing ever synchronises).
        InputError: ``user_files`` holds something that is not a path.
        Any exception ``fn`` itself raises.
    """
    require_cuda("find_sync_points", "on the CPU no call synchronises with a GPU, so there is nothing to find")
    with SyncRecorder(user_files) as rec, torch.no_grad():
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    return rec.to_frame()
