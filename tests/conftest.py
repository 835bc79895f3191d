"""Shared fixtures: GPU tests skip cleanly without CUDA; recordings go to a temporary store."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    """An empty results root, used by ResultsStore() in place of the repo's results/."""
    root = tmp_path / "results"
    root.mkdir()
    monkeypatch.setenv("CGUTILS_RESULTS", str(root))
    monkeypatch.delenv("CGUTILS_RECORDED_GPU", raising=False)
    monkeypatch.delenv("CGUTILS_RECORD", raising=False)
    return root


@pytest.fixture
def simulated():
    """A CPU simulation of CUDA graphs (tests/simulation.py): pass it as ``backend=simulated``."""
    from simulation import SimulatedBackend

    return SimulatedBackend()
