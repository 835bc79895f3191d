"""The "numbers to remember" table of notebooks/README.md, computed from results/<gpu>/ with each number's
provenance (the GPU, the torch version and the commit that recorded it).

    python scripts/numbers_to_remember.py [--gpu nvidia-h200] [--write]

Prints the markdown table; ``--write`` puts it between the ``numbers:begin``/``numbers:end`` markers of
notebooks/README.md. tests/test_readme_and_recordings.py checks that the two agree.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from cgutils.errors import RecordingError
from cgutils.overhead import launch_cost
from cgutils.store import ResultsStore

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "notebooks" / "README.md"
MARKERS = ("<!-- numbers:begin -->", "<!-- numbers:end -->")


def _source(results: Path, name: str) -> tuple[pd.DataFrame, str]:
    store = ResultsStore(results.name, root=results.parent)
    meta = store.meta_for(name)
    where = f"`{name}.csv`: {meta['gpu']}, torch {meta['torch']}, {meta['date'][:10]}, {meta['git_commit'][:7]}"
    return store.load_frame(name), where


def rows(results: Path) -> list[tuple[str, str, str, str]]:
    """(quantity, value, notebook, source) for each number."""
    out = []
    chain, src = _source(results, "overhead_chain")
    try:  # notebook 01's headline: the same 256-kernel chain in fresh processes (the median of each process)
        procs, psrc = _source(results, "launch_processes")
    except RecordingError:  # an older recording without it: the sweep's figures alone
        procs = None
    if procs is not None:
        eager = (procs.eager_us / procs.n).groupby(procs.process).median()
        node = (procs.replay_us / procs.n).groupby(procs.process).median()
        out += [(f"GPU-clock cost of one eager launch of a tiny kernel ({int(procs.n.iloc[0])}-kernel chain, "
                 f"{eager.size} fresh processes: median of each process; their range)",
                 f"{eager.median():.1f} µs ({eager.min():.1f}-{eager.max():.1f})", "01", psrc),
                ("GPU time of one node of the same chain replayed as a graph (median of the processes' medians)",
                 f"{node.median():.2f} µs", "01", psrc)]
    else:
        one = launch_cost(chain)
        out += [(f"host + GPU cost of one eager launch of a tiny kernel (median over chains of {one['n_min']}-"
                 f"{one['n_max']}; range)", f"{one['median_us']:.1f} µs ({one['min_us']:.1f}-{one['max_us']:.1f})",
                 "01", src)]
    if "host_replay_us" in chain:
        c = chain.set_index("n").host_replay_us
        out.append((f"host CPU time of one graph.replay() call, a graph of {c.index[0]} node vs {c.index[-1]} nodes",
                    f"{c.iloc[0]:.1f} vs {c.iloc[-1]:.1f} µs", "01", src))
    bound, src = _source(results, "launch_bound")
    for model in ("BERT-base seq128", "GPT-2 decode step"):
        e = bound[(bound.model == model) & (bound["mode"] == "eager")].iloc[0]
        r = bound[(bound.model == model) & (bound["mode"] == "replay")].iloc[0]
        out.append((f"{model}, batch 1: share of the wall time the GPU is busy, eager vs replay",
                    f"{1 - e.idle_fraction:.0%} vs {1 - r.idle_fraction:.0%}", "01", src))
    speed, src = _source(results, "speedup")
    b = speed[(speed.workload == "bert-base-seq128") & (speed.dtype == "fp16")].set_index("variant")
    out += [("BERT-base seq128 fp16, batch 1: GraphRunner replay (p10-p90)",
             f"{b.median_ms.graph_runner:.2f} ms ({b.p10_ms.graph_runner:.2f}-{b.p90_ms.graph_runner:.2f})", "05", src),
            ("... eager, the same run (p10-p90; it moves with the host CPU)",
             f"{b.median_ms.eager:.2f} ms ({b.p10_ms.eager:.2f}-{b.p90_ms.eager:.2f})", "05", src),
            ("... warm-up + capture + validation, once per shape", f"{b.setup_s.graph_runner * 1e3:.0f} ms", "05", src)]
    pair, src = _source(results, "generation_paired")  # notebook 06, section 4: the two in paired trials
    p = pair.set_index("variant")
    out.append(("GPT-2 fp16 greedy decoding, batch 1, 100 new tokens: ms per token in paired interleaved trials, "
                "the graphed static-cache decoder vs transformers' static-cache generate (p10-p90)",
                f"{p.ms_per_token.cgutils_graph:.2f} ms ({p.p10_ms_per_token.cgutils_graph:.2f}-"
                f"{p.p90_ms_per_token.cgutils_graph:.2f}) vs {p.ms_per_token.hf_static:.2f} ms "
                f"({p.p10_ms_per_token.hf_static:.2f}-{p.p90_ms_per_token.hf_static:.2f})", "06", src))
    mem, src = _source(results, "bucket_memory")
    out.append(("memory pool of BERT-base's three buckets (128/256/512 tokens, fp16)",
                f"{mem.pool_bytes.sum() / 2**20:.0f} MiB", "03b", src))
    return out


def table(results: Path) -> str:
    lines = ["| quantity | value | notebook | recorded in |", "|---|---|---|---|"]
    lines += [f"| {q} | {v} | {n} | {s} |" for q, v, n, s in rows(results)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="nvidia-h200", help="results/<gpu> to read (default nvidia-h200)")
    ap.add_argument("--write", action="store_true", help="update notebooks/README.md between its markers")
    args = ap.parse_args()
    text = table(ROOT / "results" / args.gpu)
    if args.write:
        readme = README.read_text()
        pattern = re.escape(MARKERS[0]) + ".*?" + re.escape(MARKERS[1])
        if not re.search(pattern, readme, re.S):
            raise SystemExit(f"{README} lacks the markers {MARKERS[0]} ... {MARKERS[1]}")
        README.write_text(re.sub(pattern, lambda _: f"{MARKERS[0]}\n{text}\n{MARKERS[1]}", readme, flags=re.S))
    print(text)


if __name__ == "__main__":
    main()
