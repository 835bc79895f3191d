"""The Nsight Systems wrapper (cgutils.analysis.nsys) on CPU: a stand-in nsys executable writes what the real one
writes (a report file; nsys stats CSVs in its layout), so the command lines, file naming and per-call arithmetic
are checked without Nsight."""
import json
import os
import stat
import sys
import textwrap

import pandas as pd
import pytest

import cgutils as cg
from cgutils.__main__ import main
from cgutils.analysis import nsys as ns

NVTX = ('"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)",'
        '"Style","Range"\n80.0,20000000,20,1000000.0,990000.0,900000,1200000,1000.0,"PushPop",":forward"\n'
        '20.0,5000000,240,20833.0,20000.0,1000,90000,10.0,"PushPop",":bert.encoder"\n')
KERN = ('"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"\n'
        '60.0,9000000,1440,6250.0,6000.0,5000,9000,100.0,"nvjet_hsh_64x8"\n'
        '40.0,6000000,2000,3000.0,3000.0,2000,4000,50.0,"void at::native::elementwise_kernel<...>"\n')
API = ('"Time (%)","Total Time (ns)","Num Calls","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"\n'
       '90.0,1000000,20,50000.0,50000.0,40000,60000,10.0,"cudaGraphLaunch_v10000"\n'
       '10.0,100000,40,2500.0,2500.0,2000,3000,10.0,"cudaLaunchKernel"\n')


@pytest.fixture
def fake_nsys(tmp_path):
    """An executable that answers `profile ... -o OUT cmd` with OUT.nsys-rep and `stats -o PREFIX ...` with CSVs;
    it logs its arguments to calls.log."""
    exe = tmp_path / "nsys"
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import sys, pathlib
        args = sys.argv[1:]
        with open({str(tmp_path / 'calls.log')!r}, "a") as f:
            f.write(" ".join(args) + "\\n")
        out = pathlib.Path(args[args.index("-o") + 1])
        if args[0] == "profile":
            if "fail" in args:
                sys.stderr.write("Importer error: libdw.so.1: cannot open shared object file\\n")
                sys.exit(1)
            if "norep" not in args:
                out.with_name(out.name + ".nsys-rep").write_bytes(b"rep")
        elif args[0] == "stats":
            for name, text in (("nvtx_sum", {NVTX!r}), ("cuda_gpu_kern_sum", {KERN!r}), ("cuda_api_sum", {API!r})):
                out.with_name(out.name + "_" + name + ".csv").write_text(text)
    """))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_profile_then_stats_per_call(fake_nsys, tmp_path):
    report = ns.nsys_profile(["python", "-c", "pass"], tmp_path / "out" / "bert", nsys=fake_nsys)
    assert report == tmp_path / "out" / "bert.nsys-rep" and report.exists()
    profile_args = (tmp_path / "calls.log").read_text().splitlines()[0].split()
    assert "--cuda-graph-trace=node" in profile_args and "--sample=none" in profile_args
    assert "--capture-range=cudaProfilerApi" in profile_args and profile_args[-3:] == ["python", "-c", "pass"]
    stats = ns.nsys_stats(report, nsys=fake_nsys)
    assert set(stats) == set(ns.REPORTS) and len(stats["cuda_gpu_kern_sum"]) == 2
    one = ns.per_call(stats, "forward")
    assert one["calls"] == 20 and one["kernels"] == 172.0 and one["kernel_us"] == 750.0
    assert one["range_us"] == 990.0 and one["graph_launch"] == 1.0 and one["launch_kernel"] == 2.0
    assert ns.api_calls_per_call(stats, 20).to_dict() == {"cudaGraphLaunch": 1.0, "cudaLaunchKernel": 2.0}
    again = ns.read_nsys_csvs(tmp_path / "out" / "bert")  # recorded mode: no nsys needed
    assert again["nvtx_sum"].equals(stats["nvtx_sum"])
    with pytest.raises(cg.InputError, match=r"no NVTX range 'decode'.*forward"):
        ns.per_call(stats, "decode")


def test_errors_say_what_to_do(fake_nsys, tmp_path, monkeypatch):
    with pytest.raises(cg.CgutilsError, match="libdw.so.1.*LD_LIBRARY_PATH"):
        ns.nsys_profile(["fail"], tmp_path / "r", nsys=fake_nsys)
    with pytest.raises(cg.CgutilsError, match=r"wrote no .*torch.cuda.profiler.start\(\)"):
        ns.nsys_profile(["norep"], tmp_path / "r", nsys=fake_nsys)
    with pytest.raises(cg.InputError, match="needs a command"):
        ns.nsys_profile([], tmp_path / "r", nsys=fake_nsys)
    with pytest.raises(cg.InputError, match="not an executable nsys"):
        ns.find_nsys(tmp_path / "missing")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CGUTILS_NSYS", raising=False)
    monkeypatch.setattr(ns, "_SEARCH", ())
    with pytest.raises(cg.DependencyError, match="install Nsight Systems"):
        ns.find_nsys()
    monkeypatch.setenv("CGUTILS_NSYS", str(fake_nsys))
    assert ns.find_nsys() == fake_nsys
    with pytest.raises(cg.InputError, match="no Nsight Systems report"):
        ns.nsys_stats(tmp_path / "none.nsys-rep")
    with pytest.raises(cg.InputError, match="no nsys stats CSV"):
        ns.read_nsys_csvs(tmp_path / "none")


def test_cli_profiles_and_prints_one_call(fake_nsys, tmp_path, capsys):
    out = tmp_path / "cli" / "run"
    assert main(["nsys", "--nsys", str(fake_nsys), "--out", str(out), "--range", "forward", "--",
                 "python", "-c", "pass"]) == 0
    printed = capsys.readouterr().out
    assert "kernels: 172" in printed and "graph_launch: 1" in printed and os.path.exists(f"{out}_nvtx_sum.csv")
    assert "provenance" in json.loads(open(f"{out}.meta.json").read())
    assert main(["nsys", "--nsys", str(fake_nsys)]) == 1
    assert "give the command to profile after --" in capsys.readouterr().err


def test_kernel_base_name_reads_both_demanglers_alike():
    nsys_style = "void at::native::<unnamed>::vectorized_layer_norm_kernel<c10::Half, float, (bool)0>(int, T2, const T1 *)"
    kineto_style = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float, false>"
                    "(int, float, c10::Half const*)")
    assert ns.kernel_base_name(nsys_style) == ns.kernel_base_name(kineto_style) == "vectorized_layer_norm_kernel"
    assert ns.kernel_base_name("nvjet_sm90_hsh_64x16_64x16_2x4_h_bz_bias_TNT") == "nvjet_sm90_hsh_64x16_64x16_2x4_h_bz_bias_TNT"
    with pytest.raises(cg.InputError, match="positive int"):
        ns.kernels_by_name({}, 0)


def test_recorded_nsys_reports_count_the_kernels_the_recorded_traces_count():
    """notebook 07: BERT-base's eager forward and replay, in Nsight Systems (results/nvidia-h200/nsys) and in
    torch.profiler (results/nvidia-h200/traces), each kernel kind the same number of times per forward."""
    from cgutils import env

    root = env.REPO_ROOT / "results" / "nvidia-h200"
    for label in ("eager", "replay"):
        stats = ns.read_nsys_csvs(root / "nsys" / f"bert_{label}")
        one = ns.per_call(stats, "forward")
        trace = cg.load_trace(root / "traces" / f"bert_{label}.json.gz")
        forwards = int(((trace.annotations.side == "cpu") & (trace.annotations.name == "forward")).sum())
        from_trace = trace.kernels.name.map(ns.kernel_base_name).value_counts() / forwards
        assert one["kernels"] == len(trace.kernels) / forwards
        assert ns.kernels_by_name(stats, one["calls"]).sort_index().equals(from_trace.sort_index().rename("per_call"))
        assert (one["graph_launch"], one["launch_kernel"] > 0) == ((1.0, False) if label == "replay" else (0.0, True))


def test_a_run_that_writes_no_report_is_not_read_as_the_older_one(fake_nsys, tmp_path):
    """With an older report at --out, a run that wrote none printed the old numbers and exited 0."""
    old = ns.nsys_profile(["python"], tmp_path / "r", nsys=fake_nsys)
    ns.nsys_stats(old, nsys=fake_nsys)
    with pytest.raises(cg.CgutilsError, match="wrote no .*is Nsight Systems' nsys"):
        ns.nsys_profile(["norep"], tmp_path / "r", nsys=fake_nsys)
    assert not old.exists()
    assert main(["nsys", "--nsys", str(fake_nsys), "--out", str(tmp_path / "r"), "--", "norep"]) == 1


def test_stats_inputs_are_checked_and_driver_launches_count(fake_nsys, tmp_path):
    with pytest.raises(cg.InputError, match="list of arguments.*shlex.split"):
        ns.nsys_profile("python x.py", tmp_path / "s", nsys=fake_nsys)
    stats = ns.nsys_stats(ns.nsys_profile(["python"], tmp_path / "s", nsys=fake_nsys), nsys=fake_nsys)
    with pytest.raises(cg.InputError, match=r"closest: \['forward'\]"):
        ns.per_call(stats, "forwrd")
    with pytest.raises(cg.InputError, match="dict that nsys_stats"):
        ns.per_call(None, "forward")
    with pytest.raises(cg.InputError, match="positive int"):
        ns.kernels_by_name(stats, True)
    import numpy as np
    by_name = ns.kernels_by_name(stats, np.int64(20))
    assert list(by_name) == sorted(by_name, reverse=True)  # most first
    driver = pd.DataFrame({"Num Calls": [40, 60], "Name": ["cudaLaunchKernel", "cuLaunchKernelEx"]})
    one = ns.per_call({**stats, "cuda_api_sum": driver}, "forward")
    assert one["launch_kernel"] == 5.0  # (40 + 60) / 20: cuBLAS's driver-API launches are kernel launches too
