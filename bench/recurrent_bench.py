"""Recurrent layers (samples/recurrent.py) on Cortex WASM against onnxruntime (native CPU, one
thread), timed interleaved, with where Cortex's time goes: each CU's median wall time from the
runtime's trace, and its op types.

    python -m bench.recurrent_bench [--models lstm,gru-small] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench import cortex_side
from bench.model_bench import _ort_session
from bench.timing import InProcess, interleave, repeats_for
from samples import recurrent


def bench(name: str, rounds: int) -> dict:
    m = recurrent.recurrent(name)
    with tempfile.TemporaryDirectory() as work:
        build = cortex_side.build(m.path, m.input_shapes, {}, m.inputs, m.outputs, Path(work))
        session = _ort_session(m.path)
        ort = InProcess("onnxruntime", lambda: session.run(None, m.inputs))
        once = min(t for _, t in ort.time(2, 3))
        timings = interleave([build.contestant, ort], rounds, repeats_for(once, budget=0.2, most=20))
        per_cu = _per_cu(build, 10)
    cortex_ms, ort_ms = timings["cortex-wasm"].median * 1e3, timings["onnxruntime"].median * 1e3
    spread = {k: (min(t.seconds) * 1e3, max(t.seconds) * 1e3) for k, t in timings.items()}
    return {"model": name, "cortex_ms": cortex_ms, "ort_ms": ort_ms, "ratio": cortex_ms / ort_ms,
            "spread": spread, "per_cu": per_cu, "max_abs_error": build.max_abs_error}


def _per_cu(build: cortex_side.CortexBuild, runs: int) -> list[tuple[str, str, float]]:
    contestant, loaded = build.contestant, build.loaded
    samples: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for _ in range(runs):
        contestant.run()
        for t in loaded.trace:
            samples.setdefault(t["cu"], []).append(t["seconds"])
            kinds[t["cu"]] = ",".join(t["op_types"])
    return [(cu, kinds[cu], statistics.median(s) * 1e3) for cu, s in samples.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(recurrent.SPECS))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        r = bench(name, args.rounds)
        (c_lo, c_hi), (o_lo, o_hi) = r["spread"]["cortex-wasm"], r["spread"]["onnxruntime"]
        print(f"{name}: cortex {r['cortex_ms']:.3f} ms [{c_lo:.3f}..{c_hi:.3f}]  onnxruntime {r['ort_ms']:.3f} ms "
              f"[{o_lo:.3f}..{o_hi:.3f}]  ratio {r['ratio']:.2f}  (max abs error {r['max_abs_error']:.2g})", flush=True)
        for cu, ops, ms in r["per_cu"]:
            print(f"    {cu} {ms:8.3f} ms  {ops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
