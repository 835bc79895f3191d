"""Where a replay goes wrong: the first module whose replayed output differs from eager's.

A runner's validation says *that* a replay differs from eager. This says *where*: it captures the function with
every submodule's output kept (a forward hook clones it while the graph is captured, so the clone lives in the
graph's pool and every replay rewrites it), replays, runs the function eagerly from the state the replay started
from (buffers, tensor inputs and random generators put back), and compares the two module call by module call in
the order the calls finished. Children finish before their parents, so the first call that differs is the
innermost, earliest place the two runs part. The function's own output is compared last.

For that module it also says what its inputs and its own state looked like, which names the usual kinds of fault:

- its inputs already differed, though no module before it did: the divergence starts in code between modules
  (a functional call in a parent's ``forward``; a parent's changed attribute is named);
- a parameter, buffer or tensor attribute is no longer the tensor captured (replaced after capture: the graph reads
  the old one);
- a plain Python attribute of it changed since capture (a number read at capture and baked into the graph);
- it drew random numbers from the default CUDA generator and still differs from the same generator state;
- otherwise its inputs were equal and nothing above changed: the fault is inside it (an in-place update of a
  captured tensor, a value computed on the host, random numbers from a generator the graph does not know).

Cost: one capture (no validation), two replays and one eager call; memory for every submodule call's outputs and
inputs, twice (one forward's activations kept, plus its inputs), and copies of the root's buffers and parameters
(two of those the function updates in place).
Tested on the CPU with a simulated capture (``tests/test_divergence.py``); the seeded faults of
``benchmarks/divergence_faults.py`` are its GPU evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..capture.compare import default_rtol, max_rel_error
from ..capture.nest import tree_leaves
from ..capture.weights import module_of
from ..checks import require_cuda
from ..errors import InputError

_PLAIN = (bool, int, float, complex, str)
OUTPUT = "(the call's output)"
"""The name of the last row of :attr:`Divergence.table`: the compared function's own output."""


@dataclass
class Divergence:
    """What :func:`find_divergence` found.

    Attributes:
        module: qualified name of the first module whose replayed output differs from eager beyond ``rtol``
            (``""`` is the root; :data:`OUTPUT` when only the function's own output differs), or ``None`` when
            everything agreed.
        call: which call of that module (0 for the first; a module called several times per forward is compared
            call by call).
        max_rel_error: its largest relative error, replay against eager (``max|a-e| / max|e|``; ``inf`` when the
            shapes or the structure differ).
        kind: ``"between_modules"``, ``"replaced_tensor"``, ``"python_value"``, ``"random"``, ``"inside"``, or
            ``""`` when nothing diverged.
        detail: the names behind ``kind`` (the replaced tensors, the changed attributes), in words.
        fix: what to do about it.
        table: one row per module call in the order the calls finished, then the function's output: ``module``,
            ``call``, ``max_rel_error``, ``diverged`` (a ``pandas.DataFrame``).
    """

    module: str | None
    call: int
    max_rel_error: float
    kind: str
    detail: str
    fix: str
    table: Any = field(repr=False, default=None)

    def __str__(self) -> str:
        if self.module is None:
            return "every module's replayed output equals eager's"
        where = "the root module" if self.module == "" else self.module
        nth = f" (call {self.call})" if self.call else ""
        return (f"first divergence in {where}{nth} (max relative error {self.max_rel_error:.3g}): {self.kind}"
                f"{': ' + self.detail if self.detail else ''}. Fix: {self.fix}")


_FIXES = {
    "between_modules": "look at the code between the modules in the parent's forward: a value read on the host, "
                       "a tensor created there at capture",
    "replaced_tensor": "copy new values into the captured tensors (load_state_dict without assign=True, "
                       "param.copy_(), t.copy_() for a tensor attribute) or capture again",
    "python_value": "keep the value in a CUDA tensor (register_buffer) and update it in place, or capture again "
                    "after changing it",
    "random": "its draws differ from the same generator state: draw outside the captured call, or check that the "
              "draws come from the default CUDA generator in the captured stream",
    "inside": "look inside the module: an in-place update of a captured tensor, a value computed on the host, "
              "random numbers from a generator of your own (a graph replays its draws), a side stream not joined",
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


def _rng_offset() -> int:
    """The default CUDA generator's offset (it moves with every draw), or -1 where it cannot be read."""
    if not torch.cuda.is_available():
        return -1
    try:
        return int(torch.cuda.default_generators[torch.cuda.current_device()].get_offset())
    except (AttributeError, RuntimeError):  # a capture in progress, or a torch without get_offset
        return -1


class _Recorder:
    """Forward hooks on every submodule of ``root``: the outputs and inputs of each call of one pass, in the
    order the calls finished. A pass is one call of the compared function (:class:`Compared` starts it)."""

    def __init__(self, root: nn.Module):
        self.names = {m: n for n, m in root.named_modules()}
        self.passes: list[list[tuple[str, list, list, int]]] = []
        self.offsets: dict[int, list[int]] = {}
        self.handles = [m.register_forward_hook(self._record, with_kwargs=True) for m in self.names]
        self.handles += [m.register_forward_pre_hook(self._mark, with_kwargs=True) for m in self.names]

    def _mark(self, module, args, kwargs):
        self.offsets.setdefault(id(module), []).append(_rng_offset())

    def _record(self, module, args, kwargs, out):
        before = self.offsets.get(id(module), [])
        drew = int(bool(before) and before.pop() != _rng_offset() != -1)
        if self.passes:  # calls outside a pass (the caller's own, before) are not recorded
            self.passes[-1].append((self.names[module], _clone(out), _clone((args, kwargs)), drew))

    def remove(self):
        for h in self.handles:
            h.remove()


class Compared(nn.Module):
    """The compared function as a module around ``model``: each call starts a pass and records the function's own
    output last. A module, so that the runner still watches the model's weights (a submodule here); its name is
    what the runner's warnings call it."""

    def __init__(self, fn: Callable[..., Any], root: nn.Module, recorder: _Recorder):
        super().__init__()
        self.model = root
        self.training = root.training  # not .train(): that would set root's submodules too
        self._call = [fn]  # in a list: a module fn would otherwise register twice
        self._recorder = recorder

    def forward(self, *args, **kwargs):
        self._recorder.passes.append([])
        out = self._call[0](*args, **kwargs)
        self._recorder.passes[-1].append((OUTPUT, _clone(out), [], 0))
        return out


class _State:
    """The root's buffers and tensor attributes, the tensor arguments of a call and the random generators, kept
    so that they can be put back: the eager reference then starts where the compared replay started."""

    def __init__(self, root: nn.Module, args: tuple, kwargs: dict, params: list | None = None):
        self.tensors = [t for m in root.modules() for t in _tensors_of(m).values()
                        if not isinstance(t, nn.Parameter)]
        self.tensors += [t for _, t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.saved = [t.detach().clone() for t in self.tensors]
        # parameters (all of them before anything ran; later those updated in place, seen by their version
        # counters) are kept in host memory: a model's weights may not fit twice on its GPU
        self.tensors += params or []
        self.saved += [p.detach().to("cpu", copy=True) for p in params or []]
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        with torch.no_grad():
            for t, s in zip(self.tensors, self.saved, strict=True):
                t.copy_(s)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _check(change: Any, replay_args: Any, replay_kwargs: Any, rtol: Any, backend: Any) -> None:
    if change is not None and not callable(change):
        raise InputError(f"change must be a function with no arguments (what your program does between calls), "
                         f"e.g. lambda: setattr(model, 'scale', 3.0); got {type(change).__name__}")
    if replay_args is not None and not isinstance(replay_args, (tuple, list)):
        raise InputError(f"replay_args must be a tuple of the compared call's positional arguments, e.g. (x2,); got "
                         f"{type(replay_args).__name__}")
    if replay_kwargs is not None and not isinstance(replay_kwargs, Mapping):
        raise InputError(f"replay_kwargs must be a dict of the compared call's keyword arguments; got "
                         f"{type(replay_kwargs).__name__}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0
                             or math.isinf(rtol)):
        raise InputError(f"rtol must be a finite number >= 0 (a relative error, e.g. 1e-3) or None; got {rtol!r}")
    if backend is not None and not callable(getattr(backend, "capture", None)):
        raise InputError(f"backend must be a capture backend such as cgutils.CudaBackend() (or the tests' CPU "
                         f"simulation), or None; got {backend!r}")


def find_divergence(fn: Callable[..., Any], *args: Any, change: Callable[[], Any] | None = None,
                    replay_args: tuple | None = None, replay_kwargs: dict | None = None, rtol: float | None = None,
                    backend: Any = None, **kwargs: Any) -> Divergence:
    """Capture ``fn`` with every submodule's output kept, optionally apply a change, replay, run eagerly from the
    same state, and name the first module whose replayed output differs from eager's.

    Args:
        fn: an ``nn.Module``, or a bound method or ``functools.partial`` of one (its submodules are watched; a
            method may call the module several times).
        *args, **kwargs: the call captured, as for :class:`cgutils.GraphRunner` (CUDA tensors, nested or not).
            To pass the model a keyword argument named like one of this function's, wrap the model in a
            ``functools.partial``.
        change: called after the capture and before the compared replay: what your program does between calls
            (new weights, a changed attribute, a counter advanced). Most replay faults only show after one.
        replay_args, replay_kwargs: the compared call (default: the captured one's arguments).
        rtol: tolerated relative error per module output (default 1e-3, 1e-2 when the outputs hold fp16/bf16).
        backend: passed to the GraphRunner that captures; ``None`` (default) captures on the GPU. The tests pass a
            CPU simulation (``tests/simulation.py``), whose replay re-runs Python, so most faults cannot show there.

    Returns:
        :class:`Divergence` (``.kind``, ``.detail``, ``.fix``; ``.table`` per module call). The eager reference
        starts from the state the compared replay started from: the root's buffers and tensor attributes, the
        parameters the function updates in place, the tensor arguments and the random generators are kept before
        the replay and put back before the eager call. At the end they are put back as they were before this
        function ran (Python attributes that ``forward`` changes are not). Parameters replaced in ``change()``
        (``module.weight = nn.Parameter(...)``) show no divergence: GraphRunner sees them and captures again.

    Raises:
        InputError: bad arguments; ``fn`` is not a module or a method of one; the replay and eager calls ran
            different modules (data-dependent control flow in Python: capture one path at a time).
        NoCudaError: no backend given and no CUDA device visible.
        CaptureError: the capture itself failed (its message says why).

    Example::

        found = cg.find_divergence(model, x, change=lambda: setattr(model.head, "scale", 0.5))
        print(found)        # first divergence in head (...): python_value: scale: 1.0 at capture, 0.5 now. Fix: ...
        found.table         # every module call's max relative error, in the order the calls finished
    """
    from ..capture.runner import GraphRunner

    _check(change, replay_args, replay_kwargs, rtol, backend)
    root = module_of(fn)
    if root is None:
        raise InputError(f"find_divergence needs an nn.Module or a method of one, to watch its submodules; got "
                         f"{type(fn).__name__}. Pass the module itself (find_divergence(model, x)).")
    if backend is None:
        require_cuda("find_divergence", "it captures and replays a CUDA graph; on a CPU only the tests' simulation "
                     "(backend=SimulatedBackend(...) from tests/simulation.py) can stand in, and it shows only "
                     "what a replay that re-runs Python can show")
    r_args = args if replay_args is None else tuple(replay_args)
    r_kwargs = kwargs if replay_kwargs is None else dict(replay_kwargs)
    params = list(dict.fromkeys(root.parameters()))
    versions = [p._version for p in params]
    before = _State(root, args, kwargs, params)
    recorder = _Recorder(root)
    # named after the user's model: the runner's warnings and errors name the class of what it captures
    call = type(type(root).__name__, (Compared,), {})(fn, root, recorder)
    try:
        runner = GraphRunner(call, validate=False, **({"backend": backend} if backend is not None else {}))
        runner(*args, **kwargs)  # warm-up passes, then the capture pass: its clones live in the pool
        del recorder.passes[:-1]  # the warm-up passes' clones are not needed
        watched = {m: (_tensors_of(m), _plain_attributes(m)) for m in root.modules()}  # as captured
        if change is not None:
            change()
        updated = [p for p, v in zip(params, versions, strict=True) if p._version != v]  # in place, by forward
        start = _State(root, r_args, r_kwargs, updated)
        runner(*r_args, **r_kwargs)  # a replay rewrites the capture pass's clones (a simulation records a pass)
        if backend is None and torch.cuda.is_available():
            torch.cuda.synchronize()
        replayed = recorder.passes[-1]
        recorder.passes.clear()
        start.restore()  # the eager reference starts where the replay started
        with torch.no_grad():
            call(*r_args, **r_kwargs)
        eager = recorder.passes[-1]
        now = {m: (_tensors_of(m), _plain_attributes(m)) for m in root.modules()}
    finally:
        recorder.remove()
        before.restore()
    if [r[0] for r in replayed] != [e[0] for e in eager]:
        raise InputError("the replay and the eager call ran different modules (control flow in Python that depends "
                         "on the data): find_divergence compares one path; capture and compare each path on its own")
    return _compare(root, replayed, eager, watched, now, rtol)


def _compare(root: nn.Module, replayed: list, eager: list, watched: dict, now: dict, rtol: float | None) -> Divergence:
    import pandas as pd

    rows, first, seen = [], None, {}
    for (name, r_out, r_in, _), (_, e_out, e_in, drew) in zip(replayed, eager, strict=True):
        nth = seen[name] = seen.get(name, -1) + 1
        tol = rtol if rtol is not None else default_rtol({t.dtype for t in e_out})
        try:
            err = max_rel_error(r_out, e_out) if r_out or e_out else 0.0
        except InputError:  # another shape or structure: as different as it gets
            err = float("inf")
        diverged = not err <= tol
        rows.append({"module": name, "call": nth, "max_rel_error": err, "diverged": diverged})
        if diverged and first is None:
            first = (name, nth, err, r_in, e_in, drew, tol)
    table = pd.DataFrame(rows, columns=["module", "call", "max_rel_error", "diverged"])
    if first is None:
        return Divergence(None, 0, 0.0, "", "", "", table)
    name, nth, err, r_in, e_in, drew, tol = first
    if name == OUTPUT:
        kind, detail = "between_modules", "every module agreed; the function's own code after them differs"
    else:
        kind, detail = _classify(root, name, watched, now, r_in, e_in, drew, tol)
    return Divergence(name, nth, err, kind, detail, _FIXES[kind], table)


def _changes(module: nn.Module, watched: dict, now: dict) -> tuple[list[str], list[str]]:
    (t_then, p_then), (t_now, p_now) = watched.get(module, ({}, {})), now.get(module, ({}, {}))
    replaced = [n for n, t in t_now.items() if n in t_then and t_then[n] is not t]
    changed = [f"{k}: {p_then[k]!r} at capture, {v!r} now" for k, v in p_now.items()
               if k in p_then and p_then[k] != v]
    return replaced, changed


def _classify(root: nn.Module, name: str, watched: dict, now: dict, r_in: list, e_in: list, drew: int,
              tol: float) -> tuple[str, str]:
    module = root.get_submodule(name)
    replaced, changed = _changes(module, watched, now)
    if replaced:
        return "replaced_tensor", ", ".join(replaced)
    if changed:
        return "python_value", "; ".join(changed)
    try:
        inputs_differ = bool(r_in) and not max_rel_error(r_in, e_in) <= tol
    except InputError:
        inputs_differ = True
    if inputs_differ:
        parts = name.split(".") if name else []
        parents = [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]  # innermost first, the root last
        for parent in parents:
            p_replaced, p_changed = _changes(root.get_submodule(parent), watched, now)
            if p_replaced or p_changed:
                where = parent or "the root module"
                return "between_modules", (f"its inputs already differed; in {where}: "
                                           + "; ".join([*(f"{n} replaced" for n in p_replaced), *p_changed]))
        return "between_modules", "its inputs already differed, though no module that finished before it did"
    if drew:
        return "random", "it drew random numbers from the default CUDA generator"
    return "inside", ""
