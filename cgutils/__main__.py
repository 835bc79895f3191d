"""Command line: ``python -m cgutils {env, bench, trace, record, figures}``.

* ``env``: device, mode and versions; the recordings available.
* ``bench [SUITE]``: a benchmark suite of :data:`cgutils.bench.SUITES` (``bench --help`` lists them).
  Measured on a CUDA GPU; without one, the recorded tables and their provenance (exit 0).
* ``trace FILE``: launch statistics and a launch-bound verdict for a torch.profiler trace; ``--coverage`` adds
  the share of GPU work inside graph launches and the eager islands.
* ``figures``: redraw the committed figures from the committed recordings (no GPU needed).
* ``record``: on a CUDA GPU, execute every notebook live and record results into ``results/<gpu>/``;
  ``record --check`` reports recordings that are stale (cell changed), ran library code that changed
  since, or are missing (exit 1 if any).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from . import env
from .bench import DEFAULT_SUITE, SUITES, VARIANTS, Options, Suite
from .errors import CgutilsError, InputError


def _at_least(minimum: float, kind: type):
    """An argparse ``type`` that rejects values below ``minimum`` at parse time, with the flag's name."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # nan compares False with every bound
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum or (kind is float and value == minimum):  # a float bound is exclusive
            raise argparse.ArgumentTypeError(f"must be {'>=' if kind is int else '>'} {minimum}, got {text}")
        return value
    return parse


def _stems(names: list[str] | None) -> list[str] | None:
    """Notebook names as file stems: ``01_launch_overhead.ipynb`` and ``notebooks/01_launch_overhead`` work too."""
    return [Path(n).name.removesuffix(".ipynb") for n in names] if names else None


def cmd_env(args: argparse.Namespace) -> int:
    from .store import ResultsStore

    prov = env.provenance()
    print(f"mode: {env.mode()}")
    for k, v in prov.items():
        print(f"{'cuda (torch build)' if k == 'cuda' else k}: {v}")
    print(f"recordings: {', '.join(ResultsStore.available()) or 'none'}")
    return 0


def _show_recorded(suite: Suite, reason: str, markdown: bool = False) -> int:
    from .store import ResultsStore

    store = ResultsStore()
    meta = store.meta_for(suite.tables[0])
    frames = {name: store.load_frame(name) for name in suite.tables}
    if not markdown:
        print(f"{reason} Showing the {suite.name} tables recorded on {meta.get('gpu')} ({store.path}).")
    suite.report(frames, f"recorded on {env.describe(meta)}", meta, markdown)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .store import live_store

    suite = SUITES[args.suite]
    if not env.cuda_available() or env.mode() == "recorded":
        given = [f"--{k}" for k in ("workloads", "out") if getattr(args, k)]
        verbs = ("applies", "is") if len(given) == 1 else ("apply", "are")
        note = f" ({' and '.join(given)} {verbs[0]} only to measuring and {verbs[1]} ignored here.)" if given else ""
        return _show_recorded(suite, f"No CUDA device visible: nothing measured here.{note}", args.markdown)
    store = live_store()
    if args.show:
        if all((store.path / f"{n}.csv").exists() for n in suite.tables):
            frames = {n: store.load_frame(n) for n in suite.tables}
            meta = store.meta_for(suite.tables[0])
            suite.report(frames, f"measured on {env.describe(meta)}", meta, args.markdown)
            return 0
        return _show_recorded(suite, f"No live {suite.name} tables in {store.path} yet (run `make run`).",
                              args.markdown)
    frames = suite.run(Options(workloads=tuple(args.workloads) if args.workloads else None,
                               dtypes=tuple(args.dtypes), variants=tuple(args.variants), budget_s=args.budget,
                               trials=args.trials))
    prov = store.write_meta()
    for name, df in frames.items():
        if args.out:
            out = Path(args.out) / f"{name}.csv"
            out.parent.mkdir(parents=True, exist_ok=True)
            df.to_csv(out, index=False)
        else:
            out = store.save_value(name, df, prov)
        print(f"wrote {out}")
    suite.report(frames, f"measured now on {env.describe(prov)}", prov, args.markdown)
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from .store import check_recordings

    if args.check:
        statuses = check_recordings()
        stems = _stems(args.notebooks)
        if stems:
            unknown = sorted(set(stems) - {st.notebook for st in statuses})
            if unknown:
                print(f"error: no recorded cells in notebook(s) {', '.join(unknown)}; give file stems such as "
                      f"01_launch_overhead", file=sys.stderr)
                return 1
            statuses = [st for st in statuses if st.notebook in stems]
        for s in statuses:
            print(f"{s.status:8s} {s.notebook} / {s.key}" + (f": {s.detail}" if s.detail and args.verbose else ""))
        bad = [s for s in statuses if s.status != "ok"]
        counts = ", ".join(f"{sum(s.status == k for s in bad)} {k}" for k in ("stale", "library", "missing")
                           if any(s.status == k for s in bad))
        print(f"{len(statuses) - len(bad)} of {len(statuses)} recorded cells are current"
              + (f" ({counts}" + ("" if args.verbose else "; `--verbose` says why") + ")." if bad else "."))
        return 1 if bad else 0
    if not env.cuda_available():
        print("record needs a CUDA GPU (none visible). Recorded mode needs no re-recording: "
              "`python -m cgutils record --check` tells whether the recordings are current.")
        return 2
    os.environ["CGUTILS_RECORD"] = "1"  # the kernels inherit it
    stems = args.notebooks
    if args.changed:
        from .recorded import PLAN_ENV, cells_to_run

        plan, stems = [], []
        nb_dir = env.REPO_ROOT / "notebooks"
        statuses = check_recordings()
        for nb in sorted({s.notebook for s in statuses} & set(_stems(args.notebooks) or [s.notebook for s in statuses])):
            changed = {s.key for s in statuses if s.notebook == nb and s.status != "ok"}
            keys = cells_to_run(nb_dir / f"{nb}.ipynb", changed) if changed else []
            print(f"{nb}: " + (f"runs {', '.join(keys)}" + (f" (needed by {', '.join(sorted(changed))})"
                                                          if set(keys) != changed else "")
                               if keys else "all recordings current, skipped"))
            plan += [f"{nb}/{k}" for k in keys]
            if keys:
                stems.append(nb)
        if not stems:
            return 0
        os.environ[PLAN_ENV] = ",".join(plan)
    return _execute_notebooks(stems, args.timeout, "recording notebooks")


def cmd_figures(args: argparse.Namespace) -> int:
    """Redraw the committed figures (``figures/``) from the committed data: the notebooks run in recorded
    mode, their plotting cells write to ``figures/``. No GPU needed."""
    os.environ["CGUTILS_MODE"] = "recorded"
    os.environ["CGUTILS_REDRAW_FIGURES"] = "1"  # the kernels inherit both
    status = _execute_notebooks(args.notebooks, args.timeout, "redrawing figures")
    if status == 0:
        print(f"figures redrawn in {env.REPO_ROOT / 'figures'} (executed notebooks in build/notebooks/)")
    return status


def _execute_notebooks(stems: list[str] | None, timeout: int, desc: str) -> int:
    """Execute notebooks (all, or the given file stems) into ``build/notebooks/``; 1 if any failed."""
    import nbformat
    from nbclient import NotebookClient
    from tqdm.auto import tqdm

    nb_dir = env.REPO_ROOT / "notebooks"
    out_dir = env.REPO_ROOT / "build" / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    stems = _stems(stems)
    paths = [nb_dir / f"{n}.ipynb" for n in stems] if stems else sorted(nb_dir.glob("*.ipynb"))
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        print(f"error: no notebook {', '.join(missing)} in {nb_dir}; give file stems such as 01_launch_overhead",
              file=sys.stderr)
        return 1
    failed = []
    for p in tqdm(paths, desc=desc):
        nb = nbformat.read(p, as_version=4)
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(nb_dir)}}).execute()
        except Exception as exc:  # keep going: record what can be recorded, report the rest
            failed.append(f"{p.name}: {type(exc).__name__}: {str(exc)[-500:]}")
        nbformat.write(nb, out_dir / p.name)
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failed else 0


def cmd_nsys(args: argparse.Namespace) -> int:
    from .analysis.nsys import nsys_profile, nsys_stats, per_call

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise InputError("nsys: give the command to profile after --, e.g. "
                         "python -m cgutils nsys --out build/nsys/run -- python my_script.py")
    report = nsys_profile(command, args.out, nsys=args.nsys, capture_range=not args.whole_run)
    stats = nsys_stats(report, nsys=args.nsys)
    prefix = report.with_suffix("")
    # where the numbers came from: this process's GPU and versions are those the command ran with
    meta = {"command": command, "whole_run": args.whole_run, "provenance": env.provenance()}
    Path(f"{prefix}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"report: {report}\nstats: " + ", ".join(f"{prefix}_{k}.csv" for k in stats))
    if args.range:
        for key, value in per_call(stats, args.range).items():
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    import pandas as pd

    from .trace import load_trace

    if args.islands is not None and not args.coverage:
        raise InputError("--islands sets how many eager islands --coverage lists: add --coverage")
    args.islands = 10 if args.islands is None else args.islands
    if not args.file.strip():
        raise InputError("trace: the file path is empty; pass a torch.profiler trace, e.g. trace.json.gz")
    if args.range is not None and not args.range.strip():
        raise InputError("trace --range: the annotation name is empty; pass the name of a record_function or "
                         "nvtx_range")
    t = load_trace(args.file)
    ranges = t.by_range(args.range) if args.range is not None else None  # an unknown name fails before any output
    s = t.summary()
    # a ratio or median of nothing (no GPU activity, no launch) is NaN in the Series: said in words here
    rows = s.drop("verdict")
    shown = pd.Series(["n/a (none in this trace)" if isinstance(v, float) and v != v else v for v in rows],
                      index=rows.index, dtype=object)  # object: counts stay ints
    with pd.option_context("display.precision", 3):
        print(shown.to_string())
    print(f"verdict: {s.verdict}")
    if t.skipped:
        print(f"skipped events: {t.skipped}")
    if args.coverage:
        from .analysis import graph_coverage

        cov = graph_coverage(t)
        print(f"\n{cov}")
        if len(cov.islands) and args.islands:
            shown = cov.islands.head(args.islands)
            print(f"eager islands (first {len(shown)} of {len(cov.islands)}; start_us/end_us from the first GPU "
                  f"activity):")
            with pd.option_context("display.precision", 1, "display.max_colwidth", 40):
                print(shown.to_string(index=False))
    if ranges is not None:
        first = min(df.ts.min() for df in (t.ops, t.runtime, t.kernels, t.annotations) if len(df))
        ranges = ranges.assign(ts=ranges.ts - first).rename(columns={"ts": "start_us", "dur": "dur_us"})
        print(f"\nGPU work launched inside '{args.range}' (start_us from the first event of the trace):")
        with pd.option_context("display.precision", 1):
            print(ranges.to_string(index=False))
    return 0


def _count(text: str) -> int:
    """An argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    from .workloads import DTYPES, WORKLOADS

    parser = argparse.ArgumentParser(prog="python -m cgutils", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="device, mode, versions", description="Print the mode (live or recorded), the device "
                   "and library versions, and the GPUs whose recordings are in results/.").set_defaults(func=cmd_env)
    b = sub.add_parser("bench", help="benchmark suites (recorded tables without CUDA)")
    b.add_argument("suite", nargs="?", choices=list(SUITES), default=DEFAULT_SUITE,
                   help="; ".join(f"{s.name}{' (default)' if s.name == DEFAULT_SUITE else ''}: {s.description}"
                                  for s in SUITES.values()))
    b.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None, help="speedup suite only")
    b.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "fp16"],
                   help="dtypes to measure (default: fp32 fp16)")
    b.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="speedup suite: the ways of running each model to time (default: all)")
    b.add_argument("--budget", type=_at_least(0, float), default=2.0, help="timed seconds per row (default 2)")
    b.add_argument("--trials", type=_at_least(1, int), default=Options.trials,
                   help=f"interleaved trials per workload and dtype, speedup suite only (default {Options.trials})")
    b.add_argument("--out", help="folder for the CSV tables (default: the live store, build/live/<gpu>/)")
    b.add_argument("--show", action="store_true", help="print the latest table, do not measure")
    b.add_argument("--markdown", action="store_true",
                   help="print markdown: the README's table (speedup), docs/pitfalls.md's (pitfalls), else each table")
    b.set_defaults(func=cmd_bench)
    r = sub.add_parser("record", help="re-record notebooks on a GPU, or --check recordings",
                       description="On a CUDA GPU: execute notebooks live and refresh the recorded cells' outputs "
                       "and saved frames under results/<gpu>/ (--changed: only the cells not current). Anywhere: "
                       "--check says which recordings are stale, ran changed library code, or are missing.")
    r.add_argument("--check", action="store_true",
                   help="do not record: report cells that are stale, ran changed library code, or are missing")
    r.add_argument("--changed", action="store_true",
                   help="run only the recorded cells whose recording is not current (and the earlier ones whose "
                        "names they read); replay the rest from their recordings")
    r.add_argument("--verbose", "-v", action="store_true", help="with --check: say why each cell is not current")
    r.add_argument("--notebooks", nargs="+", help="notebook stems (default: all)")
    r.add_argument("--timeout", type=_at_least(1, int), default=1800, help="seconds per cell (default 1800)")
    r.set_defaults(func=cmd_record)
    f = sub.add_parser("figures", help="redraw figures/ from the committed recordings (no GPU needed)",
                       description="Execute the notebooks in recorded mode and let their plotting cells redraw "
                       "figures/ from the committed data (a few minutes; no GPU needed).")
    f.add_argument("--notebooks", nargs="+", help="notebook stems (default: all)")
    f.add_argument("--timeout", type=_at_least(1, int), default=1800, help="seconds per cell (default 1800)")
    f.set_defaults(func=cmd_figures)
    n = sub.add_parser("nsys", help="profile a command with Nsight Systems (CUDA graph nodes traced), write its stats",
                       description="Run a command under nsys profile -t cuda,nvtx --cuda-graph-trace=node (CPU sampling "
                       "off), by default recording only between torch.cuda.profiler.start() and stop() in it, then "
                       "write nsys stats CSVs (nvtx_sum, cuda_gpu_kern_sum, cuda_api_sum) beside the report.")
    n.add_argument("--out", default="build/nsys/report", help="report path without suffix (default build/nsys/report)")
    n.add_argument("--nsys", help="path of the nsys executable (default: $CGUTILS_NSYS, PATH, usual install folders)")
    n.add_argument("--whole-run", action="store_true", help="record the whole run, not only profiler start()..stop()")
    n.add_argument("--range", help="also print what one call inside this NVTX range did (kernels, runtime calls)")
    n.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python my_script.py")
    n.set_defaults(func=cmd_nsys)
    t = sub.add_parser("trace", help="summarise a torch.profiler Chrome trace (.json or .json.gz)")
    t.add_argument("file", help="a torch.profiler Chrome trace (.json or .json.gz), e.g. from cgutils.profile")
    t.add_argument("--range", help="also break down the GPU work launched inside this annotation")
    t.add_argument("--coverage", action="store_true", help="also the share of GPU work that ran in CUDA graph "
                   "launches, and the eager islands between them (cgutils.graph_coverage)")
    t.add_argument("--islands", type=_count, default=None, help="eager islands listed with --coverage (default 10; "
                   "0 lists none)")
    t.set_defaults(func=cmd_trace)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CgutilsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader stopped early (`| head`): end quietly, with stdout pointed at devnull so that the
        # interpreter's final flush does not raise again (Python docs, signal module, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
