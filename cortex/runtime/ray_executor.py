"""The Ray executor: a compiled model's CUs on Ray actors, requests pipelined through them
(`cortex.load(dag, executor="ray", address=...)`, `cortex run --executor ray`).

Placement. dag.json's topological `order` is cut into contiguous stages whose flops (dag.json's
per-CU costs) are as even as the cut allows: the slowest stage bounds a pipeline's throughput. One
stage is one actor, asking Ray for `num_cpus` and, as its `memory` resource, the bytes its CUs'
memory plans hold (`artifacts.<artifact>.memory.memory_bytes`), so Ray places it only where that
fits; actors are spread over the nodes. A pipeline of stages can run in several copies
(`replicas`), requests taking turns between them. By default (`ray_plan.pipeline_shape`) each
free CPU runs one replica of the whole model when one node's memory holds it: no tensor crosses
nodes within a request, no stage waits on a slower one, and each node adds a pipeline's
throughput; a model no node holds is cut into as many stages as there are free CPUs (at most one
per CU). The executor only places CUs: inside each actor the normal
scheduler runs its stage's CUs on the normal device, so skipping (conditional CUs included:
`cortex/runtime/ray_plan.py`), the result cache and variants behave as in a local run (each actor
keeps its own cache).

Data. A request's inputs travel with the call of the one stage that reads them (inlined when
small), or are put in the object store once when several do; each stage receives the refs of what it
reads (the inputs, the dicts of earlier stages) and returns one dict of the tensors later stages or
the caller need. Ray hands numpy arrays to an actor on the same node as zero-copy read-only views
of the object store; the device copies them into the CU's memory anyway.

Pipelining. A request is one actor call per stage, submitted at once with refs between them; the
actors run calls in submission order, so stage 1 works on request n+1 while stage 2 works on
request n. `run_many` keeps up to `window` requests in flight, in groups of `group` consecutive
requests that travel together (one call per stage for the group, so that Ray's cost per call,
about a millisecond of the driver's and the actor's CPU, is paid once per group; the groups take
turns between the replicas). With `compiled_graph` the requests go through one Ray Compiled Graph
instead, a chain through the stages of one pipeline whose first stage is on this process's node
(`cortex/runtime/ray_compiled.py`). The actors' side is `cortex/runtime/ray_stage.py`.

Failures. Actors restart after their node dies (`max_restarts`), reloading their CUs. A request
whose actor or object was lost is resubmitted as a whole, to the next replica if there are
several, up to `retries` times: the outputs
returned always come from one attempt in which every stage finished, never from a mix, and a
request that cannot finish raises a CortexError. An error a CU raises (a trap) is raised as it is.

The folder. No node needs the dag folder: the driver reads the files each stage's CUs load and
ships them through the object store; each node keeps them in a cache keyed by sha256 and loads
from there (`cortex/runtime/ray_artifacts.py`), and an actor makes its copy again before a call if
the cache was cleaned. Every node needs this Python environment (cortex
installed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from backends.limits import no_sandbox_events
from backends.registry import device as device_spec
from cortex.runtime.options import RuntimeOptions
from cortex.runtime.policy import Policy
from cortex.runtime.ray_artifacts import bundle_key, read_files, stage_files
from cortex.runtime.ray_cluster import (
    connect,
    first_line,
    free_cpus,
    lost_errors,
    node_memory,
    ray_module,
)
from cortex.runtime.ray_compiled import CompiledRequests, decode
from cortex.runtime.ray_plan import Chain, Planner, StageCall, pipeline_shape, stage_cuts
from cortex.runtime.ray_stage import CUStage, Shipment
from cortex.runtime.request import Request
from cortex.runtime.scheduler import NOT_NEEDED, needed_cus
from ir.errors import CortexError

RETRY_BACKOFF_S = 0.5       # before the first resubmission; doubled each time, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 8.0
DEFAULT_WINDOW = 16
MAX_PLANS = 256             # plans kept, one per (policy, requested outputs) asked for


@dataclass
class Stage:
    cu_ids: list[str]
    cost: float
    memory_bytes: int
    replica: int = 0             # which copy of the pipeline it belongs to
    actor: object = None


class RayExecutor:
    """The scheduler's interface (`schedulers.Scheduler`) over Ray actors."""

    def __init__(self, dag: dict, dag_path: Path, device: str, options: RuntimeOptions):
        ray_options = options.ray          # checked where the options were made (RayOptions)
        stages, replicas, num_cpus = ray_options.stages, ray_options.replicas, ray_options.num_cpus
        compiled_graph, cache_dir = ray_options.compiled_graph, ray_options.cache_dir
        self.compiled_graph, self.num_cpus = compiled_graph, num_cpus
        self._graph: CompiledRequests | None = None
        self._plans: dict[tuple, tuple[list[StageCall], int, Chain]] = {}    # (policy, outputs) -> plan, its chain
        self._chain_ids = 0
        self.dag, self.path, self.device_name = dag, Path(dag_path).resolve(), device
        self.retries, self.timeout_s, self.group = ray_options.retries, ray_options.timeout_s, ray_options.group
        self.resubmitted = 0             # requests submitted again after a lost actor or result
        self.devices: dict = {}          # no device in this process: the actors hold them
        self.cache = None                # nor a result cache: each actor keeps its own
        self.cus = {cu["id"]: cu for cu in dag["cus"]}
        self.producer = {name: t["producer"] for name, t in dag["tensors"].items()}
        connect(options.address)
        ray = ray_module()
        # A Compiled Graph's timeouts, and the errors after which it is torn down (both channel errors).
        self._graph_errors = ((ray.exceptions.RayChannelTimeoutError,),
                              (*lost_errors(ray), ray.exceptions.RayChannelError))
        # An actor that cannot be placed waits, silently, for ever: refuse it now instead.
        free = free_cpus(ray, min(stages or 1, len(dag["order"])) * (replicas or 1) * num_cpus)
        stages, replicas = pipeline_shape(stages, replicas, free, num_cpus, len(dag["order"]),
                                          sum(self._memory(cu_id) for cu_id in dag["order"]),
                                          node_memory(ray), compiled_graph)
        self.pipelines = [self._place(stages, replica) for replica in range(replicas)]
        self.stages = [stage for pipeline in self.pipelines for stage in pipeline]
        self.planner = Planner(dag, [stage.cu_ids for stage in self.pipelines[0]])
        shipments = self._ship(str(dag_path), None if cache_dir is None else str(cache_dir))
        actor_class = ray.remote(CUStage)
        for k, (stage, shipment) in enumerate(zip(self.stages, shipments, strict=True)):
            stage.actor = actor_class.options(
                num_cpus=num_cpus, memory=stage.memory_bytes or None, max_restarts=ray_options.max_restarts,
                max_task_retries=0, scheduling_strategy=self._strategy(k)).remote(
                    dag, shipment, device, stage.cu_ids, options.cache_bytes)
        try:
            self._resident = sum(self._get([s.actor.resident_bytes.remote() for s in self.stages]))
        except CortexError:
            self.close()            # a stage could not load its CUs: the same error a local load gives
            raise

    def _strategy(self, k: int):
        """Where stage k's actor goes: spread over the nodes, but a Compiled Graph's first stage on
        this process's node where it fits, so that the requests enter through shared memory (a
        graph of one stage then never crosses a node: 0.2 ms a request here against 1.4 ms
        through the raylets of two nodes on one machine)."""
        if not (self.compiled_graph and k == 0):
            return "SPREAD"
        ray = ray_module()
        return ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True)

    def _memory(self, cu_id: str) -> int:
        """The bytes a CU's memory plan holds on its device."""
        artifact = device_spec(self.device_name).artifact
        return int(self.cus[cu_id].get("artifacts", {}).get(artifact, {}).get("memory", {}).get("memory_bytes", 0))

    def _place(self, count: int, replica: int) -> list[Stage]:
        order = self.dag["order"]
        costs = [float(self.cus[i].get("flops", 0)) + 1.0 for i in order]   # +1: a CU of no flops still costs a call
        memory = [self._memory(i) for i in order]
        bounds = [0, *stage_cuts(costs, count), len(order)]
        return [Stage(order[a:b], sum(costs[a:b]), sum(memory[a:b]), replica) for a, b in pairwise(bounds)]

    def _ship(self, dag_path: str, cache_dir: str | None) -> list[Shipment]:
        """Every stage's files read now and put in the object store, each content once; the refs
        live as long as the model, so a restarted actor fetches them again."""
        ray = ray_module()
        per_stage = [stage_files(self.dag, self.device_name, stage.cu_ids) for stage in self.stages]
        files, contents = read_files(self.path.parent, [path for paths in per_stage for path in paths])
        self._contents = {sha256: [ray.put(data)] for sha256, data in contents.items()}
        by_path = {f.path: f for f in files}
        key = bundle_key(self.dag, files)
        shipments = []
        for paths in per_stage:
            mine = [by_path[path] for path in paths]
            shipments.append(Shipment(dag_path, str(self.path.parent), mine,
                                      {f.sha256: self._contents[f.sha256] for f in mine if f.sha256}, key, cache_dir))
        return shipments

    def placement(self) -> list[dict]:
        """Each stage's replica, CUs, flops, memory, the node its actor runs on now and the dag.json
        it loaded there (its node's copy)."""
        where = self._get([s.actor.where.remote() for s in self.stages])
        return [{"replica": s.replica, "cus": s.cu_ids, "flops": s.cost, "memory_bytes": s.memory_bytes, **place}
                for s, place in zip(self.stages, where)]

    def resident_bytes(self) -> int:
        return self._resident

    def sandbox_events(self) -> dict[str, int]:
        """None counted here: the sandboxes are the actors'."""
        return no_sandbox_events()

    def needed(self, outputs: list[str]) -> set[str]:
        return needed_cus(self.dag, self.producer, self.cus, outputs)

    def run(self, feeds: dict[str, np.ndarray], policy: Policy, outputs: list[str]) -> tuple[dict, Request]:
        return self.run_many([feeds], policy, outputs)[0]

    def run_many(self, batch: list[dict[str, np.ndarray]], policy: Policy, outputs: list[str],
                 window: int = DEFAULT_WINDOW, on_done: Callable[[int], None] | None = None) -> list[tuple[dict, Request]]:
        """Each request's outputs and what it did, in order; up to `window` requests in flight.
        `on_done(i)` is called as request i is collected (progress, or a test removing a node)."""
        plan, chain_id, chain = self._plan(policy, outputs)
        done: list = []
        if self.compiled_graph and batch:
            done = self._run_compiled(batch, policy, outputs, plan, chain_id, chain, window, on_done)
            if len(done) == len(batch):
                return done
        return done + self._run_on_actors(batch[len(done):], policy, outputs, plan, window, on_done, len(done))

    def _plan(self, policy: Policy, outputs: list[str]) -> tuple[list[StageCall], int, Chain]:
        """The stage calls of (policy, outputs), and their chain and its id for a Compiled Graph:
        made once, as a local model's plan is."""
        key = (policy, tuple(outputs))
        if key not in self._plans:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            needed = self.needed(outputs) if policy.skip_inactive else set(self.cus)
            plan = self.planner.plan(needed, outputs)
            self._chain_ids += 1
            self._plans[key] = (plan, self._chain_ids, self.planner.chain(policy, plan, needed, outputs))
        return self._plans[key]

    def _run_on_actors(self, batch: list[dict], policy: Policy, outputs: list[str], plan: list[StageCall],
                       window: int, on_done, first: int) -> list[tuple[dict, Request]]:
        # Consecutive requests go in groups of `group`, one actor call per stage for each group,
        # the groups taking turns between the replicas.
        groups = [range(i, min(i + self.group, len(batch))) for i in range(0, len(batch), self.group)]
        in_flight = max(1, -(-window // self.group))
        pending: dict[int, tuple[list, list]] = {}
        attempts = [0] * len(groups)
        done: list = [None] * len(batch)
        submitted = 0
        for g, members in enumerate(groups):
            while submitted < len(groups) and submitted - g < in_flight:
                pending[submitted] = self._submit([batch[i] for i in groups[submitted]], policy, plan,
                                                  submitted % len(self.pipelines))
                submitted += 1
            results = self._collect(g, range(first + members.start, first + members.stop),
                                    [batch[i] for i in members], policy, plan, pending.pop(g), attempts, outputs)
            for i, result in zip(members, results, strict=True):
                done[i] = result
                if on_done is not None:
                    on_done(first + i)
        return done

    def _run_compiled(self, batch: list[dict], policy: Policy, outputs: list[str], plan: list[StageCall],
                      chain_id: int, chain: Chain, window: int, on_done) -> list[tuple[dict, Request]]:
        """The requests through the compiled graph, up to the first one it fails, whose graph is then
        torn down (the caller runs the rest on the actor path)."""
        ray = ray_module()
        timeouts, lost = self._graph_errors
        if self._graph is None:
            try:
                self._graph = CompiledRequests([s.actor for s in self.pipelines[0]], window, self.timeout_s)
            except lost:        # an actor restarting: this batch takes the actor path
                return []

        def collect(index: int, ref) -> tuple[dict, Request] | None:
            try:
                _, _, tensors, traces, error = decode(ref.get(timeout=self.timeout_s))
            except timeouts:
                raise
            except lost:
                self._teardown_graph()
                return None
            except ray.exceptions.RayTaskError as e:
                raise _task_error(e) from None
            if error is not None:
                raise type(error)(str(error)) from None
            if on_done is not None:
                on_done(index)
            return self._assemble(batch[index], policy, plan, tensors, traces, outputs)

        try:
            done = self._graph.run_many(batch, chain_id, chain, collect, lost, timeouts)
        except timeouts:
            self._teardown_graph()
            raise self._timeout_error() from None
        if len(done) < len(batch):
            self._teardown_graph()
        return done

    def _teardown_graph(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.teardown()

    def _submit(self, group: list[dict], policy: Policy, plan: list[StageCall], replica: int = 0) -> tuple[list, list]:
        """One call per stage of `plan` on `replica` for a group of requests' feeds: per stage, the
        refs of each request's tensors, and the ref of the list of their traces."""
        ray = ray_module()
        pipeline = self.pipelines[replica]
        # Feeds read by one stage travel with its call (inlined when small); read by several,
        # they are put in the object store once.
        feeds_arg = ray.put(group) if sum(call.feeds for call in plan) > 1 else group
        tensors, traces = {}, []
        for call in plan:
            # A stage that reads no model input is not sent them (another node would fetch them).
            *tensor_refs, trace_ref = pipeline[call.stage].actor.run_group.options(num_returns=len(group) + 1).remote(
                policy, call.returns, len(group), feeds_arg if call.feeds else None,
                *(ref for j in call.reads for ref in tensors[j]))
            tensors[call.stage] = tensor_refs
            traces.append(trace_ref)
        return [tensors[call.stage] for call in plan], traces

    def _collect(self, g: int, indices: range, group: list[dict], policy: Policy, plan: list[StageCall], refs,
                 attempts: list[int], outputs: list[str]) -> list[tuple[dict, Request]]:
        ray = ray_module()
        lost = lost_errors(ray)
        while True:
            tensor_refs, trace_refs = refs
            try:
                parts = self._get([*(ref for stage in tensor_refs for ref in stage), *trace_refs])
                break
            except lost as e:
                attempts[g] += 1
                if attempts[g] > self.retries:
                    what = (f"request {indices.start}" if len(indices) == 1
                            else f"requests {indices.start}-{indices.stop - 1}")
                    raise CortexError(f"{what}: lost a Ray actor or its result {attempts[g]} times, the "
                                      f"last: {first_line(e)}") from None
                # Until the cluster notices the node is gone its actors are only "unavailable":
                # back off, so that the retries span the restart instead of spending themselves on it.
                time.sleep(min(RETRY_BACKOFF_S * 2 ** (attempts[g] - 1), MAX_BACKOFF_S))
                self.resubmitted += len(group)
                # Another replica, if there is one: this one's actors may still be restarting.
                refs = self._submit(group, policy, plan, (g + attempts[g]) % len(self.pipelines))
        n = len(group)
        tensor_lists = [parts[k * n:(k + 1) * n] for k in range(len(tensor_refs))]
        trace_lists = parts[len(tensor_refs) * n:]
        return [self._assemble(feeds, policy, plan, {name: value for t in tensor_lists for name, value in t[i].items()},
                               [tr[i] for tr in trace_lists], outputs) for i, feeds in enumerate(group)]

    def _assemble(self, feeds: dict, policy: Policy, plan: list[StageCall], env: dict, traces: list[dict],
                  outputs: list[str]) -> tuple[dict, Request]:
        """The requested outputs (copies: a Compiled Graph's arrays are views of its channel) and the
        request's trace from the called stages' tensors and traces."""
        results = {name: np.array(env[name] if name in env else feeds[name]) for name in outputs}
        return results, self._request(policy, plan, traces, feeds)

    def _request(self, policy: Policy, plan: list[StageCall], stage_traces: list[dict], feeds: dict) -> Request:
        called = {call.stage for call in plan}
        request = Request(policy, None, {}, live_bytes=sum(int(np.asarray(v).nbytes) for v in feeds.values()))
        skipped = {s["cu"]: s for part in stage_traces for s in part["skipped"]}
        skipped.update({cu_id: {"cu": cu_id, "reason": NOT_NEEDED} for k, stage in enumerate(self.pipelines[0])
                        if k not in called for cu_id in stage.cu_ids})
        request.skipped = [skipped[cu_id] for cu_id in self.dag["order"] if cu_id in skipped]
        for part in stage_traces:
            request.activated += part["activated"]
            request.cpu_seconds += part["cpu_seconds"]
            request.live_bytes += part["live_bytes"]
        return request

    def _get(self, refs: list):
        ray = ray_module()
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._timeout_error() from None
        except ray.exceptions.RayTaskError as e:
            raise _task_error(e) from None

    def _timeout_error(self) -> CortexError:
        return CortexError(f"the Ray cluster did not answer in {self.timeout_s:g} s (an actor waiting for a "
                           "node with free CPUs or memory?)")

    def close(self) -> bool:
        """Kill the actors, with the CUs they hold: the executor cannot run again (True)."""
        ray = ray_module()
        self._teardown_graph()
        held = [stage for stage in self.stages if stage.actor is not None]
        free = ray.available_resources().get("CPU", 0.0)
        for stage in held:
            ray.kill(stage.actor, no_restart=True)
            stage.actor = None
        self._contents = {}              # the object store may free the shipped files
        # ray.kill returns before the CPUs are given back: wait a little, so that a model loaded
        # next sees them free and places as many replicas as the cluster holds.
        free_cpus(ray, free + len(held) * self.num_cpus, patience_s=5.0)
        return True


def _task_error(error) -> CortexError:
    """An error raised on an actor as the caller reads it: a CortexError (a CU's trap) as it is."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, CortexError):
        return type(cause)(str(cause))
    return CortexError(f"a CU failed on the Ray cluster: {first_line(error)}")
