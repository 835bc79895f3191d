"""A catalogue entry and what runs one: the :class:`Pitfall` type, :func:`run_entry`, the catalogue's input,
the observed row, and the raw captures whose failures the steps record.

An entry pairs a reproducer (:mod:`.reproducers`) with a ``diagnose`` step, which runs it through cgutils and
returns the observed row, and a ``check_fix`` step, which runs the fix and says whether it works
(:mod:`.steps`, :mod:`.outside`). Everything here leaves the caller's current stream as it found it and the
default CUDA generators usable, also after a failed capture (:func:`kept_stream`, :func:`raw_failure`,
:func:`raw_capture`), so that no entry changes the outcome of the next.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..capture import max_rel_error, reset_rng_after_failed_capture
from ..checks import first_line
from ..diagnose import explain

MARK = "# <- pitfall"


KINDS = ("loud", "silent", "cost", "documented", "safe")


@dataclass(frozen=True, kw_only=True)
class Pitfall:
    """One catalogue entry, built with keyword arguments.

    Attributes:
        key: short name, e.g. ``item``.
        title: one line for the table.
        kind: one of :data:`KINDS`: ``loud`` (capture raises), ``silent`` (wrong replay, no error),
            ``cost`` (memory or time), ``documented`` (a documented rule whose outcome depends on the versions) or
            ``safe`` (feared to break a graph, and does not: the row shows what happens instead).
        bad: the reproducer, its offending line marked ``# <- pitfall``: a function of one CUDA tensor ``x``
            (float32, shape (4, 8)), or what ``diagnose`` builds the case from (a module class, a function
            that returns a graphed callable).
        diagnose: ``diagnose(entry, x)`` runs the reproducer through cgutils and returns the observed row
            (see :func:`observed_row`; :func:`cgutils.pitfalls.run` lists its fields).
        fix: the fix in words.
        good: the fix as code, same signature as ``bad``; ``None`` when the fix is a setting or a habit.
        check_fix: ``check_fix(entry, x) -> bool`` runs ``good`` and returns whether the fix works (its
            replay matches eager); ``None`` when there is no ``good`` to run.
        expect: what cgutils should report (``exception`` class name, ``cause`` key, for syncs ``op``);
            the GPU tests assert each item. ``{}`` for outcomes that depend on the torch/driver version.
    """

    key: str
    title: str
    kind: str
    bad: Callable[..., Any]
    diagnose: Callable[[Pitfall, torch.Tensor], dict]
    fix: str
    good: Callable[..., Any] | None = None
    check_fix: Callable[[Pitfall, torch.Tensor], bool] | None = None
    expect: dict

    @property
    def marked_line(self) -> int | None:
        """Line number of the ``# <- pitfall`` line in the file of ``bad``, or None."""
        lines, start = inspect.getsourcelines(self.bad)
        return next((start + i for i, text in enumerate(lines) if MARK in text), None)

    @property
    def source(self) -> str:
        """Source code of the reproducer."""
        return inspect.getsource(self.bad)


def run_entry(p: Pitfall, x: torch.Tensor) -> dict:
    """Run one entry, from the catalogue or your own, on ``x``: its ``diagnose`` step, then its ``check_fix``.

    Args:
        p: the entry.
        x: its input; for the catalogue's reproducers a CUDA tensor, float32, shape (4, 8) (:func:`example`).

    Returns:
        ``key``, ``title``, ``kind``, the ``diagnose`` row, ``expected_line`` (the marked line), ``fix`` and
        ``fix_ok`` (what ``check_fix`` returned; ``None`` when the entry has none), in that order.

    Raises:
        Whatever ``diagnose`` or ``check_fix`` raise (they report expected failures in the row instead).
    """
    return {"key": p.key, "title": p.title, "kind": p.kind, **p.diagnose(p, x), "expected_line": p.marked_line,
            "fix": p.fix, "fix_ok": p.check_fix(p, x) if p.check_fix is not None else None}


def example(seed: int = 0) -> torch.Tensor:
    """The catalogue's input: float32, shape (4, 8), on the GPU, the same values for the same ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(4, 8, generator=g).cuda()


def observed_row(exc: BaseException | None = None, **extra: Any) -> dict:
    """The observed outcome: exception class, first line of its message, cause, sync op and line.

    Args:
        exc: what was raised (``None``: nothing); a :class:`~cgutils.errors.CaptureError` also gives its
            ``cause``, first sync point and ``original`` error.
        extra: further fields, which win over those above.
    """
    row = {"exception": type(exc).__name__ if exc else "", "message": "", "cause": "", "op": "", "line": None}
    if exc is not None:
        row["message"] = first_line(exc)[:300]
        row["cause"] = getattr(exc, "cause", "") or ""
        syncs = getattr(exc, "sync_points", None)
        if syncs is not None and len(syncs):
            row["op"], row["line"] = syncs.op.iloc[0], int(syncs.line.iloc[0])
        original = getattr(exc, "original", None)
        if original is not None:
            row["original"] = first_line(original)[:300]
    row.update(extra)
    return row


# --- captures outside cgutils: what a failure leaves, put right afterwards -----------------------------


@contextmanager
def kept_stream() -> Iterator[None]:
    """Put the caller's current CUDA stream back when the block exits, raised or not.

    ``torch.cuda.graph`` switches to its capture stream on entry and, when ``capture_end`` raises in its
    ``__exit__``, never switches back (torch/cuda/graphs.py: ``capture_end()`` runs before the stream
    context's ``__exit__``). A catalogue entry that let that through would leave every later entry
    running on the capture stream: the ``default_stream`` entry once recorded "no error" that way.
    """
    stream = torch.cuda.current_stream()
    try:
        yield
    finally:
        torch.cuda.set_stream(stream)


def raw_failure(exc: BaseException) -> dict:
    """The row for a capture that raised outside cgutils: the raw error and what explain() makes of it."""
    reset_rng_after_failed_capture()  # else every later random op fails ("Offset increment ...")
    why = explain(exc)
    return observed_row(exc, cause=why.key if why else "", explanation=str(why or ""))


def manual_capture(fn: Callable[[], Any], *, on_default_stream: bool = False) -> dict:
    """Capture ``fn`` with no warm-up and report what happened (error explained, or replay vs eager).

    After a failure the caller's current stream and the default CUDA generators are put back (:func:`kept_stream`,
    :func:`raw_failure`), so that an entry leaves nothing behind for the next one.
    """
    g = torch.cuda.CUDAGraph()
    try:
        with kept_stream():  # torch.cuda.graph leaves its capture stream current when capture_end raises
            if on_default_stream:
                g.capture_begin()  # on the current stream: PyTorch's default stream unless the caller set another
                try:
                    out = fn()
                finally:
                    g.capture_end()
            else:
                with torch.cuda.graph(g):
                    out = fn()
            g.replay()
            torch.cuda.synchronize()
            err = max_rel_error(out, fn())
    except Exception as exc:  # the raw CUDA/PyTorch error is the observation here
        return raw_failure(exc)  # also resets the default CUDA generators
    return observed_row(None, message=f"no error; replay vs eager max relative error {err:.3g}", max_rel_error=err)


def rng_works() -> bool:
    """Whether a random op on the GPU runs (a failed capture can leave the default generator unusable)."""
    try:
        torch.rand(4, device="cuda")
        torch.cuda.synchronize()
    except RuntimeError:
        return False
    return True


def raw_capture(fn: Callable[[], Any], **graph_kwargs: Any) -> dict:
    """Capture ``fn`` with ``torch.cuda.graph(g, **graph_kwargs)`` (no warm-up of its own) and record what a
    failure leaves, then put it right (the capture ended, the caller's stream and RNG back).

    Returns:
        ``raw_exception`` (class name, "" if none), ``raw_message``, ``raw_cause`` (:func:`cgutils.explain`'s
        key), ``raw_stream_restored`` (the current stream is the caller's again after ``torch.cuda.graph``
        exits) and, after a failure, ``raw_rng_ok`` (a random op works before the RNG is reset).
    """
    before = torch.cuda.current_stream()
    g = torch.cuda.CUDAGraph()
    ctx = torch.cuda.graph(g, **graph_kwargs)
    try:
        with ctx:
            fn()
    except Exception as exc:
        restored = torch.cuda.current_stream() == before
        with torch.cuda.stream(ctx.capture_stream):  # end it if the error came before capture_end
            if torch.cuda.is_current_stream_capturing():
                try:
                    g.capture_end()
                except RuntimeError:
                    pass
        torch.cuda.set_stream(before)
        rng_ok = rng_works()
        row = raw_failure(exc)  # resets the RNG
        return {"raw_exception": row["exception"], "raw_message": row["message"], "raw_cause": row["cause"],
                "raw_stream_restored": restored, "raw_rng_ok": rng_ok}
    return {"raw_exception": "", "raw_message": "no error", "raw_cause": "",
            "raw_stream_restored": torch.cuda.current_stream() == before}
