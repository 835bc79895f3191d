import numpy as np
import pytest

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
