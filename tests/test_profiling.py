"""cgutils.env.cupti_released and cgutils.overhead.profiler_session: CUPTI released after every cgutils profiler session, the caller's environment restored."""

import os

import pytest
import torch

from cgutils import env as profiling
from cgutils.overhead import profiler_session


@pytest.mark.parametrize("version, expected", [("13.0", True), ("12.6", True), ("12.4", False), ("11.8", False),
                                                ("", False), ("rocm", False)])
def test_teardown_follows_pytorchs_cuda_gate(version, expected, monkeypatch):
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    assert profiling.teardown_supported(version) is expected


def test_teardown_reads_torchs_cuda_version_by_default(monkeypatch):
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU-only build
    assert profiling.teardown_supported() is False
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert profiling.teardown_supported() is True


def test_no_teardown_where_lazy_reinit_is_off(monkeypatch):
    """torch.compile sets DISABLE_CUPTI_LAZY_REINIT where CUDA graphs crashed CUPTI's re-initialisation."""
    monkeypatch.setenv("DISABLE_CUPTI_LAZY_REINIT", "1")
    assert profiling.teardown_supported("13.0") is False


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_session_sets_teardown_inside_and_restores_the_callers_value(before, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    if before is None:
        monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    else:
        monkeypatch.setenv("TEARDOWN_CUPTI", before)
    with profiler_session([torch.profiler.ProfilerActivity.CPU]) as prof:
        assert os.environ["TEARDOWN_CUPTI"] == "1"
        torch.ones(3).add_(1)
    assert any("add_" in e.name for e in prof.events())
    assert os.environ.get("TEARDOWN_CUPTI") == before


def test_session_restores_the_environment_when_the_profiled_code_raises(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    with pytest.raises(ZeroDivisionError):
        with profiler_session([torch.profiler.ProfilerActivity.CPU]):
            raise ZeroDivisionError("in the profiled code")
    assert os.environ["TEARDOWN_CUPTI"] == "0"


def test_old_cuda_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    with profiling.cupti_released():
        assert "TEARDOWN_CUPTI" not in os.environ
