"""The server's Prometheus metrics (`GET /metrics`), one registry per server.

Per-request figures come from the trace each run writes (`model.last_trace`): CUs activated,
skipped, approximated and skipped on a cache hit; the memory tiers' `memory` (bytes loaded and
evicted, evictions) where the trace has them, zero where it does not, and what the sandbox stopped
during each run, succeeded or failed (traps, timeouts: `CompiledModel.sandbox_events()` before
and after it). A model compiled for several input shapes also counts the requests each
specialization ran (`specialization_requests`, label `specialization`, its name: `batch=4`) and how
many instances hold each one's CUs loaded (`specialization_instances`): they load lazily, per
instance.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, model_name: str, specializations: list[str] = ()):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model"]
        self.requests = Counter("cortex_requests", "Inference requests answered, by HTTP status.",
                                ["model", "status"], registry=self.registry)
        self.latency = Histogram("cortex_request_latency_seconds", "Time from an infer request's arrival to its "
                                 "response.", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.cus = Counter("cortex_cus", "CUs of the requests run, by what the scheduler did with them "
                           "(activated, skipped, approximated, fell_back).", ["model", "outcome"],
                           registry=self.registry)
        self.cache_hits = Counter("cortex_cache_hits", "CUs skipped because the result cache held their outputs.",
                                  labels, registry=self.registry)
        self.resident = Gauge("cortex_resident_bytes", "Bytes the loaded CUs of every model instance hold.",
                              labels, registry=self.registry)
        self.bytes_loaded = Counter("cortex_memory_loaded_bytes", "Bytes of CUs loaded under the memory budget.",
                                    labels, registry=self.registry)
        self.bytes_evicted = Counter("cortex_memory_evicted_bytes", "Bytes of CUs evicted under the memory budget.",
                                     labels, registry=self.registry)
        self.evictions = Counter("cortex_evictions", "CUs evicted under the memory budget.", labels,
                                 registry=self.registry)
        self.traps = Counter("cortex_sandbox_traps", "CU traps (a request failed with a 500 for each).", labels,
                             registry=self.registry)
        self.timeouts = Counter("cortex_sandbox_timeouts", "CUs stopped at their time limit.", labels,
                                registry=self.registry)
        if specializations:        # a model of one shape keeps the exposition it always had
            self.specialization_requests = Counter(
                "cortex_specialization_requests", "Inference requests run, by the shape specialization they ran "
                "on (a padded one: the bucket it was padded to).", ["model", "specialization"], registry=self.registry)
            self.specialization_instances = Gauge(
                "cortex_specialization_instances", "Model instances holding the specialization's CUs loaded.",
                ["model", "specialization"], registry=self.registry)
        for name in specializations:
            self.specialization_requests.labels(model_name, name)
            self.specialization_instances.labels(model_name, name)
        for outcome in ("activated", "skipped", "approximated", "fell_back"):
            self.cus.labels(model_name, outcome)
        for metric in (self.latency, self.cache_hits, self.resident, self.bytes_loaded, self.bytes_evicted,
                       self.evictions, self.traps, self.timeouts):
            metric.labels(model_name)

    def request(self, status: int, seconds: float | None = None) -> None:
        self.requests.labels(self.model_name, str(status)).inc()
        if seconds is not None:
            self.latency.labels(self.model_name).observe(seconds)

    def ran(self, trace: dict, resident_bytes: int, sandbox_events: dict[str, int]) -> None:
        """Count what one run's trace reports."""
        model = self.model_name
        skipped = trace.get("skipped_cus", [])
        self.cus.labels(model, "activated").inc(len(trace.get("activated_cus", [])))
        self.cus.labels(model, "skipped").inc(len(skipped))
        self.cus.labels(model, "approximated").inc(len(trace.get("approximated_cus", [])))
        self.cus.labels(model, "fell_back").inc(len(trace.get("fell_back_cus", [])))
        self.cache_hits.labels(model).inc(sum(1 for s in skipped if s.get("reason") == "cache hit"))
        memory = trace.get("memory") or {}
        self.bytes_loaded.labels(model).inc(_count(memory, "bytes_loaded"))
        self.bytes_evicted.labels(model).inc(_count(memory, "bytes_evicted"))
        self.evictions.labels(model).inc(_count(memory, "evictions"))
        self.sandbox(sandbox_events)
        self.resident.labels(model).set(resident_bytes)

    def ran_on(self, specialization: str) -> None:
        self.specialization_requests.labels(self.model_name, specialization).inc()

    def loaded(self, instances: dict[str, int]) -> None:
        """Per specialization, how many model instances hold its CUs loaded."""
        for name, count in instances.items():
            self.specialization_instances.labels(self.model_name, name).set(count)

    def failed(self, sandbox_events: dict[str, int]) -> None:
        """Count a run that failed on the server's side: what its sandbox stopped."""
        self.sandbox(sandbox_events)

    def sandbox(self, events: dict[str, int]) -> None:
        """The model's sandbox counts over one run (the trace's `sandbox_stats` are over its life)."""
        self.traps.labels(self.model_name).inc(_count(events, "traps"))
        self.timeouts.labels(self.model_name).inc(_count(events, "timeouts"))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _count(fields: dict, key: str) -> float:
    value = fields.get(key) if isinstance(fields, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0
