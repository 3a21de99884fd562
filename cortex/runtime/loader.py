"""`cortex.load(dag.json, device=..., policy=...)`: a compiled model, ready to `run({name: array})`.

Its settings are one `RuntimeOptions` (cortex/runtime/options.py), given as `options=` or built
from `load`'s keywords, checked once there; everything below reads it.

The dag.json is checked before anything is loaded (`cortex.dag.read_dag`: schema, data flow,
memory plans, artifact paths confined to its folder); the device comes from the registry by name;
the scheduler decides what runs, and where: fallback CUs on their runtime's device. Inputs are
checked against dag.json (names, dtypes, shapes) with one clear error; outputs are arrays the
caller owns.

A policy (`cortex/runtime/policy.py`) is the model's default and may be overridden per call;
`outputs=` asks for some of the model's outputs, and only the CUs they need run (except under
strict). After each run, `last_trace` is the request's trace (`cortex/runtime/trace.py`, built
when first read: for a small model building it costs a fifth of the request) and `trace` its
per-CU entries. Under the offline policy the CUs are not loaded until a request under
another policy needs them: offline is the fallback for when they cannot be.

`cu_timeout_ms` and `cu_load_timeout_s` set the sandbox's limits (backends/limits.py): each CU
call's deadline (default: none; "auto": from its cost estimate) and each CU load's timeout.

`memory_budget_mb=` keeps the resident CUs within that many MB (memory tiers, docs/runtime.md):
the least recently used CU is evicted first, never a pinned one (`pins=`, CU ids; by default the
hot CUs `cortex calibrate` recorded), and a prefetcher thread loads the next CUs while one runs.

`executor="ray"` places the CUs on Ray actors instead of this process (`cortex/runtime/ray_executor.py`,
`address=` the cluster); `run_many` submits a batch of requests at once, pipelined there.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from backends.limits import no_sandbox_events
from backends.registry import device as device_spec
from backends.registry import devices
from cortex.dag import read_dag
from cortex.runtime.cache import ResultCache
from cortex.runtime.feeds import checked_input
from cortex.runtime.offline import SourceModel
from cortex.runtime.options import RuntimeOptions, runtime_options
from cortex.runtime.parallel import machine_threads
from cortex.runtime.policy import Policy
from cortex.runtime.policy import policy as resolve_policy
from cortex.runtime.schedulers import Scheduler, open_scheduler
from cortex.runtime.specialized import SpecializedModel
from cortex.runtime.trace import empty_trace, offline_trace, process_maxrss_mb, request_trace
from cortex.specializations import is_specialized
from ir.errors import CortexError

def device_names() -> list[str]:
    return list(devices())


class CompiledModel:
    def __init__(self, dag_path: Path, device: str = "wasm", policy: str | Policy | None = None,
                 cache_bytes: int | None = None, *, options: RuntimeOptions | None = None,
                 dag: dict | None = None, lazy: bool = False, **settings):
        self.path = Path(dag_path)
        self.options = runtime_options(options, policy=policy, cache_bytes=cache_bytes, **settings)
        self.limits = self.options.limits
        self.memory_budget = self.options.memory_budget_bytes
        self.threads = machine_threads() if self.options.threads is None else self.options.threads
        self.device_name = device_spec(device).name
        self.policy = self.options.policy
        self.cache = ResultCache(self.options.cache_bytes)
        self.dag = read_dag(self.path) if dag is None else dag     # `dag`: one checked specialization
        self._scheduler: Scheduler | None = None
        self._source: SourceModel | None = None
        if self.policy.offline:
            self._source_model()           # a missing or changed source model fails at load
        elif not lazy:                     # lazy: the CUs load when the first request needs them
            self._loaded_scheduler()
        self._last_request = None     # the last request the scheduler ran (None: none, or offline)
        self._last_trace: dict | Callable[[], dict] = empty_trace(self.device_name, self.path)

    @property
    def trace(self) -> list[dict]:
        """The last request's entry for each CU that ran ([] before the first, or offline)."""
        return [] if self._last_request is None else self._last_request.activated

    @property
    def last_trace(self) -> dict:
        """The last request's trace document, built on first read from what the request recorded."""
        if callable(self._last_trace):
            self._last_trace = self._last_trace()
        return self._last_trace

    @property
    def scheduler(self) -> Scheduler:
        return self._loaded_scheduler()

    @property
    def loaded(self) -> bool:
        """Whether the CUs are loaded (a lazy model, or one under the offline policy, waits for a request)."""
        return self._scheduler is not None

    def load_cus(self) -> None:
        """Load the CUs now, as a model that is not lazy does at load."""
        self._loaded_scheduler()

    @property
    def device(self):
        """The model's device (None when every CU runs on a fallback device)."""
        return self.scheduler.devices.get(self.device_name)

    def sandbox_events(self) -> dict[str, int]:
        """Traps, timeouts, memory limit hits and rebuilt CUs over the model's life."""
        if self._scheduler is None:
            return no_sandbox_events()      # not loaded yet
        return self._scheduler.sandbox_events()

    @property
    def inputs(self) -> list[dict]:
        return list(self.dag["inputs"])

    @property
    def outputs(self) -> list[dict]:
        return list(self.dag["outputs"])

    def run(self, feeds: dict, outputs: list[str] | None = None,
            policy: str | Policy | None = None) -> dict[str, np.ndarray]:
        """The requested outputs (all by default) by name, under `policy` (the model's by default)."""
        chosen = self.policy if policy is None else resolve_policy(policy)
        names = self._requested(outputs)
        env = self._checked_inputs(feeds)
        if chosen.offline:
            results, run = self._source_model().run(env, names)
            self._last_request = None
            self._last_trace = offline_trace(device=self.device_name, dag_path=self.path, outputs=names, run=run,
                                            sandbox_events=self.sandbox_events())
            return results
        results, request = self._loaded_scheduler().run(env, chosen, names)
        self._record(chosen, names, request)
        return results

    def run_many(self, batch: list[dict], outputs: list[str] | None = None,
                 policy: str | Policy | None = None) -> list[dict[str, np.ndarray]]:
        """`run` on each feed of `batch`, in order; on Ray the requests are in flight together
        (pipelined through the actors). `last_trace` is the last request's."""
        chosen = self.policy if policy is None else resolve_policy(policy)
        if isinstance(batch, dict) or not isinstance(batch, (list, tuple)):
            raise CortexError("run_many takes a list of input dicts")
        if chosen.offline:
            return [self.run(feeds, outputs, chosen) for feeds in batch]
        names = self._requested(outputs)
        envs = [self._checked_inputs(feeds) for feeds in batch]
        done = self._loaded_scheduler().run_many(envs, chosen, names)
        if done:
            self._record(chosen, names, done[-1][1])
        return [results for results, _ in done]

    def close(self) -> None:
        """Free what the model holds besides its CUs: its Ray actors, or its threads' pool (a
        later request starts that pool again)."""
        if self._scheduler is not None and self._scheduler.close():
            self._scheduler = None

    def _record(self, chosen: Policy, names: list[str], request) -> None:
        scheduler = self._loaded_scheduler()
        self._last_request = request
        # What may change after the request is read now; the document is assembled when read.
        self._last_trace = partial(
            request_trace, policy=chosen.name, device=self.device_name, dag_path=self.path, outputs=names,
            request=request, resident_bytes=scheduler.resident_bytes(),
            fallback_cus={cu["id"] for cu in self.dag["cus"] if "runs_on" in cu},
            cache_stats=scheduler.cache.stats() if chosen.cache and scheduler.cache is not None else None,
            sandbox_events=scheduler.sandbox_events(), maxrss_mb=process_maxrss_mb(),
            threads=scheduler.threads_trace() if hasattr(scheduler, "threads_trace") else None)

    def trace_document(self) -> dict:
        """The last request's trace (`last_trace`); `traceEvents` opens in chrome://tracing or Perfetto."""
        return self.last_trace

    def _loaded_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = open_scheduler(self.dag, self.path, self.device_name, self.options, self.cache,
                                             self.threads)
        return self._scheduler

    def _source_model(self) -> SourceModel:
        if self._source is None:
            self._source = SourceModel(self.dag, self.path)
        return self._source

    def _requested(self, outputs: list[str] | None) -> list[str]:
        known = [spec["name"] for spec in self.dag["outputs"]]
        if outputs is None:
            return known
        if isinstance(outputs, str) or not all(isinstance(name, str) for name in outputs):
            raise CortexError("outputs must be a list of output names")
        unknown = [name for name in outputs if name not in known]
        if unknown:
            raise CortexError(f"unknown output {', '.join(map(repr, unknown))}: the model's outputs are "
                              f"{', '.join(map(repr, known))}")
        if not outputs:
            raise CortexError(f"no outputs requested: name at least one of {', '.join(map(repr, known))}")
        return list(dict.fromkeys(outputs))

    def _checked_inputs(self, feeds: dict) -> dict[str, np.ndarray]:
        if not isinstance(feeds, dict):
            raise CortexError("inputs must be a dict of name -> numpy array")
        expected = {spec["name"]: spec for spec in self.dag["inputs"]}
        unknown = sorted(set(feeds) - set(expected))
        if unknown:
            raise CortexError(f"unknown input {', '.join(map(repr, unknown))}: the model's inputs are "
                              f"{', '.join(map(repr, expected))}")
        return {name: checked_input(name, spec, feeds) for name, spec in expected.items()}


def load(dag_path, device: str = "wasm", policy: str | Policy | None = None, cache_bytes: int | None = None, *,
         options: RuntimeOptions | None = None, **settings) -> CompiledModel | SpecializedModel:
    """A model ready to run, under `options` (a `RuntimeOptions`, cortex/runtime/options.py) or the
    same settings as keywords (they replace those of `options`): `policy` defaults to balanced,
    `cache_bytes` bounds the result cache (0 turns it off), `memory_budget_mb` the resident CUs
    (None: all resident), `pins` the CUs that stay resident under it; `cu_timeout_ms` and
    `cu_load_timeout_s` are the sandbox's limits; `threads` runs that many ready CUs at once
    (default: the machine's cores; 1: one CU after the other; under a memory budget, one at a
    time); `executor="ray"` runs the CUs on the Ray cluster at `address` (`executor_options`:
    RayOptions' stages, replicas, group, num_cpus, retries, timeout_s, max_restarts, cache_dir,
    compiled_graph; on Ray `cache_bytes` is each actor's). A dag.json of shape specializations
    runs each request on the one its input shapes match (padded up to the nearest along
    `pad_to_bucket` when asked: cortex/runtime/specialized.py), each one's CUs loaded when a
    request first picks it (`specializations="eager"`: all of them now)."""
    options = runtime_options(options, policy=policy, cache_bytes=cache_bytes, **settings)
    if is_specialized(Path(dag_path)):
        return SpecializedModel(Path(dag_path), lambda dag: CompiledModel(Path(dag_path), device, options=options,
                                                                          dag=dag, lazy=True), options)
    if options.pad_to_bucket is not None:
        raise CortexError(f"--pad-to-bucket {options.pad_to_bucket}: {dag_path} was built for one input shape; "
                          "padding needs shape specializations (decompose --dim NAME=A,B,...)")
    return CompiledModel(Path(dag_path), device, options=options)
