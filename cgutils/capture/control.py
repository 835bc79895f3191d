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
   with the caching allocator routing this thread's allocations to the capture's memory pool (torch
   2.14's ``begin_capture_to_if_node`` re-routes the same pool by the body's capture id); a WHILE body
   ends with the kernel that sets the handle again from the condition tensor, which the body has
   rewritten.

The condition kernels are compiled once per device with NVRTC (``cuda.bindings.nvrtc``). Outside a
capture (warm-up, eager validation) the same calls run a plain Python loop, so a function using them
behaves the same eagerly (with a host sync per iteration) and captured (none).

Bodies run, eagerly and under capture, with the tensor operations that wait for the GPU refused
(:class:`~cgutils.capture.bodysync.RefuseSyncs`): under capture such a sync failed on the body stream and the process crashed at
the end of the capture (torch 2.11, H200). Conditional nodes nest: each depth of a thread has its own
body stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..checks import check_int
from ..diagnose import eager_only_sync
from ..errors import CaptureError, CgutilsError, DependencyError, InputError
from .bodysync import RefuseSyncs
from .cudadriver import check as _call
from .cudadriver import cuda_driver
from .poolscope import current_pool

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
_CONDITION_DTYPES = tuple(getattr(torch, n) for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
                                                        "uint32", "uint64") if hasattr(torch, n))
MAX_ITERS = 2**31 - 1  # the condition kernels count in a C int
_IF_ELSE_DRIVER = 12080  # an IF node with an else body needs CUDA 12.8 (CUDA Runtime API, cudaConditionalNodeParams)

_functions: dict[int, dict[str, Any] | Exception] = {}
_lock = threading.Lock()
_local = threading.local()  # per thread: body streams by (device, depth), the nesting depth, condition reads


def inside_body() -> bool:
    """Whether this thread is running (or capturing) the body of a conditional node."""
    return getattr(_local, "depth", 0) > 0


def _run_body(body: Callable[[], Any], loop: bool) -> None:
    with _body(loop):
        out = body()
    if inspect.isgenerator(out) or inspect.iscoroutine(out):
        raise InputError(f"the body returned a {type(out).__name__} and so ran nothing: pass a plain function "
                         f"(no yield, not async)")


@contextlib.contextmanager
def _body(loop: bool) -> Iterator[None]:
    """Run a body: one level deeper, with syncs refused (and random draws, inside a loop's body)."""
    depth, loops = getattr(_local, "depth", 0), getattr(_local, "loops", 0)
    _local.depth, _local.loops = depth + 1, loops + loop
    try:
        with RefuseSyncs(loop=_local.loops > 0):
            yield
    finally:
        _local.depth, _local.loops = depth, loops


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
            try:
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
            except CgutilsError as exc:  # DependencyError included: kept, so a failed compile is not retried
                _functions[device] = exc
        found = _functions[device]
    if isinstance(found, Exception):
        raise found
    return found


def _body_stream(device: int) -> torch.cuda.Stream:
    """This thread's body stream for ``device`` at the current nesting depth: a stream capturing one body
    cannot capture another, and another thread's work must not land in this thread's body graph."""
    streams = _local.__dict__.setdefault("streams", {})
    key = (device, getattr(_local, "depth", 0))
    if key not in streams:
        streams[key] = _own_stream(device)
    return streams[key]


def _own_stream(device: int) -> torch.cuda.Stream:
    """A stream of our own: ``torch.cuda.Stream()`` hands out 32 pooled streams round-robin, so a body stream
    could be the capture stream itself or another thread's (then its capture fails or mixes work)."""
    try:
        driver = cuda_driver()
    except DependencyError:
        return torch.cuda.Stream(device)  # the eager loop only; capturing needs cuda-python anyway
    with torch.cuda.device(device):
        handle = _call(driver, "cuStreamCreate", driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
    return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", device))


@contextlib.contextmanager
def _on_body_stream(cond: torch.Tensor) -> Iterator[None]:
    """Run eager bodies on the stream their capture will use, so that what a first call sets up per stream
    (cuBLAS workspaces) and the condition kernels are ready before a capture (warm-up runs this path)."""
    if not cond.is_cuda:
        yield
        return
    with contextlib.suppress(CgutilsError):  # the eager loop needs no kernel; a capture will say what failed
        _kernels(cond.device.index)
    side, current = _body_stream(cond.device.index), torch.cuda.current_stream(cond.device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        current.wait_stream(side)


def _read(cond: torch.Tensor) -> bool:
    with eager_only_sync():
        return bool(cond.reshape(()))


def _check_condition(name: str, cond: Any) -> None:
    if isinstance(cond, torch.Tensor) and cond.device.type not in ("cuda", "cpu"):
        raise InputError(f"{name} is on {cond.device}; conditional nodes read it on a CUDA device (or, eagerly, the CPU)")
    if not isinstance(cond, torch.Tensor) or cond.numel() != 1 or cond.dtype not in _CONDITION_DTYPES:
        got = f"{cond.dtype} tensor of shape {tuple(cond.shape)}" if isinstance(cond, torch.Tensor) else type(cond).__name__
        raise InputError(f"{name} must be a one-element bool or integer tensor that the GPU writes, got {got}; "
                         f"make it with e.g. torch.ones(1, dtype=torch.bool, device='cuda')")


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
    announced = current_pool()
    if announced is not None:
        return announced
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
    driver = conditional_driver()
    stream = torch.cuda.current_stream()
    if cond.device != stream.device:
        raise InputError(f"the condition is on {cond.device} but the capture runs on {stream.device}")
    if len(bodies) == 2 and _call(driver, "cuDriverGetVersion", driver.cuDriverGetVersion()) < _IF_ELSE_DRIVER:
        raise CgutilsError("an IF node with an else body needs a CUDA 12.8 driver or newer; use two if_node calls "
                           "(the second on the negated condition) instead")
    device, pool = stream.device.index, _pool(pool)
    _kernels(device)  # compiled and loaded before anything is added to the capture
    # The capture's own routing (by capture id) does not cover the body stream's separate capture. It is
    # ended first, which also checks that `pool` is the capture's, before the graph is touched; from here
    # on this thread's allocations go to the pool (begin/end pairs, each begin with its release).
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError as exc:
        raise InputError(f"pool={pool} is not the memory pool this capture records into ({str(exc).splitlines()[0]}); "
                         f"pass the handle given to torch.cuda.graph(g, pool=...)") from exc
    s = driver.CUstream(stream.cuda_stream)
    added = invalidated = False
    try:
        status, _id, graph, *_ = _call(driver, "cuStreamGetCaptureInfo", driver.cuStreamGetCaptureInfo(s))
        ctx = _call(driver, "cuCtxGetCurrent", driver.cuCtxGetCurrent())
        handle = _call(driver, "cuGraphConditionalHandleCreate",
                       driver.cuGraphConditionalHandleCreate(graph, ctx, 0, 0))
        count, loop = None, ()
        if kind == "while":
            _route(device, pool)
            try:
                count = torch.zeros(1, dtype=torch.int32, device=cond.device)  # iterations run, in the pool
            finally:
                _unroute(device, pool)
            loop = ((count.data_ptr(), ctypes.c_void_p), (max_iters, ctypes.c_int))
            _launch("cg_loop_start", s, handle, cond, *loop)
        else:
            _launch("cg_set", s, handle, cond)
        added = True
        _st, _id, graph, deps, _edges, n = _call(driver, "cuStreamGetCaptureInfo", driver.cuStreamGetCaptureInfo(s))
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = (driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE if kind == "while"
                                   else driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)
        params.conditional.size = len(bodies)
        params.conditional.ctx = ctx
        # no edge data passed on: plain dependencies (cuda-bindings 13.3.0's notes list a use-after-free in the
        # edge data that cuStreamGetCaptureInfo returns)
        node = _call(driver, "cuGraphAddNode", driver.cuGraphAddNode(graph, deps[:n], None, n, params))
        body_graphs = list(params.conditional.phGraph_out)[: len(bodies)]
        _call(driver, "cuStreamUpdateCaptureDependencies", driver.cuStreamUpdateCaptureDependencies(
            s, [node], None, 1, driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES))
        side = _body_stream(device)
        b = driver.CUstream(side.cuda_stream)
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        for body, body_graph in zip(bodies, body_graphs, strict=True):
            with torch.cuda.stream(side):
                _route(device, pool)
                try:
                    _call(driver, "cuStreamBeginCaptureToGraph",
                          driver.cuStreamBeginCaptureToGraph(b, body_graph, None, None, 0, mode))
                    try:
                        _run_body(body, kind == "while")
                        if kind == "while":
                            _launch("cg_loop_next", b, handle, cond, *loop)
                    except BaseException as exc:
                        # ended, not emptied (a body's nodes are the driver's while an enclosing body captures);
                        # the outermost capture is invalidated below, so the half-made graph never instantiates
                        driver.cuStreamEndCapture(b)
                        if isinstance(exc, CgutilsError) or not isinstance(exc, Exception):
                            raise
                        # named here: the caller's capture_end then fails on the invalidated capture with
                        # torch's own "previous error during capture", which would hide the body's error
                        raise CaptureError(
                            f"the body of a {kind.upper()} node raised {type(exc).__name__} while it was captured: "
                            f"{exc}. Fix the body (it must run under capture as it runs eagerly); the "
                            f"capture is abandoned", original=exc, cause="body_raised") from exc
                    err, *_ = driver.cuStreamEndCapture(b)
                    if err != driver.CUresult.CUDA_SUCCESS:
                        raise CgutilsError(f"capturing the body of a {kind.upper()} node failed ({err.name}): the "
                                           f"body did something a graph cannot hold (a host sync, a CPU copy) or "
                                           f"used a stream other than the current one")
                finally:
                    _unroute(device, pool)
    except BaseException:
        # A graph holding a half-made node must not instantiate: fail the capture instead, but only the
        # caller's own capture (depth 0). Inside an enclosing body the stream is a capture-to-graph of that
        # body; invalidating it and then ending it crashed the process in the enclosing body's
        # cuStreamEndCapture (SIGSEGV, H200, a body raising two levels down). Those captures end cleanly
        # as the error travels up, and the outermost call invalidates the one capture that instantiates.
        if added and getattr(_local, "depth", 0) == 0:
            driver.cuStreamSynchronize(s)
            invalidated = True
        raise
    finally:
        # torch's capture_end raises for an invalidated capture before it ends the pool's recording: put the
        # routing back only for a capture that goes on, or this thread's allocations would stay in the pool
        if not invalidated:
            _route(device, pool)
            torch._C._cuda_releasePool(device, pool)  # the pool keeps the capture's own reference
    return count


def _route(device: int, pool: tuple) -> None:
    """Send this thread's allocations on ``device`` to ``pool`` (torch >= 2.8; the current stream's before)."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    (begin or torch._C._cuda_beginAllocateCurrentStreamToPool)(device, pool)


def _unroute(device: int, pool: tuple) -> None:
    torch._C._cuda_endAllocateToPool(device, pool)
    torch._C._cuda_releasePool(device, pool)


def conditional_driver() -> Any:
    """cuda-python's driver module, 13.x: the conditional-node calls use its signatures."""
    driver = cuda_driver()
    from cuda import bindings

    major = int(str(getattr(bindings, "__version__", "0")).split(".")[0] or 0)
    if major < 13:
        raise DependencyError(f"conditional nodes need cuda-bindings 13 or newer (installed: "
                              f"{getattr(bindings, '__version__', 'unknown')}): pip install 'cuda-bindings>=13'")
    return driver


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
        InputError: ``cond`` is not a one-element bool/integer tensor, ``max_iters`` is not in
            ``[0, 2**31 - 1]``, no pool is known or ``pool`` is not the capture's, the body syncs, or it
            draws random numbers on the GPU (each iteration would repeat them under capture).
        DependencyError: cuda-python is not installed (``pip install cuda-bindings``).
        CgutilsError: the body could not be captured, or NVRTC could not compile the condition kernel.
    """
    _check_condition("cond", cond)
    max_iters = check_int("max_iters", max_iters, minimum=0, why="an upper bound on the iterations")
    if max_iters > MAX_ITERS:
        raise InputError(f"max_iters must be <= {MAX_ITERS} (the GPU counts iterations in a 32-bit int), got {max_iters}")
    if not callable(body):
        raise InputError(f"body must be a function of no arguments, got {type(body).__name__}")
    if cond.is_cuda and torch.cuda.is_current_stream_capturing():
        return _conditional("while", cond, [body], pool, max_iters)
    done = 0
    with _on_body_stream(cond):
        while done < max_iters and _read(cond):
            _run_body(body, True)
            done += 1
        if done and done == max_iters and _read(cond):
            warnings.warn(f"while_node stopped at max_iters={max_iters} with its condition still set: the loop was "
                          f"cut short (under capture it would be too); raise max_iters if that was not meant",
                          stacklevel=2)
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
    if not callable(body):
        raise InputError(f"body must be a function of no arguments, got {type(body).__name__}")
    for name, fn in (("else_body", else_body),):
        if fn is not None and not callable(fn):
            raise InputError(f"{name} must be a function of no arguments, got {type(fn).__name__}")
    if pred.is_cuda and torch.cuda.is_current_stream_capturing():
        _conditional("if", pred, [body] if else_body is None else [body, else_body], pool)
        return
    with _on_body_stream(pred):
        if _read(pred):
            _run_body(body, False)
        elif else_body is not None:
            _run_body(else_body, False)
