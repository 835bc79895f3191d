"""Module paths that moved when the pitfall catalogue and generation became packages (layout step 2), kept
importable.

``from cgutils.generation_stop import StopTokenDecoder`` or ``import cgutils.pitfall_cases`` still work: each old
path is put in ``sys.modules`` as a module that hands on, on first use, the public names of the modules that
own them now (a :class:`DeprecationWarning` names the new path). Python's import system looks in
``sys.modules`` after importing the parent package, so the old path resolves without a file of its own.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

# old module (under cgutils) -> the modules that now own its names, searched in order
MOVED: dict[str, tuple[str, ...]] = {
    "pitfall_cases": ("pitfalls.entry", "pitfalls.steps"),
    "pitfall_cases_real_use": ("pitfalls.steps", "pitfalls.outside", "pitfalls.entry"),
    "pitfalls_real_use": ("pitfalls.reproducers", "pitfalls.catalogue"),
    "generation_stop": ("generation.until_eos", "generation.request"),
    "generation_tp": ("generation.tensor_parallel",),
    "distributed": ("capture.ranks", "generation.tensor_parallel"),
}


class _MovedModule(types.ModuleType):
    def __init__(self, old: str, targets: tuple[str, ...]):
        super().__init__(f"cgutils.{old}", f"Moved: see {', '.join('cgutils.' + t for t in targets)}.")
        self._targets = targets
        self._warned = False

    def _modules(self) -> list[types.ModuleType]:
        return [importlib.import_module(f"cgutils.{t}") for t in self._targets]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        for module in self._modules():
            if hasattr(module, name):
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"{self.__name__} moved to {module.__name__}; import from there",
                                  DeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"{self.__name__} (moved to {', '.join('cgutils.' + t for t in self._targets)}) has no "
                             f"attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for m in self._modules() for n in dir(m) if not n.startswith("_")})


def register(package: types.ModuleType) -> None:
    """Put every old path of :data:`MOVED` in ``sys.modules`` and on ``package`` (``cgutils``)."""
    for old, targets in MOVED.items():
        module = sys.modules.setdefault(f"{package.__name__}.{old}", _MovedModule(old, targets))
        setattr(package, old, module)
