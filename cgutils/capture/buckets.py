"""Buckets: pad a dimension up to one of a few sizes so that a few graphs serve every length, and cut
the outputs back along the dims learned to follow it. Shared by GraphRunner and GreedyDecoder."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..checks import check_sizes, is_int, is_number
from ..errors import CaptureError, InputError
from .nest import is_plain, same_value, tensors, tree_leaves, tree_map

# Per padded input dim k: for each output tensor (in tree_map order), the output dims that follow k.
Cuts = dict[int, list[tuple[int, ...]]]


def pick_bucket(n: int, sizes: tuple[int, ...], what: str, fix: str = "") -> int:
    """The smallest size in ``sizes`` (sorted ascending) that holds ``n``.

    Raises:
        InputError: ``n`` is above the largest size; the message names ``what`` and ``fix``.
    """
    for b in sizes:
        if n <= b:
            return b
    raise InputError(f"{what} {n} is larger than the largest bucket {sizes[-1]}" + (f"; {fix}" if fix else ""))


def check_bucket_spec(buckets: Any) -> dict[int, tuple[int, ...]]:
    """``{dim: sizes}`` checked and normalised (sizes sorted, without repeats); ``{}`` for ``None``.

    Raises:
        InputError: not a dict, a key that is not a dim (int >= 0), or sizes that are not positive ints.
    """
    if buckets is None:
        return {}
    if not isinstance(buckets, dict):
        raise InputError(f"buckets must be a dict {{dim: sizes}}, e.g. {{1: (128, 256, 512)}}, got {buckets!r}")
    out = {}
    for dim, sizes in buckets.items():
        if not is_int(dim) or dim < 0:
            raise InputError(f"buckets keys are tensor dims (ints >= 0), got {dim!r}")
        out[dim] = check_sizes(f"buckets[{dim}]", sizes)
    return out


def copy_padded(buf: torch.Tensor, t: torch.Tensor, pad: float) -> None:
    """Copy ``t`` into the leading corner of ``buf`` and fill the rest with ``pad``."""
    if buf.shape == t.shape:
        buf.copy_(t)
        return
    buf.fill_(pad)
    buf[tuple(slice(0, n) for n in t.shape)].copy_(t)


class Buckets:
    """A bucket policy: which sizes each bucketed dim is padded up to, and the value padding holds.

    Args:
        spec: ``{dim: sizes}`` or ``None`` (no buckets: every shape is its own graph).
        pad_value: one number, or ``{argument name: number}`` (names as in error messages).

    Raises:
        InputError: a bad ``spec`` or ``pad_value``.
    """

    def __init__(self, spec: Any = None, pad_value: float | dict[str, float] = 0):
        self.sizes = check_bucket_spec(spec)
        if not (is_number(pad_value) or isinstance(pad_value, dict)):
            raise InputError(f"pad_value must be a number or a dict of argument name -> number, got {pad_value!r}")
        if isinstance(pad_value, dict) and not all(is_number(v) for v in pad_value.values()):
            raise InputError(f"pad_value values must be numbers, got {pad_value!r}")
        self.pad_value = pad_value

    def __bool__(self) -> bool:
        return bool(self.sizes)

    def target_shape(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The bucketed shape of ``t``, or None when a dimension is above its largest bucket."""
        shape = list(t.shape)
        for dim, sizes in self.sizes.items():
            if t.dim() > dim:
                size = next((b for b in sizes if shape[dim] <= b), None)
                if size is None:
                    return None
                shape[dim] = size
        return tuple(shape)

    def pad_of(self, name: str) -> float:
        if isinstance(self.pad_value, dict):  # the leaf's own name first, then its argument's
            return self.pad_value.get(name, self.pad_value.get(name.split("[")[0], 0))
        return self.pad_value

    def check_pad_names(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raises InputError if ``pad_value`` names something that is not a tensor argument of the call."""
        if isinstance(self.pad_value, dict):
            known = {n for n, _ in named} | {n.split("[")[0] for n, _ in named}
            unknown = sorted(set(self.pad_value) - known)
            if unknown:
                raise InputError(f"pad_value names {unknown}, which are not arguments of this call; the tensor "
                                 f"arguments are {[n for n, _ in named]}")

    def check_example(self, named: list) -> None:
        """An example call for ``GraphRunner.capture_buckets``: buckets given, tensors in it, lengths they hold.

        Raises:
            InputError: no buckets, no tensor in the example, or a length the buckets cannot hold.
        """
        if not self:
            raise InputError("capture_buckets needs GraphRunner(..., buckets={dim: sizes})")
        if not named:
            raise InputError("capture_buckets needs an example call, e.g. runner.capture_buckets(input_ids=ids, "
                             "attention_mask=mask): it is padded to each bucket to capture its graph")
        self.check_lengths(named)

    def check_lengths(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raises InputError, naming the arguments, if bucketed arguments differ in a bucketed dim."""
        for dim in self.sizes:
            lengths = {n: t.shape[dim] for n, t in named if t.dim() > dim}
            if len(set(lengths.values())) > 1:
                raise InputError(
                    f"buckets={{{dim}: ...}} pads every tensor argument with more than {dim} dimensions along "
                    f"dim {dim}, and these differ there: {lengths}. Padding and cutting the outputs back need "
                    f"one length per dim; bucket a dim that all arguments share (e.g. the sequence length)")

    def padded(self, named: list[tuple[str, torch.Tensor]], targets: list[tuple[int, ...]]) -> dict[int, tuple[int, int]]:
        """``{dim: (bucket, caller's length)}`` for every bucketed dim this call pads."""
        return {dim: (tg[dim], t.shape[dim]) for (_, t), tg in zip(named, targets, strict=True)
                for dim in self.sizes if t.dim() > dim and tg[dim] != t.shape[dim]}

    def combos(self) -> list[dict[int, int]]:
        """Every combination of bucket sizes as ``{dim: size}``, largest first (so that a shared memory
        pool grows once, to the largest graph's needs, and smaller graphs reuse its blocks)."""
        dims = sorted(self.sizes)
        return [dict(zip(dims, c, strict=True))
                for c in sorted(itertools.product(*(self.sizes[d] for d in dims)), reverse=True)]


def resize(t: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """``t`` cut or zero-padded along each dim in ``sizes`` to that size (example inputs for a bucket)."""
    for d, n in sizes.items():
        if t.dim() > d and t.shape[d] != n:
            if t.shape[d] > n:
                t = t.narrow(d, 0, n)
            else:
                shape = list(t.shape)
                shape[d] = n - t.shape[d]
                t = torch.cat([t, t.new_zeros(shape)], dim=d)
    return t


def learn_cuts(replayed: Any, expected: Any, padded: dict[int, tuple[int, int]]) -> tuple[Cuts, set[int]]:
    """For each padded input dim ``k`` (``padded[k] = (bucket, caller's length)``): per output tensor,
    the dims whose size is the bucket in the padded replay and the caller's length in eager.

    A size test alone ("equals the bucket") would also cut a pooled output of hidden size 512 under a
    512 bucket; comparing with eager's shapes tells the two apart.

    Returns:
        ``(cuts, ambiguous)``: ``cuts[k][i]`` the dims of output tensor ``i`` to cut with input dim
        ``k``; ``ambiguous`` the input dims that share their (bucket, length) pair with another padded
        dim that an output dim follows, so that this call cannot tell which of them it follows.

    Raises:
        CaptureError: ``cause="padding"``: an output differs from eager in structure, rank, a plain
            value (a length returned as a number), or a size that cutting the padding off cannot
            restore (e.g. a length that is not the input's).
    """
    got, want = tensors(replayed), tensors(expected)
    paths = [p for p, leaf in tree_leaves(replayed) if isinstance(leaf, torch.Tensor)]
    if len(paths) != len(got):
        paths = [f"output tensor {i}" for i in range(len(got))]

    def fail(why: str) -> CaptureError:
        return CaptureError(f"padding to the bucket changed the outputs beyond what cutting the padding "
                            f"off restores: {why}; use buckets only for dims that the outputs keep (cut "
                            f"back) or drop as a whole", cause="padding")

    if len(got) != len(want):
        raise fail(f"{len(got)} output tensors padded vs {len(want)} at the caller's shapes")
    values = [(p, v) for p, v in tree_leaves(replayed) if not isinstance(v, torch.Tensor)]
    wanted = [v for _, v in tree_leaves(expected) if not isinstance(v, torch.Tensor)]
    for (path, v), w in zip(values, wanted, strict=False):  # e.g. a length returned as a number
        if is_plain(v) and is_plain(w) and not same_value(v, w):
            raise fail(f"{path} is {v!r} padded vs {w!r} at the caller's shapes")
    cuts: Cuts = {k: [] for k in padded}
    ambiguous: set[int] = set()
    for path, a, e in zip(paths, got, want, strict=True):
        if a.dim() != e.dim():
            raise fail(f"{path} has {a.dim()} dims padded vs {e.dim()} at the caller's shapes")
        follows: dict[int, list[int]] = {k: [] for k in padded}
        for d, (size_padded, size_eager) in enumerate(zip(a.shape, e.shape, strict=True)):
            if size_padded == size_eager:
                continue
            ks = [k for k, pair in padded.items() if pair == (size_padded, size_eager)]
            if not ks:
                raise fail(f"{path} dim {d} is {size_padded} padded vs {size_eager} at the caller's shapes")
            if len(ks) > 1:
                ambiguous.update(ks)
            follows[ks[0]].append(d)
        for k in padded:
            cuts[k].append(tuple(follows[k]))
    return cuts, ambiguous


def apply_cuts(out: Any, cuts: Cuts, padded: dict[int, tuple[int, int]], clone: bool = False) -> Any:
    """Narrow each output tensor along the dims learned by :func:`learn_cuts` to the caller's lengths
    (and clone the result, with ``clone``, in the same pass: rebuilding a ModelOutput costs µs)."""
    index = itertools.count()

    def cut(x: torch.Tensor) -> torch.Tensor:
        i = next(index)
        for k, (_, real) in padded.items():
            for d in cuts[k][i]:
                x = x.narrow(d, 0, real)
        return x.clone() if clone else x

    return tree_map(cut, out)
