"""The decode step's routes against the bandwidth floor (cgutils.bench.decode): the CPU path end to end (Triton's
interpreter, a tiny GPT-2) and the tables ``bench generation`` prints from a run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cgutils.bench import DecodeFloorConfig, decode_floor_frames
from cgutils.errors import InputError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kwargs, message", [
    ({"routes": ("plain", "fast")}, "routes must be some of"),
    ({"routes": ()}, "routes must be some of"),
    ({"batches": (1, 0)}, "batch must be an int >= 1"),
    ({"trials": 0}, "trials must be an int >= 1"),
    ({"new_tokens": 1}, "new_tokens must be an int >= 2"),
])
def test_a_bad_config_raises_input_error_naming_the_field(kwargs, message):
    with pytest.raises(InputError, match=message):
        DecodeFloorConfig(**kwargs).check()


def test_the_frames_flatten_a_run_with_the_floor_ratio_tokens_and_a_failed_route():
    run = {"provenance": {"gpu": "G"}, "batches": [{
        "batch": 2, "floor": {"floor_us": 50.0},
        "routes": {
            "plain": {"ms_per_step": {"median": 0.5, "p10": 0.4, "p90": 0.6, "n": 3}, "ratio_to_floor": 10.0,
                      "profile": {"kernels_per_step": 150, "gpu_busy_us_per_step": 400.0,
                                  "us_per_step_by_class": {"gemm": 300.0, "other": 100.0}}},
            "hf": {"ms_per_step": {"median": 1.0, "p10": 0.9, "p90": 1.1, "n": 3}, "ratio_to_floor": 20.0,
                   "profile": {"kernels_per_step": 180, "gpu_busy_us_per_step": 450.0, "us_per_step_by_class": {}}},
            "fused": {"error": "RuntimeError: no Triton\nmore"}},
        "tokens": {"plain_vs_hf": {"equal": False, "first_differing_step": 3}}}]}
    routes, classes = decode_floor_frames(run)
    r = routes.set_index("route")
    assert r.loc["plain", "tokens_per_s"] == pytest.approx(2 / 0.5e-3)
    assert r.loc["plain", "x_floor"] == 10.0 and math.isnan(r.loc["hf", "x_floor"])  # hf: a whole call per token
    assert r.loc["plain", "tokens_equal_hf"] is False and r.loc["hf", "tokens_equal_plain"] is False
    assert r.loc["fused", "status"] == "error: RuntimeError: no Triton"
    assert classes.us_per_step.sum() == 400.0 and set(classes.route) == {"plain"}


def test_the_smoke_run_measures_every_route_and_the_fused_tokens_equal_the_plain_ones(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_floor.py"), "--smoke", "--out", str(tmp_path),
                           "--batches", "1", "--routes", "plain", "fused", "hf", "--new-tokens", "3", "--trials", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads((tmp_path / "decode_floor.json").read_text())
    routes, _ = decode_floor_frames(run)
    assert list(routes.route) == ["plain", "fused", "hf"] and (routes.status != "").all()
    assert routes.ms_per_step.notna().all(), routes.status.tolist()
    assert routes.set_index("route").tokens_equal_plain["fused"] is True
    assert run["batches"][0]["floor"]["weight_bytes"] > 0
