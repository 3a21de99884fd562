"""bench/thread_profile.py: the figures read from a trace and dag.json's edges (ideal speedup,
critical path, occupancy, time a core starved) on small hand-made schedules whose answers are known."""

from __future__ import annotations

import pytest

from bench.thread_profile import critical_path, ideal_speedup, list_schedule, occupancy, starved


def dag(order: list[str], edges: list[tuple[str, str]]) -> dict:
    return {"order": order, "edges": [{"from": a, "to": b} for a, b in edges]}


# a -> (b, c) -> d: two 2-ms slices between a 1-ms producer and a 1-ms join
DIAMOND = dag(["a", "b", "c", "d"], [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
TIMES = {"a": 1.0, "b": 2.0, "c": 2.0, "d": 1.0}


def entry(cu: str, start: float, seconds: float, thread: int = 0) -> dict:
    return {"cu": cu, "start": start, "seconds": seconds, "thread": thread}


def test_a_chain_has_no_parallelism():
    chain = dag(["a", "b", "c"], [("a", "b"), ("b", "c")])
    assert ideal_speedup(chain, {"a": 1.0, "b": 1.0, "c": 1.0}) == 1.0
    assert critical_path(chain, {"a": 1.0, "b": 1.0, "c": 1.0}) == 3.0


def test_two_slices_run_side_by_side_on_two_workers():
    assert list_schedule(DIAMOND, TIMES, 2) == 4.0           # 1 + 2 + 1
    assert list_schedule(DIAMOND, TIMES, 1) == 6.0
    assert ideal_speedup(DIAMOND, TIMES, 2) == pytest.approx(1.5)
    assert critical_path(DIAMOND, TIMES) == 4.0


def test_independent_cus_are_bounded_by_the_worker_count():
    wide = dag(["a", "b", "c", "d"], [])
    assert ideal_speedup(wide, dict.fromkeys("abcd", 1.0), 2) == 2.0
    assert critical_path(wide, dict.fromkeys("abcd", 1.0)) == 1.0


def test_occupancy_splits_the_span_by_how_many_cus_ran():
    trace = [entry("a", 0.0, 1.0), entry("b", 1.5, 2.0, 1), entry("c", 2.0, 2.0), entry("d", 4.5, 1.0)]
    occ = occupancy(trace, begin=0.0, end=6.0)
    assert (occ.none, occ.one, occ.many) == pytest.approx((1.5, 3.0, 1.5))   # none: 1-1.5, 4-4.5, 5.5-6
    assert occ.span == 6.0


def test_starved_counts_only_a_free_core_beside_a_ready_cu():
    # b and c are ready at 1.0; b starts at 1.5, c at 2.0: from 1.0 to 2.0 a core was free while
    # one of them waited; d is ready at 4.0 and starts at 4.5.
    trace = [entry("a", 0.0, 1.0), entry("b", 1.5, 2.0, 1), entry("c", 2.0, 2.0), entry("d", 4.5, 1.0)]
    assert starved(DIAMOND, trace, begin=0.0, workers=2) == pytest.approx(1.5)
    ideal = [entry("a", 0.0, 1.0), entry("b", 1.0, 2.0, 1), entry("c", 1.0, 2.0), entry("d", 3.0, 1.0)]
    assert starved(DIAMOND, ideal, begin=0.0, workers=2) == 0.0
