"""What a sandboxing device is told about the limits its CUs run under (target-neutral).

The scheduler hands a `SandboxLimits` to each device whose `DeviceSpec.sandboxed` is true; the
device decides how to enforce it (the wasm device: backends/wasm/sandbox.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ir.errors import CortexError

# The design's CU_LOAD_TIMEOUT: one CU's load (read, sha256, compile or map its native code,
# instantiate) must finish within this many seconds. A cold compile of the largest CUs we build
# (a few hundred MB of weights in data segments) takes seconds, not minutes; 120 s leaves room for
# a loaded machine while still failing a load that hangs.
CU_LOAD_TIMEOUT_S = 120.0

# `cu_timeout_ms="auto"`: each CU's deadline comes from its cost estimate. It is not the default of
# `cortex run` or `cortex.load` because the epoch checks it compiles into every loop back-edge cost
# MiniLM 1.7x (`make bench-sandbox`): all vector registers are caller-saved, so the check's cold
# call makes the GEMM loops spill. `cortex serve`, where one hostile request must not hold a
# worker, turns it on by default.
AUTO_DEADLINE = "auto"


@dataclass(frozen=True)
class SandboxLimits:
    cu_timeout_ms: float | str | None = None    # one call's deadline in ms; "auto": from the CU's cost; None or 0: none
    cu_load_timeout_s: float = CU_LOAD_TIMEOUT_S

    def __post_init__(self):
        timeout = self.cu_timeout_ms
        if timeout is not None and timeout != AUTO_DEADLINE and (
                isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not timeout >= 0 or timeout == float("inf")):
            raise CortexError(f"cu_timeout_ms must be a number of milliseconds, at least 0 (0: no time limit), or "
                              f"{AUTO_DEADLINE!r} (from each CU's cost), got {timeout!r}")
        load = self.cu_load_timeout_s
        if isinstance(load, bool) or not isinstance(load, (int, float)) or not load > 0 or load == float("inf"):
            raise CortexError(f"cu_load_timeout_s must be a positive number of seconds, got {load!r}")

    @property
    def timed(self) -> bool:
        """Whether CU calls have a deadline (and the engine needs epoch checks)."""
        return bool(self.cu_timeout_ms)


def sandbox_limits(cu_timeout_ms: float | str | None = None, cu_load_timeout_s: float | None = None) -> SandboxLimits:
    """The limits from user-facing keywords (None: the default of each)."""
    return SandboxLimits(cu_timeout_ms, CU_LOAD_TIMEOUT_S if cu_load_timeout_s is None else cu_load_timeout_s)


SANDBOX_COUNTERS = ("traps", "timeouts", "memory_limit_hits", "rebuilt")


def no_sandbox_events() -> dict[str, int]:
    return dict.fromkeys(SANDBOX_COUNTERS, 0)
