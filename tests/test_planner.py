"""The bucket planner (issue 27): known answers, an exhaustive search on small cases, and its errors."""

import itertools
import random

import pytest

import cgutils as cg
from cgutils.errors import InputError


def test_known_answers_on_a_uniform_sample():
    lengths = range(1, 9)  # each size once; a replay costs its bucket size
    every = cg.plan_buckets(lengths, {b: float(b) for b in range(1, 9)})
    assert every.buckets == tuple(range(1, 9)) and every.expected_ms == pytest.approx(4.5)
    one = cg.plan_buckets(lengths, lambda b: float(b), max_buckets=1)
    assert one.buckets == (8,) and one.expected_ms == pytest.approx(8.0)
    two = cg.plan_buckets(lengths, lambda b: float(b), max_buckets=2)  # (x*x + 8*(8-x)) / 8 is least at x = 4
    assert two.buckets == (4, 8) and two.expected_ms == pytest.approx(6.0)
    assert two.padded_fraction == pytest.approx(sum((4 - n) / 4 for n in range(1, 5)) / 8
                                                + sum((8 - n) / 8 for n in range(5, 9)) / 8)
    assert two.table.requests.tolist() == [4, 4] and two.table.share.sum() == pytest.approx(1.0)
    by_memory = cg.plan_buckets(lengths, lambda b: float(b), memory_bytes=lambda b: 1e9, memory_budget=2e9)
    assert by_memory.buckets == (4, 8) and by_memory.memory_bytes == 2e9


def test_requests_above_the_largest_affordable_bucket_run_eagerly():
    plan = cg.plan_buckets([1, 1, 1, 100], {1: 1.0, 100: 10.0}, memory_bytes={1: 1, 100: 100}, memory_budget=50,
                           eager_ms=lambda n: 50.0)
    assert plan.buckets == (1,) and plan.eager_requests == 1 and plan.expected_ms == pytest.approx((3 + 50) / 4)


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_best_ladder_an_exhaustive_search_finds(seed):
    rng = random.Random(seed)
    cand = sorted(rng.sample(range(1, 60), 7))
    lengths = [rng.randint(1, cand[-1]) for _ in range(40)]
    ms = {c: 0.2 + 0.01 * c + rng.random() * 0.05 for c in cand}
    mem = {c: rng.randint(1, 10) * 1e6 for c in cand}
    budget, k = 20e6, 3
    plan = cg.plan_buckets(lengths, ms, memory_bytes=mem, memory_budget=budget, max_buckets=k, steps=20)

    def cost(ladder):
        return sum(ms[min(b for b in ladder if b >= n)] for n in lengths) / len(lengths)

    feasible = [s for r in range(1, k + 1) for s in itertools.combinations(cand, r)
                if s[-1] == cand[-1] and sum(mem[b] for b in s) <= budget]
    assert plan.expected_ms == pytest.approx(min(cost(s) for s in feasible))
    assert plan.memory_bytes <= budget and len(plan.buckets) <= k


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": []}, "non-empty"),
    ({"lengths": [1, 0]}, "integers >= 1"),
    ({"lengths": [1, 50]}, "above every candidate"),
    ({"memory_budget": 10}, "needs memory_bytes"),
    ({"max_buckets": 0}, "max_buckets"),
    ({"replay_ms": [1, 2]}, "mapping"),
    ({"candidates": [1, 3]}, "no value for size 3"),
    ({"memory_bytes": {1: 5, 2: 5}, "memory_budget": 1}, "no ladder fits"),
])
def test_bad_input_is_named(kwargs, match):
    args = {"lengths": [1, 2], "replay_ms": {1: 1.0, 2: 2.0}, **kwargs}
    with pytest.raises(InputError, match=match):
        cg.plan_buckets(args.pop("lengths"), args.pop("replay_ms"), **args)


def test_a_ladder_that_fills_the_budget_exactly_is_found():
    """From a new user's pass: each graph's memory was rounded up to budget/512 units, so three graphs of 100 bytes
    did not fit a 300-byte budget and a worse ladder came back."""
    plan = cg.plan_buckets([1, 2, 3], {1: 1.0, 2: 2.0, 3: 3.0}, memory_bytes={1: 100, 2: 100, 3: 100}, memory_budget=300)
    assert plan.buckets == (1, 2, 3) and plan.expected_ms == pytest.approx(2.0)


def test_everything_eager_when_no_graph_pays_or_fits():
    plan = cg.plan_buckets([50, 60], {1: 1.0, 2: 1.0}, eager_ms=5.0)
    assert plan.buckets == () and plan.eager_requests == 2 and plan.expected_ms == 5.0 and plan.memory_bytes == 0
    tight = cg.plan_buckets([1, 2], {1: 1.0, 2: 1.0}, memory_bytes={1: 10, 2: 10}, memory_budget=5, eager_ms={1: 3.0, 2: 3.0})
    assert tight.buckets == () and tight.expected_ms == 3.0


@pytest.mark.parametrize("kwargs, match", [
    ({"memory_bytes": {1: -10, 2: 20}, "memory_budget": 100}, "finite number >= 0"),
    ({"memory_bytes": {1: float("nan"), 2: 20}, "memory_budget": 100}, "finite number >= 0"),
    ({"replay_ms": {1: -5.0, 2: 1.0}}, "finite number >= 0"),
    ({"replay_ms": {1: None, 2: 1.0}}, "finite number >= 0"),
    ({"replay_ms": {"1": 1.0, "2": 2.0}}, "keys are strings"),
    ({"steps": 0, "memory_bytes": {1: 1, 2: 1}, "memory_budget": 10}, "steps"),
    ({"max_buckets": True}, "max_buckets"),
    ({"candidates": [2.5, 3]}, "integers"),
    ({"lengths": [[1, 2]]}, "flat"),
    ({"eager_ms": "fast"}, "eager_ms must be"),
])
def test_more_bad_input_is_named(kwargs, match):
    args = {"lengths": [1, 2], "replay_ms": {1: 1.0, 2: 2.0}, **kwargs}
    with pytest.raises(InputError, match=match):
        cg.plan_buckets(args.pop("lengths"), args.pop("replay_ms"), **args)


def test_numpy_inputs_and_integral_floats_are_sizes():
    import numpy as np

    plan = cg.plan_buckets(np.array([1, 2, 3, 4]), {np.int64(2): 1.0, 4: 2.0}, max_buckets=np.int64(1))
    assert plan.buckets == (4,)
    assert cg.plan_buckets([1.0, 2.0], {1: 1.0, 2: 2.0}).buckets == (1, 2)


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": "123"}, "got a str"),  # was read as the sizes 1, 2, 3
    ({"lengths": [True, 5]}, "bool"),  # True was a size of 1
    ({"lengths": [2**63 + 5]}, "below 2\\*\\*53"),  # wrapped to a negative int64: padded_fraction -1e18
    ({"replay_ms": {0: 1.0, 8: 1.0}}, "replay_ms's keys"),  # named `candidates`, which the caller never passed
    ({"lengths": [3, 9], "replay_ms": {8: 1.0, 16: 1.0}, "eager_ms": {3: 0.1}}, "above the largest bucket"),
])
def test_inputs_found_by_a_new_user_are_named(kwargs, match):
    """A helper's adversarial inputs: each was read silently wrong or refused with a message about something else."""
    args = {"lengths": [3], "replay_ms": {8: 1.0}, **kwargs}
    with pytest.raises(InputError, match=match):
        cg.plan_buckets(args.pop("lengths"), args.pop("replay_ms"), **args)


def test_numpy_budgets_series_and_empty_plans_work():
    """np.int64 budgets were refused as 'not a finite number', a size-indexed Series as 'got Series', and an empty
    plan's table had no columns (plan.table.mean_size raised AttributeError)."""
    import numpy as np
    import pandas as pd

    plan = cg.plan_buckets([3], {8: 1.0}, memory_bytes={8: 4}, memory_budget=np.int64(5))
    assert plan.buckets == (8,)
    assert cg.plan_buckets([3, 9], pd.Series({8: 1.0, 16: 2.0})).buckets == cg.plan_buckets([3, 9], {8: 1.0, 16: 2.0}).buckets
    empty = cg.plan_buckets([3, 9], {8: 1.0, 16: 1.0}, eager_ms=0.1)
    assert empty.buckets == () and empty.table.empty
    assert list(empty.table.columns) == ["bucket", "requests", "share", "mean_size", "replay_ms", "memory_bytes"]


def test_a_cost_function_that_raises_is_named_with_its_size():
    """A replay_ms function's own ZeroDivisionError came out raw, without the size it failed on."""
    with pytest.raises(InputError, match=r"replay_ms\(3\) raised ZeroDivisionError") as err:
        cg.plan_buckets([3], lambda n: 1 / 0)
    assert isinstance(err.value.__cause__, ZeroDivisionError)
