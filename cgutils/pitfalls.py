"""The pitfall catalogue: each way a CUDA graph fails, as a minimal reproducer that runs.

Every entry has a reproducer (the ``bad`` function, with the offending line marked ``# <- pitfall``),
what cgutils reports about it (the ``diagnose`` step: an exception class, a cause key, and for syncs
the op and the line), and the fix (the ``good`` function, checked against eager). ``run()`` executes
one entry on the GPU and returns what really happened; ``catalogue_table()`` runs them all. The
constraints come from the CUDA Programming Guide ("CUDA Graphs", "Stream capture") and the PyTorch
docs ("CUDA Graphs" in torch.cuda semantics, "Constraints"); the outcomes are whatever the installed
torch and driver do, recorded with provenance.

The reproducers are written as user code on purpose: sync points are reported at their lines here.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .capture import GraphRunner, capture_graph, max_rel_error, reset_rng_after_failed_capture, validate_replay
from .diagnose import explain
from .errors import CaptureError, CgutilsError, InputError, NoCudaError

MARK = "# <- pitfall"
KINDS = ("loud", "silent", "cost", "documented")


@dataclass(frozen=True)
class Pitfall:
    """One catalogue entry.

    Attributes:
        key: short name, e.g. ``item``.
        title: one line for the table.
        kind: ``loud`` (capture raises), ``silent`` (wrong replay, no error), ``cost`` (memory or time)
            or ``documented`` (a documented rule whose outcome depends on the versions).
        bad: the reproducer: a function of one CUDA tensor ``x`` (float32, shape (4, 8)) unless
            ``diagnose`` says otherwise.
        diagnose: runs the reproducer through cgutils and returns the observed row (see :func:`run`).
        good: the fix, same signature as ``bad``; compared with ``reference``.
        reference: eager result the fix must match (defaults to ``good`` itself run eagerly).
        fix: the fix in words.
        expect: what cgutils should report: ``exception`` class name, ``cause`` key, and for syncs
            ``op``; the GPU tests assert these (``None`` values are not checked, for outcomes that
            depend on the torch/driver version).
    """

    key: str
    title: str
    kind: str
    bad: Callable[..., Any]
    diagnose: Callable[[Pitfall, torch.Tensor], dict]
    fix: str
    good: Callable[..., Any] | None = None
    expect: dict | None = None

    @property
    def marked_line(self) -> int | None:
        """Line number of the ``# <- pitfall`` line in this module, or None."""
        lines, start = inspect.getsourcelines(self.bad)
        for i, text in enumerate(lines):
            if MARK in text:
                return start + i
        return None

    @property
    def source(self) -> str:
        """Source code of the reproducer."""
        return inspect.getsource(self.bad)


def _example(seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(4, 8, generator=g).cuda()


def _row(exc: BaseException | None = None, **extra: Any) -> dict:
    """The observed outcome: exception class, first line of its message, cause, sync op and line."""
    row = {"exception": type(exc).__name__ if exc else "", "message": "", "cause": "", "op": "", "line": None}
    if exc is not None:
        row["message"] = (str(exc).strip().splitlines() or [""])[0][:300]
        row["cause"] = getattr(exc, "cause", "") or ""
        syncs = getattr(exc, "sync_points", None)
        if syncs is not None and len(syncs):
            row["op"], row["line"] = syncs.op.iloc[0], int(syncs.line.iloc[0])
        original = getattr(exc, "original", None)
        if original is not None:
            row["original"] = (str(original).strip().splitlines() or [""])[0][:300]
    row.update(extra)
    return row


def _through_runner(p: Pitfall, x: torch.Tensor, **runner_kwargs: Any) -> dict:
    try:
        GraphRunner(p.bad, **runner_kwargs)(x)
    except CgutilsError as exc:
        return _row(exc)
    return _row(None, message="no error")


# --- loud: syncs inside the captured function --------------------------------------------------------


def _item(x):
    return x * x.sum().item()  # <- pitfall


def _cpu(x):
    peak = x.abs().max().cpu()  # <- pitfall
    return x / peak.to(x.device)


def _tolist(x):
    firsts = x[:, 0].tolist()  # <- pitfall
    return x * sum(v > 0 for v in firsts)


def _print(x):
    print("mean activation", x.mean())  # <- pitfall
    return x * 2


def _nonzero(x):
    return torch.nonzero(x > 0)  # <- pitfall


def _bool_mask(x):
    return x[x > 0].sum()  # <- pitfall


def _python_if(x):
    if x.sum() > 0:  # <- pitfall
        return x * 2
    return -x


def _synchronize(x):
    y = x * 2
    torch.cuda.synchronize()  # <- pitfall
    return y


SYNC_FIXES: dict[str, tuple[Callable, str]] = {
    "item": (lambda x: x * x.sum(), "keep the value on the GPU: x * x.sum() (a 0-dim tensor broadcasts)"),
    "cpu": (lambda x: x / x.abs().max(), "divide by the GPU tensor: x / x.abs().max()"),
    "tolist": (lambda x: x * (x[:, 0] > 0).sum(), "count on the GPU: x * (x[:, 0] > 0).sum()"),
    "print": (lambda x: x * 2, "print outside the graphed function (after replay, from the output)"),
    "nonzero": (lambda x: torch.nonzero_static(x > 0, size=x.numel(), fill_value=-1),
                "fixed-size output: torch.nonzero_static(mask, size=x.numel()) pads with -1"),
    "bool_mask": (lambda x: torch.where(x > 0, x, 0).sum(), "mask instead of index: torch.where(x > 0, x, 0).sum()"),
    "python_if": (lambda x: torch.where(x.sum() > 0, x * 2, -x), "both branches on the GPU: torch.where(x.sum() > 0, x * 2, -x)"),
    "synchronize": (lambda x: x * 2, "drop it: replay is ordered on its stream; synchronise after replay if the CPU needs the result"),
}


def _sync_entry(key: str, title: str, bad: Callable, op: str) -> Pitfall:
    good, fix = SYNC_FIXES[key]
    return Pitfall(key, title, "loud", bad, _through_runner, fix, good,
                   {"exception": "CaptureError", "cause": "sync", "op": op})


# --- silent and static-buffer entries ------------------------------------------------------------


def _doubling_graph(x):
    """A graph of y = 2x, no GraphRunner around it: returns its static input, the graph and its static output."""
    static_x = x.clone()
    g, static_y = capture_graph(lambda: static_x * 2, warmup=2)
    return static_x, g, static_y


def _rebind_input(x):
    """Manual graph y = 2x; each call rebinds the name instead of copying into the static input."""
    static_x, g, static_y = _doubling_graph(x)

    def graphed(new_x):
        static_x = new_x  # <- pitfall  # noqa: F841 (the bug: a new name binding, the graph never sees it)
        g.replay()
        return static_y.clone()

    # The graph holds the buffer's address, not a reference: if nothing kept static_x alive, the
    # allocator would hand its memory to the next tensor and replay would read that instead.
    graphed.static_input = static_x
    return graphed


def _rebind_input_fixed(x):
    static_x, g, static_y = _doubling_graph(x)

    def graphed(new_x):
        static_x.copy_(new_x)
        g.replay()
        return static_y.clone()

    return graphed


def _overwritten_output(x):
    runner = GraphRunner(lambda t: t * 2, clone_outputs=False)

    def graphed(new_x):
        return runner(new_x)  # <- pitfall: the static output, overwritten by the next call

    return graphed


def _overwritten_output_fixed(x):
    runner = GraphRunner(lambda t: t * 2)  # clone_outputs=True (default)
    return runner


def _cpu_input(x):
    """Manual capture of a function whose input lives on the CPU: its copy to the GPU is inside capture."""
    static_x = x.cpu()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = (static_x * 2).cuda()  # <- pitfall: a pageable host-to-device copy inside capture

    def graphed(new_x):
        static_x.copy_(new_x)
        g.replay()
        return static_y.clone()

    return graphed


def _static_runner_check(p: Pitfall, x: torch.Tensor) -> dict:
    """Run a manual-graph reproducer through validate_replay on three different inputs."""
    inputs = [(_example(s),) for s in (1, 2, 3)]
    try:
        validate_replay(p.bad(x), lambda t: t * 2, inputs)
    except CgutilsError as exc:
        return _row(exc)
    except Exception as exc:  # capture itself refused it: record the raw error and its explanation
        return _raw_failure(exc)
    return _row(None, message="no error")


def _cpu_input_check(p: Pitfall, x: torch.Tensor) -> dict:
    row = _static_runner_check(p, x)
    try:
        GraphRunner(lambda t: t * 2)(x.cpu())
    except InputError as exc:
        row["runner_error"] = (str(exc).splitlines() or [""])[0][:300]
        row["runner_exception"] = type(exc).__name__
    return row


class Scaled(nn.Module):
    """y = x * self.scale, with ``scale`` a Python float: read when the graph is captured."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale  # <- pitfall: a Python number becomes a kernel argument at capture


class CpuScalar(nn.Module):
    """y = x * self.scale, with ``scale`` a 0-dim CPU tensor: passed to the kernel by value at capture."""

    def __init__(self):
        super().__init__()
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        return x * self.scale  # <- pitfall: a 0-dim CPU tensor is a scalar argument, baked in


def _baked(p: Pitfall, x: torch.Tensor) -> dict:
    model = p.bad()
    runner = GraphRunner(model, validate_replays=2)
    runner(x)
    if isinstance(model.scale, torch.Tensor):
        model.scale.fill_(3.0)
    else:
        model.scale = 3.0
    try:
        runner(_example(1))
    except CgutilsError as exc:
        return _row(exc)
    return _row(None, message="no error")


class ScaledFixed(nn.Module):
    """The fix: the scale lives in a CUDA buffer, so the graph reads it at replay time."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x):
        return x * self.scale


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x) * 2  # <- pitfall: in training mode dropout draws a new mask every call


def _dropout(p: Pitfall, x: torch.Tensor) -> dict:
    model = p.bad()  # nn.Module starts in training mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = GraphRunner(model)
    warned = any("training mode" in str(w.message) for w in caught)
    try:
        runner(x)
    except CgutilsError as exc:
        return _row(exc, warned=warned)
    return _row(None, message="no error", warned=warned)


def _new_shape(p: Pitfall, x: torch.Tensor) -> dict:
    runner = GraphRunner(p.bad)
    for n in (64, 128, 192, 256):
        runner(torch.randn(1, n, 256, device="cuda"))
    st = runner.stats
    return _row(None, message=f"{st.captures} graphs for 4 shapes, {st.memory_bytes / 2**20:.1f} MiB in all",
                captures=st.captures, memory_bytes=st.memory_bytes)


def _new_shape_fn(x):
    return torch.softmax(x @ x.transpose(-1, -2), -1) @ x  # <- pitfall: every new length is a new graph


# --- capture mechanics: warm-up, autotuning, streams ------------------------------------------------


def _raw_failure(exc: BaseException) -> dict:
    """The row for a capture that raised outside cgutils: the raw error and what explain() makes of it."""
    reset_rng_after_failed_capture()  # else every later random op fails ("Offset increment ...")
    why = explain(exc)
    return _row(exc, cause=why.key if why else "", explanation=str(why or ""))


def _manual_capture(fn: Callable[[], Any], *, on_default_stream: bool = False) -> dict:
    """Capture ``fn`` with no warm-up and report what happened (error explained, or replay vs eager)."""
    g = torch.cuda.CUDAGraph()
    try:
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
        return _raw_failure(exc)
    return _row(None, message=f"no error; replay vs eager max relative error {err:.3g}", max_rel_error=err)


def _no_warmup(x):
    lin = nn.Linear(8, 8).cuda()
    return lambda: lin(x)  # <- pitfall: captured on its first call, in a thread with no cuBLAS handle yet


def _no_warmup_check(p: Pitfall, x: torch.Tensor) -> dict:
    fn = p.bad(x)
    result: dict = {}
    # A new thread gets its own cuBLAS handle in PyTorch's per-thread pool, so its first matmul is
    # the cold start a fresh process would see.
    t = threading.Thread(target=lambda: result.update(_manual_capture(fn)))
    t.start()
    t.join()
    return result


def _cudnn_benchmark(x):
    conv = nn.Conv2d(3, 16, 3).cuda()
    img = torch.randn(1, 3, 97, 101, device="cuda")  # a shape no earlier call has autotuned
    return lambda: conv(img)  # <- pitfall: with cudnn.benchmark, the first call autotunes


def _cudnn_benchmark_check(p: Pitfall, x: torch.Tensor) -> dict:
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return _manual_capture(p.bad(x))
    finally:
        torch.backends.cudnn.benchmark = old


def _default_stream(x):
    return lambda: x * 2  # <- pitfall: captured with capture_begin() on the current stream, the default one


def _default_stream_check(p: Pitfall, x: torch.Tensor) -> dict:
    return _manual_capture(p.bad(x), on_default_stream=True)


PITFALLS: dict[str, Pitfall] = {p.key: p for p in [
    _sync_entry("item", ".item() inside forward", _item, "Tensor.item"),
    _sync_entry("cpu", ".cpu() of a CUDA tensor", _cpu, "Tensor.cpu"),
    _sync_entry("tolist", ".tolist() of a CUDA tensor", _tolist, "Tensor.tolist"),
    _sync_entry("print", "print() of a CUDA tensor", _print, "Tensor.__repr__"),
    _sync_entry("nonzero", "torch.nonzero (data-dependent shape)", _nonzero, "torch.nonzero"),
    _sync_entry("bool_mask", "boolean-mask indexing (data-dependent shape)", _bool_mask, "Tensor.__getitem__"),
    _sync_entry("python_if", "Python `if` on a CUDA tensor value", _python_if, "Tensor.__bool__"),
    _sync_entry("synchronize", "torch.cuda.synchronize() inside capture", _synchronize, "torch.cuda.synchronize"),
    Pitfall("rebind_input", "rebinding the input instead of copy_ (manual graph)", "silent", _rebind_input,
            _static_runner_check, "copy into the static input: static_x.copy_(new_x); GraphRunner does it",
            _rebind_input_fixed, {"exception": "CaptureError", "cause": "stale_input"}),
    Pitfall("overwritten_output", "keeping an output across the next replay", "silent", _overwritten_output,
            _static_runner_check, "clone before the next replay; GraphRunner(clone_outputs=True), the default",
            _overwritten_output_fixed, {"exception": "CaptureError", "cause": "overwritten_output"}),
    Pitfall("cpu_input", "CPU tensor inputs (a host copy inside capture)", "loud", _cpu_input, _cpu_input_check,
            "move inputs to the GPU before the graph and copy_ them into static buffers; GraphRunner refuses "
            "CPU tensors with InputError", None,
            {"exception": "RuntimeError", "cause": "host_copy", "runner_exception": "InputError"}),
    Pitfall("python_value", "a Python number baked in at capture", "silent", Scaled, _baked,
            "keep such values in CUDA buffers (register_buffer); GraphRunner(validate_replays=K) checks",
            ScaledFixed, {"exception": "CaptureError", "cause": "baked_value"}),
    Pitfall("cpu_scalar", "a 0-dim CPU tensor used as a scalar", "silent", CpuScalar, _baked,
            "make it a CUDA tensor (register_buffer) so replay reads its current value",
            ScaledFixed, {"exception": "CaptureError", "cause": "baked_value"}),
    Pitfall("dropout_train", "dropout in training mode (RNG)", "silent", DropoutNet, _dropout,
            "model.eval() for inference. The mask is not frozen: the default CUDA generator is registered, "
            "so each replay draws a new one; cgutils reports baked_value because replay no longer matches "
            "the eager call it is compared with",
            None, {"exception": "CaptureError", "cause": "baked_value", "warned": True}),
    Pitfall("new_shape", "a new input shape: one more graph and its memory", "cost", _new_shape_fn, _new_shape,
            "bucket the dynamic dim: GraphRunner(fn, buckets={1: (128, 256, 512)}) pads up and shares one pool",
            None, {"exception": "", "captures": 4}),
    Pitfall("no_warmup", "capture without warm-up (lazy cuBLAS handle and workspace)", "loud", _no_warmup,
            _no_warmup_check, "warm up on a side stream before capture (torch.cuda.graph does not; GraphRunner "
            "and capture_graph do)", None, {}),
    Pitfall("cudnn_benchmark", "cudnn.benchmark autotuning during capture", "loud", _cudnn_benchmark,
            _cudnn_benchmark_check, "warm up with the real shapes before capture so autotuning runs eagerly",
            None, {}),
    Pitfall("default_stream", "capture_begin on the default stream", "documented", _default_stream, _default_stream_check,
            "capture on a side stream anyway: torch.cuda.graph does, or wrap capture_begin/capture_end in "
            "torch.cuda.stream(s). The CUDA Runtime API (cudaStreamBeginCapture) says capture may not begin on "
            "cudaStreamLegacy; this torch accepted capture_begin() on its default stream (recorded outcome)", None, {}),
]}


def run(key: str) -> dict:
    """Run one catalogue entry on the GPU: the reproducer through cgutils, then the fix.

    Returns:
        A dict: ``key``, ``title``, ``kind``, ``exception`` (class name raised, "" if none), ``message``
        (its first line, or what happened), ``cause`` (cgutils' cause key), ``op`` and ``line`` (first
        sync point found, for syncs), ``expected_line`` (the marked line), ``fix``, ``fix_ok`` (the fix
        ran and matched eager; ``None`` when the entry has no fix function), plus entry-specific fields.

    Raises:
        InputError: unknown key.
        NoCudaError: no CUDA device.
    """
    if key not in PITFALLS:
        raise InputError(f"unknown pitfall {key!r}; the catalogue has {sorted(PITFALLS)}")
    if not torch.cuda.is_available():
        raise NoCudaError("the pitfall reproducers capture CUDA graphs and need a CUDA device")
    p = PITFALLS[key]
    x = _example()
    row = {"key": p.key, "title": p.title, "kind": p.kind, **p.diagnose(p, x),
           "expected_line": p.marked_line, "fix": p.fix, "fix_ok": _check_fix(p, x)}
    return row


def _check_fix(p: Pitfall, x: torch.Tensor) -> bool | None:
    if p.good is None:
        return None
    try:
        if p.key in SYNC_FIXES:
            runner = GraphRunner(p.good)
            return max_rel_error(runner(_example(1)), p.good(_example(1))) <= 1e-5
        if isinstance(p.good, type):  # module fixes: change the value after capture, replay must follow
            model = p.good().cuda()
            runner = GraphRunner(model, validate_replays=2)
            runner(x)
            model.scale.fill_(3.0)
            runner(_example(1))
            return True
        validate_replay(p.good(x), lambda t: t * 2, [(_example(s),) for s in (1, 2, 3)])
        return True
    except CaptureError:
        return False


def catalogue_table(keys: list[str] | None = None, progress: bool = True):
    """Run every entry (or ``keys``) and return one row per entry as a ``pandas.DataFrame``.

    Raises:
        NoCudaError: no CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    keys = list(PITFALLS) if keys is None else keys
    rows = []
    for k in tqdm(keys, desc="pitfalls", disable=not progress):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rows.append({**run(k), "status": "ok"})
            except Exception as exc:  # one broken entry must not hide the others
                p = PITFALLS[k]
                rows.append({"key": k, "title": p.title, "kind": p.kind, "fix": p.fix, "exception": "",
                             "message": "", "status": f"error: {type(exc).__name__}: {exc}"[:300]})
    return pd.DataFrame(rows)


def markdown_table(df) -> str:
    """The catalogue as a Markdown table (docs/pitfalls.md) from a recorded ``catalogue_table``.

    Outcomes (exception, message, cause, op, line) come from the recording; titles, kinds and fixes,
    which are documentation rather than measurements, from the current catalogue.
    """
    import re

    lines = ["| # | pitfall | kind | what happens (recorded) | cgutils diagnosis | fix |",
             "|---|---|---|---|---|---|"]
    text = [c for c in ("exception", "cause", "op", "original", "message") if c in df]
    df = df.astype({c: object for c in text}).fillna({c: "" for c in text})  # a CSV round trip leaves NaN
    for i, r in enumerate(df.itertuples(), 1):
        entry = PITFALLS.get(r.key) if hasattr(r, "key") else None
        title, fix, kind = (entry.title, entry.fix, entry.kind) if entry else (r.title, r.fix, r.kind)
        diag = r.exception or "no error"
        if getattr(r, "cause", ""):
            diag += f" (cause `{r.cause}`)"
        if getattr(r, "op", ""):
            diag += f": `{r.op}` at line {int(r.line)}"
        err = re.search(r"max relative error ([0-9.e+-]+)", r.message or "")
        if kind == "silent" and err:  # the silent outcome itself, not cgutils' report of it
            happens = f"no error from PyTorch; the replay is wrong by a relative error of {err.group(1)} against eager"
        else:
            happens = str(getattr(r, "original", "") or r.message)
        lines.append(f"| {i} | {title} | {kind} | {happens.replace('|', '/')} | {diag} | {fix.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
