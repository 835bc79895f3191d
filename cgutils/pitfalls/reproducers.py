"""The catalogue's reproducers and fixes: the code of every entry, its offending line marked ``# <- pitfall``.

Each function or module class here is an entry's ``bad`` (or ``good``) in :mod:`.catalogue`; sync points are
reported at this file's lines (``diagnose.user_code``), so docs/pitfalls.md quotes them. The one-line
reproducers take one CUDA tensor ``x`` (float32, shape (4, 8)); the rest return what their entry's step
builds the case from (a graphed callable, a module class, a thread's loop).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..capture import GraphRunner, capture_graph
from ..checks import first_line
from .outside import extension_sync

# --- loud: syncs inside the captured function ----------------------------------------------------------------


def item(x):
    return x * x.sum().item()  # <- pitfall


def cpu(x):
    peak = x.abs().max().cpu()  # <- pitfall
    return x / peak.to(x.device)


def tolist(x):
    firsts = x[:, 0].tolist()  # <- pitfall
    return x * sum(v > 0 for v in firsts)


def print_in_forward(x):
    print("mean activation", x.mean())  # <- pitfall
    return x * 2


def nonzero(x):
    return torch.nonzero(x > 0)  # <- pitfall


def bool_mask(x):
    return x[x > 0].sum()  # <- pitfall


def python_if(x):
    if x.sum() > 0:  # <- pitfall
        return x * 2
    return -x


def synchronize(x):
    y = x * 2
    torch.cuda.synchronize()  # <- pitfall
    return y


# --- silent and static-buffer entries ------------------------------------------------------------------------


def doubling_graph(x):
    """A graph of y = 2x, no GraphRunner around it: returns its static input, the graph and its static output."""
    static_x = x.clone()
    g, static_y = capture_graph(lambda: static_x * 2, warmup=2)
    return static_x, g, static_y


def rebind_input(x):
    """Manual graph y = 2x; each call rebinds the name instead of copying into the static input."""
    static_x, g, static_y = doubling_graph(x)

    def graphed(new_x):
        static_x = new_x  # <- pitfall  # noqa: F841 (the bug: a new name binding, the graph never sees it)
        g.replay()
        return static_y.clone()

    # The graph holds the buffer's address, not a reference: if nothing kept static_x alive, the
    # allocator would hand its memory to the next tensor and replay would read that instead.
    graphed.static_input = static_x
    return graphed


def rebind_input_fixed(x):
    static_x, g, static_y = doubling_graph(x)

    def graphed(new_x):
        static_x.copy_(new_x)
        g.replay()
        return static_y.clone()

    return graphed


def overwritten_output(x):
    runner = GraphRunner(lambda t: t * 2, clone_outputs=False)

    def graphed(new_x):
        return runner(new_x)  # <- pitfall: the static output, overwritten by the next call

    return graphed


def overwritten_output_fixed(x):
    runner = GraphRunner(lambda t: t * 2)  # clone_outputs=True (default)
    return runner


def cpu_input(x):
    """Manual capture of a function whose input lives on the CPU: its copy to the GPU is inside capture."""
    static_x = x.cpu()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = (static_x * 2).cuda()  # <- pitfall: a pageable host-to-device copy inside capture

    def graphed(new_x):
        static_x.copy_(new_x)
        g.replay()
        return static_y.clone()

    return graphed


class Scaled(nn.Module):
    """y = x * self.scale, with ``scale`` a Python float: read when the graph is captured."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale  # <- pitfall: a Python number becomes a kernel argument at capture


class CpuScalar(nn.Module):
    """y = x * self.scale, with ``scale`` a 0-dim CPU tensor: passed to the kernel by value at capture."""

    def __init__(self):
        super().__init__()
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        return x * self.scale  # <- pitfall: a 0-dim CPU tensor is a scalar argument, baked in


class ScaledFixed(nn.Module):
    """The fix: the scale lives in a CUDA buffer, so the graph reads it at replay time."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x):
        return x * self.scale


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x) * 2  # <- pitfall: in training mode dropout draws a new mask every call


def new_shape_fn(x):
    return torch.softmax(x @ x.transpose(-1, -2), -1) @ x  # <- pitfall: every new length is a new graph


# --- capture mechanics: warm-up, autotuning, streams ---------------------------------------------------------


def no_warmup(x):
    lin = nn.Linear(8, 8).cuda()
    return lambda: lin(x)  # <- pitfall: captured on its first call, in a thread with no cuBLAS handle yet


def cudnn_benchmark(x):
    conv = nn.Conv2d(3, 16, 3).cuda()
    img = torch.randn(1, 3, 97, 101, device="cuda")  # a shape no earlier call has autotuned
    return lambda: conv(img)  # <- pitfall: with cudnn.benchmark, the first call autotunes


def default_stream(x):
    return lambda: x * 2  # <- pitfall: captured with capture_begin() on the current stream, the default one


# --- threads: one graph, several callers ---------------------------------------------------------------------


def double(t):
    return t * 2


def shared_graph(x):
    """A manual graph y = 2x with its static buffers, handed to every thread of a server, no lock."""
    static_x = x.clone()
    g, static_y = capture_graph(lambda: static_x * 2, warmup=2)

    def graphed(new_x):
        static_x.copy_(new_x)  # <- pitfall: another thread may copy its input in before this thread's replay
        g.replay()
        return static_y.clone()

    graphed.static_input = static_x  # the graph holds its address: keep the buffer alive
    return graphed


def shared_runner(x):
    """The fix: one GraphRunner shared by the threads (it locks copy-in/replay/copy-out, orders streams)."""
    runner = GraphRunner(double)
    runner(x)  # captured once, before the threads start (a server's warm-up)
    return runner


# --- state: in-place updates, counters, attributes -----------------------------------------------------------


class NormalizeInPlace(nn.Module):
    """An image model's first step: normalise the input in place, then a projection. x: (N, 8) float32."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor(0.5))
        self.register_buffer("std", torch.tensor(2.0))
        self.proj = nn.Linear(8, 8)

    def forward(self, img):
        img.sub_(self.mean).div_(self.std)  # <- pitfall: an in-place update of the caller's tensor
        return self.proj(img)


class NormalizeOutOfPlace(NormalizeInPlace):
    """The plain fix: normalise into a new tensor; the caller's tensor is left alone."""

    def forward(self, img):
        return self.proj((img - self.mean) / self.std)


class DecodeStep(nn.Module):
    """A decode step in miniature: write this step's key into a cache at a position held in a CUDA int64
    buffer, advance the position, return the cache's sum. x: (N, 8) float32 -> (1, 8)."""

    def __init__(self, slots: int = 16):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(slots, 8))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.int64))

    def forward(self, x):
        self.cache.index_copy_(0, self.pos, self.proj(x).sum(0, keepdim=True))
        self.pos.add_(1)  # <- pitfall: every extra call (warm-up, validation) advances the position
        return self.cache.sum(0, keepdim=True)


class KeepsHidden(nn.Module):
    """Stores its hidden features on ``self.hidden`` for the caller to read after forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.hidden = None

    def forward(self, x):
        h = torch.relu(self.proj(x))
        self.hidden = h  # <- pitfall: a replay runs no Python, so this assignment happens at capture only
        return h.sum(-1)


class ReturnsHidden(KeepsHidden):
    """The plain fix: return what the caller needs instead of storing it on the module."""

    def forward(self, x):
        h = torch.relu(self.proj(x))
        return h.sum(-1), h


# --- failed captures, other threads, syncs outside PyTorch, side streams -------------------------------------


def item_in_forward(x):
    return x * x.sum().item()  # <- pitfall: capture fails here; torch.cuda.graph then leaves its stream current


def prefetch_loop(stop: threading.Event, counts: dict, numel: int = 4096) -> None:
    """A data-prefetch thread in miniature: each batch pinned in new host memory (kept, as a queue of
    batches keeps it, so each is a new cudaHostAlloc), copied to the GPU on the thread's own stream, that
    stream synchronised. Runs until ``stop`` is set; counts iterations and failed ones in ``counts``."""
    stream, held = torch.cuda.Stream(priority=-1), []  # never the capture stream (see unforked_stream)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            try:
                batch = torch.empty(numel, pin_memory=True)  # <- pitfall: cudaHostAlloc in another thread
                held = held if len(held) < 8192 else []  # at most 8192 batches held
                held.append(batch)
                batch.to("cuda", non_blocking=True)
                stream.synchronize()  # its own stream: a device-wide sync would include the capturing stream,
                # which CUDA refuses in every capture mode (NVIDIA/TensorRT#2888)
            except RuntimeError as exc:  # counted; the first error's text is kept
                counts["errors"] += 1
                counts.setdefault("error", first_line(exc)[:200])
            counts["iterations"] += 1


def external_sync(x):
    y = x * 2
    extension_sync()  # <- pitfall: a sync PyTorch never sees (an extension calling the CUDA runtime)
    return y


def unforked_stream(x):
    # priority=-1 draws from PyTorch's high-priority stream pool: pool streams are handed out round-robin,
    # and a default-priority one could be the capture stream itself, which would hide the pitfall
    side = torch.cuda.Stream(priority=-1)
    with torch.cuda.stream(side):
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)  # <- pitfall: a join with no fork before it
    return y


def forked_stream(x):
    side = torch.cuda.Stream(priority=-1)
    side.wait_stream(torch.cuda.current_stream())  # fork: the side stream joins the capture
    with torch.cuda.stream(side):
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    return y


# --- sampling, many shapes -----------------------------------------------------------------------------------


class Sampler(nn.Module):
    """Samples one class per row from a softmax (intended randomness). x: (N, 8) float32 -> (N, 1) int64."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        return torch.multinomial(torch.softmax(self.proj(x), -1), 1)  # <- pitfall: random on purpose


def per_length(x):
    return torch.softmax(x @ x.transpose(-1, -2), -1) @ x  # <- pitfall: 12 lengths, 12 graphs, no buckets
