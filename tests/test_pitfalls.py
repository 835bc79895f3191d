"""The pitfall catalogue: CPU checks of its structure; GPU tests (``-m gpu``) run every entry on the H200
and assert cgutils' diagnosis: exception class, cause, and for syncs the op and the user's line."""

import pytest
import torch

from cgutils import pitfalls
from cgutils.pitfalls import PITFALLS


def test_catalogue_has_at_least_twelve_entries_of_known_kinds():
    assert len(PITFALLS) >= 12
    assert {p.kind for p in PITFALLS.values()} <= set(pitfalls.KINDS)
    for p in PITFALLS.values():
        assert p.title and p.fix and callable(p.bad) and callable(p.diagnose)


@pytest.mark.parametrize("key", [k for k, p in PITFALLS.items() if (p.expect or {}).get("cause") == "sync"])
def test_sync_reproducers_mark_their_offending_line(key):
    p = PITFALLS[key]
    line = p.marked_line
    assert line is not None and pitfalls.MARK in p.source
    assert pitfalls.MARK in open(pitfalls.__file__).read().splitlines()[line - 1]


def test_run_rejects_unknown_keys():
    with pytest.raises(pitfalls.InputError, match="unknown pitfall"):
        pitfalls.run("nope")


def test_markdown_table_escapes_pipes_and_names_the_op():
    import pandas as pd

    df = pd.DataFrame([{"title": "t", "kind": "loud", "exception": "CaptureError", "cause": "sync",
                        "op": "Tensor.item", "line": 7, "message": "a | b", "original": "", "fix": "x | y"}])
    md = pitfalls.markdown_table(df)
    assert "`Tensor.item` at line 7" in md and "a / b" in md and "x / y" in md


@pytest.mark.gpu
@pytest.mark.parametrize("key", list(PITFALLS))
def test_pitfall_is_diagnosed(key):
    p = PITFALLS[key]
    row = pitfalls.run(key)
    for field, want in (p.expect or {}).items():
        if field == "op":
            assert row["op"] == want, row
            assert row["line"] == p.marked_line, row  # the user's line, not a torch frame
        else:
            assert row.get(field) == want, (field, row)
    if p.expect == {}:  # outcome depends on torch/driver: the report must be consistent either way
        if row["exception"]:
            assert row["cause"] or row["message"], row
        else:
            assert row["max_rel_error"] <= 1e-5, row
    assert row["fix_ok"] in (True, None), row
    torch.cuda.synchronize()  # the context is still usable after the failure


def test_markdown_shows_the_silent_outcome_and_current_fix_text():
    import pandas as pd

    df = pd.DataFrame([{"key": "python_value", "title": "old title", "kind": "silent", "exception": "CaptureError",
                        "cause": "baked_value", "op": None, "line": None, "original": None, "fix": "old fix",
                        "message": "replay 2 of X differs from eager: max relative error 0.333 > rtol 0.001"}])
    md = pitfalls.markdown_table(df)
    assert "no error from PyTorch; the replay is wrong by a relative error of 0.333" in md
    assert PITFALLS["python_value"].fix in md and "old fix" not in md


def test_method_targets_tolerate_a_missing_method():
    import pandas as pd

    from cgutils.bench import method_targets

    df = pd.DataFrame({"workload": ["w"] * 3, "method": ["manual_graph", "graph_runner", "compile_ro"],
                       "median_ms": [1.0, 1.001, 0.5], "status": ["ok"] * 3})
    t = method_targets(df).iloc[0]
    assert abs(t.runner_us_over_raw - 1.0) < 1e-6 and t.runner_vs_compile_ro == pytest.approx(2.002)
    assert pd.isna(t.runner_compiled_vs_compile_ro)
