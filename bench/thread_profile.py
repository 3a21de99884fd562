"""Where a threaded run's time goes, read from its per-CU trace (start, seconds, CPU seconds,
thread) and dag.json's edges, and what the dag itself allows. The occupancy figures are wall clock,
which other load on the machine inflates; the dag's figures come from CPU times and need no quiet
machine.

- `occupancy`: of a request's wall-clock span, how long 0, 1 and 2+ CUs were running. Time with
  none running is the walk itself (decisions, input gathering, hand-offs to the pool) or the OS
  running someone else.
- `dispatch_delays`: for each CU, from the moment it could start (its last predecessor ended) to
  its start: for a CU the pool ran, the walk's and the hand-off's price.
- `starved`: time a core had nothing to run while a CU could have started.
- `ideal_speedup`: from a one-thread run's CU CPU times, their sum over the makespan of a list
  schedule on `workers` cores that respects dag.json's edges. It is what the dag's shape allows
  with free hand-offs; a measured speedup far below it points at overhead, one near it at the dag.
  `critical_path` (infinite cores) bounds it from above.

    python -m bench.thread_profile [--models shufflenet,squeezenet,minilm-l6-s128] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

import cortex
from bench import cortex_side, model_bench


def predecessors(dag: dict) -> dict[str, set[str]]:
    preds: dict[str, set[str]] = {cu: set() for cu in dag["order"]}
    for edge in dag["edges"]:
        preds[edge["to"]].add(edge["from"])
    return preds


def list_schedule(dag: dict, cu_seconds: dict[str, float], workers: int) -> float:
    """Makespan of the CUs on `workers` cores: each starts, in dag.json's order, on the core free
    first once its predecessors are done (the threaded walk's own rule, with free hand-offs)."""
    preds = predecessors(dag)
    free, finish = [0.0] * workers, {}
    for cu in dag["order"]:
        core = min(range(workers), key=free.__getitem__)
        start = max([free[core], *(finish[p] for p in preds[cu])])
        finish[cu] = free[core] = start + cu_seconds.get(cu, 0.0)
    return max(finish.values(), default=0.0)


def critical_path(dag: dict, cu_seconds: dict[str, float]) -> float:
    """The longest chain of CU times through dag.json's edges (as many cores as CUs)."""
    preds = predecessors(dag)
    finish: dict[str, float] = {}
    for cu in dag["order"]:
        finish[cu] = max((finish[p] for p in preds[cu]), default=0.0) + cu_seconds.get(cu, 0.0)
    return max(finish.values(), default=0.0)


def ideal_speedup(dag: dict, cu_seconds: dict[str, float], workers: int = 2) -> float | None:
    """Sum of the CU times over their makespan on `workers` cores: 1.0 for a chain, `workers` at best."""
    makespan = list_schedule(dag, cu_seconds, workers)
    return sum(cu_seconds.get(cu, 0.0) for cu in dag["order"]) / makespan if makespan else None


def cu_cpu_seconds(entries: list[dict]) -> dict[str, float]:
    """Each CU's CPU time in a trace: what other load on the machine changes least."""
    return {e["cu"]: e["cpu_seconds"] for e in entries}


@dataclass
class Occupancy:
    span: float          # first CU start (or the request's start) to the last end
    none: float          # no CU running: the walk between CUs
    one: float
    many: float          # two or more at once

    def to_json(self) -> dict:
        return {"span_ms": self.span * 1e3, "none_ms": self.none * 1e3, "one_ms": self.one * 1e3,
                "many_ms": self.many * 1e3}


def occupancy(entries: list[dict], begin: float | None = None, end: float | None = None) -> Occupancy:
    """How many CUs ran at each moment between `begin` and `end` (default: the CUs' own span)."""
    events = sorted([(e["start"], 1) for e in entries] + [(e["start"] + e["seconds"], -1) for e in entries])
    if not events:
        return Occupancy(0.0, 0.0, 0.0, 0.0)
    begin = events[0][0] if begin is None else begin
    end = events[-1][0] if end is None else end
    spent = {0: 0.0, 1: 0.0, 2: 0.0}
    running, last = 0, begin
    for t, step in events:
        spent[min(running, 2)] += max(t - last, 0.0)
        running, last = running + step, max(t, last)
    spent[0] += max(end - last, 0.0)
    return Occupancy(end - begin, spent[0], spent[1], spent[2])


def starved(dag: dict, entries: list[dict], begin: float, workers: int = 2) -> float:
    """Seconds during which fewer than `workers` CUs ran while some CU that could start (its
    predecessors done) had not: hand-off latency and the walk's own time, not the dag's shape."""
    preds = predecessors(dag)
    end = {e["cu"]: e["start"] + e["seconds"] for e in entries}
    events = []
    for e in entries:
        ready = max([begin, *(end[p] for p in preds[e["cu"]] if p in end)])
        events += [(ready, 0, 1), (e["start"], -1, 1), (e["start"], 1, 0), (end[e["cu"]], -1, 0)]
    lost, running, waiting, last = 0.0, 0, 0, begin
    for t, step, is_wait in sorted(events):
        if waiting > 0 and running < workers:
            lost += max(t - last, 0.0)
        last = max(t, last)
        if is_wait:
            waiting += 1 if step == 0 else -1
        else:
            running += 1 if step == 1 else -1
    return lost


def dispatch_delays(dag: dict, entries: list[dict], begin: float) -> list[float]:
    """Per CU that ran: its start minus the moment its last predecessor (or the request) ended."""
    preds = predecessors(dag)
    end = {e["cu"]: e["start"] + e["seconds"] for e in entries}
    return [e["start"] - max([begin, *(end[p] for p in preds[e["cu"]] if p in end)]) for e in entries]


def thread_busy(entries: list[dict]) -> dict[int, float]:
    busy: dict[int, float] = {}
    for e in entries:
        busy[e.get("thread", 0)] = busy.get(e.get("thread", 0), 0.0) + e["seconds"]
    return busy


def copy_seconds_per_byte(nbytes: int = 1 << 20, calls: int = 20) -> float:
    """What a host copy into a CU's memory costs per byte here (numpy into a preallocated array)."""
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        dst[...] = src
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) / nbytes


@dataclass
class Profile:
    name: str
    cus: int
    wall: float
    entries: list[dict]
    begin: float
    dag: dict
    threads: int

    def summary(self, per_byte: float) -> dict:
        occ = occupancy(self.entries, self.begin, self.begin + self.wall)
        # A CU goes to the pool only when a thread is free: its delay is the walk's and the hand-off's.
        delays = dispatch_delays(self.dag, self.entries, self.begin)
        pooled = [d for d, e in zip(delays, self.entries) if e.get("thread", 0) != 0]
        moved = sum(e["bytes_in"] for e in self.entries)
        joins = sum(e["seconds"] for e in self.entries if set(e["op_types"]) == {"Concat"})
        busy = {t: s * 1e3 for t, s in sorted(thread_busy(self.entries).items())}
        return {"cus": self.cus, "wall_ms": self.wall * 1e3, "cu_ms": sum(e["seconds"] for e in self.entries) * 1e3,
                "cu_cpu_ms": sum(e["cpu_seconds"] for e in self.entries) * 1e3, **occ.to_json(),
                "busy_ms_by_thread": busy, "starved_ms": starved(self.dag, self.entries, self.begin, self.threads) * 1e3,
                "pooled_cus": len(pooled), "pool_hand_off_us_mean": statistics.mean(pooled) * 1e6 if pooled else 0,
                "bytes_in": moved, "copy_in_ms_estimate": moved * per_byte * 1e3, "concat_only_cu_ms": joins * 1e3}


def profile(name: str, model, feeds: dict, runs: int) -> Profile:
    """The run of median wall time among `runs` (after one warm-up)."""
    model.run(feeds)
    seen = []
    for _ in range(runs):
        begin = time.perf_counter()
        model.run(feeds)
        seen.append((time.perf_counter() - begin, begin, list(model.trace)))
    wall, begin, entries = sorted(seen, key=lambda s: s[0])[len(seen) // 2]
    return Profile(name, len(model.dag["cus"]), wall, entries, begin, model.dag, model.threads)


def profile_model(name: str, runs: int, decompose: tuple[str, ...], log=print) -> dict:
    case = model_bench.model_case(name)
    sess = ort.InferenceSession(str(case.path), providers=["CPUExecutionProvider"])
    reference = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, case.feeds)))
    per_byte = copy_seconds_per_byte()
    out = {}
    with tempfile.TemporaryDirectory(prefix=f"cortex-thread-profile-{name}-") as tmp:
        for build, flags in (("default", ()), ("sliced", decompose)):
            cortex_side.build(case.path, case.input_shapes, case.dims, case.feeds, reference,
                                      Path(tmp) / build, decompose=flags)
            dag_path = Path(tmp) / build / "dag.json"
            for threads in (1, 2):
                model = cortex.load(dag_path, policy="strict", threads=threads)
                p = profile(name, model, case.feeds, runs)
                s = out[f"{build}-{threads}t"] = p.summary(per_byte)
                if threads == 1:
                    s["ideal_2t"] = ideal_speedup(model.dag, cu_cpu_seconds(p.entries))
                    s["critical_path_ms"] = critical_path(model.dag, cu_cpu_seconds(p.entries)) * 1e3
    log(f"{name}:")
    for key, s in out.items():
        log(f"  {key}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in s.items()))
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="shufflenet,squeezenet," + model_bench.MINILM)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decompose", default="--parallel 2", help="decompose flags of the sliced build")
    args = parser.parse_args(argv)
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        profile_model(name, args.runs, tuple(args.decompose.split()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
