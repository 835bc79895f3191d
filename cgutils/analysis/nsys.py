"""Nsight Systems from Python: find ``nsys``, profile a command with the flags that suit CUDA graphs, and read
``nsys stats`` reports back as DataFrames (notebook 07 puts them beside torch.profiler's view of the same calls).

The flags are ``-t cuda,nvtx --sample=none --cpuctxsw=none --cuda-graph-trace=node``: CUDA runtime calls, kernels
and NVTX ranges only, with each kernel node of a replayed graph traced as its own kernel (Nsight Systems User Guide,
``--cuda-graph-trace``; its other value, ``graph``, shows one block per graph launch). Without the two ``--sample``
and ``--cpuctxsw`` flags the raw report of a short BERT run grew to gigabytes (measured on the H200 host). With
``capture_range=True`` only the part of the run between ``torch.cuda.profiler.start()`` and ``stop()`` is
recorded, so warm-up and capture stay out of the counts.
"""

from __future__ import annotations

import difflib
import glob
import numbers
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import CgutilsError, DependencyError, InputError

NSYS_FLAGS = ("-t", "cuda,nvtx", "--sample=none", "--cpuctxsw=none", "--cuda-graph-trace=node")
CAPTURE_RANGE_FLAGS = ("--capture-range=cudaProfilerApi", "--capture-range-end=stop")
REPORTS = ("nvtx_sum", "cuda_gpu_kern_sum", "cuda_api_sum")
# where installers put nsys when it is not on PATH: Nsight Systems' own, the CUDA toolkit's, Nsight Compute's copy
_SEARCH = ("/opt/nvidia/nsight-systems*/bin/nsys", "/opt/nvidia/nsight-systems*/*/bin/nsys",
           "/usr/local/cuda*/bin/nsys", "/usr/local/cuda*/nsight-systems*/bin/nsys",
           "/opt/nvidia/nsight-compute*/*/host/*/nsys", "/usr/local/cuda*/nsight-compute*/host/*/nsys")


def find_nsys(nsys: str | os.PathLike | None = None) -> Path:
    """The ``nsys`` executable: ``nsys`` if given, else ``$CGUTILS_NSYS``, else ``nsys`` on ``PATH``, else the usual
    install folders (Nsight Systems, the CUDA toolkit, Nsight Compute's bundled copy).

    Raises:
        InputError: ``nsys`` (or ``$CGUTILS_NSYS``) names no executable file.
        DependencyError: none found.
    """
    given = nsys if nsys is not None else os.environ.get("CGUTILS_NSYS") or None
    if given is not None:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise InputError(f"{str(path)!r} is not an executable nsys; pass the path of Nsight Systems' nsys "
                             f"(e.g. /opt/nvidia/nsight-systems/<version>/bin/nsys)")
        return path
    found = shutil.which("nsys")
    if found:
        return Path(found)
    for pattern in _SEARCH:
        for hit in sorted(glob.glob(pattern), reverse=True):  # newest version first
            if os.access(hit, os.X_OK):
                return Path(hit)
    raise DependencyError("Nsight Systems' nsys was not found on PATH or in /opt/nvidia and /usr/local/cuda*: "
                          "install Nsight Systems (developer.nvidia.com/nsight-systems), or pass its path "
                          "(--nsys PATH, or CGUTILS_NSYS=PATH)")


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-12:])
        hint = (" If it names libdw.so.1 or another missing library, install elfutils' libdw1 and libelf1 or put "
                "them on LD_LIBRARY_PATH." if "lib" in tail and "cannot open" in tail else "")
        raise CgutilsError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}{hint}")
    return proc


def nsys_profile(command: Sequence[str], out: str | os.PathLike, *, nsys: str | os.PathLike | None = None,
                 capture_range: bool = True, extra: Sequence[str] = ()) -> Path:
    """Run ``command`` under ``nsys profile`` with :data:`NSYS_FLAGS` and write ``<out>.nsys-rep``.

    Args:
        command: the program and its arguments, e.g. ``["python", "script.py"]``.
        out: the report's path without its suffix (folders are made).
        capture_range: record only between ``torch.cuda.profiler.start()`` and ``stop()`` in the program.
        extra: more ``nsys profile`` options.

    Returns:
        The ``.nsys-rep`` path.

    Raises:
        InputError: ``command`` is empty. DependencyError: no nsys. CgutilsError: nsys or the program failed
        (its last lines of output are in the message), or no report was written.
    """
    if isinstance(command, (str, bytes)):
        raise InputError(f"nsys_profile needs the command as a list of arguments, e.g. ['python', 'my_script.py'], "
                         f"not one string ({command!r}): split it with shlex.split")
    command = [str(c) for c in command]
    if not command:
        raise InputError("nsys_profile needs a command to profile, e.g. ['python', 'my_script.py']")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = out.with_name(out.name + ".nsys-rep")
    report.unlink(missing_ok=True)  # else a run that writes none would leave an older report to be read as this one's
    cmd = [str(find_nsys(nsys)), "profile", *NSYS_FLAGS, *(CAPTURE_RANGE_FLAGS if capture_range else ()),
           *extra, "--force-overwrite=true", "-o", str(out), *command]
    _run(cmd, "nsys profile")
    if not report.exists():
        why = (" Recording only between profiler start and stop (the default; --whole-run / capture_range=False "
               "records everything), the program must call torch.cuda.profiler.start() and stop()."
               if capture_range else "")
        raise CgutilsError(f"nsys profile wrote no {report}. Check that {cmd[0]} is Nsight Systems' nsys.{why}")
    return report


def nsys_stats(report: str | os.PathLike, *, reports: Sequence[str] = REPORTS,
               nsys: str | os.PathLike | None = None) -> dict[str, pd.DataFrame]:
    """Run ``nsys stats`` on a report and return ``{report name: DataFrame}``; the CSVs are written next to the
    report as ``<report stem>_<name>.csv`` (read them back later with :func:`read_nsys_csvs`, no nsys needed).

    Raises:
        InputError: ``report`` does not exist. DependencyError: no nsys. CgutilsError: nsys stats failed.
    """
    report = Path(report)
    if not report.exists():
        raise InputError(f"no Nsight Systems report at {report}; make one with cgutils' nsys_profile or "
                         f"`python -m cgutils nsys -- python your_script.py`")
    prefix = report.with_suffix("")
    for name in reports:  # a report with no data of a kind writes no CSV: an older one must not stand in for it
        for old in prefix.parent.glob(f"{glob.escape(prefix.name)}_{name}*.csv"):
            old.unlink()
    _run([str(find_nsys(nsys)), "stats", "-r", ",".join(reports), "--format", "csv", "--force-export=true",
          "--force-overwrite=true", "-o", str(prefix), str(report)], "nsys stats")
    return read_nsys_csvs(prefix, reports)


def read_nsys_csvs(prefix: str | os.PathLike, reports: Sequence[str] = REPORTS) -> dict[str, pd.DataFrame]:
    """The CSVs ``nsys stats --format csv -o <prefix>`` wrote, as ``{report name: DataFrame}``; a report that
    wrote no CSV (no data of that kind) is an empty frame.

    Raises:
        InputError: none of the reports' CSVs exists.
    """
    prefix = Path(prefix)
    out, found = {}, False
    for name in reports:
        hits = sorted(prefix.parent.glob(f"{glob.escape(prefix.name)}_{name}*.csv"))
        found = found or bool(hits)
        out[name] = pd.read_csv(hits[0]) if hits else pd.DataFrame()
    if not found:
        raise InputError(f"no nsys stats CSV at {prefix}_<report>.csv for {', '.join(reports)}; run nsys_stats "
                         f"on the .nsys-rep first")
    return out


def _column(frame: pd.DataFrame, *names: str) -> str:
    for name in names:
        for col in frame.columns:
            if col.strip().lower().startswith(name.lower()):
                return col
    raise InputError(f"an nsys stats table without a {names[0]!r} column (columns: {list(frame.columns)}); "
                     f"this nsys version writes another layout")


def per_call(stats: dict[str, pd.DataFrame], range_name: str) -> dict[str, float]:
    """What one call did, from a capture-range report whose calls each ran inside one NVTX range ``range_name``:
    ``calls`` (that range's instances), ``kernels`` (kernel instances per call), ``kernel_us`` (GPU µs of kernels
    per call), ``range_us`` (the range's median host duration, µs), and per call, ``launch_kernel`` (runtime
    ``cudaLaunchKernel*`` and driver ``cuLaunchKernel*`` calls: cuBLAS and cuDNN launch through the driver) and
    ``graph_launch`` (``cudaGraphLaunch*`` and ``cuGraphLaunch*``).

    Raises:
        InputError: no NVTX range of that name (the message lists those there are).
    """
    _check_stats(stats)
    nvtx = stats.get("nvtx_sum", pd.DataFrame())
    names = nvtx[_column(nvtx, "Range", "Name")].astype(str).str.lstrip(":") if len(nvtx) else pd.Series([], dtype=str)
    rows = nvtx[names == range_name]
    if rows.empty:
        known = sorted(set(names))
        close = difflib.get_close_matches(range_name, known, n=5, cutoff=0.3)
        raise InputError(f"no NVTX range {range_name!r} in the report; closest: {close or 'none'}; "
                         f"{len(known)} in all: {known[:20]}")
    calls = int(rows[_column(nvtx, "Instances", "Count")].sum())
    kern = stats.get("cuda_gpu_kern_sum", pd.DataFrame())
    per_api = api_calls_per_call(stats, calls)

    def api_calls(prefix: str) -> float:
        return float(per_api[per_api.index.str.startswith(prefix)].sum())

    return {"calls": calls,
            "kernels": float(kern[_column(kern, "Instances", "Count")].sum()) / calls if len(kern) else 0.0,
            "kernel_us": float(kern[_column(kern, "Total Time")].sum()) / 1e3 / calls if len(kern) else 0.0,
            "range_us": float(rows[_column(nvtx, "Med")].iloc[0]) / 1e3,
            "launch_kernel": api_calls("cudaLaunchKernel") + api_calls("cuLaunchKernel"),
            "graph_launch": api_calls("cudaGraphLaunch") + api_calls("cuGraphLaunch")}


def kernel_base_name(name: str) -> str:
    """A kernel's function name without namespaces, template arguments or parameters, so that one kernel reads
    the same from Nsight Systems (``at::native::<unnamed>::vectorized_layer_norm_kernel<c10::Half, float,
    (bool)0>(int, T2, ...)``) and from torch.profiler, whose demangler writes ``(anonymous namespace)`` and
    ``false``: both give ``vectorized_layer_norm_kernel``."""
    text = str(name).removeprefix("void ").replace("<unnamed>", "anon").replace("(anonymous namespace)", "anon")
    cut = min((i for i in (text.find("<"), text.find("(")) if i >= 0), default=len(text))
    return text[:cut].rsplit("::", 1)[-1].strip()


def kernels_by_name(stats: dict[str, pd.DataFrame], calls: int) -> pd.Series:
    """Kernel instances per call by :func:`kernel_base_name`, most first, from a report's ``cuda_gpu_kern_sum``; ``calls``
    is the number of calls the report holds (:func:`per_call`'s ``calls``).

    Raises:
        InputError: ``calls`` < 1.
    """
    return _per_call_by_name(stats, "cuda_gpu_kern_sum", calls, kernel_base_name, ("Instances", "Count"))


def api_calls_per_call(stats: dict[str, pd.DataFrame], calls: int) -> pd.Series:
    """Runtime and driver API calls per call by function name, from a report's ``cuda_api_sum``, with nsys'
    version suffixes dropped (``cudaGraphLaunch_v10000`` counts as ``cudaGraphLaunch``); ``calls`` as in
    :func:`kernels_by_name`. Kernel launches are ``cudaLaunchKernel*`` and, for libraries that launch through
    the driver API (cuBLAS, cuDNN), ``cuLaunchKernel*``.

    Raises:
        InputError: ``calls`` < 1.
    """
    return _per_call_by_name(stats, "cuda_api_sum", calls, lambda name: re.sub(r"_v\d+$", "", str(name)),
                             ("Num Calls", "Calls", "Count"))


def _per_call_by_name(stats: dict[str, pd.DataFrame], report: str, calls: int, key: Any,
                      counts: tuple[str, ...]) -> pd.Series:
    """One report table's counts summed by ``key(name)`` and divided by ``calls``."""
    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 1:
        raise InputError(f"calls must be a positive int (the calls the report holds), got {calls!r}")
    _check_stats(stats)
    table = stats.get(report, pd.DataFrame())
    if table.empty:
        return pd.Series(dtype=float, name="per_call")
    names = table[_column(table, "Name")].map(key)
    per_call = table[_column(table, *counts)].groupby(names).sum() / int(calls)
    return per_call.sort_values(ascending=False, kind="stable").rename("per_call")


def _check_stats(stats: object) -> None:
    if not isinstance(stats, Mapping):
        raise InputError(f"expected the {{report name: DataFrame}} dict that nsys_stats or read_nsys_csvs returns, "
                         f"got {type(stats).__name__}")
