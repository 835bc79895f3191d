"""Control flow on the device: WHILE and IF conditional nodes around captured PyTorch work.

A captured graph replays the same kernels every time, so a Python ``while``/``if`` on a CUDA tensor
cannot be captured (it needs ``.item()``, a host sync). CUDA 12.4 added *conditional nodes*: a node
whose body graph runs once (IF) or again and again (WHILE) as long as a *condition handle* is non-zero,
where a kernel sets the handle on the GPU with ``cudaGraphSetConditional`` (CUDA Programming Guide,
"Conditional Graph Nodes"). PyTorch exposes them from 2.12 (``torch.cond`` under capture) and 2.14
(``CUDAGraph.begin_capture_to_while_node``); this module builds them on torch 2.11 too, through
cuda-python, in the middle of a torch capture:

1. read the graph being captured and its current dependencies (``cuStreamGetCaptureInfo``);
2. create a condition handle on it and launch a one-thread kernel that sets the handle from the
   condition tensor (captured as a kernel node);
3. add the conditional node after that kernel (``cuGraphAddNode``) and make the capture continue after
   the node (``cuStreamUpdateCaptureDependencies``);
4. capture the body into the node's body graph on a second stream (``cuStreamBeginCaptureToGraph``),
   with the caching allocator routing that stream's allocations to the capture's memory pool (as
   torch 2.14's ``begin_capture_to_if_node`` does); a WHILE body ends with the kernel that sets the
   handle again from the condition tensor, which the body has rewritten.

The condition kernels are compiled once per device with NVRTC (``cuda.bindings.nvrtc``). Outside a
capture (warm-up, eager validation) the same calls run a plain Python loop, so a function using them
behaves the same eagerly (with a host sync per iteration) and captured (none).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..checks import check_int
from ..errors import CgutilsError, InputError
from .cudadriver import check as _call
from .cudadriver import cuda_driver

# Condition kernels: one thread reads the condition tensor's bytes (any non-zero byte: true, which is
# right for bool and integer tensors) and sets the handle. The device-runtime function is declared here
# because NVRTC has no CUDA runtime headers; the compiler lowers the call itself (no device runtime to link).
_SOURCE = r"""
typedef unsigned long long cg_handle_t;
extern "C" __device__ void cudaGraphSetConditional(cg_handle_t handle, unsigned int value);
__device__ bool cg_nonzero(const unsigned char* p, int n) {
  bool v = false;
  for (int i = 0; i < n; ++i) v |= p[i] != 0;
  return v;
}
extern "C" __global__ void cg_set(cg_handle_t h, const unsigned char* cond, int n) {
  cudaGraphSetConditional(h, cg_nonzero(cond, n) ? 1u : 0u);
}
extern "C" __global__ void cg_loop_start(cg_handle_t h, const unsigned char* cond, int n, int* count, int max_iters) {
  *count = 0;
  cudaGraphSetConditional(h, (max_iters > 0 && cg_nonzero(cond, n)) ? 1u : 0u);
}
extern "C" __global__ void cg_loop_next(cg_handle_t h, const unsigned char* cond, int n, int* count, int max_iters) {
  int c = *count + 1;
  *count = c;
  cudaGraphSetConditional(h, (c < max_iters && cg_nonzero(cond, n)) ? 1u : 0u);
}
"""
_KERNELS = ("cg_set", "cg_loop_start", "cg_loop_next")
_CONDITION_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

_functions: dict[int, dict[str, Any]] = {}
_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
_pools = threading.local()


@contextlib.contextmanager
def capture_pool(pool: Any) -> Iterator[None]:
    """Tell :func:`while_node` and :func:`if_node` which memory pool the capture in this thread records
    into (:func:`~cgutils.capture.graph.capture_graph` does, for GraphRunner and GreedyDecoder)."""
    stack = _pools.__dict__.setdefault("stack", [])
    stack.append(tuple(pool))
    try:
        yield
    finally:
        stack.pop()


def _compile(capability: tuple[int, int]) -> bytes:
    from cuda.bindings import nvrtc

    def ok(result: tuple, what: str) -> Any:
        err, *values = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CgutilsError(f"NVRTC {what} failed ({err.name}) compiling cgutils' condition kernels")
        return values[0] if values else None

    prog = ok(nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"cgutils_conditions.cu", 0, [], []), "create")
    try:
        arch = f"--gpu-architecture=sm_{capability[0]}{capability[1]}".encode()
        if nvrtc.nvrtcCompileProgram(prog, 1, [arch])[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CgutilsError(f"NVRTC could not compile cgutils' condition kernels for sm_{capability[0]}"
                               f"{capability[1]}: {log.decode(errors='replace').strip()}")
        size = ok(nvrtc.nvrtcGetCUBINSize(prog), "CUBIN size")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "CUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _kernels(device: int) -> dict[str, Any]:
    """The condition kernels on ``device``, compiled and loaded on first use."""
    with _lock:
        if device not in _functions:
            driver = cuda_driver()
            try:
                cubin = _compile(torch.cuda.get_device_capability(device))
            except ImportError as exc:
                raise CgutilsError("conditional nodes need NVRTC (cuda.bindings.nvrtc and the nvidia-cuda-nvrtc "
                                   "library, which CUDA builds of torch install)") from exc
            with torch.cuda.device(device):
                module = _call(driver, "cuModuleLoadData", driver.cuModuleLoadData(cubin))
                _functions[device] = {name: _call(driver, "cuModuleGetFunction",
                                                  driver.cuModuleGetFunction(module, name.encode()))
                                      for name in _KERNELS}
        return _functions[device]


def _body_stream(device: int) -> torch.cuda.Stream:
    with _lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]


@contextlib.contextmanager
def _on_body_stream(cond: torch.Tensor) -> Iterator[None]:
    """Run eager bodies on the stream their capture will use, so that what a first call sets up per stream
    (cuBLAS workspaces) and the condition kernels are ready before a capture (warm-up runs this path)."""
    if not cond.is_cuda:
        yield
        return
    _kernels(cond.device.index)
    side, current = _body_stream(cond.device.index), torch.cuda.current_stream(cond.device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        current.wait_stream(side)


def _run_eagerly(what: str, body: Callable[[], Any]) -> None:
    """Run a body outside capture with CUDA's sync check on: a body that syncs is refused here, in the
    warm-up, because under capture it failed on a side stream and crashed the process (torch 2.11, H200)."""
    if not torch.cuda.is_available():
        body()
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        body()
    except RuntimeError as exc:
        if "synchronizing" not in str(exc):
            raise
        raise InputError(f"the body of {what} made a host sync ({str(exc).splitlines()[0]}); a conditional node's "
                         f"body runs on the GPU and cannot wait for the host: keep .item(), bool(tensor), "
                         f"printing and CPU copies out of it (cgutils.find_sync_points(body) lists them)") from exc
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _check_condition(name: str, cond: Any) -> None:
    if not isinstance(cond, torch.Tensor) or cond.numel() != 1 or cond.dtype not in _CONDITION_DTYPES:
        got = f"{cond.dtype} tensor of shape {tuple(cond.shape)}" if isinstance(cond, torch.Tensor) else type(cond).__name__
        raise InputError(f"{name} must be a one-element bool or integer tensor that the GPU writes, got {got}; "
                         f"make it with e.g. torch.ones(1, dtype=torch.bool, device='cuda')")
    if cond.is_cuda and not cond.is_contiguous():
        raise InputError(f"{name} must be contiguous (its bytes are read by a kernel); use .contiguous() once, "
                         f"outside the captured code, and keep writing that tensor")


def _launch(name: str, stream: Any, handle: Any, cond: torch.Tensor, *extra: tuple[Any, Any]) -> None:
    driver = cuda_driver()
    values = (int(handle), cond.data_ptr(), cond.element_size(), *(v for v, _ in extra))
    types = (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int, *(t for _, t in extra))
    func = _kernels(cond.device.index)[name]
    _call(driver, "cuLaunchKernel", driver.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, stream, (values, types), 0))


def _pool(pool: Any) -> tuple[int, int]:
    if pool is not None:
        if not (isinstance(pool, tuple) and len(pool) == 2):
            raise InputError(f"pool must be the memory-pool handle the capture records into (a pair from "
                             f"torch.cuda.graph_pool_handle()), got {type(pool).__name__}")
        return pool
    stack = getattr(_pools, "stack", None)
    if stack:
        return stack[-1]
    current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)  # torch >= 2.14
    if current is not None:
        return tuple(current().pool())
    raise InputError("a conditional node inside a plain torch.cuda.graph capture needs the capture's memory pool "
                     "(torch 2.11 cannot tell it during capture): capture with h = torch.cuda.graph_pool_handle(); "
                     "torch.cuda.graph(g, pool=h) and pass pool=h, or capture with cgutils.GraphRunner, which "
                     "passes its own")


def _conditional(kind: str, cond: torch.Tensor, bodies: list[Callable[[], Any]], pool: Any,
                 max_iters: int = 0) -> torch.Tensor | None:
    """Insert an IF (one or two bodies) or WHILE node into the capture running on the current stream."""
    driver = cuda_driver()
    stream = torch.cuda.current_stream()
    if cond.device != stream.device:
        raise InputError(f"the condition is on {cond.device} but the capture runs on {stream.device}")
    device, pool = stream.device.index, _pool(pool)
    kernels = _kernels(device)  # noqa: F841  (compiled before anything is added to the capture)
    s = driver.CUstream(stream.cuda_stream)
    status, _id, graph, *_ = _call(driver, "cuStreamGetCaptureInfo", driver.cuStreamGetCaptureInfo(s))
    ctx = _call(driver, "cuCtxGetCurrent", driver.cuCtxGetCurrent())
    handle = _call(driver, "cuGraphConditionalHandleCreate", driver.cuGraphConditionalHandleCreate(graph, ctx, 0, 0))
    count = None
    if kind == "while":
        count = torch.zeros(1, dtype=torch.int32, device=cond.device)  # iterations run, in the capture's pool
        loop = ((count.data_ptr(), ctypes.c_void_p), (max_iters, ctypes.c_int))
        _launch("cg_loop_start", s, handle, cond, *loop)
    else:
        _launch("cg_set", s, handle, cond)
    _st, _id, graph, deps, edges, n = _call(driver, "cuStreamGetCaptureInfo", driver.cuStreamGetCaptureInfo(s))
    params = driver.CUgraphNodeParams()
    params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = (driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE if kind == "while"
                               else driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)
    params.conditional.size = len(bodies)
    params.conditional.ctx = ctx
    node = _call(driver, "cuGraphAddNode", driver.cuGraphAddNode(graph, deps[:n], edges[:n] if edges else None, n, params))
    body_graphs = list(params.conditional.phGraph_out)[: len(bodies)]
    _call(driver, "cuStreamUpdateCaptureDependencies", driver.cuStreamUpdateCaptureDependencies(
        s, [node], None, 1, driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES))
    side = _body_stream(device)
    b = driver.CUstream(side.cuda_stream)
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    # The capture's own routing (by capture id) does not cover the body stream's separate capture:
    # route the body stream to the same pool while its body is captured, then the capture stream again.
    # Each begin takes a reference on the pool, so each is paired with a release.
    torch._C._cuda_endAllocateToPool(device, pool)
    try:
        for body, body_graph in zip(bodies, body_graphs, strict=True):
            with torch.cuda.stream(side):
                torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool)
                try:
                    _call(driver, "cuStreamBeginCaptureToGraph",
                          driver.cuStreamBeginCaptureToGraph(b, body_graph, None, None, 0, mode))
                    try:
                        body()
                        if kind == "while":
                            _launch("cg_loop_next", b, handle, cond, *loop)
                    except BaseException:
                        driver.cuStreamEndCapture(b)
                        _abandon(driver, body_graph, s)
                        raise
                    err, *_ = driver.cuStreamEndCapture(b)
                    if err != driver.CUresult.CUDA_SUCCESS:
                        _abandon(driver, body_graph, s)
                        raise CgutilsError(f"capturing the body of a {kind.upper()} node failed ({err.name}): the "
                                           f"body did something a graph cannot hold (a host sync such as .item(), "
                                           f"a CPU copy) or used a stream other than the current one")
                finally:
                    torch._C._cuda_endAllocateToPool(device, pool)
                    torch._C._cuda_releasePool(device, pool)
    finally:
        torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)
    return count


def _abandon(driver: Any, graph: Any, capture_stream: Any) -> None:
    """After a body failed to capture: remove what it left in its body graph, and invalidate the capture
    around it (a stream sync is illegal while capturing), so that capture ends with an error instead of
    instantiating a graph that holds a half-captured body (that crashed the process, measured on the H200)."""
    err, nodes, count = driver.cuGraphGetNodes(graph, 0)
    if err == driver.CUresult.CUDA_SUCCESS and count:
        err, nodes, count = driver.cuGraphGetNodes(graph, count)
        for node in nodes[:count]:
            driver.cuGraphDestroyNode(node)
    driver.cuStreamSynchronize(capture_stream)


def while_node(cond: torch.Tensor, body: Callable[[], Any], *, max_iters: int, pool: Any = None) -> torch.Tensor:
    """Run ``body()`` while ``cond`` is non-zero, at most ``max_iters`` times: on the GPU when called inside
    a capture (a WHILE conditional node; no host sync), as a Python loop otherwise.

    ``body`` must update its state in place (static buffers) and rewrite ``cond`` on the GPU, e.g.
    ``running.copy_(~done.all())``; what it returns is ignored. Under capture the condition is read
    before the first iteration and after each one, exactly as the Python loop reads it.

    Args:
        cond: one-element bool or integer tensor on the capture's device (non-zero: run the body).
        body: a function of no arguments, capturable (no ``.item()``, no host copies, no new streams).
        max_iters: the most iterations (>= 0): a loop whose condition never clears stops there instead of
            hanging the GPU.
        pool: in a plain ``torch.cuda.graph(g, pool=h)`` capture, ``h`` (from ``torch.cuda.graph_pool_handle()``);
            GraphRunner and StopTokenDecoder pass their own.

    Returns:
        ``(1,)`` int32 tensor on ``cond``'s device: the iterations run (after each replay, under capture).

    Raises:
        InputError: ``cond`` is not a one-element bool/integer tensor, ``max_iters`` < 0, or no pool known.
        DependencyError: cuda-python is not installed (``pip install cuda-bindings``).
        CgutilsError: the body could not be captured, or NVRTC could not compile the condition kernel.
    """
    _check_condition("cond", cond)
    max_iters = check_int("max_iters", max_iters, minimum=0, why="an upper bound on the iterations")
    if not callable(body):
        raise InputError(f"body must be a function of no arguments, got {type(body).__name__}")
    if cond.is_cuda and torch.cuda.is_current_stream_capturing():
        return _conditional("while", cond, [body], pool, max_iters)
    done = 0
    with _on_body_stream(cond):
        while done < max_iters and bool(cond.reshape(())):
            _run_eagerly("while_node", body)
            done += 1
    return torch.full((1,), done, dtype=torch.int32, device=cond.device)


def if_node(pred: torch.Tensor, body: Callable[[], Any], else_body: Callable[[], Any] | None = None, *,
            pool: Any = None) -> None:
    """Run ``body()`` if ``pred`` is non-zero, else ``else_body()`` (if given): chosen on the GPU when called
    inside a capture (an IF conditional node; only the chosen branch runs), in Python otherwise.

    Unlike ``torch.where``, which computes both branches and selects elementwise, only one branch's
    kernels run. Branches update state in place; what they return is ignored.

    Args:
        pred: one-element bool or integer tensor on the capture's device.
        body, else_body: functions of no arguments, capturable. An IF node with two bodies needs CUDA 12.8+.
        pool: as for :func:`while_node`.

    Raises:
        InputError, DependencyError, CgutilsError: as for :func:`while_node`.
    """
    _check_condition("pred", pred)
    for name, fn in (("body", body), ("else_body", else_body)):
        if fn is not None and not callable(fn):
            raise InputError(f"{name} must be a function of no arguments, got {type(fn).__name__}")
    if pred.is_cuda and torch.cuda.is_current_stream_capturing():
        _conditional("if", pred, [body] if else_body is None else [body, else_body], pool)
        return
    with _on_body_stream(pred):
        if bool(pred.reshape(())):
            _run_eagerly("if_node", body)
        elif else_body is not None:
            _run_eagerly("if_node", else_body)
