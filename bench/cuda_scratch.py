"""CUDA scratch space with and without reuse of temporaries: per model, the bytes its CUs' temporaries
add up to (each aligned as its own allocation) against the scratch space the lifetime planner gives
(`codegen.memory_plan`, used by backends/cuda/render.py). No compiler and no GPU needed: it decomposes,
lowers and renders each CU, and compiles nothing.

    python -m bench.cuda_scratch [--models light,minilm]    (make bench-cuda-scratch)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from backends.cuda.render import ALIGN, render_cuda
from codegen.lower import lower_graph
from codegen.memory_plan import aligned_size
from cortex.commands.decompose import decompose_model
from cortex.compile import read_cus
from passes.partition import PartitionIntoCUs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from testdata import LARGE_LIGHT_MODELS, LIGHT_MODEL_NAMES, light_model, minilm


def scratch_of(case) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cus = Path(tmp) / "cus"
        decompose_model(Path(case.path), cus, PartitionIntoCUs(4096, 50_000_000, 8),
                        input_shapes=case.input_shapes, dims=case.dims)
        _, graphs = read_cus(cus, "cuda")
        separate = planned = 0
        for graph in graphs.values():
            program = lower_graph(graph)
            separate += sum(aligned_size(s.nbytes, ALIGN) for s in program.storages if s.kind == "temp")
            planned += render_cuda(program).scratch_bytes
    return {"model": case.name, "cus": len(graphs), "temporaries_bytes": separate, "scratch_bytes": planned,
            "saved": 1 - planned / separate if separate else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_scratch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="light,minilm", help="comma-separated: light, minilm")
    args = parser.parse_args(argv)
    groups = set(args.models.split(","))
    cases = [light_model(n) for n in LIGHT_MODEL_NAMES if n not in LARGE_LIGHT_MODELS] if "light" in groups else []
    cases += [minilm(1, 128)] if "minilm" in groups else []
    print(f"{'model':<28} {'CUs':>4} {'temporaries':>12} {'scratch':>12} {'saved':>6}")
    for case in cases:
        row = scratch_of(case)
        print(f"{row['model']:<28} {row['cus']:>4} {row['temporaries_bytes']:>12} {row['scratch_bytes']:>12} "
              f"{100 * row['saved']:>5.1f}%", flush=True)
        print(json.dumps(row), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
