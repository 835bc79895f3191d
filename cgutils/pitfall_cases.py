"""How a pitfall case is run and observed: the catalogue's entry type and the steps its entries share.

An entry (:class:`Pitfall`) pairs a reproducer with a ``diagnose`` step, which runs it through cgutils
and returns the observed row, and a ``check_fix`` step, which runs the fix and says whether it works.
The reproducers and fixes themselves, and the catalogue of entries, are in :mod:`cgutils.pitfalls` (and,
for the entries of real use, :mod:`cgutils.pitfalls_real_use`, whose steps are in
:mod:`cgutils.pitfall_cases_real_use`): the lines reported for them are lines of those files. Every step
leaves the caller's current stream as it found it and the default CUDA generators usable, also after a
failed capture (:func:`kept_stream`, :func:`raw_failure`), so that no entry changes the outcome of the next.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .capture import GraphRunner, max_rel_error, reset_rng_after_failed_capture, validate_replay
from .checks import first_line
from .diagnose import explain
from .errors import CaptureError, CgutilsError, InputError

MARK = "# <- pitfall"
KINDS = ("loud", "silent", "cost", "documented")


@dataclass(frozen=True, kw_only=True)
class Pitfall:
    """One catalogue entry, built with keyword arguments.

    Attributes:
        key: short name, e.g. ``item``.
        title: one line for the table.
        kind: one of :data:`KINDS`: ``loud`` (capture raises), ``silent`` (wrong replay, no error),
            ``cost`` (memory or time) or ``documented`` (a documented rule whose outcome depends on the versions).
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


# --- diagnose steps: run the reproducer, return the observed row ----------------------------------------


def through_runner(p: Pitfall, x: torch.Tensor) -> dict:
    """``GraphRunner(bad)(x)``: what it raises (syncs: the op and the user's line), else "no error"."""
    try:
        GraphRunner(p.bad)(x)
    except CgutilsError as exc:
        return observed_row(exc)
    return observed_row(None, message="no error")


def through_validate_replay(p: Pitfall, x: torch.Tensor) -> dict:
    """A manual graph (``bad(x)`` returns the graphed callable) through validate_replay on three inputs.
    A capture that raises is recorded raw; the caller's stream and RNG are put back after it."""
    try:
        with kept_stream():
            validate_replay(p.bad(x), lambda t: t * 2, [(example(s),) for s in (1, 2, 3)])
    except CgutilsError as exc:
        return observed_row(exc)
    except Exception as exc:  # capture itself refused it: record the raw error and its explanation
        return raw_failure(exc)
    return observed_row(None, message="no error")


def cpu_input_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`through_validate_replay`, plus what GraphRunner says when handed the CPU tensor itself."""
    row = through_validate_replay(p, x)
    try:
        GraphRunner(lambda t: t * 2)(x.cpu())
    except InputError as exc:
        row["runner_error"] = first_line(exc)[:300]
        row["runner_exception"] = type(exc).__name__
    return row


def baked_value_check(p: Pitfall, x: torch.Tensor) -> dict:
    """Capture the module ``bad()`` with checked replays, change its ``scale`` to 3, call it again."""
    model = p.bad()
    runner = GraphRunner(model, validate_replays=2)
    runner(x)
    if isinstance(model.scale, torch.Tensor):
        model.scale.fill_(3.0)
    else:
        model.scale = 3.0
    try:
        runner(example(1))
    except CgutilsError as exc:
        return observed_row(exc)
    return observed_row(None, message="no error")


def training_mode_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of the module ``bad()`` left in training mode: the warning (``warned``) and the outcome."""
    model = p.bad()  # nn.Module starts in training mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = GraphRunner(model)
    warned = any("training mode" in str(w.message) for w in caught)
    try:
        runner(x)
    except CgutilsError as exc:
        return observed_row(exc, warned=warned)
    return observed_row(None, message="no error", warned=warned)


def new_shapes_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of ``bad`` on four sequence lengths: graphs captured and their memory in bytes."""
    runner = GraphRunner(p.bad)
    for n in (64, 128, 192, 256):
        runner(torch.randn(1, n, 256, device="cuda"))
    st = runner.stats
    return observed_row(None, message=f"{st.captures} graphs for 4 shapes, {st.memory_bytes / 2**20:.1f} MiB in all",
                        captures=st.captures, memory_bytes=st.memory_bytes)


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


def cold_thread_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`manual_capture` of ``bad(x)`` in a new thread, as a fresh process would first run it."""
    fn = p.bad(x)
    result: dict = {}
    # A new thread gets its own cuBLAS handle in PyTorch's per-thread pool, so its first matmul is
    # the cold start a fresh process would see.
    t = threading.Thread(target=lambda: result.update(manual_capture(fn)))
    t.start()
    t.join()
    return result


def cudnn_benchmark_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`manual_capture` of ``bad(x)`` with ``torch.backends.cudnn.benchmark`` on (restored after)."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return manual_capture(p.bad(x))
    finally:
        torch.backends.cudnn.benchmark = old


def default_stream_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`manual_capture` of ``bad(x)`` with ``capture_begin()`` on the current (default) stream."""
    return manual_capture(p.bad(x), on_default_stream=True)


# --- fix checks: run ``good``, return whether the fix works ----------------------------------------------


def graphed_fix_matches_eager(p: Pitfall, x: torch.Tensor) -> bool:
    """``good`` through GraphRunner, on an input it was not captured with, matches ``good`` run eagerly."""
    try:
        return max_rel_error(GraphRunner(p.good)(example(1)), p.good(example(1))) <= 1e-5
    except CaptureError:
        return False


def replay_fix_validates(p: Pitfall, x: torch.Tensor) -> bool:
    """The graphed callable ``good(x)`` passes validate_replay against y = 2x on three inputs."""
    try:
        validate_replay(p.good(x), lambda t: t * 2, [(example(s),) for s in (1, 2, 3)])
    except CaptureError:
        return False
    return True


def module_fix_follows_changes(p: Pitfall, x: torch.Tensor) -> bool:
    """The module ``good()`` through GraphRunner with checked replays: its ``scale`` changed after capture
    to 3, the replays still match eager."""
    try:
        model = p.good().cuda()
        runner = GraphRunner(model, validate_replays=2)
        runner(x)
        model.scale.fill_(3.0)
        runner(example(1))
    except CaptureError:
        return False
    return True
