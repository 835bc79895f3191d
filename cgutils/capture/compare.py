"""Replay against eager: relative error of nested outputs, default tolerances, and the checks that turn
a mismatch into a :class:`~cgutils.errors.CaptureError` naming its likely cause."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import CaptureError, InputError
from .nest import is_plain, same_value, tree_leaves

# the next step for a baked value, in every message that diagnoses one
LOCATE = ("cgutils.find_divergence(fn, *args) names the module whose replay goes wrong and the value that changed "
          "(it replays and compares module by module)")

def default_rtol(dtypes: set[torch.dtype]) -> float:
    """Tolerated relative error for outputs of these dtypes: 1e-2 with fp16/bf16, else 1e-3."""
    # Replay runs the same kernels on the same data, so results are usually bitwise equal; the slack
    # covers library heuristics that pick a different algorithm on the capture stream.
    low = {torch.float16, torch.bfloat16}
    return 1e-2 if dtypes & low else 1e-3


def rtol_for(out: Any, rtol: float | None = None, extra: set[torch.dtype] | None = None) -> float:
    """``rtol`` if given, else :func:`default_rtol` of the dtypes in ``out`` (and ``extra``, e.g. the inputs')."""
    if rtol is not None:
        return rtol
    dtypes = {t.dtype for _, t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    return default_rtol(dtypes | (extra or set()))


def max_rel_error(actual: Any, expected: Any) -> float:
    """Largest relative error between two nests of tensors: ``max|a-e| / max|e|`` per leaf.

    Integer and bool leaves count 0.0 when equal and ``inf`` otherwise; so do plain non-tensor leaves
    (numbers, strings, bytes, None, dtypes, devices, sizes, numpy arrays). Other objects (a model's
    cache object, say) are not compared. NaN or infinity where the other side has none (or another value)
    counts ``inf``: a replay that produces NaN never passes.

    Raises:
        InputError: if the two nests differ in structure or shapes, or a tensor is paired with a non-tensor.
    """
    a_leaves, e_leaves = tree_leaves(actual), tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise InputError(f"outputs differ in structure: {len(a_leaves)} vs {len(e_leaves)} leaves")
    worst = 0.0
    for (path, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        if not isinstance(a, torch.Tensor) and not isinstance(e, torch.Tensor):
            # Plain values must match; other objects (a transformers cache, a module) compare by
            # identity, so two correct calls would never agree: they are skipped.
            if is_plain(a) and is_plain(e) and not same_value(a, e):
                return float("inf")
            continue
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            raise InputError(f"{path}: cannot compare {type(a).__name__} with {type(e).__name__}; "
                             f"max_rel_error takes tensors or nests of tensors")
        if a.shape != e.shape:
            raise InputError(f"{path}: shape {tuple(a.shape)} vs {tuple(e.shape)}")
        worst = max(worst, _leaf_rel_error(a, e))
    return worst


def _leaf_rel_error(a: torch.Tensor, e: torch.Tensor) -> float:
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, e) else float("inf")
    if e.numel() == 0:
        return 0.0
    a64, e64 = a.detach().double(), e.detach().double()
    fin_e = torch.isfinite(e64)
    if not torch.equal(torch.isfinite(a64), fin_e):
        return float("inf")  # NaN or inf on one side only: never "close"
    special = ~fin_e
    if special.any() and not torch.equal(torch.nan_to_num(a64[special], nan=0.0),
                                         torch.nan_to_num(e64[special], nan=0.0)):
        return float("inf")  # +inf against -inf, or inf against NaN
    a64, e64 = a64[fin_e], e64[fin_e]
    if e64.numel() == 0:
        return 0.0
    scale = e64.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((a64 - e64).abs().max() / scale)


def validate_replay(replay: Callable[..., Any], eager: Callable[..., Any], inputs: list[tuple],
                    *, rtol: float | None = None):
    """Check a graphed function against eager on several inputs, the way a caller uses it.

    Calls ``replay(*args)`` for every ``args`` in ``inputs`` **keeping every output** (as a caller that
    stores results would), then ``eager(*args)`` for each, and compares. Holding the outputs first is
    what exposes the two silent static-buffer bugs: outputs that a later replay overwrote, and a
    replay that kept reading the captured input because the input was rebound instead of copied.

    Args:
        replay: the graphed callable under test (e.g. a function that copies into static inputs,
            replays and returns the static output).
        eager: the reference, same signature.
        inputs: at least two argument tuples with different values (identical inputs hide both bugs).
        rtol: tolerated relative error (default 1e-3, 1e-2 with fp16/bf16 outputs).

    Returns:
        ``pandas.DataFrame``, one row per input: ``input`` (index) and ``max_rel_error``.

    Raises:
        InputError: fewer than two inputs, identical inputs, or inputs that are not argument tuples.
        CaptureError: a replay output differs from eager; ``.cause`` is ``"overwritten_output"`` (every
            held output equals the last one, which was right when returned), ``"stale_input"`` (every
            output equals the first: replay ignores new inputs), ``"nonfinite"`` (NaN/inf only in the
            replay) or ``"baked_value"``; the message names the first wrong input and the fix.
    """
    import pandas as pd

    inputs = list(inputs)
    if not all(isinstance(args, tuple) for args in inputs):
        raise InputError("validate_replay takes inputs as a list of argument tuples, e.g. [(x1,), (x2,)], got "
                         + ", ".join(type(a).__name__ for a in inputs[:3]))
    if len(inputs) < 2:
        raise InputError("validate_replay needs at least two inputs with different values; with one, "
                         "stale inputs and overwritten outputs cannot show")
    if all(_identical(args, inputs[0]) for args in inputs[1:]):
        raise InputError("validate_replay got identical inputs; stale inputs and overwritten outputs only show "
                         "with different values (e.g. torch.randn_like for each)")
    held = [replay(*args) for args in inputs]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with torch.no_grad():
        expected = [eager(*args) for args in inputs]
    tol = rtol_for(expected, rtol)
    errors = [max_rel_error(h, e) for h, e in zip(held, expected, strict=True)]
    table = pd.DataFrame({"input": range(len(inputs)), "max_rel_error": errors})
    bad = [i for i, r in enumerate(errors) if not r <= tol]
    if not bad:
        return table
    same_as_last = all(max_rel_error(h, held[-1]) == 0 for h in held)
    same_as_first = all(max_rel_error(h, held[0]) == 0 for h in held)
    if not all(_finite(h) for h in held) and all(_finite(e) for e in expected):
        cause, why = "nonfinite", (
            "the replay produced NaN or inf where eager did not: it read memory that holds no valid "
            "input (a freed or never-written static buffer) or computed something else than eager")
    elif same_as_last and errors[-1] <= tol:
        cause, why = "overwritten_output", (
            "every output you kept equals the last one: the outputs are the graph's static output "
            "tensors, which each replay overwrites in place. Clone them before the next replay "
            "(out.clone()), or use GraphRunner with clone_outputs=True")
    elif same_as_first:
        cause, why = "stale_input", (
            "every output equals the first one: replay ignores the new inputs. A graph reads its "
            "inputs from the addresses captured; rebinding a Python name (static_x = new_x) never "
            "reaches it. Copy into the static input instead: static_x.copy_(new_x)")
    else:
        cause, why = "baked_value", (
            "the replay follows the inputs but computes something else than eager: a value was baked in "
            "at capture (a Python number or module attribute, a 0-dim CPU tensor, a branch on CPU-side "
            f"state). Pass such values as CUDA tensors; {LOCATE}")
    i = bad[0]
    raise CaptureError(f"replay differs from eager on input {i} of {len(inputs)} (max relative error "
                       f"{errors[i]:.3g} > rtol {tol:.3g}); {len(bad)} of {len(inputs)} inputs wrong. "
                       f"Likely cause: {why}.", max_rel_error=errors[i], cause=cause)


def check_first_replay(replayed: Any, expected: Any, rtol: float) -> float:
    """The first replay of a new graph against the last eager warm-up on the same static inputs.

    Returns:
        the max relative error (at most ``rtol``).

    Raises:
        CaptureError: ``cause="baked_value"``: the graph froze data-dependent work at capture.
    """
    rel = max_rel_error(replayed, expected)
    if not rel <= rtol:
        raise CaptureError(
            f"replay of the captured graph differs from eager: max relative error {rel:.3g} > "
            f"rtol {rtol:.3g}. Likely cause: data-dependent work that the graph froze at capture "
            f"(a value read on the CPU during capture, a Python branch), or state the function updates in "
            f"place where GraphRunner cannot see it (a tensor inside an object it does not inspect, so warm-up "
            f"calls advanced it). Keep control flow on the GPU (torch.where), keep state in module buffers or "
            f"arguments, or raise rtol if the difference is numerical noise. {LOCATE}.", max_rel_error=rel,
            cause="baked_value")
    return rel


def check_later_replay(replayed: Any, expected: Any, rtol: float, what: str) -> None:
    """A later replay (``validate_replays``) against an eager call on the caller's inputs.

    Raises:
        CaptureError: ``cause="baked_value"``: a Python value baked in at capture has changed since.
    """
    try:
        rel = max_rel_error(replayed, expected)
    except InputError as exc:  # eager now returns another structure or shape than the graph
        rel, why = float("inf"), f"eager now gives other outputs ({exc})"
    else:
        why = f"max relative error {rel:.3g} > rtol {rtol:.3g}"
    if not rel <= rtol:
        raise CaptureError(
            f"{what} differs from eager on the same inputs: {why}, "
            f"although replay matched eager at capture. Likely cause: a Python value was baked into "
            f"the graph at capture and has changed since (a module attribute or Python number read "
            f"in forward, a 0-dim CPU tensor used as a scalar, a Python branch on CPU-side state). "
            f"Pass such values as CUDA tensors; {LOCATE}. The graph is dropped: the next call captures a "
            f"new one with the values as they are then.", max_rel_error=rel, cause="baked_value")


def check_padding(replayed: Any, expected: Any, rtol: float) -> None:
    """A padded replay, already cut back to the caller's lengths, against eager at the caller's shapes.

    Raises:
        CaptureError: ``cause="padding"``: padding changed the outputs (their structure, or the values
            at the real positions).
    """
    try:
        rel = max_rel_error(replayed, expected)
    except InputError as exc:  # e.g. a non-tensor output that depends on the length
        raise CaptureError(f"padding to the bucket changed the outputs: {exc}; use buckets only for "
                           f"dims that the outputs keep (cut back) or drop as a whole",
                           cause="padding") from exc
    if not rel <= rtol:
        raise CaptureError(
            f"padding to the bucket changed the result on the real positions: max relative error "
            f"{rel:.3g} > rtol {rtol:.3g} against an eager call at the caller's shapes. The model "
            f"reads the padded positions (for attention: pass an attention mask, padded with 0, "
            f"e.g. pad_value={{'attention_mask': 0}}); use buckets only for dims that padding "
            f"leaves alone.", max_rel_error=rel, cause="padding")


def _finite(out: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for _, t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def _identical(a: tuple, b: tuple) -> bool:
    try:
        return max_rel_error(a, b) == 0
    except InputError:  # other shapes or structure: certainly not identical
        return False
