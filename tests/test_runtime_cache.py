"""The result cache: hits on byte-identical inputs with chained keys, misses on any changed byte,
LRU eviction within its byte budget, outputs the caller cannot write into it, and never a CU
holding a random op. The models are built with their input marked repeating (`--cache-inputs x`),
since a dag.json that marks nothing caches nothing."""

from __future__ import annotations

import numpy as np
import pytest

import cortex
from cortex.runtime.cache import ResultCache
from cortex.runtime.scheduler import SequentialScheduler
from runtime_cases import build, random_model, two_output_model


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    return build(two_output_model(), tmp_path_factory.mktemp("two_outputs"), cache_inputs=("x",))


def test_a_dag_that_marks_nothing_caches_nothing(tmp_path, hash_calls):
    model = cortex.load(build(two_output_model(), tmp_path))
    assert not any("cache" in cu for cu in model.dag["cus"])
    for _ in range(2):
        model.run(feeds())
        assert model.last_trace["activated_cus"] == model.dag["order"]
    stats = model.last_trace["cache"]
    assert stats["hits"] == 0 and stats["entries"] == 0 and hash_calls == []


def test_a_repeated_call_is_all_cache_hits_with_chained_keys(two_outputs, hash_calls):
    model = cortex.load(two_outputs)
    first = model.run(feeds())
    cu_outputs = [name for cu in model.dag["cus"] for name in cu["outputs"]]
    # The first run hashes the model input and, as each CU's entry is stored, its outputs.
    assert len(hash_calls) == 1 + len(cu_outputs)
    assert model.last_trace["skipped_cus"] == [] and model.last_trace["cache"]["misses"] == len(model.dag["cus"])
    hash_calls.clear()
    second = model.run(feeds())
    # Only the model input is hashed: every CU's key chains from the input's and its hits' keys.
    assert len(hash_calls) == 1
    np.testing.assert_array_equal(hash_calls[0], feeds()["x"])
    assert model.last_trace["activated_cus"] == []
    assert model.last_trace["skipped_cus"] == [{"cu": cu, "reason": "cache hit"} for cu in model.dag["order"]]
    assert model.last_trace["cache"]["hits"] == len(model.dag["cus"])
    for name in first:
        np.testing.assert_array_equal(second[name], first[name])


def test_one_changed_input_byte_misses(two_outputs):
    model = cortex.load(two_outputs)
    x = feeds()["x"]
    model.run({"x": x})
    changed = x.copy()
    positive = int(np.flatnonzero(x.reshape(-1) > 0)[0])   # the Relu passes it on: h changes too
    # A high mantissa bit (little-endian: byte 2 of 4): large enough to reach every output. (The
    # lowest bit changes h and y1 but can leave Tanh's output t, and so the last CU, a hit.)
    changed.reshape(-1).view(np.uint8)[4 * positive + 2] ^= 0x40
    assert np.count_nonzero(changed != x) == 1
    got = model.run({"x": changed})
    assert model.last_trace["activated_cus"] == model.dag["order"]
    np.testing.assert_array_equal(got["y1"], cortex.load(two_outputs, policy="strict").run({"x": changed})["y1"])


def test_keys_are_content_keys_so_an_identical_intermediate_hits(two_outputs):
    """x -> Relu -> h: inputs that differ only in negative entries give the same h, and the CUs
    reading h are hits although the model input changed."""
    model = cortex.load(two_outputs)
    x = feeds()["x"]
    model.run({"x": x})
    other = np.where(x < 0, x * 2, x)
    assert not np.array_equal(other, x)
    model.run({"x": other})
    relu = next(cu["id"] for cu in model.dag["cus"] if cu["inputs"] == ["x"])
    assert model.last_trace["activated_cus"] == [relu]
    assert {s["cu"] for s in model.last_trace["skipped_cus"]} == set(model.dag["order"]) - {relu}


def test_outputs_are_copies_the_caller_cannot_write_into_the_cache(two_outputs):
    model = cortex.load(two_outputs)
    first = model.run(feeds())
    kept = first["y1"].copy()
    first["y1"][...] = 0                              # the caller owns its arrays
    second = model.run(feeds())
    assert model.last_trace["activated_cus"] == []
    np.testing.assert_array_equal(second["y1"], kept)
    second["y1"][...] = 1
    np.testing.assert_array_equal(model.run(feeds())["y1"], kept)
    entry = next(iter(model.cache.entries.values()))
    assert not any(a.flags.writeable for a in entry.outputs.values())


def test_lru_evicts_the_least_recently_used_entry_first():
    cache = ResultCache(budget_bytes=64)
    a, b, c = (np.full(8, i, np.float32) for i in range(3))   # 32 bytes each
    cache.put(b"a", {"t": a})
    cache.put(b"b", {"t": b})
    assert cache.get(b"a") is not None                # a is now the most recently used
    cache.put(b"c", {"t": c})
    assert list(cache.entries) == [b"a", b"c"] and cache.evictions == 1 and cache.nbytes == 64
    assert cache.get(b"b") is None
    assert cache.put(b"big", {"t": np.zeros(17, np.float32)}) is None   # larger than the budget
    assert list(cache.entries) == [b"a", b"c"]


def test_a_small_budget_keeps_the_cache_within_it(two_outputs):
    dag = cortex.load(two_outputs).dag
    largest = max(sum(dag["tensors"][n]["bytes"] for n in cu["outputs"]) for cu in dag["cus"])
    model = cortex.load(two_outputs, cache_bytes=largest)
    for _ in range(2):
        model.run(feeds())
        stats = model.last_trace["cache"]
        assert stats["bytes"] <= largest and stats["entries"] == 1
    # Each CU's entry pushed out the one before it, so the second run found none of the first.
    assert model.last_trace["activated_cus"] == dag["order"]
    assert stats["evictions"] == 2 * len(dag["cus"]) - 1 and stats["hits"] == 0


def test_a_zero_budget_turns_the_cache_off(two_outputs, hash_calls):
    model = cortex.load(two_outputs, cache_bytes=0)
    model.run(feeds())
    model.run(feeds())
    assert model.last_trace["activated_cus"] == model.dag["order"] and hash_calls == []


def test_cus_holding_random_ops_are_never_cached(tmp_path):
    dag_path = build(random_model(), tmp_path, fallback="onnxruntime", cache_inputs=("x",))
    model = cortex.load(dag_path)
    random_cu = next(cu for cu in model.dag["cus"] if cu.get("random"))
    assert random_cu["op_types"] == ["RandomUniformLike"]
    first = model.run(feeds())["y"]
    second = model.run(feeds())["y"]
    trace = model.last_trace
    matmul = next(cu["id"] for cu in model.dag["cus"] if cu["op_types"] == ["MatMul"])
    assert trace["skipped_cus"] == [{"cu": matmul, "reason": "cache hit"}]
    assert random_cu["id"] in trace["activated_cus"]
    assert not np.array_equal(first, second)          # fresh noise: the random CU really ran
    # Only the MatMul is stored: the Add reads fresh noise, so it is not repeating and never keyed.
    assert [cu["id"] for cu in model.dag["cus"] if cu.get("cache") == "repeating"] == [matmul]
    assert len(model.cache.entries) == 1


def test_the_registry_marks_random_cus_even_without_the_dag_json_mark(tmp_path):
    dag_path = build(random_model(), tmp_path, fallback="onnxruntime")
    model = cortex.load(dag_path)
    for cu in model.dag["cus"]:
        cu.pop("random", None)
    scheduler = SequentialScheduler(model.dag, dag_path, "wasm")
    assert [cu_id for cu_id, random in scheduler.uncached.items() if random] == \
        [cu["id"] for cu in model.dag["cus"] if cu["op_types"] == ["RandomUniformLike"]]


def test_entries_view_the_cus_slots_until_those_cus_run_again(two_outputs):
    """On one thread an entry is stored without a copy, as a view of its CU's output slots; before
    that CU runs again on other inputs the entry becomes a host copy, so a later hit still returns
    the first inputs' results."""
    model = cortex.load(two_outputs, threads=1)
    x = feeds()["x"]
    first = model.run({"x": x})
    cache = model.scheduler.cache
    keys = list(cache.entries)
    entries = list(cache.entries.values())
    assert entries and all(entry.keeps is not None for entry in entries)
    device = model.device
    for entry in entries:
        for array in entry.outputs.values():
            assert not array.flags.writeable
            assert any(np.shares_memory(array, view) for instance in device.instances.values()
                       for view in instance.outputs.values())
    model.run({"x": x + 1})                  # every CU runs again: their slots change
    assert all(cache.entries[key].keeps is None for key in keys)
    again = model.run({"x": x})
    assert model.last_trace["activated_cus"] == []
    for name in first:
        np.testing.assert_array_equal(again[name], first[name])
