"""The JavaScript runtime's CU workers (js/src/cu_workers.js) in Node: `numThreads` 1 against 2 on
a `--parallel N` build of each model (large contractions sliced into N independent CUs, which is
what gives the workers something to run at once), runs interleaved round by round, medians kept of
wall time and of the process's CPU time over all its threads (its ratio is what the workers cost in
extra work, which other load on a shared machine does not change, unlike wall time),
and where the 2-thread request's time went, from its trace: each thread's busy and idle time, the
CUs it ran, and the calling thread's time outside CUs (copies, postMessage, the walk).

    python -m bench.cu_workers_bench [--models squeezenet,inception_v1] [--parallel 2] [--rounds 15]

Builds go to .cache/cu-workers/<model>-p<N> and are reused (delete the folder to build again)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import cortex_side, model_bench
from bench.node_runner import NODE

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECK = REPO_ROOT / "js" / "testing" / "cu_workers_check.mjs"
CACHE = REPO_ROOT / ".cache" / "cu-workers"


def built(name: str, parallel: int) -> tuple[Path, dict]:
    """The `--parallel` build of `name` (dag.json) and its feeds, built and checked against onnxruntime once."""
    case = model_bench.model_case(name)
    workdir = CACHE / f"{name}-p{parallel}"
    if not (workdir / "dag.json").is_file():
        session = ort.InferenceSession(str(case.path), providers=["CPUExecutionProvider"])
        reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, case.feeds)))
        workdir.mkdir(parents=True, exist_ok=True)
        decompose = ("--parallel", str(parallel)) if parallel > 1 else ()
        cortex_side.build(case.path, case.input_shapes, case.dims, case.feeds, reference, workdir, decompose=decompose)
    return workdir / "dag.json", case.feeds


def profile(trace: dict, wall_ms: float) -> dict:
    """Per thread: busy milliseconds (its CUs' own time), CUs run; the request's span, and the calling
    thread's time in neither its own CUs nor waiting (the walk, copies, posting and taking messages)."""
    cus = trace["cus"]
    threads: dict[int, dict] = {}
    for cu in cus:
        t = threads.setdefault(cu.get("thread", 0), {"busy_ms": 0.0, "cus": 0})
        t["busy_ms"] += cu["seconds"] * 1e3
        t["cus"] += 1
    for t in threads.values():
        t["idle_ms"] = wall_ms - t["busy_ms"]
    return {"wall_ms": wall_ms, "threads": {str(k): v for k, v in sorted(threads.items())},
            "walk": trace["threads"].get("walk"), "because": trace["threads"].get("sequential_because")}


def measure(name: str, parallel: int, rounds: int, threads: tuple[int, ...]) -> dict:
    dag, feeds = built(name, parallel)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = {}
        for k, (input_name, array) in enumerate(feeds.items()):
            file = Path(tmp) / f"in{k}.bin"
            file.write_bytes(np.ascontiguousarray(array).tobytes())
            inputs[input_name] = {"dtype": str(array.dtype), "shape": list(array.shape), "file": file.name}
        job = {"dag": str(dag), "folder": tmp, "inputs": inputs, "out": tmp, "numThreads": list(threads),
               "policy": "strict", "timing": {"rounds": rounds, "traces": True}}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        done = subprocess.run([NODE, "--experimental-wasm-relaxed-simd", str(CHECK), str(Path(tmp) / "job.json")],
                              capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        found = json.loads(done.stdout.strip().splitlines()[-1])
    medians = {n: statistics.median(found["ms"][str(n)]) for n in threads}
    cpu = {n: statistics.median(found["cpu_ms"][str(n)]) for n in threads}
    cus = len(json.loads(dag.read_text())["cus"])
    profiles = {}
    for n in threads:       # each thread count's traced request nearest its median
        timed = found["ms"][str(n)]
        nearest = min(range(len(timed)), key=lambda i: abs(timed[i] - medians[n]))
        profiles[n] = profile(found["traces"][str(n)][nearest], timed[nearest])
    return {"model": name, "parallel": parallel, "cus": cus, "median_ms": medians,
            "spread_ms": {n: [min(found["ms"][str(n)]), max(found["ms"][str(n)])] for n in threads},
            "speedup": medians[threads[0]] / medians[threads[-1]],
            "cpu_ms": cpu, "cpu_ratio": cpu[threads[-1]] / cpu[threads[0]],
            "profile": profiles,
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="squeezenet,inception_v1")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    threads = tuple(int(n) for n in args.threads.split(","))
    results = []
    for name in args.models.split(","):
        print(f"load average before {name}: {os.getloadavg()}", flush=True)
        found = measure(name, args.parallel, args.rounds, threads)
        results.append(found)
        ms = "  ".join(f"n{n} {found['median_ms'][n]:.1f} ms" for n in threads)
        cpu = "  ".join(f"n{n} {found['cpu_ms'][n]:.1f}" for n in threads)
        print(f"{name} --parallel {args.parallel} ({found['cus']} CUs): {ms}  speedup {found['speedup']:.2f}x;"
              f"  process CPU ms {cpu} (ratio {found['cpu_ratio']:.2f})", flush=True)
        for n, seen in found["profile"].items():
            busy = "  ".join(f"thread {t}: {v['busy_ms']:.1f} ms in {v['cus']} CUs" for t, v in seen["threads"].items())
            print(f"  n{n} request of {seen['wall_ms']:.1f} ms ({seen['walk']}): {busy}"
                  + (f"; sequential because {seen['because']}" if seen["because"] else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if results:
        geomean = float(np.exp(np.mean([np.log(r["speedup"]) for r in results])))
        print(f"geomean speedup {geomean:.2f}x over {len(results)} models")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
