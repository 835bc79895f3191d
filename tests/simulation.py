"""A CPU stand-in for :class:`cgutils.capture.CudaBackend` with a CUDA graph's static-buffer semantics.

Most of GraphRunner is Python around a few CUDA calls (capture, replay, pool accounting): argument
binding, the input check and its fast path, static-buffer substitution, bucket padding, cutting back,
eager fallback and validation. With this backend those Python paths run end to end in CI:

- "capture" runs the function once on the static input buffers and keeps its output tensors;
- "replay" runs the function again on the same static input buffers and writes the result into
  those same output tensors, in place, as a replayed graph rewrites its static outputs.

With ``SimulatedBackend(frozen=module)``, a replay also reads the parameter and buffer *objects* that
``module`` held at capture, as a graph reads the addresses it was captured with: replacing them afterwards
(``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``) goes unseen, as on a GPU.

What it cannot show (kernels frozen at capture, storages swapped by ``.half()``, streams, memory pools) stays
in the GPU tests.
"""

import contextlib

import torch

from cgutils.capture import tree_leaves


class SimulatedGraph:
    def __init__(self, fn, static_out, frozen=None):
        self.fn, self.static_out = fn, static_out
        self.frozen = [(d, k, v) for m in frozen.modules() for d in (m._parameters, m._buffers)
                       for k, v in d.items()] if frozen is not None else []

    @contextlib.contextmanager
    def _captured_tensors(self):
        now = [(d, k, d[k]) for d, k, _ in self.frozen]
        for d, k, v in self.frozen:
            d[k] = v
        try:
            yield
        finally:
            for d, k, v in now:
                d[k] = v

    def replay(self):
        with torch.no_grad(), self._captured_tensors():
            fresh = self.fn()
        # a real replay writes device memory whatever autograd flags the tensors carry; inference tensors
        # (captured under torch.inference_mode) only take in-place writes inside that mode
        with torch.inference_mode():
            for (_, dst), (_, src) in zip(tree_leaves(self.static_out), tree_leaves(fresh), strict=True):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)


class SimulatedBackend:
    """CPU tensors stand for CUDA tensors; ``graphs`` lists every simulated capture, in order."""

    device_type = "cpu"

    def __init__(self, frozen=None):
        self.graphs: list[SimulatedGraph] = []
        self.frozen = frozen

    def available(self):
        return True

    def new_pool(self):
        return object()

    def pool_bytes(self, pool):
        return 0

    def synchronize(self):
        pass

    def follow(self, last):
        return None

    def capture(self, fn, *, warmup=3, pool=None, on_last_warmup=None, on_warmup=None, what="function",
                debug=False, inspect=None, breaks=None):
        if inspect is not None or breaks is not None:
            raise NotImplementedError("the CPU simulation does not simulate node tables (inspect=True) or piecewise "
                                      "capture (breaks=); those need a CUDA device")
        with torch.no_grad():
            for i in range(warmup):
                out = fn()
                if on_warmup is not None:
                    on_warmup(i, out)
            if on_last_warmup is not None:
                on_last_warmup(out)
            static_out = fn()
        self.graphs.append(SimulatedGraph(fn, static_out, self.frozen))
        return self.graphs[-1], static_out

