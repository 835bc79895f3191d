"""Pitfalls of real use: threads, state, failed captures, other threads, syncs outside PyTorch, unforked
streams, sampling, many shapes.

The catalogue's second half (:data:`REAL_USE`, merged into :data:`cgutils.pitfalls.PITFALLS` after the
entries there). Each entry is a situation from real use rather than one bad line: a graph shared by a
server's threads, a model that updates its input or a cache in place, a prefetch thread doing CUDA work
during capture, an extension that synchronises behind PyTorch's back. Its ``diagnose`` step
(:mod:`cgutils.pitfall_cases_real_use`) runs the raw failure where there is one (a manual graph,
``torch.cuda.graph``) next to GraphRunner on the same code and records both; the row's ``happens`` says
in words what the run showed (docs/pitfalls.md's "what happens" column). Where threads race, counts
differ from run to run: ``expect`` holds only what must hold on every run.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from . import pitfall_cases as cases
from . import pitfall_cases_real_use as real
from .capture import GraphRunner, capture_graph
from .checks import first_line
from .pitfall_cases import Pitfall

__all__ = ["REAL_USE", "NormalizeInPlace", "NormalizeOutOfPlace", "DecodeStep", "KeepsHidden", "ReturnsHidden",
           "Sampler"]


# --- threads: one graph, several callers ------------------------------------------------------------


def _double(t):
    return t * 2


def _shared_graph(x):
    """A manual graph y = 2x with its static buffers, handed to every thread of a server, no lock."""
    static_x = x.clone()
    g, static_y = capture_graph(lambda: static_x * 2, warmup=2)

    def graphed(new_x):
        static_x.copy_(new_x)  # <- pitfall: another thread may copy its input in before this thread's replay
        g.replay()
        return static_y.clone()

    graphed.static_input = static_x  # the graph holds its address: keep the buffer alive
    return graphed


def _shared_runner(x):
    """The fix: one GraphRunner shared by the threads (it locks copy-in/replay/copy-out, orders streams)."""
    runner = GraphRunner(_double)
    runner(x)  # captured once, before the threads start (a server's warm-up)
    return runner


# --- state: in-place updates, counters, attributes ----------------------------------------------------


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


# --- failed captures, other threads, syncs outside PyTorch, side streams ------------------------------


def _item_in_forward(x):
    return x * x.sum().item()  # <- pitfall: capture fails here; torch.cuda.graph then leaves its stream current


def _prefetch_loop(stop: threading.Event, counts: dict, numel: int = 4096) -> None:
    """A data-prefetch thread in miniature: each batch pinned in new host memory (kept, as a queue of
    batches keeps it, so each is a new cudaHostAlloc), copied to the GPU on the thread's own stream, that
    stream synchronised. Runs until ``stop`` is set; counts iterations and failed ones in ``counts``."""
    stream, held = torch.cuda.Stream(priority=-1), []  # never the capture stream (see _unforked_stream)
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


def _external_sync(x):
    y = x * 2
    real.extension_sync()  # <- pitfall: a sync PyTorch never sees (an extension calling the CUDA runtime)
    return y


def _unforked_stream(x):
    # priority=-1 draws from PyTorch's high-priority stream pool: pool streams are handed out round-robin,
    # and a default-priority one could be the capture stream itself, which would hide the pitfall
    side = torch.cuda.Stream(priority=-1)
    with torch.cuda.stream(side):
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)  # <- pitfall: a join with no fork before it
    return y


def _forked_stream(x):
    side = torch.cuda.Stream(priority=-1)
    side.wait_stream(torch.cuda.current_stream())  # fork: the side stream joins the capture
    with torch.cuda.stream(side):
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    return y


# --- sampling, many shapes -----------------------------------------------------------------------------


class Sampler(nn.Module):
    """Samples one class per row from a softmax (intended randomness). x: (N, 8) float32 -> (N, 1) int64."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        return torch.multinomial(torch.softmax(self.proj(x), -1), 1)  # <- pitfall: random on purpose


def _per_length(x):
    return torch.softmax(x @ x.transpose(-1, -2), -1) @ x  # <- pitfall: 12 lengths, 12 graphs, no buckets


REAL_USE: dict[str, Pitfall] = {p.key: p for p in [
    Pitfall(key="shared_threads", title="one graph shared by threads, no lock", kind="silent", bad=_shared_graph,
            diagnose=real.threads_check,
            fix="one runner per thread, or a lock around copy-in/replay/copy-out; GraphRunner locks and orders "
                "streams with events",
            good=_shared_runner, check_fix=real.threads_fix_ok,
            expect={"exception": "", "runner_wrong": 0, "runner_thread_errors": 0}),
    Pitfall(key="inplace_input", title="forward updates its input in place", kind="silent", bad=NormalizeInPlace,
            diagnose=real.inplace_input_check,
            fix="GraphRunner copies inputs updated in place back to the caller's tensors after each replay (a copy "
                "per call); or normalise out of place: img = (img - mean) / std",
            good=NormalizeOutOfPlace, check_fix=real.module_fix_matches_eager,
            expect={"exception": "", "matches_eager": True, "caller_tensor_matches": True}),
    Pitfall(key="stateful_buffer", title="state advanced in place (a position counter and a cache)", kind="silent",
            bad=DecodeStep, diagnose=real.stateful_check,
            fix="keep the state in CUDA buffers updated in place; GraphRunner undoes its extra warm-up and validation "
                "calls so the caller sees one call per call. With a manual graph, reset the state after warm-up",
            expect={"exception": "", "state_matches": True, "pos": real.STEPS}),
    Pitfall(key="rebound_attribute", title="forward stores a tensor on self", kind="silent", bad=KeepsHidden,
            diagnose=real.rebound_check,
            fix="return what you need from forward; GraphRunner warns and sets the attribute to the replayed tensor "
                "after each replay",
            good=ReturnsHidden, check_fix=real.module_fix_matches_eager,
            expect={"exception": "", "warned": True, "attribute_follows": True}),
    Pitfall(key="failed_capture_stream", title="state left behind by a failed capture", kind="loud",
            bad=_item_in_forward, diagnose=real.failed_capture_check,
            fix="after a failed torch.cuda.graph capture, put the stream back (torch.cuda.set_stream(saved)) and "
                "reset the RNG (cgutils.reset_rng_after_failed_capture()); GraphRunner and capture_graph do both",
            expect={"exception": "CaptureError", "cause": "sync", "op": "Tensor.item", "runner_stream_restored": True,
                    "rng_ok": True}),
    Pitfall(key="other_thread_work", title="another thread's CUDA work during capture", kind="loud",
            bad=_prefetch_loop, diagnose=real.other_thread_check,
            fix="capture in thread-local mode: torch.cuda.graph(g, capture_error_mode=\"thread_local\") (GraphRunner "
                "and capture_graph do), or pause the other threads while capturing",
            expect={"exception": ""}),
    Pitfall(key="external_sync", title="a sync outside PyTorch (an extension calling the CUDA runtime)",
            kind="loud", bad=_external_sync, diagnose=real.external_sync_check,
            fix="move the call out of the graphed function, or make the extension asynchronous (no "
                "cudaDeviceSynchronize/cudaStreamSynchronize, blocking cudaMemcpy or cudaMalloc); find it with "
                "`nsys profile -t cuda` around one eager call",
            good=_double, check_fix=cases.graphed_fix_matches_eager,
            expect={"exception": "CaptureError", "cause": "external_sync"}),
    Pitfall(key="unforked_stream", title="a side stream joined back but never forked", kind="loud",
            bad=_unforked_stream, diagnose=cases.through_runner,
            fix="fork before using the side stream: side.wait_stream(torch.cuda.current_stream()), then join back",
            good=_forked_stream, check_fix=cases.graphed_fix_matches_eager, expect={"exception": "CaptureError", "cause": "unforked_stream"}),
    Pitfall(key="sampling", title="sampling on purpose (torch.multinomial)", kind="silent", bad=Sampler,
            diagnose=real.sampling_check,
            fix="nothing to fix: the default CUDA generator is registered with the graph, so each replay draws new "
                "samples, and GraphRunner validates from the same generator state (cgutils used to report "
                "baked_value and advise model.eval()); seed with torch.cuda.manual_seed for repeatable runs",
            expect={"exception": "", "differs_across_replays": True}),
    Pitfall(key="many_shapes", title="many input shapes: a graph each, and a warning", kind="cost", bad=_per_length,
            diagnose=real.many_shapes_check,
            fix="bucket the dynamic dim: GraphRunner(fn, buckets={1: (64, 128, 256)}) pads up to a few sizes",
            expect={"exception": "", "warned": True, "captures": len(real.LENGTHS)}),
]}
