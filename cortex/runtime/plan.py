"""A request plan: for one dag, policy and set of requested outputs, what every request does,
computed once.

A request walks dag.json's order. Most CUs need no decision from the host: under the policy they
are neither branch CUs whose condition the request reads, nor CUs the cache may key, nor CUs a
variant replaces, nor fallback CUs on another device, and no memory budget loads them. A maximal
run of such CUs on one device that can chain them (`joins_segment`) is a **segment**: the device
runs it with one call (backends/wasm/segment.py), and the host acts only at its borders: it writes
the segment's inputs from outside, then records its outputs and the trace. Every other CU is a
**step** of its own, walked as before (`SequentialScheduler._walk_cu`).

What a segment's CUs put in the trace is known in advance but their times: each CU's entry is
ready-made, and the segment's time is shared out over them by their estimated flops (a
segment is one call, so no finer time exists); the entries say `"segment"` and its length.
`RuntimeOptions(segments=False)` (`--no-segments`) runs every CU as a step, timed on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    cus: tuple[dict, ...]
    where: str                              # the device that runs it
    runner: object                          # what the device's `segment` returned
    inputs: tuple[str, ...]                 # tensors from outside that its CUs read
    produced: tuple[tuple[str, str], ...]   # (tensor, the CU that makes it), for every output of its CUs
    entries: tuple[dict, ...]               # each CU's trace entry, without its times
    shares: tuple[float, ...]               # each CU's part of the segment's time
    bytes_out: int


@dataclass(frozen=True)
class RequestPlan:
    steps: tuple[dict | Segment, ...]       # a CU (its dag.json record) or a segment, in dag.json's order


def plan_steps(order: list[str], cus: dict[str, dict], placement: dict[str, str],
               joins: Callable[[dict], bool]) -> list[list[dict]]:
    """dag.json's order cut into runs: CUs that `joins` admits, consecutive and on one device,
    form one run (a segment when longer than one CU); every other CU is a run of its own."""
    runs: list[list[dict]] = []
    open_run = False
    for cu_id in order:
        cu = cus[cu_id]
        if not joins(cu):
            runs.append([cu])
            open_run = False
        elif open_run and placement[runs[-1][0]["id"]] == placement[cu_id]:
            runs[-1].append(cu)
        else:
            runs.append([cu])
            open_run = True
    return runs


def keyable_cus(order: list[str], cus: dict[str, dict], cacheable: Callable[[dict], bool],
                repeating: Callable[[dict], bool], select_of: dict[str, list[str]]) -> set[str]:
    """The CUs a request may key in the result cache, as far as dag.json says: the ones marked
    repeating, and those whose every input may have a key (chained from such a CU). A superset
    of what `_hit_possible` keys in any request, so a segment never holds a CU the cache would key."""
    keyed_tensors: set[str] = set()
    keyed: set[str] = set()
    for cu_id in order:
        cu = cus[cu_id]
        if not cacheable(cu):
            continue
        if repeating(cu) or (cu["inputs"] and all(name in keyed_tensors for name in cu["inputs"])):
            keyed.add(cu_id)
            keyed_tensors.update(cu["inputs"])
            keyed_tensors.update(cu["outputs"])
            for name in cu["outputs"]:
                keyed_tensors.update(select_of.get(name, ()))
    return keyed


def flop_shares(cus: list[dict]) -> tuple[float, ...]:
    """Each CU's part of a segment's time: its estimated flops, and an equal part where none are known."""
    flops = [float(cu.get("flops") or 0) for cu in cus]
    total = sum(flops)
    if total <= 0:
        return tuple(1 / len(cus) for _ in cus)
    return tuple(f / total for f in flops)


def selects_reading(dag: dict) -> dict[str, list[str]]:
    """Case tensor -> the selected outputs that may take its value (and so its cache key)."""
    found: dict[str, list[str]] = {}
    for s in dag.get("selects", []):
        for case in s["cases"]:
            found.setdefault(case["tensor"], []).append(s["tensor"])
    return found


def make_segment(cus: list[dict], where: str, device, placement: dict[str, str], producer: dict[str, str | None],
                 tensor_bytes: dict[str, int], traffic: dict[str, tuple[int, int]]) -> Segment:
    """The segment of `cus` on `device` (named `where`): its runner, its inputs from outside and
    each CU's trace entry but its times."""
    inside = {name for cu in cus for name in cu["outputs"]}
    inputs = tuple(dict.fromkeys(name for cu in cus for name in cu["inputs"] if name not in inside))
    entries = []
    for cu in cus:
        cu_id = cu["id"]
        bytes_in, bytes_out = traffic[cu_id]
        producers = [producer.get(name) for name in cu["inputs"]]
        entries.append({
            "cu": cu_id, "device": where, "op_types": cu.get("op_types", []), "segment": len(cus),
            "bytes_in": bytes_in, "bytes_out": bytes_out,
            "bytes_from_other_devices": sum(tensor_bytes[name] for name, p in zip(cu["inputs"], producers)
                                            if p is not None and placement[p] != where),
            "resident_bytes": device.resident_bytes(cu_id)})
    runner = device.segment(cus)
    for entry, copied in zip(entries, runner.copied_bytes()):
        entry["bytes_copied_between_cus"] = copied
    return Segment(tuple(cus), where, runner, inputs, tuple((name, cu["id"]) for cu in cus for name in cu["outputs"]),
                   tuple(entries), flop_shares(cus), sum(traffic[cu["id"]][1] for cu in cus))
