"""Command line: ``python -m cgutils {env, bench, trace, record}``.

* ``env``: device, mode and versions; the recordings available.
* ``bench [speedup|overhead|methods|generation|memory|pitfalls]``: a benchmark suite. Measured on a CUDA GPU; without
  one, the recorded tables and their provenance (exit 0).
* ``trace FILE``: launch statistics and a launch-bound verdict for a torch.profiler trace.
* ``record``: on a CUDA GPU, execute every notebook live and record results into ``results/<gpu>/``;
  ``record --check`` reports stale or missing recordings (exit 1 if any).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import env
from .errors import CgutilsError


def _print_summary(df, source: str, prov: dict | None = None, markdown: bool = False) -> None:
    import pandas as pd

    from .bench import markdown_table, summary_table

    if markdown:
        print(markdown_table(df, prov or {}))
        return

    summary = summary_table(df)
    print("Median latency per iteration in ms (eager, graph_runner, raw_graph, compile_ro); speedups are "
          "eager / variant from the same run; article_* are the source article's A100 figures.")
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 3):
        print(summary.to_string(index=False))
    problems = df[df.status != "ok"]
    for _, r in problems.iterrows():
        print(f"  note: {r['workload']} {r['dtype']} {r['variant']}: {r['status']}")
    print(f"Source: {source}")


def cmd_env(args: argparse.Namespace) -> int:
    from .recorded import ResultsStore

    prov = env.provenance()
    print(f"mode: {env.mode()}")
    for k, v in prov.items():
        print(f"{'cuda (torch build)' if k == 'cuda' else k}: {v}")
    print(f"recordings: {', '.join(ResultsStore.available()) or 'none'}")
    return 0


# Each suite: the tables it writes to a results store (names shared with the notebooks' --save).
SUITES = {
    "speedup": ["speedup"],
    "overhead": ["overhead_chain", "overhead_size", "launch_bound"],
    "methods": ["graph_methods"],
    "generation": ["generation", "generation_steps", "generation_batch"],
    "memory": ["graph_memory", "validation_cost"],
    "pitfalls": ["pitfalls"],
}


def _print_suite(suite: str, frames: dict, source: str, prov: dict, markdown: bool) -> None:
    import pandas as pd

    if suite == "speedup":
        _print_summary(frames["speedup"], source, prov, markdown)
        return
    if suite == "pitfalls":
        from .pitfalls import markdown_table

        if markdown:
            print(markdown_table(frames["pitfalls"]), end="")
            return
        cols = [c for c in ("key", "kind", "exception", "cause", "op", "line", "fix_ok") if c in frames["pitfalls"]]
        frames = {"pitfalls (the full table: --markdown, or docs/pitfalls.md)": frames["pitfalls"][cols]}
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 3):
        for name, df in frames.items():
            print(f"\n{name}:")
            if len(df) > 40 and not markdown:  # a per-step table: its head says what it holds
                print(df.head(10).to_string(index=False))
                print(f"... {len(df) - 10} more rows (--markdown prints all; the CSV is in results/)")
                continue
            print(df.to_markdown(index=False) if markdown else df.to_string(index=False))
    if suite == "overhead":
        from .overhead import crossover, fit_per_launch

        fit = fit_per_launch(frames["overhead_chain"])
        print(f"\nper eager launch: {fit['eager_slope_us']:.2f} µs; per replayed graph node: "
              f"{fit['replay_slope_us']:.2f} µs (least-squares slopes, weighted by 1/time)")
        print(f"kernel size where GPU time equals one eager launch: "
              f"{crossover(frames['overhead_size'], fit['eager_slope_us']):.3g} elements (fp32)")
    if suite == "methods":
        from .bench import method_targets

        print("\ntargets (same run): GraphRunner <= 10 µs over the manual graph; ratios to "
              "torch.compile(reduce-overhead) <= 1")
        print(method_targets(frames["graph_methods"]).to_string(index=False, float_format="%.3f"))
    print(f"Source: {source}")


def _show_recorded(suite: str, reason: str, markdown: bool = False) -> int:
    from .recorded import ResultsStore

    store = ResultsStore()
    meta = store.meta_for(SUITES[suite][0])
    frames = {name: store.load_frame(name) for name in SUITES[suite]}
    if not markdown:
        print(f"{reason} Showing the {suite} tables recorded on {meta.get('gpu')} ({store.path}).")
    _print_suite(suite, frames, f"recorded on {env.describe(meta)}", meta, markdown)
    return 0


def _measure_suite(suite: str, args: argparse.Namespace) -> dict:
    from . import bench, overhead

    if suite == "speedup":
        return {"speedup": bench.speedup_table(args.workloads, args.dtypes, args.variants, budget_s=args.budget)}
    if suite == "overhead":
        return {"overhead_chain": overhead.chain_sweep(), "overhead_size": overhead.size_sweep(),
                "launch_bound": overhead.launch_bound_table()}
    if suite == "methods":
        return {"graph_methods": bench.graph_methods_table()}
    if suite == "pitfalls":
        from .pitfalls import catalogue_table

        return {"pitfalls": catalogue_table()}
    if suite == "memory":
        return {"graph_memory": bench.memory_table(), "validation_cost": bench.validation_cost()}
    return {"generation": bench.generation_table(), "generation_steps": bench.decode_step_times(),
            "generation_batch": bench.batch_sweep()}


def cmd_bench(args: argparse.Namespace) -> int:
    from .recorded import live_store

    if not env.cuda_available() or env.mode() == "recorded":
        given = [f"--{k}" for k in ("workloads", "out") if getattr(args, k)]
        note = f" ({', '.join(given)} apply to measuring and are ignored.)" if given else ""
        return _show_recorded(args.suite, f"No CUDA device visible: nothing measured here.{note}", args.markdown)
    store = live_store()
    if args.show:
        if all((store.path / f"{n}.csv").exists() for n in SUITES[args.suite]):
            frames = {n: store.load_frame(n) for n in SUITES[args.suite]}
            meta = store.meta_for(SUITES[args.suite][0])
            _print_suite(args.suite, frames, f"measured on {env.describe(meta)}", meta, args.markdown)
            return 0
        return _show_recorded(args.suite, f"No live {args.suite} tables in {store.path} yet (run `make run`).",
                              args.markdown)
    frames = _measure_suite(args.suite, args)
    prov = store.write_meta()
    for name, df in frames.items():
        if args.out:
            out = Path(args.out) / f"{name}.csv"
            out.parent.mkdir(parents=True, exist_ok=True)
            df.to_csv(out, index=False)
        else:
            out = store.save_value(name, df, prov)
        print(f"wrote {out}")
    _print_suite(args.suite, frames, f"measured now on {env.describe(prov)}", prov, args.markdown)
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from .recorded import check_recordings

    if args.check:
        statuses = check_recordings()
        for s in statuses:
            print(f"{s.status:8s} {s.notebook} / {s.key}" + (f": {s.detail}" if s.detail and args.verbose else ""))
        bad = [s for s in statuses if s.status != "ok"]
        print(f"{len(statuses) - len(bad)} of {len(statuses)} recorded cells are current.")
        return 1 if bad else 0
    if not env.cuda_available():
        print("record needs a CUDA GPU (none visible). Recorded mode needs no re-recording: "
              "`python -m cgutils record --check` tells whether the recordings are current.")
        return 2
    import nbformat
    from nbclient import NotebookClient
    from tqdm.auto import tqdm

    os.environ["CGUTILS_RECORD"] = "1"  # the kernels inherit it
    nb_dir = env.REPO_ROOT / "notebooks"
    out_dir = env.REPO_ROOT / "build" / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [nb_dir / f"{n}.ipynb" for n in args.notebooks] if args.notebooks else sorted(nb_dir.glob("*.ipynb"))
    failed = []
    for p in tqdm(paths, desc="recording notebooks"):
        nb = nbformat.read(p, as_version=4)
        try:
            NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(nb_dir)}}).execute()
        except Exception as exc:  # keep going: record what can be recorded, report the rest
            failed.append(f"{p.name}: {type(exc).__name__}: {str(exc)[-500:]}")
        nbformat.write(nb, out_dir / p.name)
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failed else 0


def cmd_trace(args: argparse.Namespace) -> int:
    import pandas as pd

    from .trace import load_trace

    t = load_trace(args.file)
    ranges = t.by_range(args.range) if args.range else None  # an unknown name fails before any output
    s = t.summary()
    with pd.option_context("display.precision", 3):
        print(s.drop("verdict").to_string())
    print(f"verdict: {s.verdict}")
    if t.skipped:
        print(f"skipped events: {t.skipped}")
    if ranges is not None:
        first = min(df.ts.min() for df in (t.ops, t.runtime, t.kernels, t.annotations) if len(df))
        ranges = ranges.assign(ts=ranges.ts - first).rename(columns={"ts": "start_us", "dur": "dur_us"})
        print(f"\nGPU work launched inside '{args.range}' (start_us from the first event of the trace):")
        with pd.option_context("display.precision", 1):
            print(ranges.to_string(index=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .bench import VARIANTS
    from .workloads import DTYPES, WORKLOADS

    parser = argparse.ArgumentParser(prog="python -m cgutils", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="device, mode, versions").set_defaults(func=cmd_env)
    b = sub.add_parser("bench", help="benchmark suites (recorded tables without CUDA)")
    b.add_argument("suite", nargs="?", choices=list(SUITES), default="speedup",
                   help="speedup (default): eager vs graphs per workload; overhead: launch cost, kernel "
                        "size, launch-bound fraction; methods: four ways to get a graph; generation: GPT-2 decoders; "
                        "memory: graph memory per shape, shared pool, buckets, validation cost; pitfalls: the "
                        "pitfall catalogue")
    b.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None, help="speedup suite only")
    b.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "fp16"])
    b.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    b.add_argument("--budget", type=float, default=2.0, help="timed seconds per row (default 2)")
    b.add_argument("--out", help="folder for the CSV tables (default: the live store, build/live/<gpu>/)")
    b.add_argument("--show", action="store_true", help="print the latest table, do not measure")
    b.add_argument("--markdown", action="store_true",
                   help="print markdown: the README's table (speedup), docs/pitfalls.md's (pitfalls), else each table")
    b.set_defaults(func=cmd_bench)
    r = sub.add_parser("record", help="re-record notebooks on a GPU, or --check recordings")
    r.add_argument("--check", action="store_true")
    r.add_argument("--verbose", "-v", action="store_true")
    r.add_argument("--notebooks", nargs="+", help="notebook stems (default: all)")
    r.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    r.set_defaults(func=cmd_record)
    t = sub.add_parser("trace", help="summarise a torch.profiler Chrome trace (.json or .json.gz)")
    t.add_argument("file")
    t.add_argument("--range", help="also break down the GPU work launched inside this annotation")
    t.set_defaults(func=cmd_trace)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CgutilsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
