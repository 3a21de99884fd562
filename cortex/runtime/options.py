"""`RuntimeOptions`: every setting of the runtime in one object, validated once, where it is made.

The CLI's `run`, `bench` and `serve` generate their runtime flags from its fields
(`cortex/commands/generated_options.py`, as targets and passes do); `cortex.load`, the server's
pool and the Ray executor take the object itself (`cortex.load`'s keywords build one). An error
names the option as the CLI spells it (`--memory-budget`), whoever made the object, so there is
one wording per mistake.

Construction normalises as it checks: `policy` becomes a `Policy` (with `trust_threshold`
applied), `pins` a tuple, `executor_options` a `RayOptions` (None under the local executor).
`dataclasses.replace` checks the result again.

    options = RuntimeOptions(policy="strict", memory_budget_mb=64, pins=["cu-0003"])
    model = cortex.load("out/dag.json", options=options)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from backends.limits import AUTO_DEADLINE, SandboxLimits, sandbox_limits
from cortex.runtime.cache import DEFAULT_CACHE_BYTES
from cortex.runtime.memory import MB, parse_pins
from cortex.runtime.policy import DEFAULT_POLICY, POLICIES, Policy
from cortex.runtime.policy import policy as resolve_policy
from ir.errors import CortexError
from ir.options import option

EXECUTORS = ("local", "ray")
SPECIALIZATION_LOADING = ("lazy", "eager")


def policy_option(value: str | Policy | None) -> Policy:
    """`--policy` as a Policy; an unknown name is one error naming the flag."""
    try:
        return resolve_policy(value)
    except CortexError as e:
        raise CortexError(f"--policy: {e}") from None


def parse_cu_timeout(text: str) -> float | str:
    """`--cu-timeout-ms` as typed: a number of ms or 'auto'."""
    if text == AUTO_DEADLINE:
        return text
    try:
        return float(text)
    except ValueError:
        raise CortexError(_cu_timeout_error(text)) from None


def parse_executor_options(texts: list[str]) -> dict:
    """`--executor-option KEY=VALUE`, repeated, as a dict of values (`_option_value`)."""
    parsed = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise CortexError(f"--executor-option {text!r}: expected KEY=VALUE, e.g. replicas=2")
        parsed[key.strip()] = _option_value(value.strip())
    return parsed


def _option_value(text: str):
    """A whole number, a number, true/false, or else the text itself (a folder)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# The Ray executor's defaults (cortex/runtime/ray_executor.py says what each does).
DEFAULT_RETRIES = 8
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_GROUP = 4          # requests of a batch per actor call


@dataclass(frozen=True)
class RayOptions:
    """The Ray executor's settings (`executor_options=`, `--executor-option KEY=VALUE`)."""
    stages: int | None = None           # None: from the cluster (ray_plan.pipeline_shape)
    replicas: int | None = None
    group: int = DEFAULT_GROUP
    num_cpus: float = 1.0
    retries: int = DEFAULT_RETRIES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_restarts: int = 4
    cache_dir: str | None = None        # None: each node's default (ray_artifacts.node_cache_dir)
    compiled_graph: bool = False

    def __post_init__(self):
        for name in ("stages", "replicas", "group"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CortexError(f"the ray executor's {name} must be a whole number, at least 1 (got {value!r})")
        if not self.num_cpus > 0:
            raise CortexError(f"the ray executor's num_cpus per actor must be above 0 (got {self.num_cpus!r})")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, Path)):
            raise CortexError(f"the ray executor's cache_dir must be a folder path (got {self.cache_dir!r})")
        if not isinstance(self.compiled_graph, bool):
            raise CortexError(f"the ray executor's compiled_graph must be True or False (got {self.compiled_graph!r})")


RAY_OPTIONS = tuple(f.name for f in fields(RayOptions))


@dataclass(frozen=True)
class RuntimeOptions:
    policy: str | Policy | None = field(default=DEFAULT_POLICY, metadata=option(
        f"What the scheduler may do: {', '.join(POLICIES)} (strict: every CU, exact, no cache; offline: the source "
        "model on onnxruntime).", parse=policy_option))
    trust_threshold: float | None = field(default=None, metadata=option(
        "The calibrated trust a reduced-precision variant needs to run, in [0, 1] (default: the policy's)."))
    cache_bytes: int = field(default=DEFAULT_CACHE_BYTES, metadata=option(
        "Byte budget of the result cache (0: off); it matters to repeated runs in one process, not to one "
        "'cortex run'."))
    threads: int | None = field(default=None, metadata=option(
        "Ready CUs run at once on this many threads (default: the machine's cores, or 1 for a model whose "
        "critical path holds over 90% of its flops; 1: one after the other, runs of CUs as segments)."))
    memory_budget_mb: float | None = field(default=None, metadata=option(
        "Keep the resident CUs within this many MB: the least recently used is evicted, a prefetcher loads the "
        "next ones while one runs (default: every CU resident).", flag="--memory-budget"))
    pins: tuple[str, ...] | None = field(default=None, metadata=option(
        "CUs that stay resident under --memory-budget, comma-separated (cu-0003,cu-0007; default: the hot CUs "
        "'cortex calibrate' recorded).", parse=parse_pins, flag="--pin"))
    cu_timeout_ms: float | str | None = field(default=None, metadata=option(
        "Each CU call's time limit: a number of ms, or 'auto' (from the CU's cost estimate in dag.json, at least "
        "1 s); 0 or unset: none (the checks cost GEMM-heavy models up to 1.7x). A CU past it fails the run with "
        "its id; the model stays usable.", parse=parse_cu_timeout))
    cu_load_timeout_s: float | None = field(default=None, metadata=option(
        "Each CU load's time limit in seconds (read, check, compile, instantiate; default: CU_LOAD_TIMEOUT, 120)."))
    segments: bool = field(default=True, metadata=option(
        "Run each run of CUs that needs no decision from the host as one call into the device (a segment: "
        "cortex/runtime/plan.py); off: one call per CU, each timed on its own in the trace.",
        flag="--segments/--no-segments"))
    specializations: str = field(default=SPECIALIZATION_LOADING[0], metadata=option(
        "With shape specializations: lazy (each one's CUs load when a request first has its shapes: one copy of "
        "the weights per shape in use) or eager (all at load)."))
    pad_to_bucket: str | None = field(default=None, metadata=option(
        "With shape specializations: pad inputs no specialization matches up to the nearest larger one along "
        "this dim (a --dim name, or an input), and slice the outputs back; sound only for masked inputs "
        "(docs/runtime.md)."))
    pad_value: float = field(default=0.0, metadata=option(
        "The value --pad-to-bucket pads every input with (an attention mask's 0, a [PAD] token id)."))
    executor: str = field(default=EXECUTORS[0], metadata=option(
        "local (this process) or ray (the Ray cluster at --address)."))
    address: str | None = field(default=None, metadata=option(
        "The Ray cluster for --executor ray (host:port of its head, or auto; default: the one in RAY_ADDRESS, "
        "else a new local one)."))
    executor_options: RayOptions | dict | None = field(default=None, metadata=option(
        "KEY=VALUE of the ray executor, repeatable: " + ", ".join(RAY_OPTIONS) + " (docs/runtime.md, \"Ray\").",
        parse=parse_executor_options, flag="--executor-option", repeat=True))

    def __post_init__(self):
        chosen = policy_option(self.policy)
        if self.trust_threshold is not None:
            chosen = chosen.with_threshold(self.trust_threshold)
        object.__setattr__(self, "policy", chosen)
        _check_cache_bytes(self.cache_bytes)
        _check_threads(self.threads)
        _check_memory_budget(self.memory_budget_mb)
        object.__setattr__(self, "pins", _checked_pins(self.pins, self.memory_budget_mb))
        _check_timeouts(self.cu_timeout_ms, self.cu_load_timeout_s)
        if not isinstance(self.segments, bool):
            raise CortexError(f"--segments must be true or false (got {self.segments!r})")
        if self.specializations not in SPECIALIZATION_LOADING:
            raise CortexError(f"--specializations {self.specializations!r}: expected one of "
                              f"{', '.join(SPECIALIZATION_LOADING)} (when each shape specialization's CUs load)")
        object.__setattr__(self, "executor_options", _checked_executor(self))

    @property
    def memory_budget_bytes(self) -> int | None:
        """The budget in bytes (None: no budget, every CU resident)."""
        return None if self.memory_budget_mb is None else int(self.memory_budget_mb * MB)

    @property
    def limits(self) -> SandboxLimits:
        return sandbox_limits(self.cu_timeout_ms, self.cu_load_timeout_s)

    @property
    def ray(self) -> RayOptions:
        """The Ray executor's settings (its defaults under the local executor)."""
        return self.executor_options or RayOptions()


def runtime_options(options: RuntimeOptions | None = None, **given) -> RuntimeOptions:
    """`options` (default: the defaults) with the settings `given` as keywords (None: not given)
    replacing its own; an unknown keyword is a TypeError, as for any function."""
    unknown = sorted(set(given) - {f.name for f in fields(RuntimeOptions)})
    if unknown:
        raise TypeError(f"unknown runtime option {', '.join(map(repr, unknown))}")
    if options is not None and not isinstance(options, RuntimeOptions):
        raise CortexError(f"options must be a RuntimeOptions, got {type(options).__name__}")
    given = {name: value for name, value in given.items() if value is not None}
    if options is None:
        return RuntimeOptions(**given)
    return replace(options, **given) if given else options


def _check_cache_bytes(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CortexError(f"--cache-bytes must be a whole number of bytes, got {value!r}")
    if value < 0:
        raise CortexError(f"--cache-bytes cannot be negative, got {value}")


def _check_threads(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise CortexError(f"--threads must be a whole number of at least 1, got {value!r}")
    if value < 1:
        raise CortexError(f"--threads must be at least 1, got {value}")


def _check_memory_budget(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CortexError(f"--memory-budget must be a positive number of MB, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise CortexError(f"--memory-budget must be a positive number of MB, got {value:g}")


def _checked_pins(pins, memory_budget_mb) -> tuple[str, ...] | None:
    if pins is None:
        return None
    if isinstance(pins, str) or not all(isinstance(p, str) for p in pins):
        raise CortexError(f"--pin must be CU ids, such as ['cu-0003'] (got {pins!r})")
    if memory_budget_mb is None:
        raise CortexError("--pin needs --memory-budget: without a budget every CU stays resident")
    return tuple(pins)


def _cu_timeout_error(value) -> str:
    return (f"--cu-timeout-ms must be a number of milliseconds, at least 0 (0: no limit), or '{AUTO_DEADLINE}', "
            f"got {value!r}")


def _check_timeouts(cu_timeout_ms, cu_load_timeout_s) -> None:
    if cu_timeout_ms is not None and cu_timeout_ms != AUTO_DEADLINE and (
            isinstance(cu_timeout_ms, bool) or not isinstance(cu_timeout_ms, (int, float))
            or not 0 <= cu_timeout_ms < float("inf")):
        raise CortexError(_cu_timeout_error(cu_timeout_ms))
    if cu_load_timeout_s is not None and (
            isinstance(cu_load_timeout_s, bool) or not isinstance(cu_load_timeout_s, (int, float))
            or not 0 < cu_load_timeout_s < float("inf")):
        raise CortexError(f"--cu-load-timeout-s must be a positive number of seconds, got {cu_load_timeout_s!r}")


def _checked_executor(options: RuntimeOptions) -> RayOptions | None:
    """The executor's settings, checked against the executor; the Ray executor's as a RayOptions."""
    executor, given = options.executor, options.executor_options
    if executor not in EXECUTORS:
        raise CortexError(f"--executor {executor}: expected {' or '.join(EXECUTORS)}")
    if options.address is not None and executor != "ray":
        raise CortexError("--address names a Ray cluster: it needs --executor ray")
    if executor != "ray":
        if given:
            raise CortexError("--executor-option sets the ray executor: it needs --executor ray")
        return None
    if options.memory_budget_mb is not None:
        raise CortexError("--memory-budget keeps this process's CUs resident within it: it needs the local "
                          "executor (Ray actors hold their own CUs)")
    if given is None or isinstance(given, RayOptions):
        return given or RayOptions()
    if not isinstance(given, dict):
        raise CortexError(f"--executor-option: the ray executor's options are a dict of name -> value, got {given!r}")
    unknown = sorted(set(given) - set(RAY_OPTIONS))
    if unknown:
        raise CortexError(f"unknown executor option {', '.join(map(repr, unknown))} for the ray executor: "
                          f"expected {', '.join(RAY_OPTIONS)}")
    return RayOptions(**given)
