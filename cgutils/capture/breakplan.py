"""Which calls run eagerly between graph pieces (:class:`BreakPlan`): submodules, whole (their ``forward``), or
methods of submodules that the top-level forward calls itself (torchvision's detectors call
``self.transform.postprocess(...)`` from their own forward; no forward hook sees that call).

A method break is made by shadowing the bound method with an instance attribute for the length of one capture
(:class:`MethodHook`); replay calls the method itself (:class:`~cgutils.capture.piecewise.Break`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from ..errors import InputError

_FORWARD = ("forward", "_call_impl", "_wrapped_call_impl")


class BreakPlan:
    """Which module calls run eagerly between graph pieces.

    Args:
        root: the function being captured: an ``nn.Module`` (names are its qualified names), or a function
            (then ``breaks`` must be module objects or classes, or ``"auto"``).
        breaks: ``"auto"``: found while capturing: when capture fails with a CPU-GPU sync (or another
            call a graph cannot hold), the innermost module running at that moment becomes a break (or, when the
            failure is in the top-level forward's own code, the submodule method it was calling) and capture
            starts again; or an iterable of qualified module names (``"encoder.layer.5.attention"``), qualified
            method names of submodules (``"transform.postprocess"``), ``nn.Module`` objects and ``nn.Module``
            subclasses (every instance breaks).

    Raises:
        InputError: an unknown name (the message lists close ones), an entry of another kind, or the root
            module itself (nothing would be left to capture).
    """

    def __init__(self, root: Any, breaks: Any):
        self.root = root if isinstance(root, nn.Module) else None
        self.names = {id(m): n for n, m in self.root.named_modules()} if self.root is not None else {}
        self.auto = isinstance(breaks, str) and breaks == "auto"
        self.objects: dict[int, tuple[nn.Module, str]] = {}  # id(module) -> (module, why)
        self.method_breaks: dict[tuple[int, str], tuple[nn.Module, str, str]] = {}  # -> (module, method, why)
        self.types: dict[type, str] = {}
        if self.auto:
            return
        if isinstance(breaks, (str, nn.Module, type)):
            breaks = [breaks]
        if not isinstance(breaks, Iterable):
            raise InputError(f"breaks must be 'auto' or a list of module names, modules or module classes, got {breaks!r}")
        by_name = dict(self.root.named_modules()) if self.root is not None else {}
        for b in breaks:
            if isinstance(b, str):
                self._add_name(b, by_name)
            elif isinstance(b, nn.Module):
                self._add(b, "named")
            elif isinstance(b, type) and issubclass(b, nn.Module):
                self.types[b] = f"named class {b.__name__}"
                for m in self.root.modules() if self.root is not None else ():
                    if isinstance(m, b) and m is not self.root:
                        self._add(m, self.types[b])
            else:
                raise InputError(f"breaks: {b!r} is not a module name, module or module class")
        if not self.objects and not self.types and not self.method_breaks:
            raise InputError("breaks is empty: name at least one module, or use breaks='auto'")

    def _add_name(self, b: str, by_name: dict[str, nn.Module]) -> None:
        if self.root is None:
            raise InputError(f"breaks: the name {b!r} needs an nn.Module to look it up in; this function is not "
                             f"one, so pass the module object or its class instead")
        if b in by_name:
            self._add(by_name[b], "named")
            return
        owner, _, method = b.rpartition(".")
        if owner in by_name and owner and callable(getattr(by_name[owner], method, None)) \
                and not isinstance(getattr(by_name[owner], method), nn.Module):
            self.add_method(by_name[owner], method, "named")
            return
        close = [n for n in by_name if n and (b in n or n.endswith(b.split(".")[-1]))][:5]
        raise InputError(f"breaks: no submodule (or method of one) named {b!r} in {type(self.root).__name__}"
                         + (f"; close: {close}" if close else "; see [n for n, _ in model.named_modules()]"))

    def _add(self, module: nn.Module, why: str) -> None:
        if module is self.root:
            raise InputError(f"breaks: {type(module).__name__} is the root module itself; nothing would be left to "
                             f"capture. Name a submodule, or call the model eagerly.")
        self.objects.setdefault(id(module), (module, why))

    def add_method(self, module: nn.Module, method: str, why: str) -> None:
        """Make ``module.<method>(...)`` a break (a submodule's method the top-level forward calls)."""
        if method in _FORWARD:
            self._add(module, why)
        else:
            self.method_breaks.setdefault((id(module), method), (module, method, why))

    def why(self, module: nn.Module, method: str = "") -> str | None:
        """Why ``module`` (or its ``method``) breaks, or ``None`` if it is captured."""
        hit = self.method_breaks.get((id(module), method)) if method else self.objects.get(id(module))
        return hit[-1] if hit is not None else None

    def modules(self) -> list[nn.Module]:
        """The break modules found so far (names, objects, instances of the classes seen, auto's finds)."""
        return [m for m, _ in self.objects.values()]

    def methods(self) -> list[tuple[nn.Module, str]]:
        """The method breaks found so far: ``(module, method name)``."""
        return [(m, name) for m, name, _ in self.method_breaks.values()]

    def name(self, module: nn.Module, method: str = "") -> str:
        base = self.names.get(id(module)) or type(module).__name__
        return f"{base}.{method}" if method else base

    def watching(self) -> _Watch:
        """Context manager for the first warm-up call: finds the instances of the named classes it calls."""
        return _Watch(self)


class _Watch:
    """A module stack during one eager call: instances of the plan's classes that it calls become breaks
    (a function's modules are only known once it runs)."""

    def __init__(self, plan: BreakPlan):
        self.plan, self.handle = plan, None

    def _enter_module(self, module: nn.Module, *_: Any) -> None:
        for t, why in self.plan.types.items():
            if isinstance(module, t) and module is not self.plan.root:
                self.plan._add(module, why)

    def __enter__(self) -> _Watch:
        if self.plan.types:
            self.handle = nn.modules.module.register_module_forward_pre_hook(self._enter_module)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()


class MethodHook:
    """Shadow ``module.<method>`` with ``wrap(original)`` until :meth:`remove` (a removable handle, as a forward
    hook's): an instance attribute wins over the class's function for ``self.transform.postprocess(...)``."""

    def __init__(self, module: nn.Module, method: str, wrap: Callable[[Callable], Callable]):
        self.module, self.method = module, method
        self.had, self.saved = method in module.__dict__, module.__dict__.get(method)
        module.__dict__[method] = wrap(getattr(module, method))

    def remove(self) -> None:
        if self.had:
            self.module.__dict__[self.method] = self.saved
        else:
            self.module.__dict__.pop(self.method, None)


def submodule_method(exc: BaseException, plan: BreakPlan) -> tuple[nn.Module, str] | None:
    """``(module, "postprocess")`` when the failing call ran inside a method other than ``forward`` of one of
    ``plan.root``'s submodules (torchvision's detectors call ``self.transform.postprocess`` from their own
    forward): the outermost such frame of the traceback (the call the top-level code made; a helper it calls in
    turn is inside the break then), or ``None``."""
    names = {id(m): m for n, m in plan.root.named_modules() if n} if isinstance(plan.root, nn.Module) else {}
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names and tb.tb_frame.f_code.co_name not in _FORWARD:
            return names[id(owner)], tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return None
