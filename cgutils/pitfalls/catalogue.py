"""The pitfall catalogue: each way a CUDA graph fails, as an entry that runs, and the table of them all.

Every entry (:class:`~cgutils.pitfalls.entry.Pitfall`) has a reproducer (``bad``, in :mod:`.reproducers`, its
offending line marked ``# <- pitfall``), what cgutils reports (``diagnose``: exception class, cause key, for
syncs the op and line), and the fix (``good``, tried by the entry's own ``check_fix``); the steps that run and
observe them are in :mod:`.steps` and :mod:`.outside`. The single-line entries come first, then those of real
use (threads, state, failed captures, other threads, syncs outside PyTorch, side streams, sampling, many
shapes). ``run()`` runs one entry on the GPU with the reproducers' file as the user's code, so that syncs are
reported at its lines; ``catalogue_table()`` runs all; ``markdown_table()`` is docs/pitfalls.md's table.
Sources: the CUDA Programming Guide ("CUDA Graphs", "Stream capture"), the PyTorch docs ("CUDA Graphs" in
torch.cuda semantics); outcomes are what this torch and driver do.
"""

from __future__ import annotations

import re
import warnings

import torch

from ..checks import require_cuda
from ..diagnose import user_code
from ..errors import InputError
from . import outside, steps
from . import reproducers as r
from .entry import Pitfall, example, run_entry

__all__ = ["PITFALLS", "REAL_USE", "run", "catalogue_table", "markdown_table"]


def _sync(op: str) -> dict:
    """What cgutils should report for a sync: GraphRunner's CaptureError, cause ``sync``, the op."""
    return {"exception": "CaptureError", "cause": "sync", "op": op}


_ONE_LINE = [  # one offending line each, or one setting
    Pitfall(key="item", title=".item() inside forward", kind="loud", bad=r.item, diagnose=steps.through_runner,
            fix="keep the value on the GPU: x * x.sum() (a 0-dim tensor broadcasts)",
            good=lambda x: x * x.sum(), check_fix=steps.graphed_fix_matches_eager, expect=_sync("Tensor.item")),
    Pitfall(key="cpu", title=".cpu() of a CUDA tensor", kind="loud", bad=r.cpu, diagnose=steps.through_runner,
            fix="divide by the GPU tensor: x / x.abs().max()",
            good=lambda x: x / x.abs().max(), check_fix=steps.graphed_fix_matches_eager, expect=_sync("Tensor.cpu")),
    Pitfall(key="tolist", title=".tolist() of a CUDA tensor", kind="loud", bad=r.tolist, diagnose=steps.through_runner,
            fix="count on the GPU: x * (x[:, 0] > 0).sum()",
            good=lambda x: x * (x[:, 0] > 0).sum(), check_fix=steps.graphed_fix_matches_eager,
            expect=_sync("Tensor.tolist")),
    Pitfall(key="print", title="print() of a CUDA tensor", kind="loud", bad=r.print_in_forward, diagnose=steps.through_runner,
            fix="print outside the graphed function (after replay, from the output)",
            good=lambda x: x * 2, check_fix=steps.graphed_fix_matches_eager, expect=_sync("Tensor.__repr__")),
    Pitfall(key="nonzero", title="torch.nonzero (data-dependent shape)", kind="loud", bad=r.nonzero,
            diagnose=steps.through_runner,
            fix="fixed-size output: torch.nonzero_static(mask, size=x.numel()) pads with -1",
            good=lambda x: torch.nonzero_static(x > 0, size=x.numel(), fill_value=-1),
            check_fix=steps.graphed_fix_matches_eager, expect=_sync("torch.nonzero")),
    Pitfall(key="bool_mask", title="boolean-mask indexing (data-dependent shape)", kind="loud", bad=r.bool_mask,
            diagnose=steps.through_runner, fix="mask instead of index: torch.where(x > 0, x, 0).sum()",
            good=lambda x: torch.where(x > 0, x, 0).sum(), check_fix=steps.graphed_fix_matches_eager,
            expect=_sync("Tensor.__getitem__")),
    Pitfall(key="python_if", title="Python `if` on a CUDA tensor value", kind="loud", bad=r.python_if,
            diagnose=steps.through_runner, fix="both branches on the GPU: torch.where(x.sum() > 0, x * 2, -x)",
            good=lambda x: torch.where(x.sum() > 0, x * 2, -x), check_fix=steps.graphed_fix_matches_eager,
            expect=_sync("Tensor.__bool__")),
    Pitfall(key="synchronize", title="torch.cuda.synchronize() inside capture", kind="loud", bad=r.synchronize,
            diagnose=steps.through_runner,
            fix="drop it: replay is ordered on its stream; synchronise after replay if the CPU needs the result",
            good=lambda x: x * 2, check_fix=steps.graphed_fix_matches_eager, expect=_sync("torch.cuda.synchronize")),
    Pitfall(key="rebind_input", title="rebinding the input instead of copy_ (manual graph)", kind="silent",
            bad=r.rebind_input, diagnose=steps.through_validate_replay,
            fix="copy into the static input: static_x.copy_(new_x); GraphRunner does it",
            good=r.rebind_input_fixed, check_fix=steps.replay_fix_validates,
            expect={"exception": "CaptureError", "cause": "stale_input"}),
    Pitfall(key="overwritten_output", title="keeping an output across the next replay", kind="silent",
            bad=r.overwritten_output, diagnose=steps.through_validate_replay,
            fix="clone before the next replay; GraphRunner(clone_outputs=True), the default",
            good=r.overwritten_output_fixed, check_fix=steps.replay_fix_validates,
            expect={"exception": "CaptureError", "cause": "overwritten_output"}),
    Pitfall(key="cpu_input", title="CPU tensor inputs (a host copy inside capture)", kind="loud", bad=r.cpu_input,
            diagnose=steps.cpu_input_check,
            fix="move inputs to the GPU before the graph and copy_ them into static buffers; GraphRunner refuses "
                "CPU tensors with InputError",
            expect={"exception": "RuntimeError", "cause": "host_copy", "runner_exception": "InputError"}),
    Pitfall(key="python_value", title="a Python number baked in at capture", kind="silent", bad=r.Scaled,
            diagnose=steps.baked_value_check,
            fix="keep such values in CUDA buffers (register_buffer); GraphRunner(validate_replays=K) checks",
            good=r.ScaledFixed, check_fix=steps.module_fix_follows_changes,
            expect={"exception": "CaptureError", "cause": "baked_value"}),
    Pitfall(key="cpu_scalar", title="a 0-dim CPU tensor used as a scalar", kind="silent", bad=r.CpuScalar,
            diagnose=steps.baked_value_check,
            fix="make it a CUDA tensor (register_buffer) so replay reads its current value",
            good=r.ScaledFixed, check_fix=steps.module_fix_follows_changes,
            expect={"exception": "CaptureError", "cause": "baked_value"}),
    Pitfall(key="dropout_train", title="dropout in training mode (RNG)", kind="safe", bad=r.DropoutNet,
            diagnose=steps.training_mode_check,
            fix="model.eval() for inference; GraphRunner warns about a module in training mode. The mask is not "
                "frozen: dropout draws from the default CUDA generator, which the graph registers, so each replay "
                "draws a new one",
            expect={"warned": True, "differs_across_replays": True}),
    Pitfall(key="new_shape", title="a new input shape: one more graph and its memory", kind="cost",
            bad=r.new_shape_fn, diagnose=steps.new_shapes_check,
            fix="bucket the dynamic dim: GraphRunner(fn, buckets={1: (128, 256, 512)}) pads up and shares one pool",
            expect={"exception": "", "captures": 4}),
    Pitfall(key="no_warmup", title="capture without warm-up (lazy cuBLAS handle and workspace)", kind="loud",
            bad=r.no_warmup, diagnose=steps.cold_thread_check,
            fix="warm up on a side stream before capture (torch.cuda.graph does not; GraphRunner "
                "and capture_graph do)",
            expect={}),
    Pitfall(key="cudnn_benchmark", title="cudnn.benchmark autotuning during capture", kind="loud",
            bad=r.cudnn_benchmark, diagnose=steps.cudnn_benchmark_check,
            fix="warm up with the real shapes before capture so autotuning runs eagerly",
            expect={}),
    Pitfall(key="default_stream", title="capture_begin on the default stream", kind="documented",
            bad=r.default_stream, diagnose=steps.default_stream_check,
            fix="capture on a side stream: torch.cuda.graph does, or wrap capture_begin/capture_end in "
                "torch.cuda.stream(s). The CUDA Runtime API (cudaStreamBeginCapture) says capture may not begin on "
                "cudaStreamLegacy",
            expect={}),
]

_REAL_USE = [  # situations of real use: threads, state, failed captures, other threads, syncs outside PyTorch

    Pitfall(key="shared_threads", title="one graph shared by threads, no lock", kind="silent", bad=r.shared_graph,
            diagnose=outside.threads_check,
            fix="one runner per thread, or a lock around copy-in/replay/copy-out; GraphRunner locks and orders "
                "streams with events",
            good=r.shared_runner, check_fix=outside.threads_fix_ok,
            expect={"exception": "", "runner_wrong": 0, "runner_thread_errors": 0}),
    Pitfall(key="inplace_input", title="forward updates its input in place", kind="silent", bad=r.NormalizeInPlace,
            diagnose=steps.inplace_input_check,
            fix="GraphRunner copies inputs updated in place back to the caller's tensors after each replay (a copy "
                "per call); or normalise out of place: img = (img - mean) / std",
            good=r.NormalizeOutOfPlace, check_fix=steps.module_fix_matches_eager,
            expect={"exception": "", "matches_eager": True, "caller_tensor_matches": True}),
    Pitfall(key="stateful_buffer", title="state advanced in place (a position counter and a cache)", kind="silent",
            bad=r.DecodeStep, diagnose=steps.stateful_check,
            fix="keep the state in CUDA buffers updated in place; GraphRunner undoes its extra warm-up and validation "
                "calls so the caller sees one call per call. With a manual graph, reset the state after warm-up",
            expect={"exception": "", "state_matches": True, "pos": steps.STEPS}),
    Pitfall(key="rebound_attribute", title="forward stores a tensor on self", kind="silent", bad=r.KeepsHidden,
            diagnose=steps.rebound_check,
            fix="return what you need from forward; GraphRunner warns and sets the attribute to the replayed tensor "
                "after each replay",
            good=r.ReturnsHidden, check_fix=steps.module_fix_matches_eager,
            expect={"exception": "", "warned": True, "attribute_follows": True}),
    Pitfall(key="failed_capture_stream", title="state left behind by a failed capture", kind="loud",
            bad=r.item_in_forward, diagnose=steps.failed_capture_check,
            fix="after a failed torch.cuda.graph capture, put the stream back (torch.cuda.set_stream(saved)) and "
                "reset the RNG (cgutils.reset_rng_after_failed_capture()); GraphRunner and capture_graph do both",
            expect={"exception": "CaptureError", "cause": "sync", "op": "Tensor.item", "runner_stream_restored": True,
                    "rng_ok": True}),
    Pitfall(key="other_thread_work", title="another thread's CUDA work during capture", kind="loud",
            bad=r.prefetch_loop, diagnose=outside.other_thread_check,
            fix="capture in thread-local mode: torch.cuda.graph(g, capture_error_mode=\"thread_local\") (GraphRunner "
                "and capture_graph do), or pause the other threads while capturing",
            expect={"exception": ""}),
    Pitfall(key="external_sync", title="a sync outside PyTorch (an extension calling the CUDA runtime)",
            kind="loud", bad=r.external_sync, diagnose=outside.external_sync_check,
            fix="move the call out of the graphed function, or make the extension asynchronous (no "
                "cudaDeviceSynchronize/cudaStreamSynchronize, blocking cudaMemcpy or cudaMalloc); find it with "
                "`nsys profile -t cuda` around one eager call",
            good=r.double, check_fix=steps.graphed_fix_matches_eager,
            expect={"exception": "CaptureError", "cause": "external_sync"}),
    Pitfall(key="unforked_stream", title="a side stream joined back but never forked", kind="loud",
            bad=r.unforked_stream, diagnose=steps.through_runner,
            fix="fork before using the side stream: side.wait_stream(torch.cuda.current_stream()), then join back",
            good=r.forked_stream, check_fix=steps.graphed_fix_matches_eager, expect={"exception": "CaptureError", "cause": "unforked_stream"}),
    Pitfall(key="sampling", title="sampling on purpose (torch.multinomial)", kind="safe", bad=r.Sampler,
            diagnose=steps.sampling_check,
            fix="nothing to fix: the default CUDA generator is registered with the graph, so each replay draws new "
                "samples, and GraphRunner validates from the same generator state (cgutils used to report "
                "baked_value and advise model.eval()); seed with torch.cuda.manual_seed for repeatable runs",
            expect={"exception": "", "differs_across_replays": True}),
    Pitfall(key="many_shapes", title="many input shapes: a graph each, and a warning", kind="cost", bad=r.per_length,
            diagnose=steps.many_shapes_check,
            fix="bucket the dynamic dim: GraphRunner(fn, buckets={1: (64, 128, 256)}) pads up to a few sizes",
            expect={"exception": "", "warned": True, "captures": len(steps.LENGTHS)}),
]
PITFALLS: dict[str, Pitfall] = {p.key: p for p in [*_ONE_LINE, *_REAL_USE]}
REAL_USE: dict[str, Pitfall] = {p.key: p for p in _REAL_USE}  # the entries of real use, last in PITFALLS


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
    with user_code([r.__file__]):  # sync points are reported at the reproducers' lines
        return run_entry(PITFALLS[key], example())


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
    for i, row in enumerate(df.itertuples(), 1):
        entry = PITFALLS.get(row.key) if hasattr(row, "key") else None
        title, fix, kind = (entry.title, entry.fix, entry.kind) if entry else (row.title, row.fix, row.kind)
        diag = row.exception or "no error"
        if getattr(row, "cause", ""):
            diag += f" (cause `{row.cause}`)"
        if getattr(row, "op", ""):
            diag += f": `{row.op}` at reproducers.py line {int(row.line)}"
        err = re.search(r"max relative error ([0-9.e+-]+)", row.message or "")
        if kind == "silent" and err and not getattr(row, "happens", ""):  # the silent outcome, not cgutils' report
            happens = f"no error from PyTorch; the replay is wrong by a relative error of {err.group(1)} against eager"
        else:
            happens = str(getattr(row, "happens", "") or getattr(row, "original", "") or row.message)
        lines.append(f"| {i} | {title} | {kind} | {happens.replace('|', '/')} | {diag} | {fix.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
