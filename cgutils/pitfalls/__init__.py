"""The executable pitfall catalogue: each way a CUDA graph fails, as a reproducer that runs on the GPU.

- :mod:`.entry`: the entry type (:class:`Pitfall`), :func:`run_entry`, the observed row, raw captures.
- :mod:`.reproducers`: every entry's code, its offending line marked ``# <- pitfall``.
- :mod:`.steps`: diagnose steps and fix checks that run in the calling thread.
- :mod:`.outside`: steps for trouble from outside the call (other threads, syncs behind PyTorch's back).
- :mod:`.catalogue`: :data:`PITFALLS`, :func:`run`, :func:`catalogue_table`, :func:`markdown_table`
  (docs/pitfalls.md).
"""

from .catalogue import PITFALLS, REAL_USE, catalogue_table, markdown_table, run
from .entry import KINDS, MARK, Pitfall, run_entry
from .reproducers import CpuScalar, DropoutNet, Scaled, ScaledFixed

__all__ = ["PITFALLS", "REAL_USE", "KINDS", "MARK", "Pitfall", "run", "run_entry", "catalogue_table", "markdown_table",
           "Scaled", "CpuScalar", "ScaledFixed", "DropoutNet"]
