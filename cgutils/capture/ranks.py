"""Graphs across processes (torch.distributed): the checks that turn a capture hang into an error.

A collective (all-reduce, all-gather) waits until every rank of its group has called it. If one rank
captures different work than another (a different input shape, a different graph key, a rank that skips
the capture), the others wait in the collective forever: the classic hang of graphed tensor-parallel
inference (pytorch issues #196133, #191681; NCCL documentation, "Using NCCL with CUDA Graphs"). Two
things prevent it here:

- :func:`agree_across_ranks` compares a description of what each rank is about to capture (e.g. a
  GraphRunner signature) on every rank *before* capture, over the group's own backend, and raises on
  every rank with the ranks that differ and what each has, instead of letting them hang;
- :func:`warm_up_collectives` runs one small all-reduce before capture: a communicator sets itself up
  lazily at its first collective, which must not happen inside a capture.

The tensor-parallel layers and decode step that need these live in :mod:`cgutils.generation.tensor_parallel`.
Launch the processes with ``torchrun``; the CPU tests run them on the gloo backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..checks import require_cuda
from ..errors import CaptureError, InputError


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the world) and the group's size.

    Raises:
        InputError: torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("torch.distributed is not initialised: call torch.distributed.init_process_group(...) "
                         "first (torchrun sets the environment it reads)")
    return dist.get_rank(group), dist.get_world_size(group)


_CAPTURE_FIX = ("Every rank must capture the same work, or the collectives inside the graph wait for each other forever; "
                "give every rank the same shapes (pad to a common bucket) and the same graph key")


def agree_across_ranks(value: str, *, what: str = "the capture", group: Any = None, fix: str = _CAPTURE_FIX) -> None:
    """Check that every rank of ``group`` passes the same ``value``; raise on every rank if not.

    Call it on every rank, right before a capture (or any collective whose inputs depend on the rank's data),
    with a description of what the rank will do, e.g. a GraphRunner signature ``"x:(1, 4096) bfloat16"``.
    It is itself a collective (``all_gather_object`` over the group's backend), so it must be reached by all
    ranks. A rank that never calls it leaves the others waiting until the process group's timeout
    (``init_process_group(timeout=...)``); that timeout is then raised here as a ``CaptureError`` naming this rank
    and the comparison. A rank that died (gloo: "Connection closed by peer") is reported the same way. After
    that error the group is broken: end it with ``dist.destroy_process_group()`` before the process exits;
    leaving a gloo group alive after a failed collective was seen here to abort the process at exit
    ("terminate called without an active exception", torch 2.14 CPU).

    Args:
        value: what this rank is about to capture.
        what: named in the error, e.g. ``"GraphRunner(decoder) capture"``.
        fix: what the error tells the caller to do when the ranks disagree (default: a capture's advice).
        group: the process group (default: the world).

    Raises:
        InputError: torch.distributed is not initialised, or ``value`` is not a string.
        CaptureError: the ranks disagree (``cause="rank_divergence"``): the message lists each distinct value
            with its ranks; or the other ranks did not all come before the group's timeout.
    """
    if not isinstance(value, str):
        raise InputError(f"value must be a string describing what this rank captures, got {type(value).__name__}")
    rank, world = rank_and_world(group)
    values: list[Any] = [None] * world
    try:
        dist.all_gather_object(values, value, group=group)
    except RuntimeError as exc:  # the backend's timeout (init_process_group(timeout=...)) or a rank that died
        raise CaptureError(
            f"rank {rank} of {world} waited for the other ranks to compare {what} and they did not all come "
            f"(all_gather_object failed: {str(exc).splitlines()[0][:200]}). A rank that skips the capture, "
            f"replays while the others capture, or died, leaves the rest waiting; call the runner on every rank "
            f"with the same inputs. The process group's timeout bounds this wait", cause="rank_divergence") from exc
    distinct: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        distinct.setdefault(v, []).append(r)
    if len(distinct) > 1:
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v!r}"
                            for v, rs in distinct.items())
        raise CaptureError(
            f"the ranks disagree about {what} (this is rank {rank} of {world}): {listing}. {fix}",
            cause="rank_divergence")


def warm_up_collectives(device: torch.device | str | None = None, *, group: Any = None) -> None:
    """Run one all-reduce of one element on ``device`` (default: the current CUDA device, else the CPU) and
    wait for it, so that the communicator is set up before any capture.

    Raises:
        InputError: torch.distributed is not initialised.
        NoCudaError: ``device`` is a CUDA device and none is visible.
        CaptureError: the ranks' sums disagree with the world size (a broken group).
    """
    _, world = rank_and_world(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda":
        require_cuda("warm_up_collectives(device='cuda')", "pass device='cpu' with the gloo backend")
    one = torch.ones(1, device=device)
    dist.all_reduce(one, group=group)
    total = int(one.item())  # a sync, outside any capture on purpose
    if total != world:
        raise CaptureError(f"a warm-up all-reduce summed to {total} instead of the world size {world}",
                           cause="rank_divergence")


class CaptureRanks:
    """GraphRunner's ``distributed=`` option: before each capture, agree with the other ranks on what is captured.

    Args:
        distributed: ``False`` (one process: nothing to agree), ``True`` (the default group) or a
            ``torch.distributed`` process group.

    Raises:
        InputError: ``distributed`` is none of these.
    """

    def __init__(self, distributed: Any):
        if distributed is not False and distributed is not True and not isinstance(distributed, getattr(dist, "ProcessGroup", ())):
            raise InputError(f"distributed must be False, True (the default group) or a torch.distributed "
                             f"ProcessGroup, got {type(distributed).__name__}")
        self.enabled, self.group = distributed is not False, None if distributed is True else distributed
        self._collectives_ready = False

    def before_capture(self, signature: str, what: str, device: Any) -> None:
        """:func:`agree_across_ranks` on ``signature``; before the first capture, :func:`warm_up_collectives`.

        Raises:
            CaptureError: the ranks differ (on every rank), or a rank does not answer.
        """
        if not self.enabled:
            return
        agree_across_ranks(signature, what=what, group=self.group)
        if not self._collectives_ready:
            warm_up_collectives(device, group=self.group)
            self._collectives_ready = True
