"""Which calls run eagerly between graph pieces (:class:`BreakPlan`): submodules, whole (their ``forward``), or
methods of submodules that the top-level forward calls itself (torchvision's detectors call
``self.transform.postprocess(...)`` from their own forward; no forward hook sees that call).

A method break is made by shadowing the bound method with an instance attribute for the length of one capture
(:class:`MethodHook`); replay calls the method itself (:class:`~cgutils.capture.piecewise.Break`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from ..errors import InputError

_FORWARD = ("forward", "_call_impl", "_wrapped_call_impl")
_MISSING = object()
_MODULE_API = frozenset(dir(nn.Module))  # to, cuda, state_dict, forward, ...: nn.Module's, not the model's steps


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

    A method break names model code: ``"transform.forward"`` is refused in favour of ``"transform"`` (the
    submodule, whose forward runs when it is called), and so are nn.Module's own methods (``to``, ``cuda``,
    ``state_dict``) and special names (``__class__``).

    Raises:
        InputError: an unknown name (the message lists close submodule and method names); a name of an
            attribute that is not a method, of nn.Module's own API or of the root's own method; an entry of
            another kind, or a dict (a list is meant); the root module itself (nothing would be left to
            capture); with a module root, a module object that is not one of its submodules, or a class with
            no instance among them. With a function root, a class none of whose instances runs in the
            first warm-up call raises there (:meth:`watching`).
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
        if isinstance(breaks, Mapping):
            raise InputError(f"breaks must be 'auto' or a list of module names, modules or module classes, got a "
                             f"{type(breaks).__name__} (keys {list(breaks)[:5]}), whose values would be ignored: pass "
                             f"list(breaks) if its keys are the breaks")
        if not isinstance(breaks, Iterable):
            raise InputError(f"breaks must be 'auto' or a list of module names, modules or module classes, got {breaks!r}")
        # every name of a module shared under several (named_modules() gives its first only)
        by_name = dict(self.root.named_modules(remove_duplicate=False)) if self.root is not None else {}
        for b in breaks:
            if isinstance(b, str):
                self._add_name(b, by_name)
            elif isinstance(b, nn.Module):
                if self.root is not None and id(b) not in self.names:
                    raise InputError(f"breaks: the {type(b).__name__} object given is not a submodule of "
                                     f"{type(self.root).__name__} (not in model.modules()): a copy of one, or a module "
                                     f"of another model, never runs in this one. Pass the submodule itself "
                                     f"(model.<name>) or its name.")
                self._add(b, "named")
            elif isinstance(b, type) and issubclass(b, nn.Module):
                self._add_class(b)
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
        root = type(self.root).__name__
        if owner in by_name and owner:
            self.add_method(by_name[owner], method, "named", check=f"breaks: {b!r}")
            return
        close = difflib.get_close_matches(b, [n for n in by_name if n] + [f"{n}.{m}" for n, mod in by_name.items()
                                                                           if n for m in model_methods(mod)], n=5)
        hint = f"; close: {close}" if close else "; see [n for n, _ in model.named_modules()]"
        if not owner and hasattr(self.root, b):
            raise InputError(f"breaks: {b!r} is {root}'s own attribute: the top-level forward's code is what is "
                             f"captured, so a break must be a submodule or a submodule's method" + hint)
        raise InputError(f"breaks: no submodule (or method of one) named {b!r} in {root}" + hint)

    def _add_class(self, cls: type) -> None:
        self.types[cls] = f"named class {cls.__name__}"
        if self.root is None:
            return  # a function's modules are known once it runs: _Watch finds them, or says it found none
        found = [m for m in self.root.modules() if isinstance(m, cls) and m is not self.root]
        if not found:
            raise InputError(f"breaks: {type(self.root).__name__} has no {cls.__name__} among its submodules, so the "
                             f"class names no break; name a class of one of them "
                             f"({', '.join(sorted({type(m).__name__ for m in self.root.modules()})[:10])}), or a submodule")
        for m in found:
            self._add(m, self.types[cls])

    def _add(self, module: nn.Module, why: str) -> None:
        if module is self.root:
            raise InputError(f"breaks: {type(module).__name__} is the root module itself; nothing would be left to "
                             f"capture. Name a submodule, or call the model eagerly.")
        self.objects.setdefault(id(module), (module, why))

    def add_method(self, module: nn.Module, method: str, why: str, check: str = "") -> None:
        """Make ``module.<method>(...)`` a break (a submodule's method the top-level forward calls).

        With ``check`` (the start of an error message), the name is checked first: it must be a method of
        model code (not nn.Module's API, ``forward`` included, nor a special name), else InputError.
        Unchecked (breaks='auto': a method seen running), ``forward`` stands for the module."""
        if check:
            method_check(module, method, self.name(module), check)
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

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
        missing = [t.__name__ for t in self.plan.types if not any(isinstance(m, t) for m in self.plan.modules())]
        if missing and kind is None:  # after an error in the call, that error is the one to see
            raise InputError(f"breaks: no {' or '.join(missing)} ran in the first call of the function, so "
                             f"{'that class names' if len(missing) == 1 else 'those classes name'} no break; name "
                             f"a class whose instances the function calls, or the module objects themselves")


class MethodHook:
    """Shadow ``module.<method>`` with ``wrap(original)`` until :meth:`remove` (a removable handle, as a forward
    hook's): an instance attribute wins over the class's function for ``self.transform.postprocess(...)``."""

    def __init__(self, module: nn.Module, method: str, wrap: Callable[[Callable], Callable]):
        """Raises:
            InputError: ``module`` has no callable ``method`` (any more: deleted since the plan was made);
                the message lists close names or its methods.
        """
        call = require_method(module, method, "method break")
        self.module, self.method = module, method
        self.had, self.saved = method in module.__dict__, module.__dict__.get(method)
        module.__dict__[method] = wrap(call)

    def remove(self) -> None:
        if self.had:
            self.module.__dict__[self.method] = self.saved
        else:
            self.module.__dict__.pop(self.method, None)


def model_methods(module: nn.Module) -> list[str]:
    """Names of ``module``'s methods that are model code: callable attributes of its class or instance that
    are neither nn.Module's own API, special names, submodules nor classes."""
    names = {n for n in [*dir(type(module)), *vars(module)] if not _module_api(n)}
    # read statically: a property's getter may compute, or raise, and is no method anyway
    return sorted(n for n in names if _method_like(inspect.getattr_static(module, n, None)))


def require_method(module: nn.Module, method: str, what: str) -> Callable:
    """``module.<method>``, the bound callable.

    Raises:
        InputError: ``module`` has no such callable attribute; the message starts with ``what`` and lists
            close names (or the module's methods).
    """
    call = getattr(module, method, None)
    if not callable(call):
        names = model_methods(module)
        close = difflib.get_close_matches(method, names, n=5)
        raise InputError(f"{what}: {type(module).__name__} has no method {method!r}"
                         + (f"; close: {close}" if close else f"; its methods: {names[:20]}"))
    return call


def method_check(module: nn.Module, method: str, owner: str, what: str) -> None:
    """Raise InputError (starting with ``what``) unless ``owner.<method>`` can be a method break: a method of
    model code, not nn.Module's API nor a special name, not a plain attribute."""
    if method in _FORWARD or method == "__call__":
        raise InputError(f"{what}: {method} is what runs when {owner} is called; name the submodule itself, "
                         f"{owner!r}")
    if _module_api(method):
        raise InputError(f"{what}: {method} is nn.Module's own API (or a Python special name), not a step of the "
                         f"model; to run {owner} eagerly, name the submodule itself, {owner!r}")
    value = getattr(module, method, _MISSING)
    if value is not _MISSING and not _method_like(value):
        raise InputError(f"{what}: {owner}.{method} is an attribute of {type(module).__name__} (a "
                         f"{type(value).__name__}), not a method; a break is a submodule or a method of one")
    require_method(module, method, what)


def _module_api(name: str) -> bool:
    return name in _MODULE_API or name.startswith("__") and name.endswith("__")


def _method_like(value: Any) -> bool:
    # a class is callable but constructs; a module is a break of its own, by its name
    return (callable(value) or isinstance(value, (staticmethod, classmethod))) and not isinstance(value, (type, nn.Module))


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
