"""cuda-python's driver bindings, imported on first use, and the unpacking of their result tuples."""

from __future__ import annotations

from typing import Any

from ..errors import CgutilsError, DependencyError


def cuda_driver() -> Any:
    """``cuda.bindings.driver``.

    Raises:
        DependencyError: cuda-python is not installed (``pip install cuda-bindings``).
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DependencyError(
            "reading or building a graph's nodes needs cuda-python's driver bindings, which are not installed: "
            "pip install cuda-bindings (or pip install -e '.[inspect]' in this repository). Without them, "
            "graph.debug_dump(path) and cgutils.graph_node_types(text) count node types from a DOT file.") from exc
    return driver


def check(driver: Any, what: str, result: tuple) -> Any:
    """Unpack a cuda-python result tuple ``(CUresult, *values)``: the value, or a list of them.

    Raises:
        CgutilsError: the call returned an error code (named in the message).
    """
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CgutilsError(f"{what} failed with {getattr(err, 'name', err)} while reading or building a CUDA graph; "
                           f"a graph handle may have been destroyed (keep the CUDAGraph object alive)")
    return values[0] if len(values) == 1 else values
