"""The scheduler decides which CUs run, in what order and where; a Device only runs what it is
handed. It walks dag.json's topological order one CU at a time.

Where: each CU on the device its record asks for (`runs_on`: a fallback CU's runtime, from
`cortex decompose --fallback`), the others on the model's device, or where that device's
placement rule puts them (`DeviceSpec.place`: `--device hybrid` by each CU's flops). Each device comes from the
registry by name and is opened on the CUs it runs. Tensors cross between devices only at those
borders, through the producer's `to_host` and the reader's `to_device`, once per tensor and device
in a request; model inputs go to each device that reads them.

Whether: one method, `_skip_reason`, decides per request whether a CU runs, under the request's
policy (`cortex/runtime/policy.py`): a branch CU of a decomposed If whose condition picks the
other branch is an `inactive branch` (`cortex/runtime/activation.py`; the If's outputs are
selects, resolved once the picked case's CU has run); a CU no requested output depends on is `not needed`; a CU
whose inputs are byte-identical to an earlier run's is a `cache hit` (`cortex/runtime/cache.py`).
Hashing a CU's inputs and storing its outputs costs more than a light CU's run, so only the CUs
where a hit is possible are keyed: those dag.json marks as repeating (`decompose --cache-inputs`:
CUs with `cache: "repeating"`), and those whose every input already has a key in the request
(chained from a hit or a stored entry). Every other CU skips the hash, the lookup and the stored
copy, and may run inside a segment. A dag.json that marks nothing caches nothing: a request whose
inputs never repeat pays nothing for the cache.
`strict` skips nothing and caches nothing: every CU runs, both branches' included (the selects
still pick by the condition).
CUs holding random ops are never cached, nor CUs on a device whose tensors are not host arrays
(a GPU: storing its outputs would copy each one back).

Resident: with a memory budget (`memory_budget`, bytes) only some CUs are loaded at a time
(`cortex/runtime/memory.py` decides which, `cortex/runtime/residency.py` loads, prefetches and
evicts); without one every CU is loaded before the first request. Either way a CU runs the same.
Threads (`cortex/runtime/parallel.py`, the ready CUs at once, deciding with this class's own
steps) and Ray (`cortex/runtime/ray_executor.py`, this class on each actor's stage of CUs) change
which CU runs when and where, never how a CU runs. Under a memory budget the walk stays sequential:
the residency plans loads and evictions in dag.json's order.
"""

from __future__ import annotations

import time
from functools import cached_property
from pathlib import Path

import numpy as np

from backends.limits import SandboxLimits, no_sandbox_events
from backends.registry import Device, HostTensors
from backends.registry import device as device_spec
from cortex.runtime.activation import INACTIVE, Branches
from cortex.runtime.cache import ResultCache, cu_identity, cu_key, holds_random_ops
from cortex.runtime.memory import ResidentSet, choose_pins
from cortex.runtime.plan import RequestPlan, Segment, keyable_cus, make_segment, plan_steps, selects_reading
from cortex.runtime.policy import Policy
from cortex.runtime.request import Execution, Request
from cortex.runtime.residency import END, Residency
from cortex.runtime.variants import VariantRunner

HOST = None   # where a model input, or a cached output, lives before any device reads it

NOT_NEEDED = "not needed"
CACHE_HIT = "cache hit"
REPEATING = "repeating"      # a CU's `cache` mark in dag.json (passes/partition.py's REPEATING_MARK)


class SequentialScheduler:
    def __init__(self, dag: dict, dag_path: Path, device: str, cache: ResultCache | None = None,
                 limits: SandboxLimits | None = None, memory_budget: int | None = None,
                 pins: list[str] | None = None, segments: bool = False):
        self.dag = dag
        self.cus = {cu["id"]: cu for cu in dag["cus"]}
        self.tensor_bytes = {name: t["bytes"] for name, t in dag["tensors"].items()}
        self.producer = {name: t["producer"] for name, t in dag["tensors"].items()}
        # What a trace entry says of each CU that no run changes, computed once, not per request.
        self.traffic = {cu_id: (sum(self.tensor_bytes[n] for n in cu["inputs"]),
                                sum(self.tensor_bytes[n] for n in cu["outputs"])) for cu_id, cu in self.cus.items()}
        place = device_spec(device).place(dag) if device_spec(device).place else lambda cu: device
        self.placement = {cu_id: self.cus[cu_id].get("runs_on") or place(self.cus[cu_id]) for cu_id in dag["order"]}
        self.devices: dict[str, Device] = {}
        for name in dict.fromkeys([device, *self.placement.values()]):
            ids = [cu_id for cu_id in dag["order"] if self.placement[cu_id] == name]
            if ids or name == device and not self.placement:
                part = {**dag, "cus": [self.cus[i] for i in ids], "order": ids}
                spec = device_spec(name)
                self.devices[name] = (spec.open(part, Path(dag_path), limits or SandboxLimits()) if spec.sandboxed
                                      else spec.open(part, Path(dag_path)))
        self.cache = cache if cache is not None else ResultCache(0)
        # Cached outputs are host copies: on a device whose tensors live elsewhere (a GPU) storing
        # them would copy every output back, so CUs there are never cached.
        self.uncached = {cu_id: holds_random_ops(cu) or not isinstance(self.devices[self.placement[cu_id]], HostTensors)
                         for cu_id, cu in self.cus.items()}
        self.identity = {cu_id: cu_identity(cu, self.placement[cu_id]) for cu_id, cu in self.cus.items()}
        self.variants = VariantRunner(self.cus, self.placement, self.devices,
                                      {name: device_spec(name).artifact for name in self.devices})
        self.branches = Branches(dag)
        self.residency = None if memory_budget is None else self._residency(memory_budget, pins)
        # Segments need a device's CUs in one store (a wasm call crosses instances only there);
        # under a memory budget every CU is a step: the residency decides before each one runs.
        self.segmented = segments and self.residency is None
        if self.segmented:
            for device in self.devices.values():
                if hasattr(device, "join_one_store"):
                    device.join_one_store()
        self.position = {cu_id: i for i, cu_id in enumerate(dag["order"])}
        self._resident_bytes: int | None = None
        self.borrowed: dict[str, list[bytes]] = {}    # CU -> keys of cache entries that view its output slots
        self._plans: dict[tuple[Policy, frozenset[str] | None], RequestPlan] = {}

    def _residency(self, budget: int, pins: list[str] | None) -> Residency:
        footprints = {cu_id: self.devices[self.placement[cu_id]].footprint(self.cus[cu_id]) for cu_id in self.dag["order"]}
        resident_set = ResidentSet(budget, footprints, choose_pins(self.cus, footprints, budget, pins))
        # Where each tensor is read last, so an evicted CU's outputs are copied out only if still read.
        last_use: dict[str, float] = {}
        for position, cu_id in enumerate(self.dag["order"]):
            cu = self.cus[cu_id]
            for name in [*cu["inputs"], *([cu["activation"]["tensor"]] if "activation" in cu else [])]:
                last_use[name] = position
        for s in self.dag.get("selects", []):
            last_use.update((name, END) for name in [s["tensor"], s["condition"], *(c["tensor"] for c in s["cases"])])
        last_use.update((spec["name"], END) for spec in self.dag["outputs"])
        return Residency(resident_set, self.devices, self.placement, self.cus, self.dag["order"], last_use)

    def load(self, policy: Policy | None = None) -> None:
        """Every CU resident on its device (under a budget: the pinned ones), and the variants
        `policy` picks, before the first request."""
        self._resident_bytes = None
        if self.residency is not None:
            self.residency.load_pins()
        else:
            for name, device in self.devices.items():
                device.load([self.cus[cu_id] for cu_id in self.dag["order"] if self.placement[cu_id] == name])
        if policy is not None:
            self.variants.load(policy)
            if self.segmented:
                # The plan for every output, made now: its segments' drivers are compiled at load,
                # before a server forks its workers (a forked child compiles none: backends/wasm/segment.py).
                self.plan_for(policy, [spec["name"] for spec in self.dag["outputs"]])

    def needed(self, outputs: list[str]) -> frozenset[str]:
        """The CUs the tensors `outputs` depend on: dag.json's data flow walked backwards, through
        the cases and condition of a selected output and the condition a conditional CU reads.
        Walked once per set of outputs: a request should not pay for the whole graph's walk."""
        key = tuple(outputs)
        found = self._needed_by_outputs.get(key)
        if found is None:
            found = self._needed_by_outputs[key] = frozenset(needed_cus(self.dag, self.producer, self.cus, outputs))
        return found

    @cached_property
    def _needed_by_outputs(self) -> dict[tuple[str, ...], frozenset[str]]:
        return {}

    def sandbox_events(self) -> dict[str, int]:
        """What the sandboxed devices stopped over the model's life, summed (the trace's `sandbox_stats`)."""
        totals = no_sandbox_events()
        for name, device in self.devices.items():
            if device_spec(name).sandboxed:
                for counter, n in device.sandbox_events().items():
                    totals[counter] += n
        return totals

    def resident_bytes(self) -> int:
        """What the loaded CUs hold. Without a budget only `load` changes it (a rebuilt store's CUs
        have their planned sizes again), so it is summed once per load, not per request."""
        if self.residency is None and self._resident_bytes is not None:
            return self._resident_bytes
        total = sum(self.devices[self.placement[cu_id]].resident_bytes(cu_id) for cu_id in self.dag["order"])
        if self.residency is None:
            self._resident_bytes = total
        return total

    def run_many(self, batch: list[dict[str, np.ndarray]], policy: Policy,
                 outputs: list[str]) -> list[tuple[dict[str, np.ndarray], Request]]:
        """`run` on each feed of `batch`, one request after the other."""
        return [self.run(feeds, policy, outputs) for feeds in batch]

    def close(self) -> bool:
        """Stop the devices' kernel threads (`--wasm-features threads`); they start again with the
        next call of their CU. The scheduler stays usable (`schedulers.Scheduler`)."""
        for device in self.devices.values():
            if hasattr(device, "close_kernel_threads"):
                device.close_kernel_threads()
        return False

    def use_kernel_threads(self, count: int) -> None:
        """Each split contraction (backends/wasm/kernel_parts.py) runs on `count` threads; before `load`."""
        self.kernel_threads = count
        for device in self.devices.values():
            if hasattr(device, "use_kernel_threads"):
                device.use_kernel_threads(count)

    def threads_trace(self) -> dict:
        """How requests use threads: the walk, and the split contractions' threads (the trace's `threads`)."""
        return {"walk": "sequential", "cu_threads": 1, "kernel_threads": getattr(self, "kernel_threads", 1),
                "split_cus": [cu_id for cu_id, cu in self.cus.items()
                              if "threads" in cu.get("artifacts", {}).get("wasm", {}).get("memory", {})]}

    def run(self, feeds: dict[str, np.ndarray], policy: Policy,
            outputs: list[str]) -> tuple[dict[str, np.ndarray], Request]:
        """The requested outputs (host arrays the caller owns) and what the request did."""
        request = self._new_request(feeds, policy, outputs)
        residency = self.residency
        if residency is not None:
            request.memory = residency.stats()
        try:
            self._walk(request, residency)
        except Exception:
            # A failed CU may have had its store rebuilt: entries that view the old one become
            # copies, so that it is freed.
            self._give_back(list(self.borrowed))
            raise
        finally:
            if residency is not None:
                residency.finish(request)     # no load left in flight, even when a CU failed
        return self._results(outputs, request), request

    def _walk(self, request: Request, residency: Residency | None) -> None:
        """Every CU in dag.json's order: skipped with its reason, or made resident and run; the
        runs of CUs that need no decision as segments, each in one call (cortex/runtime/plan.py)."""
        if residency is not None:
            residency.plan(-1, request, lambda cu: self._known_to_run(cu, request))
            for cu_id in self.dag["order"]:
                self._walk_cu(self.cus[cu_id], request, residency)
            return
        for step in self._plan(request).steps:
            if type(step) is Segment:
                self._run_segment(step, request)
            else:
                self._walk_cu(step, request, None)

    def _walk_cu(self, cu: dict, request: Request, residency: Residency | None) -> None:
        cu_id = cu["id"]
        request.key, request.hit, request.position = None, None, self.position[cu_id]
        reason = self._skip_reason(cu, request)
        if reason is None:
            if residency is not None:
                residency.acquire(cu_id, request)
                residency.plan(request.position, request, lambda cu: self._known_to_run(cu, request))
            self._run_cu(cu, request)
        self._settle(cu_id, reason, request)

    def plan_for(self, policy: Policy, outputs: list[str]) -> RequestPlan:
        """The plan a request for `outputs` under `policy` follows (a benchmark times its segments alone)."""
        return self._plan(self._new_request({}, policy, outputs))

    def _plan(self, request: Request) -> RequestPlan:
        """The request's plan: made once for each policy and set of needed CUs."""
        key = (request.policy, request.needed)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(request.policy, request.needed)
        return plan

    def _make_plan(self, policy: Policy, needed: frozenset[str] | None) -> RequestPlan:
        order = self.dag["order"]
        keyable = keyable_cus(order, self.cus, lambda cu: not self.uncached[cu["id"]],
                              lambda cu: cu.get("cache") == REPEATING,
                              selects_reading(self.dag)) \
            if policy.cache and self.cache.enabled else set()

        def joins(cu: dict) -> bool:
            """Whether `cu` needs no decision from the host under `policy`."""
            cu_id = cu["id"]
            device = self.devices[self.placement[cu_id]]
            return (self.segmented and getattr(device, "joins_segment", None) is not None and device.joins_segment(cu)
                    and (needed is None or cu_id in needed)
                    and not ("activation" in cu and policy.skip_inactive)
                    and cu_id not in self.branches.cases_of and cu_id not in keyable
                    and not (cu.get("variants") and self.variants.choice(cu_id, policy) is not None))

        steps = []
        for run in plan_steps(order, self.cus, self.placement, joins):
            steps.append(self._segment(run) if len(run) > 1 else run[0])
        return RequestPlan(tuple(steps))

    def _segment(self, cus: list[dict]) -> Segment:
        where = self.placement[cus[0]["id"]]
        return make_segment(cus, where, self.devices[where], self.placement, self.producer, self.tensor_bytes,
                            self.traffic)

    def _run_segment(self, segment: Segment, request: Request) -> None:
        """One call for the segment's CUs; their outputs join the request, their entries the trace."""
        where, env = segment.where, request.env
        if self.borrowed:
            self._give_back([cu["id"] for cu in segment.cus])
        inputs = {name: self._on_device(name, where, request)[0] for name in segment.inputs}
        cpu_start = time.thread_time()
        start = time.perf_counter()
        outputs = segment.runner.run(inputs)
        seconds = time.perf_counter() - start
        cpu_seconds = time.thread_time() - cpu_start
        request.cpu_seconds += cpu_seconds
        made_by = request.made_by
        for name, cu_id in segment.produced:
            env[name] = (where, outputs[name])
            made_by[name] = cu_id
        request.live_bytes += segment.bytes_out
        request.segments.append((len(request.ran), segment, start, seconds, cpu_seconds))

    def _new_request(self, feeds: dict[str, np.ndarray], policy: Policy, outputs: list[str]) -> Request:
        return Request(policy, self.needed(outputs) if policy.skip_inactive else None,
                       {name: (HOST, value) for name, value in feeds.items()},
                       live_bytes=sum(int(np.asarray(v).nbytes) for v in feeds.values()))

    def _settle(self, cu_id: str, reason: str | None, request: Request) -> None:
        """What follows a CU's turn, whether it ran (`reason` None) or was skipped: a skip is
        recorded, a cache hit's outputs join the request, and selects its case decides resolve."""
        if reason is not None:
            request.skipped.append({"cu": cu_id, "reason": reason})
        if reason == CACHE_HIT:
            request.env.update((name, (HOST, array)) for name, array in request.hit.outputs.items())
            request.keys.update(request.hit.output_keys)
            request.live_bytes += request.hit.nbytes
        if reason in (None, CACHE_HIT) and cu_id in self.branches.cases_of:   # a skipped CU's cases do not exist
            for out, case in self.branches.selected(cu_id, lambda name: self._condition(name, request)):
                request.env[out] = request.env[case]
                if case in request.made_by:
                    request.made_by[out] = request.made_by[case]
                if case in request.keys:
                    request.keys[out] = request.keys[case]

    def _results(self, outputs: list[str], request: Request) -> dict[str, np.ndarray]:
        results = {}
        for name in outputs:
            home, tensor = request.env[name]
            results[name] = np.array(tensor) if home is HOST else self.devices[home].to_host(tensor)
        return results

    def _skip_reason(self, cu: dict, request: Request) -> str | None:
        """Why `cu` does not run in this request, or None when it runs. The one place that decides
        it; on a cache hit it leaves the entry in `request.hit`, and for a cacheable CU its key in
        `request.key` (stored after it runs)."""
        # A CU no requested output needs is skipped before its condition is read: that condition's
        # producer may not have run either.
        if request.needed is not None and cu["id"] not in request.needed:
            return NOT_NEEDED
        # Then: a CU of an untaken branch needs neither its inputs hashed nor a cache lookup.
        if request.policy.skip_inactive and self.branches.skip_reason(
                cu, lambda name: self._condition(name, request)) is not None:
            return INACTIVE
        # The key names the exact CU's code: a CU this policy runs as a variant is never looked up.
        if request.policy.cache and self.cache.enabled and not self.uncached[cu["id"]] \
                and self._hit_possible(cu, request) \
                and (not cu.get("variants") or self.variants.choice(cu["id"], request.policy) is None):
            request.key = cu_key(self.identity[cu["id"]], [self._tensor_key(name, request) for name in cu["inputs"]])
            request.hit = self.cache.get(request.key)
            if request.hit is not None:
                return CACHE_HIT
        return None

    def _hit_possible(self, cu: dict, request: Request) -> bool:
        """Whether `cu` may be a cache hit in this request, so that keying it can pay: see the
        module's docstring. A CU whose inputs change with every request never hits, and hashing
        them and copying its outputs into the cache would cost more than running it."""
        return cu.get("cache") == REPEATING or all(name in request.keys for name in cu["inputs"])

    def _known_to_run(self, cu: dict, request: Request) -> bool:
        """Whether `cu`, later in this request, will run as far as is known now: a CU no requested
        output needs will not, nor a branch CU whose condition picked the other branch; a branch
        CU whose condition is not computed yet is not known to (a cache hit cannot be foreseen)."""
        if request.needed is not None and cu["id"] not in request.needed:
            return False
        activation = cu.get("activation")
        if activation is None or not request.policy.skip_inactive:
            return True
        if activation["tensor"] not in request.env:
            return False
        return self.branches.skip_reason(cu, lambda name: self._condition(name, request)) is None

    def _condition(self, name: str, request: Request) -> np.ndarray:
        """A branch condition's value on the host, read once per request."""
        if name not in request.conditions:
            home, tensor = request.env[name]
            request.conditions[name] = np.array(tensor) if home is HOST else self.devices[home].to_host(tensor)
        return request.conditions[name]

    def _tensor_key(self, name: str, request: Request) -> bytes:
        """The content key of a tensor: known when it came from a cache hit or was hashed earlier
        in this request (chaining), hashed from its bytes otherwise."""
        key = request.keys.get(name)
        if key is None:
            home, tensor = request.env[name]
            host = tensor if isinstance(tensor, np.ndarray) else self.devices[home].to_host(tensor)
            key = request.keys[name] = self.cache.tensor_key(host)
        return key

    def _lender(self, device: Device, cu_id: str, run: Execution) -> object | None:
        """What keeps the CU's output slots alive when the cache may store views of them (None:
        store host copies). Only a sequential walk without a budget lends them: it runs one CU at a
        time, unloads none, and gives the views back (`_give_back`) before the CU runs again."""
        lend = getattr(device, "output_owner", None)
        if not self.segmented or lend is None or run.variant:
            return None
        return lend(cu_id)

    def _give_back(self, cu_ids) -> None:
        """The cache's views of these CUs' output slots become host copies: the CUs are about to run."""
        for cu_id in cu_ids:
            for key in self.borrowed.pop(cu_id, ()):
                self.cache.materialize(key)

    def _run_cu(self, cu: dict, request: Request) -> None:
        if self.borrowed:
            self._give_back((cu["id"],))
        inputs, crossed = self._gather_inputs(cu, request)
        self._record(cu, request, self._execute(cu, inputs, request.policy), crossed, request.key)

    def _gather_inputs(self, cu: dict, request: Request) -> tuple[dict, int]:
        """The CU's inputs on its device, and the bytes that came from another device."""
        where = self.placement[cu["id"]]
        crossed = 0
        inputs = {}
        for name in cu["inputs"]:
            inputs[name], moved = self._on_device(name, where, request)
            crossed += moved
        return inputs, crossed

    def _on_device(self, name: str, where: str, request: Request) -> tuple[object, int]:
        """Tensor `name` on device `where`, copied there once per request where it lives elsewhere,
        and the bytes this call brought from another device."""
        home, tensor = request.env[name]
        if home == where:
            return tensor, 0
        crossed = 0
        if (name, where) not in request.copies:
            host = tensor if home is HOST else self.devices[home].to_host(tensor)
            request.copies[name, where] = self.devices[where].to_device(host)
            request.live_bytes += self.tensor_bytes[name]
            crossed = self.tensor_bytes[name] if home is not HOST else 0
        return request.copies[name, where], crossed

    def _execute(self, cu: dict, inputs: dict, policy: Policy) -> Execution:
        """One timed run of the CU on its device: it touches nothing of the request, so another
        thread may do it."""
        cpu_start = time.thread_time()
        start = time.perf_counter()
        results, variant = self.variants.run(cu, inputs, policy)   # the exact CU or a guarded variant
        seconds = time.perf_counter() - start
        return Execution(results, variant, start, seconds, time.thread_time() - cpu_start)

    def _record(self, cu: dict, request: Request, run: Execution, crossed: int, key: bytes | None) -> None:
        """The run's outputs join the request, the cache stores them under `key`, the trace gets its entry."""
        cu_id = cu["id"]
        where = self.placement[cu_id]
        device = self.devices[where]
        request.cpu_seconds += run.cpu_seconds
        env, made_by = request.env, request.made_by
        for name, tensor in run.results.items():
            env[name] = (where, tensor)
            made_by[name] = cu_id
        bytes_in, bytes_out = self.traffic[cu_id]
        request.live_bytes += bytes_out
        if key is not None and self.cache.fits(bytes_out):
            keeps = self._lender(device, cu_id, run)
            entry = self.cache.put(key, run.results if keeps is not None else
                                   {name: device.to_host(t) for name, t in run.results.items()}, keeps)
            if entry is not None:
                request.keys.update(entry.output_keys)
                if keeps is not None:
                    self.borrowed.setdefault(cu_id, []).append(key)
        entry = {"cu": cu_id, "device": where, "op_types": cu.get("op_types", []),
                 "start": run.start, "seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
                 "bytes_in": bytes_in, "bytes_out": bytes_out, "bytes_from_other_devices": crossed,
                 "resident_bytes": device.resident_bytes(cu_id)}
        if run.variant:
            entry.update(run.variant)
        if run.where:
            entry.update(run.where)
        request.ran.append(entry)
        copied = _copied_between_cus(cu, request, where, device, self.tensor_bytes)
        if copied is not None:
            entry["bytes_copied_between_cus"] = copied
        if self.residency is not None:
            entry["resident_total_bytes"] = self.residency.after_run(cu_id, request, request.position)


def _copied_between_cus(cu: dict, request: Request, where: str, device: Device, sizes: dict[str, int]) -> int | None:
    """Bytes of the CU's inputs that other CUs on its device produced and the device copied into
    the CU's memory; the device says which it read in place (a shared memory). None: a device
    that does not say."""
    reads_in_place = getattr(device, "reads_in_place", None)
    if reads_in_place is None:
        return None
    copied = 0
    for name in cu["inputs"]:
        home, tensor = request.env[name]
        if home == where and not reads_in_place(cu, name, tensor):
            copied += sizes[name]
    return copied


def needed_cus(dag: dict, producer: dict[str, str | None], cus: dict[str, dict], outputs: list[str]) -> set[str]:
    """`SequentialScheduler.needed`, for the Ray executor too (its stages must agree with it)."""
    selects = {s["tensor"]: s for s in dag.get("selects", [])}
    needed: set[str] = set()
    stack, seen = list(outputs), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in selects:
            stack += [selects[name]["condition"], *(case["tensor"] for case in selects[name]["cases"])]
        made_by = producer.get(name)
        if made_by is not None and made_by not in needed:
            needed.add(made_by)
            cu = cus[made_by]
            stack += cu["inputs"]
            if "activation" in cu:
                stack.append(cu["activation"]["tensor"])
    return needed
