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


@dataclass(frozen=True)
class SandboxLimits:
    cu_timeout_ms: float | None = None          # one call's deadline; None: from the CU's cost; 0: none
    cu_load_timeout_s: float = CU_LOAD_TIMEOUT_S

    def __post_init__(self):
        timeout = self.cu_timeout_ms
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0 or timeout == float("inf")):
            raise CortexError(f"cu_timeout_ms must be a number of milliseconds, at least 0 (0: no time limit), "
                              f"got {timeout!r}")
        load = self.cu_load_timeout_s
        if isinstance(load, bool) or not isinstance(load, (int, float)) or not load > 0 or load == float("inf"):
            raise CortexError(f"cu_load_timeout_s must be a positive number of seconds, got {load!r}")


def sandbox_limits(cu_timeout_ms: float | None = None, cu_load_timeout_s: float | None = None) -> SandboxLimits:
    """The limits from user-facing keywords (None: the default of each)."""
    return SandboxLimits(cu_timeout_ms, CU_LOAD_TIMEOUT_S if cu_load_timeout_s is None else cu_load_timeout_s)


SANDBOX_COUNTERS = ("traps", "timeouts", "memory_limit_hits", "rebuilt")


def no_sandbox_events() -> dict[str, int]:
    return dict.fromkeys(SANDBOX_COUNTERS, 0)
