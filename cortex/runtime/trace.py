"""The trace of one request (`model.last_trace`, `cortex run --trace`), in the shape of
docs/runtime.md; its JSON Schema is `cortex/schemas/trace.schema.json`.

`sandbox_stats`:
- `cpu_time_ms`: CPU time (`time.thread_time`) of the threads that ran CUs, while they ran them (or
  of the calling thread while onnxruntime ran the source model); work on a GPU, or on threads a
  device starts itself, is not in it.
- `peak_memory_mb`: `peak_memory_basis` says which measure it is. With CUs, "loaded CUs + live
  tensors": the resident bytes of every loaded CU plus the bytes of the tensors the request holds
  at its end (it frees none before; inputs, outputs, copies between devices, cached outputs). A
  wasm CU's outputs lie in its memory and are counted twice, so it is an upper bound. Offline,
  "process maxrss": the process's peak resident set (VmHWM on Linux, else `resource.getrusage`), which onnxruntime's
  arena is part of. `process_maxrss_mb` is that figure in both cases.
- `wasm_executions`: CUs the wasm device ran.
- `bytes_copied_between_cus`: bytes of CU outputs copied into the memory of a CU that reads them on
  the same device (each entry's own figure is in `cus`); 0 for a wasm build with `--memory shared`,
  whose consumers read their producers' slots in place.
- `traps`, `timeouts`, `memory_limit_hits`, `rebuilt`: what the CU sandbox (backends/limits.py,
  backends/wasm/sandbox.py) stopped and how many CU stores it rebuilt, over the model's life,
  failed requests included (a failed request has no trace of its own: the next one shows them).

`memory` (docs/runtime.md, "Memory tiers"): the budget and pins, the bytes the resident CUs hold
after the request and at their peak during it, bytes loaded and evicted, prefetch hits and misses,
and wasted bytes: bytes loaded in this request for CUs that then did not run in it. Without a
budget every CU was loaded before the first request: nothing is loaded or evicted. Under a budget
each CU entry also carries `resident_total_bytes`, what every resident CU held right after it ran.
"""

from __future__ import annotations

import json
import resource
import sys
from functools import cache
from pathlib import Path

import jsonschema

from backends.limits import no_sandbox_events
from cortex.runtime.variants import variant_trace

TRACE_SCHEMA = "cortex.trace/1"
SCHEMA_FILE = Path(__file__).resolve().parent.parent / "schemas" / "trace.schema.json"
FALLBACK_RUNTIME = "fallback runtime"
MB = 1 << 20


def request_trace(*, policy: str, device: str, dag_path: Path, outputs: list[str], request, resident_bytes: int,
                  fallback_cus: set[str], cache_stats: dict | None, sandbox_events: dict | None = None,
                  maxrss_mb: float | None = None, threads: dict | None = None) -> dict:
    """The trace of a request the scheduler ran (`request`: its `Request`; `maxrss_mb`: the process's
    peak as it was when the request ended, read now when not given; `threads`: the scheduler's
    `threads_trace()`, where it has one)."""
    entries = request.activated
    variants = variant_trace(entries)
    memory = request.memory.document(resident_bytes) if request.memory is not None \
        else unbounded_memory(resident_bytes, len(entries))
    peak = memory["peak_resident_bytes"] + request.live_bytes
    return {
        **_header(policy, device, dag_path, outputs),
        "activated_cus": [t["cu"] for t in entries],
        "skipped_cus": list(request.skipped),
        "approximated_cus": variants["approximated_cus"],
        "fell_back_cus": [{"cu": t["cu"], "reason": FALLBACK_RUNTIME} for t in entries if t["cu"] in fallback_cus]
        + variants["fell_back_cus"],
        "sandbox_stats": {"cpu_time_ms": request.cpu_seconds * 1e3,
                          "peak_memory_mb": peak / MB,
                          "peak_memory_basis": "loaded CUs + live tensors",
                          "process_maxrss_mb": process_maxrss_mb() if maxrss_mb is None else maxrss_mb,
                          "wasm_executions": sum(1 for t in entries if t["device"] == "wasm"),
                          "bytes_copied_between_cus": sum(t.get("bytes_copied_between_cus", 0) for t in entries),
                          **(sandbox_events or no_sandbox_events())},
        "cache": cache_stats,
        "memory": memory,
        "offline": None,
        "cus_by_device": {name: sum(1 for t in entries if t["device"] == name)
                          for name in dict.fromkeys(t["device"] for t in entries)},
        "total_seconds": sum(t["seconds"] for t in entries),
        "cus": _entries(entries),
        "traceEvents": _events(entries),
        **({"threads": threads} if threads is not None else {}),
    }


def offline_trace(*, device: str, dag_path: Path, outputs: list[str], run: dict,
                  sandbox_events: dict | None = None) -> dict:
    """The trace of a request the offline policy ran (`run`: what `SourceModel.run` reported)."""
    maxrss = process_maxrss_mb()
    return {
        **_header("offline", device, dag_path, outputs),
        "activated_cus": [], "skipped_cus": [], "approximated_cus": [], "fell_back_cus": [],
        "sandbox_stats": {"cpu_time_ms": run["cpu_seconds"] * 1e3, "peak_memory_mb": maxrss,
                          "peak_memory_basis": "process maxrss", "process_maxrss_mb": maxrss,
                          "wasm_executions": 0, **(sandbox_events or no_sandbox_events())},
        "cache": None,
        "memory": None,
        "offline": {k: v for k, v in run.items() if k not in ("start", "cpu_seconds")},
        "cus_by_device": {},
        "total_seconds": run["seconds"],
        "cus": [],
        "traceEvents": [{"name": "source model", "cat": "offline", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0,
                         "dur": run["seconds"] * 1e6, "args": {"runtime": run["runtime"], "model": run["model"]}}],
    }


def empty_trace(device: str, dag_path: Path) -> dict:
    """`last_trace` before the first request."""
    return {**_header(None, device, dag_path, []), "activated_cus": [], "skipped_cus": [], "approximated_cus": [],
            "fell_back_cus": [], "sandbox_stats": {"cpu_time_ms": 0.0, "peak_memory_mb": 0.0,
                                                   "peak_memory_basis": "loaded CUs + live tensors",
                                                   "process_maxrss_mb": process_maxrss_mb(), "wasm_executions": 0,
                                                   **no_sandbox_events()},
            "cache": None, "memory": None, "offline": None, "cus_by_device": {},
            "total_seconds": 0.0, "cus": [], "traceEvents": []}


def unbounded_memory(resident_bytes: int, ran: int) -> dict:
    """The `memory` object of a request without a budget: every CU it ran was already resident."""
    return {"budget_bytes": None, "pinned_cus": [], "resident_bytes": resident_bytes,
            "peak_resident_bytes": resident_bytes, "bytes_loaded": 0, "bytes_evicted": 0, "loads": 0,
            "evictions": 0, "prefetch_hits": 0, "prefetch_misses": 0, "already_resident": ran, "wasted_bytes": 0}


def _header(policy: str | None, device: str, dag_path: Path, outputs: list[str]) -> dict:
    return {"schema": TRACE_SCHEMA, "policy": policy, "device": device, "dag": str(dag_path),
            "requested_outputs": list(outputs)}


def _entries(entries: list[dict]) -> list[dict]:
    """The per-CU entries; where threads ran them, each says when it started (`start_ms`, from the
    first CU's start) and on which thread, so overlapping runs can be read from the trace."""
    t0 = min((t["start"] for t in entries), default=0.0)
    return [{**{k: v for k, v in t.items() if k != "start"},
             **({"start_ms": (t["start"] - t0) * 1e3} if "thread" in t else {})} for t in entries]


def _events(entries: list[dict]) -> list[dict]:
    """Chrome trace events: open the file in chrome://tracing or Perfetto (one row per thread)."""
    t0 = min((t["start"] for t in entries), default=0.0)
    return [{"name": t["cu"], "cat": ",".join(t["op_types"]), "ph": "X", "pid": 0, "tid": t.get("thread", 0),
             "ts": (t["start"] - t0) * 1e6, "dur": t["seconds"] * 1e6,
             "args": {"device": t["device"], "bytes_in": t["bytes_in"], "bytes_out": t["bytes_out"]}}
            for t in entries]


def _proc_status_mb(field: str) -> float | None:
    """A size field (`VmRSS`, `VmHWM`) of /proc/self/status in MB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def process_rss_mb() -> float:
    """The process's resident set now, in MB (0 where /proc is missing)."""
    return _proc_status_mb("VmRSS") or 0.0


# ru_maxrss when this module was imported: at least what exec carried over from the parent.
_MAXRSS_AT_IMPORT = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def process_maxrss_mb() -> float:
    """The process's peak resident set in MB. On Linux it is VmHWM, this program's own: getrusage's
    ru_maxrss survives fork and exec, so a process started by a large one reports its parent's peak.
    Once ru_maxrss has grown past its value at import it is this process's own high-water mark (the
    kernel reports the larger of the two), VmHWM as the kernel's per-CPU counters approximate it
    (within a fraction of a MB): one system call (about 2 us) instead of reading /proc/self/status
    (about 30 us), which every request's trace pays."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "linux" and peak > _MAXRSS_AT_IMPORT:
        return peak / 1024
    peak_mb = _proc_status_mb("VmHWM")
    if peak_mb is not None:
        return peak_mb
    return peak / MB if sys.platform == "darwin" else peak / 1024   # bytes on macOS, KiB on Linux


@cache
def trace_schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


def validate_trace(trace: dict) -> None:
    """Raise jsonschema.ValidationError if `trace` does not follow the cortex.trace/1 schema."""
    jsonschema.Draft202012Validator(trace_schema()).validate(trace)
