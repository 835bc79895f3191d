"""Seeded replay faults for ``cg.find_divergence`` (issue 26): does it place each in the right module, and does it
stay quiet where nothing is wrong?

Each case is a small model with one real kind of fault, the change a program makes between calls, the module the
fault lives in and the kind expected. Run on a CUDA GPU; prints one row per case and the counts:

    python benchmarks/divergence_faults.py [--out faults.json]

On a CPU the script only builds every case and runs it eagerly (a smoke run: a graph's replay cannot be simulated
faithfully for most of these faults; tests/test_divergence.py covers the mechanics with a simulated capture).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import cgutils as cg

WIDTH = 64


class Scaled(nn.Module):
    """Multiplies by a Python number: a graph bakes in the value it had at capture."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


class Counted(nn.Module):
    """Adds a position it counts on the host: the graph keeps the count it saw at capture."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.pos = 0

    def forward(self, x):
        self.pos += 1
        return self.lin(x) + self.pos


class Table(nn.Module):
    """Reads a plain tensor attribute (not a buffer): rebinding it after capture is not seen by a replay."""

    def __init__(self, device):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.table = torch.ones(WIDTH, device=device)

    def forward(self, x):
        return self.lin(x) * self.table


class Noisy(nn.Module):
    """Draws from a generator of its own, which the graph does not register: every replay repeats the draw."""

    def __init__(self, device):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gen = torch.Generator(device=device).manual_seed(0)

    def forward(self, x):
        return self.lin(x) + torch.rand(x.shape, device=x.device, generator=self.gen)


class LengthMask(nn.Module):
    """Rebuilds a mask when a Python length changes: eager rebuilds it, the graph keeps the mask of capture."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.length = WIDTH

    def forward(self, x):
        mask = (torch.arange(x.shape[-1], device=x.device) < self.length).to(x.dtype)
        return self.lin(x) * mask


class CacheWrite(nn.Module):
    """Writes into a cache buffer at a Python index: the graph writes where the index was at capture."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4, WIDTH))
        self.index = 0

    def forward(self, x):
        self.cache[self.index] = x
        return self.cache.sum(0)


class Ema(nn.Module):
    """Moves its weight in place each call: GraphRunner keeps that as eager would (not a fault)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.99)
        return self.lin(x)


class SideStream(nn.Module):
    """Runs part of its work on a side stream it never joins back: capture refuses it (loud)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.side = None

    def forward(self, x):
        self.side = self.side or torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            y = self.lin(x)
        return y


class Scatter(nn.Module):
    """index_add_ in fp32 with atomics: bits may differ from run to run, well inside tolerance (not a fault)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        idx = torch.arange(x.shape[0], device=x.device) % 2
        return torch.zeros(2, WIDTH, device=x.device).index_add_(0, idx, self.lin(x))


@dataclass
class Case:
    name: str
    build: Callable[[str], tuple[nn.Module, Callable[[nn.Module], Any] | None]]
    module: str | None  # where the fault lives; None: no fault
    kind: str
    refused: bool = False  # PyTorch itself refuses it at capture: a loud failure, found without this tool


def _wrap(inner: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), inner, nn.Linear(WIDTH, WIDTH))


CASES = [
    Case("python scalar changed after capture",
         lambda d: (_wrap(Scaled()), lambda m: setattr(m[2], "scale", 3.0)), "2", "python_value"),
    Case("position counter on the host", lambda d: (_wrap(Counted()), None), "2", "python_value"),
    Case("tensor attribute rebound after capture",
         lambda d: (_wrap(Table(d)), lambda m: setattr(m[2], "table", torch.full((WIDTH,), 2.0, device=d))),
         "2", "replaced_tensor"),
    # torch 2.11 refuses a generator that is not registered with the graph at capture (H200 run of ab60c60:
    # "Attempt to increase offset for a CUDA generator not in capture mode"): loud, not silent
    Case("random draws from an unregistered generator", lambda d: (_wrap(Noisy(d)), None), "2", "inside",
         refused=True),
    Case("mask rebuilt from a Python length", lambda d: (_wrap(LengthMask()), lambda m: setattr(m[2], "length", 16)),
         "2", "python_value"),
    Case("cache written at a Python index", lambda d: (_wrap(CacheWrite()), lambda m: setattr(m[2], "index", 3)),
         "2", "python_value"),
    Case("side stream never joined", lambda d: (_wrap(SideStream()), None), "2", "inside", refused=True),
    Case("weight updated in place by forward (not a fault)", lambda d: (_wrap(Ema()), None), None, ""),
    Case("weights loaded in place (not a fault)",
         lambda d: (_wrap(Scaled()), lambda m: m[0].weight.data.mul_(0.5)), None, ""),
    Case("atomic scatter in fp32 (not a fault)", lambda d: (_wrap(Scatter()), None), None, ""),
    Case("a plain model (not a fault)", lambda d: (_wrap(nn.GELU()), None), None, ""),
]


def run(device: str) -> list[dict]:
    rows = []
    for case in CASES:
        torch.manual_seed(0)
        model, change = case.build(device)
        model = model.to(device).eval()
        x = torch.randn(4, WIDTH, device=device)
        if device != "cuda":  # smoke: the case builds (and runs, unless it needs CUDA streams)
            if not isinstance(model[2], SideStream):
                with torch.no_grad():
                    model(x)
            rows.append({"case": case.name, "expected": case.module, "found": "(not run: no CUDA)", "placed": None})
            continue
        try:
            found = cg.find_divergence(model, x, change=None if change is None else (lambda m=model, c=change: c(m)),
                                       replay_args=(torch.randn(4, WIDTH, device=device),))
        except cg.CgutilsError as exc:  # a refused capture: right where PyTorch refuses it, else a miss
            rows.append({"case": case.name, "expected": case.module, "found": f"raised {type(exc).__name__}",
                         "detail": str(exc).splitlines()[0][:200], "placed": case.refused})
            continue
        placed = found.module == case.module and (case.module is None or found.kind == case.kind)
        rows.append({"case": case.name, "expected": case.module, "expected_kind": case.kind, "found": found.module,
                     "kind": found.kind, "detail": found.detail, "max_rel_error": found.max_rel_error,
                     "placed": placed})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows and the counts as JSON")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run(device)
    for r in rows:
        print(r)
    faults = [r for r, c in zip(rows, CASES, strict=True) if r["expected"] is not None and not c.refused]
    refused = [r for r, c in zip(rows, CASES, strict=True) if c.refused]
    clean = [r for r in rows if r["expected"] is None]
    if device == "cuda":
        print(f"placed {sum(r['placed'] for r in faults)} of {len(faults)} silent faults in the right module and kind; "
              f"false alarms on {sum(r['found'] is not None for r in clean)} of {len(clean)} fault-free cases; "
              f"{sum(r['placed'] for r in refused)} of {len(refused)} refused by PyTorch at capture as expected")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "rows": rows, "provenance": cg.provenance()}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
