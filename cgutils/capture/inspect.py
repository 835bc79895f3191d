"""What a captured graph holds: its nodes, the module that added each one, and where replay time goes.

A CUDA graph is a DAG of nodes (kernels, memcpy, memset, event and empty nodes). PyTorch keeps the
captured ``cudaGraph_t`` when the graph is made with ``torch.cuda.CUDAGraph(keep_graph=True)`` and hands
it out with ``raw_cuda_graph()`` (torch >= 2.8); the driver lists its nodes and their launch parameters
(CUDA Driver API, "Graph Management": ``cuGraphGetNodes``, ``cuGraphNodeGetType``,
``cuGraphKernelNodeGetParams``, ``cuFuncGetName``, ``cuFuncGetParamInfo``). This module reads them
through cuda-python (``pip install cuda-bindings``).

During capture the graph being built can be read too (``cuStreamGetCaptureInfo`` returns it), so
:class:`NodeAttribution` reads it at every module's forward pre- and post-hook and at every
:class:`cgutils.nvtx_range` boundary: nodes added since the last look belong to the innermost module
(and range) that was running. After replay, :func:`node_times` joins the node table with a profiler
trace of one replay (CUPTI reports each replayed kernel with the ``cudaGraphLaunch``'s correlation id,
in execution order) to give GPU time per node, and :func:`time_by_module` per module.

:func:`graph_node_types` counts node types from a ``debug_dump`` DOT file instead (no cuda-python).
"""

from __future__ import annotations

import collections
import numbers
import re
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
import torch
from torch import nn

from ..checks import check_index
from ..errors import CgutilsError, InputError
from ..trace import is_graph_launch
from .cudadriver import check as _call
from .cudadriver import cuda_driver

NODE_COLUMNS = ["index", "type", "kernel", "family", "grid", "block", "shared_mem_bytes", "param_bytes",
                "module", "range", "depends_on"]

# Kernel families by name, first match wins (cuDNN's convolution kernels carry "implicit_gemm" or
# "fprop" in their names, so convolution comes before GEMM).
_FAMILIES: list[tuple[str, str]] = [
    ("attention", r"flash|fmha|attention|sdpa|mha_"),
    ("convolution", r"conv|fprop|dgrad|wgrad|winograd"),
    # nvjet_*: cuBLAS's GEMM kernels on Hopper and later (CUDA 12.8+), named without "gemm"
    ("gemm", r"gemm|cutlass|xmma|cublas|matmul|gemv|nvjet|sm\d+_.*_tn|splitk"),
    ("softmax", r"softmax"),
    ("normalization", r"layer_norm|layernorm|batch_norm|batchnorm|group_norm|rms_?norm|bn_fw"),
    ("reduction", r"reduce|argmax|argmin|\bsum\b|mean|cumsum|scan"),
    ("copy/index", r"copy|cat_|CatArray|index|gather|scatter|embedding|indexSelect|take"),
    ("pooling", r"pool"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|fill"),
]


def kernel_family(name: str) -> str:
    """A kernel's family from its (demangled) name: ``gemm``, ``attention``, ``convolution``, ``softmax``,
    ``normalization``, ``reduction``, ``copy/index``, ``pooling``, ``elementwise`` or ``other``.

    The rules are substring patterns over the names that cuBLAS, cuDNN, FlashAttention, Triton and
    PyTorch's own ATen kernels use (first match wins); an unknown library's kernel is ``other``.
    """
    for family, pattern in _FAMILIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return family
    return "other"


def _nodes(driver: Any, graph: Any) -> list[int]:
    """Node handles of a ``CUgraph`` as ints, in the driver's order."""
    count = _call(driver, "cuGraphGetNodes", driver.cuGraphGetNodes(graph, 0))[1]
    if not count:
        return []
    nodes = _call(driver, "cuGraphGetNodes", driver.cuGraphGetNodes(graph, count))[0]
    return [int(n) for n in nodes[:count]]


def capturing_graph(stream: int | None = None) -> Any | None:
    """The ``CUgraph`` that ``stream`` (default: the current stream) is capturing into, or ``None``."""
    driver = cuda_driver()
    if stream is None:
        stream = torch.cuda.current_stream().cuda_stream
    status, _id, graph, *_ = _call(driver, "cuStreamGetCaptureInfo", driver.cuStreamGetCaptureInfo(driver.CUstream(stream)))
    if status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return graph


class NodeAttribution:
    """While a capture runs, note which module and :class:`cgutils.nvtx_range` added each graph node.

    Use it around the capture (GraphRunner and :func:`~cgutils.capture.capture_graph` do, with
    ``inspect=True``)::

        with NodeAttribution(model) as attribution:
            with torch.cuda.graph(g):
                model(x)
        table = node_table(g, attribution)

    Every module's forward pre-hook and post-hook, and every ``cgutils.nvtx_range`` enter and exit, look
    at the graph being captured: nodes added since the last look were added by the innermost module
    (range) running in between. Module names are ``root``'s qualified names (``encoder.layer.3.attention``),
    the root itself by its class name (``BertModel``: work in its own forward, outside its submodules); a
    module outside ``root`` is named by its class under the module that called it.

    Args:
        root: the module being captured (for its qualified names), or ``None``.
        nodes_now: returns the node handles of the graph being captured (default: read from the driver
            through the current stream); tests pass a simulation.

    Attributes:
        owner: ``{node handle: (module name, range name)}``; ``""`` for no module (a function's own code)
            / no range.
        order: node handles in the order they were first seen (a topological order of the capture).
        marks: how many times the graph was read (about two per module call).
    """

    def __init__(self, root: nn.Module | None = None, nodes_now: Callable[[], Iterable[int]] | None = None):
        self.owner: dict[int, tuple[str, str]] = {}
        self.order: list[int] = []
        self.marks = 0
        # the root's own forward (code outside its submodules) is named by its class, e.g. "BertModel"
        self._names = {id(m): n or type(m).__name__ for n, m in root.named_modules()} if isinstance(root, nn.Module) else {}
        self._modules: list[str] = []
        self._ranges: list[str] = []
        self._nodes_now = nodes_now or self._from_driver
        self._handles: list[Any] = []

    def _from_driver(self) -> list[int]:
        graph = capturing_graph()
        return [] if graph is None else _nodes(cuda_driver(), graph)

    def mark(self) -> None:
        """Give every node added since the last mark to the innermost running module and range."""
        self.marks += 1
        owner = (self._modules[-1] if self._modules else "", self._ranges[-1] if self._ranges else "")
        for node in self._nodes_now():
            if node not in self.owner:
                self.owner[node] = owner
                self.order.append(node)

    def _name(self, module: nn.Module) -> str:
        name = self._names.get(id(module))
        if name is None:  # a module outside root: its class, under the module that called it
            outer = self._modules[-1] if self._modules else ""
            name = f"{outer}.{type(module).__name__}" if outer else type(module).__name__
        return name

    def _pre(self, module: nn.Module, *_: Any) -> None:
        self.mark()
        self._modules.append(self._name(module))

    def _post(self, module: nn.Module, *_: Any) -> None:
        self.mark()
        if self._modules:
            self._modules.pop()

    def range_enter(self, name: str) -> None:
        """Called by :class:`cgutils.nvtx_range` when a range opens during the capture."""
        self.mark()
        self._ranges.append(name)

    def range_exit(self) -> None:
        """Called by :class:`cgutils.nvtx_range` when a range closes during the capture."""
        self.mark()
        if self._ranges:
            self._ranges.pop()

    def __enter__(self) -> NodeAttribution:
        from ..annotate import range_listeners
        hooks = nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._pre),
                         hooks.register_module_forward_hook(self._post, always_call=True)]
        range_listeners.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        from ..annotate import range_listeners
        if exc[0] is None:
            self.mark()  # nodes after the last module returned: the top level's
        for h in self._handles:
            h.remove()
        self._handles = []
        if self in range_listeners:
            range_listeners.remove(self)


def raw_graph(graph: Any) -> Any:
    """The ``CUgraph`` of a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True`` (or of a raw
    handle given as an int).

    Raises:
        InputError: the graph was not kept (``keep_graph=False``, torch's default), or is not a graph.
    """
    driver = cuda_driver()
    if isinstance(graph, int) and not isinstance(graph, bool):
        if graph == 0:
            raise InputError("graph handle 0 is a null cudaGraph_t; pass a torch.cuda.CUDAGraph captured with "
                             "keep_graph=True, or its raw_cuda_graph()")
        return driver.CUgraph(graph)
    if not hasattr(graph, "raw_cuda_graph"):
        raise InputError(f"expected a torch.cuda.CUDAGraph or a cudaGraph_t handle (int), got {type(graph).__name__}")
    try:
        handle = graph.raw_cuda_graph()
    except RuntimeError as exc:
        raise InputError(
            "this CUDAGraph did not keep its cudaGraph_t: PyTorch destroys it after instantiation unless the "
            "graph is made with torch.cuda.CUDAGraph(keep_graph=True) (GraphRunner(..., inspect=True) does). "
            f"PyTorch said: {str(exc).splitlines()[0]}") from exc
    return driver.CUgraph(int(handle))


def _kernel(driver: Any, node: Any, cache: dict) -> dict[str, Any]:
    params = _call(driver, "cuGraphKernelNodeGetParams", driver.cuGraphKernelNodeGetParams(node))
    func, kern = int(params.func), int(params.kern)
    key = func or kern
    if key not in cache:
        if func:
            name = _call(driver, "cuFuncGetName", driver.cuFuncGetName(params.func))
            info = lambda i: driver.cuFuncGetParamInfo(params.func, i)  # noqa: E731
        else:
            name = _call(driver, "cuKernelGetName", driver.cuKernelGetName(params.kern))
            info = lambda i: driver.cuKernelGetParamInfo(params.kern, i)  # noqa: E731
        size, i = 0, 0
        while i < 4096:  # the parameter list ends where the driver refuses the next index
            err, offset, nbytes = info(i)
            if err != driver.CUresult.CUDA_SUCCESS:
                break
            size, i = max(size, offset + nbytes), i + 1
        mangled = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        cache[key] = (torch._C._demangle(mangled), size)
    name, size = cache[key]
    return {"kernel": name, "family": kernel_family(name),
            "grid": (params.gridDimX, params.gridDimY, params.gridDimZ),
            "block": (params.blockDimX, params.blockDimY, params.blockDimZ),
            "shared_mem_bytes": int(params.sharedMemBytes), "param_bytes": size}


def node_table(graph: Any, attribution: NodeAttribution | None = None) -> pd.DataFrame:
    """Every node of a captured graph, in capture order, with its launch parameters and its module.

    Args:
        graph: a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``, or a ``cudaGraph_t`` as an int.
        attribution: the :class:`NodeAttribution` that watched the capture; without it ``module`` and
            ``range`` are empty and the order is a topological order of the DAG (ties in the driver's order).

    Returns:
        ``pandas.DataFrame``, one row per node, columns ``NODE_COLUMNS``: ``index`` (0-based, capture
        order), ``type`` (``KERNEL``, ``MEMCPY``, ``MEMSET``, ``EMPTY``, ``EVENT_RECORD``, ``WAIT_EVENT``,
        ``GRAPH``, ``HOST``, ``MEM_ALLOC``, ``MEM_FREE``, ``CONDITIONAL``...), ``kernel`` (demangled name;
        empty for other types), ``family`` (:func:`kernel_family`), ``grid`` and ``block`` (3-tuples of
        ints), ``shared_mem_bytes`` (dynamic shared memory, bytes), ``param_bytes`` (size of the
        kernel's parameter block, bytes), ``module`` and ``range`` (innermost module / nvtx_range running
        when the node was captured; ``""`` for the top level), ``depends_on`` (indexes of the nodes it
        waits for).

    Raises:
        DependencyError: cuda-python (``cuda-bindings``) is not installed.
        InputError: the graph was not captured with ``keep_graph=True``, or the handle is 0.
        CgutilsError: the driver could not be loaded (no NVIDIA driver) or refused a query (a destroyed graph).
    """
    driver = cuda_driver()
    handle = raw_graph(graph)
    try:
        nodes = _nodes(driver, handle)
    except RuntimeError as exc:  # cuda-python loads libcuda at the first call: "Failed to dlopen libcuda.so.1"
        raise CgutilsError(f"reading a CUDA graph needs the NVIDIA driver, which could not be loaded here "
                           f"({exc}); run this on a machine with a GPU, or read a recorded table") from exc
    handles = {n: driver.CUgraphNode(n) for n in nodes}
    n_edges = _call(driver, "cuGraphGetEdges", driver.cuGraphGetEdges(handle, 0))[-1]
    deps: dict[int, list[int]] = {n: [] for n in nodes}
    if n_edges:
        src, dst, *_ = _call(driver, "cuGraphGetEdges", driver.cuGraphGetEdges(handle, n_edges))
        for a, b in zip(src[:n_edges], dst[:n_edges], strict=True):
            deps.setdefault(int(b), []).append(int(a))
    order = _capture_order(nodes, deps, attribution)
    index = {n: i for i, n in enumerate(order)}
    cache: dict[int, tuple[str, int]] = {}
    rows = []
    for n in order:
        kind = _call(driver, "cuGraphNodeGetType", driver.cuGraphNodeGetType(handles[n]))
        row = {"index": index[n], "type": kind.name.replace("CU_GRAPH_NODE_TYPE_", ""), "kernel": "", "family": "",
               "grid": None, "block": None, "shared_mem_bytes": 0, "param_bytes": 0}
        if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            row.update(_kernel(driver, handles[n], cache))
        module, rng = attribution.owner.get(n, ("", "")) if attribution is not None else ("", "")
        row.update(module=module, range=rng, depends_on=sorted(index[d] for d in deps.get(n, []) if d in index))
        rows.append(row)
    return pd.DataFrame(rows, columns=NODE_COLUMNS)


def _capture_order(nodes: list[int], deps: dict[int, list[int]], attribution: NodeAttribution | None) -> list[int]:
    """Nodes in the order the capture added them (the attribution's), else a topological order (Kahn's
    algorithm, ties in the driver's order); nodes the attribution never saw go last, in that order."""
    if attribution is not None and attribution.order:
        present = set(nodes)
        seen = [n for n in attribution.order if n in present]
        known = set(seen)
        return seen + [n for n in nodes if n not in known]
    waiting = {n: len(deps.get(n, [])) for n in nodes}
    children: dict[int, list[int]] = collections.defaultdict(list)
    for n in nodes:
        for d in deps.get(n, []):
            children[d].append(n)
    rank = {n: i for i, n in enumerate(nodes)}
    ready = [n for n in nodes if waiting[n] == 0]
    out: list[int] = []
    while ready:
        ready.sort(key=rank.__getitem__)
        n = ready.pop(0)
        out.append(n)
        for c in children[n]:
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    placed = set(out)  # once: a set per node made this quadratic
    return out + [n for n in nodes if n not in placed]


def captured_node_table(graph: Any, attribution: NodeAttribution | None = None) -> pd.DataFrame:
    """:func:`node_table` of a kept graph, or of a graph captured in pieces (one that has its own
    ``node_table``, :class:`~cgutils.capture.piecewise.PiecewiseGraph`: the pieces' nodes, a ``piece`` column)."""
    own = getattr(graph, "node_table", None)
    return own(attribution) if callable(own) else node_table(graph, attribution)


def node_counts(table: pd.DataFrame) -> pd.DataFrame:
    """Nodes counted by type and kernel family: columns ``type``, ``family``, ``nodes``, most first."""
    _check_table(table, ["type", "family"])
    out = table.groupby(["type", "family"], dropna=False).size().rename("nodes").reset_index()
    return out.sort_values("nodes", ascending=False, kind="stable").reset_index(drop=True)


def to_dot(table: pd.DataFrame, *, name: str = "cuda_graph", label_chars: int = 48) -> str:
    """The node table as a Graphviz DOT graph: one box per node (index, type or shortened kernel name),
    one cluster per top-level module, an edge per dependency. Render with ``dot -Tsvg``.

    Args:
        table: from :func:`node_table`, or a recorded one read back from CSV (``depends_on`` as text such as
            ``"0 3"``).
        name: the DOT graph's name.
        label_chars: longest kernel label kept (names are shortened to their function name first).
    """
    _check_table(table, ["index", "type", "kernel", "module", "depends_on"])

    def quote(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"digraph {quote(name)} {{", "  node [shape=box, fontsize=10];"]
    by_top: dict[str, list[str]] = collections.defaultdict(list)
    for r in table.itertuples():
        kernel = r.kernel if isinstance(r.kernel, str) else ""  # an empty CSV cell reads back as NaN
        module = r.module if isinstance(r.module, str) else ""
        label = f"{r.index}: " + (short_kernel_name(kernel)[:label_chars] if kernel else r.type)
        by_top[module.split(".")[0]].append(f"    n{r.index} [label={quote(label)}];")
    for i, (top, nodes) in enumerate(by_top.items()):
        lines += [f"  subgraph cluster_{i} {{", f"    label={quote(top or '(top level)')};", *nodes, "  }"]
    for r in table.itertuples():
        lines += [f"  n{d} -> n{r.index};" for d in _dependencies(r.depends_on)]
    return "\n".join(lines + ["}"]) + "\n"


def _dependencies(value: Any) -> list[int]:
    """``depends_on`` as a list of node indexes, from a list or from what CSV gives back (``"0 3"``, ``3.0``, NaN)."""
    if isinstance(value, str):
        return [int(v) for v in re.findall(r"\d+", value)]
    if value is None or (isinstance(value, numbers.Real) and value != value):  # an empty CSV cell: NaN
        return []
    if isinstance(value, numbers.Real):  # a cell holding one index reads back as a number
        return [int(value)]
    return [int(v) for v in value]


def short_kernel_name(name: str) -> str:
    """A demangled kernel name without its template arguments, parameter list and return type, e.g.
    ``at::native::vectorized_elementwise_kernel``; the name itself when nothing can be cut."""
    depth, out = 0, []
    for ch in name.replace("(anonymous namespace)::", ""):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    short = "".join(out).strip().split(" ")[-1]
    return short or name


def _check_table(table: Any, columns: list[str]) -> None:
    if not isinstance(table, pd.DataFrame) or not set(columns) <= set(table.columns):
        got = list(table.columns) if isinstance(table, pd.DataFrame) else type(table).__name__
        raise InputError(f"expected a node table from cgutils.node_table (columns {columns}), got {got}")


_ACTIVITY_OF = {"KERNEL": "kernel", "MEMSET": "memset", "MEMCPY": "memcpy"}


def node_times(table: pd.DataFrame, trace: Any, *, launch: int = -1) -> pd.DataFrame:
    """Join a node table with a profiler trace of the graph's replay: GPU time per node.

    CUPTI reports every kernel, memcpy and memset that a ``cudaGraphLaunch`` runs with that call's
    correlation id (:meth:`cgutils.Trace.links`). Those activities, in start-time order, are matched to the
    table's kernel/memcpy/memset nodes: each kernel to the first unmatched node, in capture order, with the
    same demangled name; each copy or memset to the first unmatched node of its kind.

    Args:
        table: from :func:`node_table` (or a recorded one).
        trace: a :class:`cgutils.Trace` (``cgutils.load_trace(path)``) that holds replays of this graph.
        launch: which ``cudaGraphLaunch`` of the trace to use, by position among the graph launches
            (default: the last one, after any first-launch upload).

    Returns:
        The table with ``ts`` (µs, trace clock) and ``gpu_us`` (duration) for each matched node (NaN for
        nodes without GPU work or left unmatched). ``.attrs``: ``launch_correlation``, ``activities`` (GPU
        activities of that launch), ``matched``, ``unmatched_activities`` (names of activities that found
        no node), ``launch_gpu_us`` (their summed duration).

    Raises:
        InputError: ``table`` is not a node table, holds several pieces of a piecewise graph, the trace has
            no ``cudaGraphLaunch`` with GPU work, or ``launch`` is out of range.
    """
    _check_table(table, ["index", "type", "kernel"])
    if "piece" in table.columns and table.piece.nunique() > 1:
        raise InputError(
            f"this node table holds {table.piece.nunique()} graph pieces (a piecewise runner's), and each piece is "
            f"its own cudaGraphLaunch: join one at a time, node_times(table[table.piece == k], trace, launch=...) "
            f"with the launch of piece k (pieces launch in order, so piece k of the last call is launch "
            f"k - {table.piece.nunique()})")
    links = trace.links()
    graph_links = links[is_graph_launch(links.call)]
    correlations = list(dict.fromkeys(graph_links.correlation))
    if not correlations:
        raise InputError(f"{getattr(trace, 'path', 'the trace')} holds no cudaGraphLaunch with GPU work; profile "
                         f"a replay of the graph (cgutils.profile(runner_call, path))")
    check_index("launch", launch, len(correlations), "the graph launches in the trace")
    corr = correlations[launch]
    acts = graph_links[graph_links.correlation == corr].sort_values("ts", kind="stable")
    queues: dict[tuple[str, str], collections.deque] = collections.defaultdict(collections.deque)
    for r in table.itertuples():
        kind = _ACTIVITY_OF.get(r.type)
        if kind is not None:
            queues[(kind, r.kernel if kind == "kernel" else "")].append(r.Index)
    ts = pd.Series(float("nan"), index=table.index)
    dur = ts.copy()
    unmatched: list[str] = []
    for a in acts.itertuples():
        q = queues.get((a.kind, a.name if a.kind == "kernel" else ""))
        if not q:
            unmatched.append(a.name)
            continue
        i = q.popleft()
        ts[i], dur[i] = a.ts, a.dur
    out = table.assign(ts=ts, gpu_us=dur)
    out.attrs.update(launch_correlation=int(corr), activities=len(acts), matched=int(dur.notna().sum()),
                     unmatched_activities=unmatched, launch_gpu_us=float(acts.dur.sum()))
    return out


def time_by_module(timed: pd.DataFrame, *, depth: int | None = None) -> pd.DataFrame:
    """GPU time of one replay per module, from :func:`node_times`.

    Args:
        timed: the output of :func:`node_times`.
        depth: cut module names to their first ``depth`` dotted parts (``encoder.layer.3`` at depth 3),
            so children add up into their parent; ``None`` keeps the innermost module.

    Returns:
        ``pandas.DataFrame`` with ``module`` (``"(top level)"`` for nodes outside every module), ``nodes``
        (with GPU work), ``gpu_us`` (summed) and ``share`` (of the matched GPU time), largest first.
    """
    _check_table(timed, ["module", "gpu_us"])
    if depth is not None and (not isinstance(depth, int) or depth < 1):
        raise InputError(f"depth must be an int >= 1 or None, got {depth!r}")
    work = timed[timed.gpu_us.notna()]
    names = work.module.fillna("").map(lambda m: ".".join(m.split(".")[:depth]) if depth else m)
    out = work.assign(module=names.replace("", "(top level)")).groupby("module").agg(
        nodes=("gpu_us", "size"), gpu_us=("gpu_us", "sum")).reset_index()
    total = out.gpu_us.sum()
    out["share"] = out.gpu_us / total if total else 0.0
    return out.sort_values("gpu_us", ascending=False, kind="stable").reset_index(drop=True)


def graph_node_types(dot: str) -> dict[str, int]:
    """Count the nodes of a captured graph by type from its DOT dump (``graph.debug_dump(path)`` after
    capturing with ``debug=True``; the format is CUDA's ``cudaGraphDebugDotPrint``, whose node labels
    start with the node type, e.g. ``KERNEL`` or ``MEMSET``).

    Returns:
        ``{node type: count}``; empty if the text holds no recognisable node.
    """
    return dict(collections.Counter(re.findall(r'label="\{\s*([A-Z_]+)', dot)))
