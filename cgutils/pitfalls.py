"""The pitfall catalogue: each way a CUDA graph fails, as a minimal reproducer that runs.

Every entry (:class:`~cgutils.pitfall_cases.Pitfall`) has a reproducer (``bad``, its offending line marked
``# <- pitfall``), what cgutils reports (``diagnose``: exception class, cause key, for syncs the op and line)
and the fix (``good``, tried by the entry's own ``check_fix``); :mod:`cgutils.pitfall_cases` runs and observes
them. Entries of real use (threads, state, failed captures, other threads, syncs outside PyTorch, unforked
streams, sampling, many shapes) are in :mod:`cgutils.pitfalls_real_use`, after these in :data:`PITFALLS`.
``run()`` runs one entry on the GPU, with the reproducers' files as the user's (``diagnose.user_code``: syncs
are reported at their lines); ``catalogue_table()`` runs all. Sources: the CUDA Programming Guide ("CUDA
Graphs", "Stream capture"), the PyTorch docs ("CUDA Graphs" in torch.cuda semantics); outcomes are what this
torch and driver do. docs/pitfalls.md quotes the sync reproducers' lines (111-145): code above keeps its length.
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn

from . import pitfall_cases as cases
from . import pitfalls_real_use as real_use
from .capture import GraphRunner, capture_graph
from .checks import require_cuda
from .diagnose import user_code
from .errors import InputError
from .pitfall_cases import KINDS, MARK, Pitfall, run_entry

__all__ = ["PITFALLS", "KINDS", "MARK", "Pitfall", "run", "run_entry", "catalogue_table", "markdown_table",
           "Scaled", "CpuScalar", "ScaledFixed", "DropoutNet"]


def run(key: str) -> dict:
    """Run one catalogue entry on the GPU: the reproducer through cgutils, then the fix.

    Args:
        key: an entry of :data:`PITFALLS`, e.g. ``"item"``.

    Returns:
        A dict: ``key``, ``title``, ``kind``, ``exception`` (class name raised, "" if none), ``message``
        (its first line, or what happened), ``cause`` (cgutils' cause key), ``op`` and ``line`` (first
        sync point found, for syncs), ``expected_line`` (the marked line), ``fix``, ``fix_ok`` (the entry's
        ``check_fix``: the fix ran and matched eager; ``None`` when it has no fix code), plus entry-specific fields.

    Raises:
        InputError: unknown key.
        NoCudaError: no CUDA device.
    """
    if key not in PITFALLS:
        raise InputError(f"unknown pitfall {key!r}; the catalogue has {sorted(PITFALLS)}")
    require_cuda("pitfalls.run()", "docs/pitfalls.md shows the recorded outcomes")
    with user_code([__file__, real_use.__file__]):  # sync points are reported at the reproducers' lines
        return run_entry(PITFALLS[key], cases.example())


def catalogue_table(keys: list[str] | None = None, progress: bool = True):
    """Run every entry (or ``keys``) and return one row per entry (see :func:`run`) as a ``pandas.DataFrame``.

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
    lines = ["| # | pitfall | kind | what happens (recorded) | cgutils diagnosis | fix |",
             "|---|---|---|---|---|---|"]
    text = [c for c in ("exception", "cause", "op", "original", "message", "happens") if c in df]
    df = df.astype({c: object for c in text}).fillna({c: "" for c in text})  # a CSV round trip leaves NaN
    for i, r in enumerate(df.itertuples(), 1):
        entry = PITFALLS.get(r.key) if hasattr(r, "key") else None
        title, fix, kind = (entry.title, entry.fix, entry.kind) if entry else (r.title, r.fix, r.kind)
        diag = r.exception or "no error"
        if getattr(r, "cause", ""):
            diag += f" (cause `{r.cause}`)"
        if getattr(r, "op", ""):
            diag += f": `{r.op}` at {_file_of(entry)}line {int(r.line)}"
        err = re.search(r"max relative error ([0-9.e+-]+)", r.message or "")
        if kind == "silent" and err and not getattr(r, "happens", ""):  # the silent outcome, not cgutils' report
            happens = f"no error from PyTorch; the replay is wrong by a relative error of {err.group(1)} against eager"
        else:
            happens = str(getattr(r, "happens", "") or getattr(r, "original", "") or r.message)
        lines.append(f"| {i} | {title} | {kind} | {happens.replace('|', '/')} | {diag} | {fix.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


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


def _new_shape_fn(x):
    return torch.softmax(x @ x.transpose(-1, -2), -1) @ x  # <- pitfall: every new length is a new graph


# --- capture mechanics: warm-up, autotuning, streams ------------------------------------------------


def _no_warmup(x):
    lin = nn.Linear(8, 8).cuda()
    return lambda: lin(x)  # <- pitfall: captured on its first call, in a thread with no cuBLAS handle yet


def _cudnn_benchmark(x):
    conv = nn.Conv2d(3, 16, 3).cuda()
    img = torch.randn(1, 3, 97, 101, device="cuda")  # a shape no earlier call has autotuned
    return lambda: conv(img)  # <- pitfall: with cudnn.benchmark, the first call autotunes


def _default_stream(x):
    return lambda: x * 2  # <- pitfall: captured with capture_begin() on the current stream, the default one


def _sync(op: str) -> dict:
    """What cgutils should report for a sync: GraphRunner's CaptureError, cause ``sync``, the op."""
    return {"exception": "CaptureError", "cause": "sync", "op": op}


PITFALLS: dict[str, Pitfall] = {p.key: p for p in [
    Pitfall(key="item", title=".item() inside forward", kind="loud", bad=_item, diagnose=cases.through_runner,
            fix="keep the value on the GPU: x * x.sum() (a 0-dim tensor broadcasts)",
            good=lambda x: x * x.sum(), check_fix=cases.graphed_fix_matches_eager, expect=_sync("Tensor.item")),
    Pitfall(key="cpu", title=".cpu() of a CUDA tensor", kind="loud", bad=_cpu, diagnose=cases.through_runner,
            fix="divide by the GPU tensor: x / x.abs().max()",
            good=lambda x: x / x.abs().max(), check_fix=cases.graphed_fix_matches_eager, expect=_sync("Tensor.cpu")),
    Pitfall(key="tolist", title=".tolist() of a CUDA tensor", kind="loud", bad=_tolist, diagnose=cases.through_runner,
            fix="count on the GPU: x * (x[:, 0] > 0).sum()",
            good=lambda x: x * (x[:, 0] > 0).sum(), check_fix=cases.graphed_fix_matches_eager,
            expect=_sync("Tensor.tolist")),
    Pitfall(key="print", title="print() of a CUDA tensor", kind="loud", bad=_print, diagnose=cases.through_runner,
            fix="print outside the graphed function (after replay, from the output)",
            good=lambda x: x * 2, check_fix=cases.graphed_fix_matches_eager, expect=_sync("Tensor.__repr__")),
    Pitfall(key="nonzero", title="torch.nonzero (data-dependent shape)", kind="loud", bad=_nonzero,
            diagnose=cases.through_runner,
            fix="fixed-size output: torch.nonzero_static(mask, size=x.numel()) pads with -1",
            good=lambda x: torch.nonzero_static(x > 0, size=x.numel(), fill_value=-1),
            check_fix=cases.graphed_fix_matches_eager, expect=_sync("torch.nonzero")),
    Pitfall(key="bool_mask", title="boolean-mask indexing (data-dependent shape)", kind="loud", bad=_bool_mask,
            diagnose=cases.through_runner, fix="mask instead of index: torch.where(x > 0, x, 0).sum()",
            good=lambda x: torch.where(x > 0, x, 0).sum(), check_fix=cases.graphed_fix_matches_eager,
            expect=_sync("Tensor.__getitem__")),
    Pitfall(key="python_if", title="Python `if` on a CUDA tensor value", kind="loud", bad=_python_if,
            diagnose=cases.through_runner, fix="both branches on the GPU: torch.where(x.sum() > 0, x * 2, -x)",
            good=lambda x: torch.where(x.sum() > 0, x * 2, -x), check_fix=cases.graphed_fix_matches_eager,
            expect=_sync("Tensor.__bool__")),
    Pitfall(key="synchronize", title="torch.cuda.synchronize() inside capture", kind="loud", bad=_synchronize,
            diagnose=cases.through_runner,
            fix="drop it: replay is ordered on its stream; synchronise after replay if the CPU needs the result",
            good=lambda x: x * 2, check_fix=cases.graphed_fix_matches_eager, expect=_sync("torch.cuda.synchronize")),
    Pitfall(key="rebind_input", title="rebinding the input instead of copy_ (manual graph)", kind="silent",
            bad=_rebind_input, diagnose=cases.through_validate_replay,
            fix="copy into the static input: static_x.copy_(new_x); GraphRunner does it",
            good=_rebind_input_fixed, check_fix=cases.replay_fix_validates,
            expect={"exception": "CaptureError", "cause": "stale_input"}),
    Pitfall(key="overwritten_output", title="keeping an output across the next replay", kind="silent",
            bad=_overwritten_output, diagnose=cases.through_validate_replay,
            fix="clone before the next replay; GraphRunner(clone_outputs=True), the default",
            good=_overwritten_output_fixed, check_fix=cases.replay_fix_validates,
            expect={"exception": "CaptureError", "cause": "overwritten_output"}),
    Pitfall(key="cpu_input", title="CPU tensor inputs (a host copy inside capture)", kind="loud", bad=_cpu_input,
            diagnose=cases.cpu_input_check,
            fix="move inputs to the GPU before the graph and copy_ them into static buffers; GraphRunner refuses "
                "CPU tensors with InputError",
            expect={"exception": "RuntimeError", "cause": "host_copy", "runner_exception": "InputError"}),
    Pitfall(key="python_value", title="a Python number baked in at capture", kind="silent", bad=Scaled,
            diagnose=cases.baked_value_check,
            fix="keep such values in CUDA buffers (register_buffer); GraphRunner(validate_replays=K) checks",
            good=ScaledFixed, check_fix=cases.module_fix_follows_changes,
            expect={"exception": "CaptureError", "cause": "baked_value"}),
    Pitfall(key="cpu_scalar", title="a 0-dim CPU tensor used as a scalar", kind="silent", bad=CpuScalar,
            diagnose=cases.baked_value_check,
            fix="make it a CUDA tensor (register_buffer) so replay reads its current value",
            good=ScaledFixed, check_fix=cases.module_fix_follows_changes,
            expect={"exception": "CaptureError", "cause": "baked_value"}),
    Pitfall(key="dropout_train", title="dropout in training mode (RNG)", kind="silent", bad=DropoutNet,
            diagnose=cases.training_mode_check,
            fix="model.eval() for inference; GraphRunner warns about a module in training mode. The mask is not "
                "frozen: dropout draws from the default CUDA generator, which the graph registers, so each replay "
                "draws a new one",
            expect={"warned": True}),
    Pitfall(key="new_shape", title="a new input shape: one more graph and its memory", kind="cost",
            bad=_new_shape_fn, diagnose=cases.new_shapes_check,
            fix="bucket the dynamic dim: GraphRunner(fn, buckets={1: (128, 256, 512)}) pads up and shares one pool",
            expect={"exception": "", "captures": 4}),
    Pitfall(key="no_warmup", title="capture without warm-up (lazy cuBLAS handle and workspace)", kind="loud",
            bad=_no_warmup, diagnose=cases.cold_thread_check,
            fix="warm up on a side stream before capture (torch.cuda.graph does not; GraphRunner "
                "and capture_graph do)",
            expect={}),
    Pitfall(key="cudnn_benchmark", title="cudnn.benchmark autotuning during capture", kind="loud",
            bad=_cudnn_benchmark, diagnose=cases.cudnn_benchmark_check,
            fix="warm up with the real shapes before capture so autotuning runs eagerly",
            expect={}),
    Pitfall(key="default_stream", title="capture_begin on the default stream", kind="documented",
            bad=_default_stream, diagnose=cases.default_stream_check,
            fix="capture on a side stream: torch.cuda.graph does, or wrap capture_begin/capture_end in "
                "torch.cuda.stream(s). The CUDA Runtime API (cudaStreamBeginCapture) says capture may not begin on "
                "cudaStreamLegacy",
            expect={}),
]}
PITFALLS.update(real_use.REAL_USE)  # the entries of real use, after these


def _file_of(entry: Pitfall | None) -> str:
    """The reproducer's file, for an entry whose reproducer is not in this file ("" for this file's)."""
    module = getattr(entry.bad, "__module__", __name__) if entry is not None else __name__
    return "" if module == __name__ else f"{module.rsplit('.', 1)[-1]}.py "
