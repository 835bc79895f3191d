"""Where a replay goes wrong: the first module whose replayed output differs from eager's.

A runner's validation says *that* a replay differs from eager. This says *where*: it captures the function with
every submodule's output kept (a forward hook clones it while the graph is captured, so the clone lives in the
graph's pool and every replay rewrites it), replays, runs the function eagerly on the same inputs with the same
hooks, and compares the two module by module in the order the modules finished. Children finish before their
parents, so the first module that differs is the innermost, earliest place the two runs part.

For that module it also says what its inputs and its own state looked like, which names the usual kinds of fault:

- its inputs already differed, though no module before it did: the divergence starts in code between modules
  (a functional call in a parent's ``forward``);
- a parameter, buffer or tensor attribute is no longer the tensor captured (replaced after capture: the graph reads
  the old one);
- a plain Python attribute of it changed since capture (a number read at capture and baked into the graph);
- it drew random numbers from the default CUDA generator (its offset moved while the module ran eagerly; draws from
  a generator of your own are not seen and read as "inside");
- otherwise its inputs were equal and nothing above changed: the fault is inside it (an in-place update of a
  captured tensor, a value computed on the host, a side stream never joined).

Cost: one capture (no validation), one replay and one eager call, and memory for every submodule's outputs twice
(one forward's activations, kept). Tested on the CPU with a simulated capture (``tests/test_divergence.py``); what
only a GPU replay shows (values frozen at capture) is not yet measured there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..capture.compare import default_rtol, max_rel_error
from ..capture.nest import tree_leaves
from ..capture.weights import module_of
from ..errors import InputError

_PLAIN = (bool, int, float, complex, str)


@dataclass
class Divergence:
    """What :func:`find_divergence` found.

    Attributes:
        module: qualified name of the first module whose replayed output differs from eager beyond ``rtol``
            (``""`` is the root), or ``None`` when every module agreed.
        max_rel_error: that module's largest relative error, replay against eager (``max|a-e| / max|e|``).
        kind: ``"between_modules"``, ``"replaced_tensor"``, ``"python_value"``, ``"random"``, ``"inside"``, or
            ``""`` when nothing diverged.
        detail: the names behind ``kind`` (the replaced tensors, the changed attributes), in words.
        fix: what to do about it.
        table: one row per module call in the order the modules finished: ``module``, ``max_rel_error``,
            ``diverged`` (a ``pandas.DataFrame``).
    """

    module: str | None
    max_rel_error: float
    kind: str
    detail: str
    fix: str
    table: Any = field(repr=False, default=None)

    def __str__(self) -> str:
        if self.module is None:
            return "every module's replayed output equals eager's"
        where = self.module or "the root module"
        return (f"first divergence in {where} (max relative error {self.max_rel_error:.3g}): {self.kind}"
                f"{': ' + self.detail if self.detail else ''}. Fix: {self.fix}")


_FIXES = {
    "between_modules": "look at the code between the modules in the parent's forward: a value read on the host, "
                       "a tensor created there at capture",
    "replaced_tensor": "copy new values into the captured tensors (load_state_dict without assign=True, "
                       "param.copy_()) or capture again",
    "python_value": "keep the value in a CUDA tensor (register_buffer) and update it in place, or capture again "
                    "after changing it",
    "random": "draw from the default CUDA generator (registered with the graph) or draw before the captured call",
    "inside": "look inside the module: an in-place update of a captured tensor, a value computed on the host, "
              "a side stream not joined back",
}


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if isinstance(v, _PLAIN) and not k.startswith("_")}


def _tensors_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Its own parameters, buffers and plain tensor attributes (``self.table = t``: a graph reads those by address
    too, and the runner's weight check does not watch them)."""
    found = dict(module.named_parameters(recurse=False))
    found.update((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)
    found.update((k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("_"))
    return found


def _clone(out: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for _, t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Recorder:
    """Forward hooks on every submodule of ``root``: outputs and inputs of the last pass, in finishing order."""

    def __init__(self, root: nn.Module):
        self.names = {m: n for n, m in root.named_modules()}
        self.root = root
        self.passes: list[list[tuple[str, list, list, int]]] = []
        self.handles = [root.register_forward_pre_hook(self._new_pass)]
        self.handles += [m.register_forward_hook(self._record, with_kwargs=True) for m in self.names]
        self.handles += [m.register_forward_pre_hook(self._mark, with_kwargs=True) for m in self.names]
        self.offsets: dict[int, int] = {}

    def _new_pass(self, module, args):
        self.passes.append([])

    def _mark(self, module, args, kwargs):
        self.offsets[id(module)] = _rng_offset()

    def _record(self, module, args, kwargs, out):
        if not self.passes:
            self.passes.append([])
        drew = int(_rng_offset() != self.offsets.pop(id(module), None))
        self.passes[-1].append((self.names[module], _clone(out), _clone((args, kwargs)), drew))

    def remove(self):
        for h in self.handles:
            h.remove()


def _rng_offset() -> int:
    """The default CUDA generator's offset (moves with every draw), or the CPU generator's state hash off CUDA."""
    if torch.cuda.is_available():
        try:
            return int(torch.cuda.default_generators[torch.cuda.current_device()].get_offset())
        except (AttributeError, RuntimeError):  # capture in progress, or a torch without get_offset
            return -1
    return hash(torch.random.get_rng_state().numpy().tobytes())


def find_divergence(fn: Callable[..., Any], *args: Any, change: Callable[[], Any] | None = None,
                    replay_args: tuple | None = None, replay_kwargs: dict | None = None, rtol: float | None = None,
                    backend: Any = None, **kwargs: Any) -> Divergence:
    """Capture ``fn`` with every submodule's output kept, optionally apply a change, replay, run eagerly, and name
    the first module whose replayed output differs from eager's.

    Args:
        fn: an ``nn.Module``, or a bound method or ``functools.partial`` of one (its submodules are watched).
        *args, **kwargs: the call captured, as for :class:`cgutils.GraphRunner` (CUDA tensors, nested or not).
        change: called after the capture and before the compared replay: what your program does between calls
            (new weights, a changed attribute, a counter advanced). Most replay faults only show after one.
        replay_args, replay_kwargs: the compared call (default: the captured one's arguments).
        rtol: tolerated relative error per module output (default 1e-3, 1e-2 when the outputs hold fp16/bf16).
        backend: passed to the GraphRunner that captures (tests: a CPU simulation of capture and replay).

    Returns:
        :class:`Divergence`. Outputs are compared per module call, in the order the modules finished; a module
        called twice is compared call by call.

    Raises:
        InputError: ``fn`` is not a module or a method of one; the replay and eager calls ran different modules
            (data-dependent control flow in Python: capture one path at a time).
        CaptureError: the capture itself failed (its message says why).
    """
    from ..capture.runner import GraphRunner

    root = module_of(fn)
    if root is None:
        raise InputError(f"find_divergence needs an nn.Module or a method of one, to watch its submodules; got "
                         f"{type(fn).__name__}. Pass the module itself (find_divergence(model, x)).")
    r_args = args if replay_args is None else tuple(replay_args)
    r_kwargs = kwargs if replay_kwargs is None else dict(replay_kwargs)
    recorder = _Recorder(root)
    try:
        runner = GraphRunner(fn, validate=False, **({"backend": backend} if backend is not None else {}))
        runner(*args, **kwargs)  # warm-up, then the capture pass: its clones live in the pool
        del recorder.passes[:-1]  # the warm-up passes' clones are not needed
        watched = {m: (_tensors_of(m), _plain_attributes(m)) for m in root.modules()}  # as captured
        if change is not None:
            change()
        runner(*r_args, **r_kwargs)  # a replay rewrites the capture pass's clones (a simulation records a pass)
        if backend is None and torch.cuda.is_available():
            torch.cuda.synchronize()
        replayed = recorder.passes[-1]
        recorder.passes.clear()
        with torch.no_grad():
            fn(*r_args, **r_kwargs)
        eager = recorder.passes[-1]
    finally:
        recorder.remove()
    if [r[0] for r in replayed] != [e[0] for e in eager]:
        raise InputError("the replay and the eager call ran different modules (control flow in Python that depends "
                         "on the data): find_divergence compares one path; capture and compare each path on its own")
    rows, first = [], None
    for (name, r_out, r_in, _), (_, e_out, e_in, drew) in zip(replayed, eager, strict=True):
        tol = rtol if rtol is not None else default_rtol({t.dtype for t in e_out})
        err = max_rel_error(r_out, e_out) if r_out else 0.0
        diverged = not err <= tol
        rows.append({"module": name, "max_rel_error": err, "diverged": diverged})
        if diverged and first is None:
            first = (name, err, r_in, e_in, drew, tol)
    import pandas as pd

    table = pd.DataFrame(rows, columns=["module", "max_rel_error", "diverged"])
    if first is None:
        return Divergence(None, 0.0, "", "", "", table)
    name, err, r_in, e_in, drew, tol = first
    kind, detail = _classify(root.get_submodule(name), watched, r_in, e_in, drew, tol)
    return Divergence(name, err, kind, detail, _FIXES[kind], table)


def _classify(module: nn.Module, watched: dict, r_in: list, e_in: list, drew: int, tol: float) -> tuple[str, str]:
    tensors_then, plain_then = watched.get(module, ({}, {}))
    replaced = [n for n, t in _tensors_of(module).items() if tensors_then.get(n) is not t]
    if replaced:
        return "replaced_tensor", ", ".join(replaced)
    changed = [f"{k}: {plain_then[k]!r} at capture, {v!r} now" for k, v in _plain_attributes(module).items()
               if k in plain_then and plain_then[k] != v]
    if changed:
        return "python_value", "; ".join(changed)
    if len(r_in) == len(e_in) and r_in and not max_rel_error(r_in, e_in) <= tol:
        return "between_modules", "its inputs already differed, though no module that finished before it did"
    if drew:
        return "random", "it drew random numbers"
    return "inside", ""
