import numpy as np
import pytest
import torch

import cgutils as cg
from cgutils.timing import summarize


def test_summarize_known_values():
    t = summarize(np.arange(1, 101, dtype=float), "perf_counter")  # 1..100 ms
    assert t.median_ms == pytest.approx(50.5)
    assert t.p10_ms == pytest.approx(10.9)
    assert t.p90_ms == pytest.approx(90.1)
    assert t.n == 100 and t.clock == "perf_counter"


def test_summarize_rejects_bad_samples():
    with pytest.raises(cg.InputError, match="no timing samples"):
        summarize([], "x")
    with pytest.raises(cg.InputError, match="finite"):
        summarize([1.0, float("nan")], "x")
    with pytest.raises(cg.InputError, match="finite"):
        summarize([1.0, -2.0], "x")


def test_measure_never_times_the_warmup(monkeypatch):
    calls = []
    clock = iter(np.arange(0, 1000, 0.001))  # each perf_counter() read advances 1 ms
    monkeypatch.setattr("cgutils.timing.time.perf_counter", lambda: next(clock))
    t = cg.measure(lambda: calls.append(1), warmup=7, iters=13, device="cpu")
    assert len(calls) == 20
    assert t.n == 13 and t.clock == "perf_counter"
    assert t.median_ms == pytest.approx(1.0)  # one clock tick between start and end of each call


def test_measure_validates_arguments():
    with pytest.raises(cg.InputError, match="iters must be an int >= 1"):
        cg.measure(lambda: None, iters=0, device="cpu")
    with pytest.raises(cg.InputError, match="warmup must be an int >= 0"):
        cg.measure(lambda: None, warmup=-1, device="cpu")
    with pytest.raises(cg.InputError, match="warmup must be an int"):
        cg.measure(lambda: None, warmup=True, device="cpu")  # a bool is not a count


def test_measure_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match=r"measure\(device='cuda'\) needs a CUDA device.*use device='cpu'"):
        cg.measure(lambda: None, device="cuda")


def test_timing_str_has_units():
    assert "ms median" in str(summarize([1.0, 2.0, 3.0], "cuda_event"))


def test_measure_rejects_bad_arguments_clearly():
    with pytest.raises(cg.InputError, match="callable"):
        cg.measure(5)
    with pytest.raises(cg.InputError, match="iters must be an int >= 1 .*got 2.5"):
        cg.measure(lambda: None, iters=2.5, device="cpu")
    with pytest.raises(cg.InputError, match="not 'meta'"):
        cg.measure(lambda: None, device="meta")
    with pytest.raises(cg.InputError, match="unknown device 'gpu'"):
        cg.measure(lambda: None, device="gpu")


# --- interleaved trials ---------------------------------------------------------------------------


def _logging_fns(names, log):
    return {n: (lambda n=n: log.append(n)) for n in names}


def _trial_orders(frame):
    return [tuple(g.sort_values("order").variant) for _, g in frame.groupby("trial")]


def test_interleaved_trials_shuffle_the_order_per_trial_and_follow_the_seed():
    """The run order changes between trials, every variant goes first equally often (8 trials of 4:
    twice each), the `order` column is the order the calls really ran in, and the seed fixes it."""
    names = ["eager", "graph_runner", "raw_graph", "compile_ro"]
    log = []
    frame = cg.interleaved_trials(_logging_fns(names, log), trials=8, iters=1, warmup=0, trial_warmup=0,
                                  device="cpu", seed=0)
    orders = _trial_orders(frame)
    assert [n for order in orders for n in order] == log  # one call per variant per trial, in `order`
    assert len(set(orders)) > 1
    firsts = [o[0] for o in orders]
    assert sorted(firsts.count(n) for n in names) == [2, 2, 2, 2]
    again = cg.interleaved_trials(_logging_fns(names, []), trials=8, iters=1, warmup=0, trial_warmup=0,
                                  device="cpu", seed=0)
    assert _trial_orders(again) == orders
    other = cg.interleaved_trials(_logging_fns(names, []), trials=8, iters=1, warmup=0, trial_warmup=0,
                                  device="cpu", seed=1)
    assert _trial_orders(other) != orders
    # rows come in the order of fns within each trial, whatever order they ran in
    assert frame.variant.tolist() == names * 8 and frame.trial.tolist() == [t for t in range(8) for _ in names]
    assert set(frame.columns) == {"trial", "variant", "order", "median_ms", "p10_ms", "p90_ms", "n", "clock"}


def test_interleaved_trials_warm_up_every_variant_before_the_first_trial():
    log = []
    frame = cg.interleaved_trials(_logging_fns(["a", "b", "c"], log), trials=4, iters=3, warmup=2,
                                  trial_warmup=1, device="cpu")
    assert log[:6] == ["a", "a", "b", "b", "c", "c"]
    blocks = [log[i:i + 4] for i in range(6, len(log), 4)]  # per trial and variant: 1 untimed + 3 timed
    assert len(blocks) == 12 and all(len(set(b)) == 1 for b in blocks)
    assert frame.n.tolist() == [3] * 12 and set(frame.clock) == {"perf_counter"}


def test_interleaved_trials_time_each_block_and_summarize_pairs_them(monkeypatch):
    """End to end with a fake clock (each perf_counter() read advances 1 ms): a call of `slow` reads
    the clock twice itself, so it spans 3 ticks against `fast`'s 1; the speedup is exactly 3."""
    clock = iter(np.arange(0, 1e6, 1.0) / 1e3)
    monkeypatch.setattr("cgutils.timing.time.perf_counter", lambda: next(clock))
    import cgutils.timing as timing

    def slow():
        timing.time.perf_counter()
        timing.time.perf_counter()

    frame = cg.interleaved_trials({"slow": slow, "fast": lambda: None}, trials=5, iters=4, device="cpu")
    assert frame.median_ms.round(6).tolist() == [3.0, 1.0] * 5
    s = cg.summarize_trials(frame, "slow").set_index("variant")
    assert s.loc["fast", "speedup"] == pytest.approx(3.0) and s.loc["slow", "speedup"] == 1.0
    assert s.loc["fast", "trials"] == 5 and s.loc["fast", "n"] == 20


def test_a_failing_variant_is_dropped_and_the_others_go_on():
    calls = {"n": 0}

    def breaks_in_trial_2():
        calls["n"] += 1
        if calls["n"] > 1 + 2 * 3:  # warm-up, then trials 0 and 1 (1 untimed + 2 timed each)
            raise RuntimeError("replay broke")

    failed = {}
    frame = cg.interleaved_trials({"ok": lambda: None, "bad": breaks_in_trial_2}, trials=4, iters=2,
                                  warmup=1, device="cpu", failed=failed)
    assert list(failed) == ["bad"] and "replay broke" in str(failed["bad"])
    assert frame.variant.tolist() == ["ok"] * 4  # no partial trials of the failed variant
    with pytest.raises(RuntimeError, match="replay broke"):  # without `failed` it propagates
        calls["n"] = 0
        cg.interleaved_trials({"ok": lambda: None, "bad": breaks_in_trial_2}, trials=4, iters=2, warmup=1,
                              device="cpu")


def test_interleaved_trials_reject_bad_arguments_before_calling_anything():
    called = []
    fn = lambda: called.append(1)  # noqa: E731
    with pytest.raises(cg.InputError, match="at least one variant"):
        cg.interleaved_trials({}, device="cpu")
    with pytest.raises(cg.InputError, match="at least one variant"):
        cg.interleaved_trials([fn], device="cpu")
    with pytest.raises(cg.InputError, match="variant 'x' needs a callable"):
        cg.interleaved_trials({"x": 3}, device="cpu")
    with pytest.raises(cg.InputError, match="variant names must be strings"):
        cg.interleaved_trials({1: fn}, device="cpu")
    with pytest.raises(cg.InputError, match="trials must be an int >= 1"):
        cg.interleaved_trials({"x": fn}, trials=0, device="cpu")
    with pytest.raises(cg.InputError, match="trials must be an int >= 1"):
        cg.interleaved_trials({"x": fn}, trials=True, device="cpu")
    with pytest.raises(cg.InputError, match="iters must be an int >= 1"):
        cg.interleaved_trials({"x": fn}, iters=0, device="cpu")
    with pytest.raises(cg.InputError, match="seed must be an int >= 0"):
        cg.interleaved_trials({"x": fn}, seed=-1, device="cpu")
    with pytest.raises(cg.InputError, match="not 'meta'"):
        cg.interleaved_trials({"x": fn}, device="meta")
    assert not called


def _trial_frame(rows):
    import pandas as pd

    return pd.DataFrame([{"trial": t, "variant": v, "median_ms": m, "n": 10} for t, v, m in rows])


def test_summarize_trials_pairs_the_speedup_within_each_trial():
    """Eager is slow in trials 1 and 2 (a noisy host), the graph only in trial 1. Per trial the ratios are
    2, 2, 5: the paired speedup is 2 (median), where the ratio of the overall medians would say 10/2 = 5.
    Rows are shuffled: pairing goes by trial, not by row position."""
    frame = _trial_frame([(2, "graph", 2.0), (0, "eager", 2.0), (1, "graph", 5.0), (1, "eager", 10.0),
                          (0, "graph", 1.0), (2, "eager", 10.0)])
    s = cg.summarize_trials(frame, "eager").set_index("variant")
    g = s.loc["graph"]
    assert g.speedup == pytest.approx(2.0)
    assert g.speedup_p10 == pytest.approx(2.0) and g.speedup_p90 == pytest.approx(4.4)  # [2, 2, 5]
    assert g.median_ms == pytest.approx(2.0) and g.p10_ms == pytest.approx(1.2) and g.p90_ms == pytest.approx(4.4)
    assert g.trials == 3 and g.n == 30
    e = s.loc["eager"]
    assert e.median_ms == pytest.approx(10.0) and e.p10_ms == pytest.approx(3.6)  # across trials: [2, 10, 10]
    assert (e.speedup, e.speedup_p10, e.speedup_p90) == (1.0, 1.0, 1.0)
    assert list(s.index) == ["graph", "eager"]  # order of first appearance
    assert cg.summarize_trials(frame).speedup.isna().all()  # no baseline: no speedups


def test_summarize_trials_rejects_bad_input():
    import pandas as pd

    frame = _trial_frame([(0, "eager", 2.0), (0, "graph", 1.0)])
    with pytest.raises(cg.InputError, match=r"baseline 'egaer' is not a variant .*\['eager', 'graph'\]"):
        cg.summarize_trials(frame, "egaer")
    with pytest.raises(cg.InputError, match="empty frame"):
        cg.summarize_trials(frame.iloc[:0], "eager")
    with pytest.raises(cg.InputError, match="needs interleaved_trials' frame with columns"):
        cg.summarize_trials(frame.drop(columns="trial"), "eager")
    with pytest.raises(cg.InputError, match="needs interleaved_trials' frame"):
        cg.summarize_trials({"trial": [0]}, "eager")
    with pytest.raises(cg.InputError, match="two rows for trial 0, variant 'eager'"):
        cg.summarize_trials(pd.concat([frame, frame]), "eager")
    with pytest.raises(cg.InputError, match="finite and > 0 ms"):
        cg.summarize_trials(_trial_frame([(0, "eager", 2.0), (0, "graph", 0.0)]), "eager")


def test_host_us_per_call_times_the_calls_on_the_chosen_clock():
    import time

    from cgutils import host_us_per_call

    calls = []
    assert host_us_per_call(lambda: calls.append(1), calls=5, warmup=2) >= 0
    assert len(calls) == 7  # warm-up calls run, untimed
    slept = host_us_per_call(lambda: time.sleep(0.002), calls=3, warmup=0)
    assert slept >= 1500  # the wall clock counts the sleep
    assert host_us_per_call(lambda: time.sleep(0.002), calls=3, warmup=0, clock="thread") < slept / 2  # CPU time does not
    with pytest.raises(cg.InputError, match="clock must be one of"):
        host_us_per_call(lambda: None, clock="gpu")
    with pytest.raises(cg.InputError, match="needs a callable"):
        host_us_per_call(42)


def test_timing_after_a_profiler_session_warns_once(monkeypatch, tmp_path):
    """cgutils' sessions that leave CUPTI attached are counted and the first host-bound timing after one says so,
    once; sessions torn down (the default, cg.profile included) are not counted and stay silent."""
    import warnings

    from torch.profiler import ProfilerActivity

    from cgutils import overhead, timing

    monkeypatch.setattr(timing, "_profiler_sessions", 0)
    monkeypatch.setattr(timing, "_after_profiler_warned", False)
    monkeypatch.setattr(timing, "device_sync", lambda *a: None)
    monkeypatch.setattr(overhead, "_settle_teardown", lambda: None)
    monkeypatch.setattr(overhead, "_prime_teardown", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", timing.TimingAfterProfilerWarning)
        cg.host_us_per_call(lambda: None, calls=2)  # no session yet: silent
    with cg.profiler_session(activities=[ProfilerActivity.CPU], teardown=False):
        pass
    cg.profile(lambda: None, tmp_path / "t", warmup=0, active=1)
    assert timing._profiler_sessions == 0  # no CUDA: no CUPTI to stay attached
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with cg.profiler_session(activities=[ProfilerActivity.CPU]):  # torn down (default)
        pass
    assert timing._profiler_sessions == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", timing.TimingAfterProfilerWarning)
        cg.host_us_per_call(lambda: None, calls=2)
    with cg.profiler_session(activities=[ProfilerActivity.CPU], teardown=False):
        pass
    assert timing._profiler_sessions == 1
    with pytest.warns(timing.TimingAfterProfilerWarning, match="after 1 torch.profiler session"):
        cg.host_us_per_call(lambda: None, calls=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", timing.TimingAfterProfilerWarning)
        cg.host_us_per_call(lambda: None, calls=2)  # once per process


def test_the_profiler_warning_names_the_callers_line_however_deep_in_cgutils_it_is_raised(monkeypatch):
    """It pointed at a fixed 3 frames up, which named timing.py when measure ran under interleaved_trials."""
    import os
    import warnings

    from cgutils import timing

    monkeypatch.setattr(timing, "_profiler_sessions", 1)
    monkeypatch.setattr(timing, "_after_profiler_warned", False)
    # two frames that live in the package, as interleaved_trials -> measure do
    source = "def outer():\n    inner()\ndef inner():\n    timing._warn_if_after_profiler('this timing')\n"
    namespace = {"timing": timing}
    exec(compile(source, os.path.join(os.path.dirname(timing.__file__), "_frames.py"), "exec"), namespace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace["outer"]()
    assert [os.path.abspath(w.filename) for w in caught] == [os.path.abspath(__file__)]


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_a_profiler_session_sets_teardown_for_itself_and_puts_the_environment_back(monkeypatch, before):
    """The teardown switch is the caller's environment: set for the session, restored after it, also on error."""
    import os

    from torch.profiler import ProfilerActivity

    from cgutils import overhead

    if before is None:
        monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    else:
        monkeypatch.setenv("TEARDOWN_CUPTI", before)
    settles = []
    monkeypatch.setattr(overhead, "_settle_teardown", lambda: settles.append(os.environ.get("TEARDOWN_CUPTI")))
    monkeypatch.setattr(overhead, "_prime_teardown", lambda: settles.append("primed " + os.environ["TEARDOWN_CUPTI"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with cg.profiler_session(activities=[ProfilerActivity.CPU]):
        assert os.environ["TEARDOWN_CUPTI"] == "1"
    assert os.environ.get("TEARDOWN_CUPTI") == before
    assert settles == [before, "primed 1", "1"], "settle, a primed teardown, the session, a settle while still set"
    with pytest.raises(RuntimeError, match="inside"), cg.profiler_session(activities=[ProfilerActivity.CPU]):
        raise RuntimeError("an error inside the session")
    assert os.environ.get("TEARDOWN_CUPTI") == before


def test_a_failing_priming_session_still_puts_the_environment_back(monkeypatch):
    """The switch was set before the try, so an error in the throw-away session left TEARDOWN_CUPTI=1 behind."""
    import os

    from torch.profiler import ProfilerActivity

    from cgutils import overhead

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.setattr(overhead, "_settle_teardown", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken():
        raise RuntimeError("CUPTI could not start")

    monkeypatch.setattr(overhead, "_prime_teardown", broken)
    with pytest.raises(RuntimeError, match="CUPTI"), cg.profiler_session(activities=[ProfilerActivity.CPU]):
        pass
    assert "TEARDOWN_CUPTI" not in os.environ


@pytest.mark.parametrize("kwargs, message", [
    ({"activities": "cpu"}, "non-empty list"), ({"activities": []}, "non-empty list"),
    ({"activities": ["CPU"]}, "non-empty list"), ({"activities": None}, "non-empty list"),
    ({"activities": [torch.profiler.ProfilerActivity.CPU], "teardown": "no"}, "True or False")])
def test_a_profiler_session_rejects_bad_arguments_before_it_starts(kwargs, message):
    """A new user's try: these reached torch as raw TypeError/AssertionError, or (teardown="no") passed as True."""
    with pytest.raises(cg.InputError, match=message), cg.profiler_session(**kwargs):
        pass


def test_a_cuda_profiler_session_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(cg.NoCudaError, match="ProfilerActivity.CPU"), \
            cg.profiler_session(activities=[torch.profiler.ProfilerActivity.CUDA]):
        pass


@pytest.mark.parametrize("kwargs, message", [
    ({"fn": 42}, "needs a callable"), ({"warmup": -1}, "warmup must be an int >= 0"),
    ({"active": 0}, "active must be an int >= 1"), ({"active": 2.0}, "active must be an int"),
    ({"record_shapes": "yes"}, "True or False")])
def test_profile_rejects_bad_arguments_before_fn_runs(tmp_path, kwargs, message):
    """These reached torch as raw TypeError/AssertionError before, after fn had run."""
    calls = []
    args = {"fn": lambda: calls.append(1), "path": tmp_path / "t", **kwargs}
    with pytest.raises(cg.InputError, match=message):
        cg.profile(**args)
    assert calls == []


def test_profile_refuses_a_path_it_cannot_write_before_fn_runs(tmp_path):
    """A path it cannot write failed with a raw OSError, and only after every call had run."""
    calls = []
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder.json").mkdir()
    with pytest.raises(cg.InputError, match="cannot make the folder"):
        cg.profile(lambda: calls.append(1), tmp_path / "a_file" / "t", warmup=0, active=1)
    with pytest.raises(cg.InputError, match="cannot write"):
        cg.profile(lambda: calls.append(1), tmp_path / "a_folder.json", warmup=0, active=1)
    assert calls == []
    written = cg.profile(lambda: calls.append(1), tmp_path / "ok", warmup=1, active=2)
    assert written.name == "ok.json.gz" and written.exists() and calls == [1, 1, 1]
