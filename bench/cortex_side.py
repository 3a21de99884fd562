"""Cortex's own column of the model benchmark: compile a model with the CLI (decompose, build-dag,
compile-wasm), load the result with the runtime (`cortex.load(dag, device="wasm")`), and check it
against onnxruntime before timing it. Whatever stage is missing or fails becomes the reason printed
in the report's "n/a" cells."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.timing import InProcess
from ir.onnx_import import load_model
from passes import optimize_pipeline, run_pipeline
from passes.plan_memory import plan_graph_memory


class NotAvailable(Exception):
    """Why Cortex has no number for a model (a missing stage, a failed command, a wrong result)."""


@dataclass
class CortexBuild:
    contestant: InProcess
    compile_s: float
    load_s: float                  # a second (warm) load of the same dag.json
    stage_s: dict[str, float] = field(default_factory=dict)
    max_abs_error: float = 0.0
    loaded: object | None = None   # the cortex.load(...) model it times (its trace says where time goes)


def memory_plan(model: Path, input_shapes: dict, dims: dict) -> dict:
    """The whole model planned in node order: what the arena would hold, against its lower bound."""
    graph, _ = run_pipeline(load_model(model), optimize_pipeline(input_shapes, dims, require_static=True))
    plan = plan_graph_memory(graph)
    naive = sum(v.nbytes for v in graph.values() if not v.is_const and v.is_tensor)
    return {"arena_bytes": plan.arena_bytes, "lower_bound": plan.lower_bound, "no_reuse_bytes": naive,
            "in_place": len(plan.aliases)}


def _cli(*argv: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cortex.cli", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise NotAvailable(f"cortex {argv[0]} failed: {last[:160]}")
    return time.perf_counter() - start


def _commands() -> set[str]:
    from cortex.cli import app
    return {c.name for c in app.registered_commands}


def build(model: Path, input_shapes: dict, dims: dict, feeds: dict, reference: dict, workdir: Path,
          rtol: float = 1e-3, atol: float = 1e-4, threads: int = 1, decompose: tuple[str, ...] = (),
          label: str = "cortex-wasm", features: str = "simd,relaxed-simd") -> CortexBuild:
    """`threads`: the runtime's (1 for the one-thread tables, which time the calling thread's CPU);
    `decompose`: extra decompose flags (--parallel N); `label`: the contestant's name; `features`:
    compile-wasm's (with threads, large contractions run as parts on the runtime's threads)."""
    missing = {"decompose", "build-dag", "compile-wasm"} - _commands()
    if missing:
        raise NotAvailable(f"cortex {', '.join(sorted(missing))} not available yet")
    import cortex
    if not hasattr(cortex, "load"):
        raise NotAvailable("the runtime loader cortex.load is not available yet")
    bind = [f"--input-shape={name}={'x'.join(map(str, shape))}" for name, shape in input_shapes.items()]
    bind += [f"--dim={name}={value}" for name, value in dims.items()]
    cus, dag, wasm = workdir / "cus", workdir / "dag.json", workdir / "wasm-bin"
    stages = {
        "decompose": _cli("decompose", "--model-path", str(model), "--output-dir", str(cus), *bind, *decompose),
        "build-dag": _cli("build-dag", "--cu-dir", str(cus), "--output", str(dag)),
        "compile-wasm": _cli("compile-wasm", "--cu-dir", str(cus), "--output", str(wasm), "--dag", str(dag),
                             "--features", features, "--opt-level", "3"),
    }
    cortex.load(dag, device="wasm")  # the first load pays for cold files and engine set-up
    start = time.perf_counter()
    loaded = cortex.load(dag, device="wasm", policy="strict", threads=threads)   # timed: every CU runs, no cache
    load_s = time.perf_counter() - start
    outputs = loaded.run(feeds)
    worst = 0.0
    for name, want in reference.items():
        got = np.asarray(outputs[name])
        if got.shape != np.shape(want) or not np.allclose(got, want, rtol=rtol, atol=atol):
            diff = float(np.max(np.abs(got - want))) if got.shape == np.shape(want) else float("inf")
            raise NotAvailable(f"output {name!r} differs from onnxruntime (max abs error {diff:.3g})")
        worst = max(worst, float(np.max(np.abs(got - want))) if got.size else 0.0)
    return CortexBuild(InProcess(label, lambda: loaded.run(feeds)), sum(stages.values()), load_s,
                       stages, worst, loaded)
