"""Options several commands share, spelled once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cortex.runtime import device_names
from ir.errors import CortexError

DeviceOption = Annotated[str, typer.Option("--device", help=f"One of: {', '.join(device_names())}.")]

CuTimeoutOption = Annotated[str | None, typer.Option(
    "--cu-timeout-ms", help="Each CU call's time limit: a number of ms, or 'auto' (from the CU's cost estimate in "
                            "dag.json, at least 1 s); 0 or unset: none (the checks cost GEMM-heavy models up to 1.7x). "
                            "A CU past it fails the run with its id; the model stays usable.")]
CuLoadTimeoutOption = Annotated[float | None, typer.Option(
    "--cu-load-timeout-s", help="Each CU load's time limit in seconds (read, check, compile, instantiate; "
                                "default: CU_LOAD_TIMEOUT, 120).")]
MemoryBudgetOption = Annotated[Optional[float], typer.Option(
    "--memory-budget", help="Keep the resident CUs within this many MB: the least recently used is evicted, a "
    "prefetcher loads the next ones while one runs (default: every CU resident).")]
PinOption = Annotated[Optional[str], typer.Option(
    "--pin", help="CUs that stay resident under --memory-budget, comma-separated (cu-0003,cu-0007; default: the "
    "hot CUs 'cortex calibrate' recorded).")]
SpecializationsOption = Annotated[str, typer.Option(
    "--specializations", help="With shape specializations: lazy (each one's CUs load when a request first has its "
    "shapes: one copy of the weights per shape in use) or eager (all at load).")]
PadToBucketOption = Annotated[str | None, typer.Option(
    "--pad-to-bucket", help="With shape specializations: pad inputs no specialization matches up to the nearest "
    "larger one along this dim (a --dim name, or an input), and slice the outputs back; sound only for masked "
    "inputs (docs/runtime.md).")]
PadValueOption = Annotated[float, typer.Option(
    "--pad-value", help="The value --pad-to-bucket pads every input with (an attention mask's 0, a [PAD] token id).")]
ThreadsOption = Annotated[Optional[int], typer.Option("--threads", help="Ready CUs run at once on this many threads "
                                                     "(default: the machine's cores; 1: one after the other).")]


def checked_threads(threads: int | None) -> int | None:
    if threads is not None and threads < 1:
        raise CortexError(f"--threads must be at least 1, got {threads}")
    return threads
ExecutorOption = Annotated[str, typer.Option("--executor", help="local (this process) or ray (the Ray cluster "
                                              "at --address).")]
AddressOption = Annotated[Optional[str], typer.Option("--address", help="The Ray cluster for --executor ray "
                                                      "(host:port of its head, or auto; default: the one in "
                                                      "RAY_ADDRESS, else a new local one).")]
ExecutorOptionsOption = Annotated[Optional[list[str]], typer.Option(
    "--executor-option", help="KEY=VALUE of the ray executor, repeatable: stages, replicas, group, num_cpus, "
    "retries, timeout_s, max_restarts, cache_dir, compiled_graph (docs/runtime.md, \"Ray\").")]
