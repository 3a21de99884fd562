"""`make bench`: Cortex WASM against onnxruntime (native) and onnxruntime-web on the nine light
models, MiniLM-L6 (seq 128), recurrent layers and quantized models (a table of their own), and GEMM
micro-benchmarks; then Cortex on 2 threads (bench/threads_bench.py). Around each section the FMA-loop
peak is measured again, and a section whose peak drifted more than 10% says so beside its figures.
Writes its sections of docs/benchmarks.md.

    python -m bench.bench_models [--models resnet50,minilm-l6-s128,recurrent-gru] [--rounds 5] [--no-gemm]
                                 [--no-models] [--no-threads] [--threads-models squeezenet,minilm-l6-s128]
                                 [--output docs/benchmarks.md] [--json out/bench.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from bench import gemm_bench, machine, model_bench, report, threads_bench
from bench.node_runner import NodeRunner, NodeUnavailable
from ir.fs import write_bytes_atomically


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(model_bench.ALL_NAMES),
                        help="comma-separated, from: " + ", ".join(model_bench.ALL_NAMES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per measurement")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM micro-benchmarks")
    parser.add_argument("--no-models", action="store_true", help="skip the model benchmarks")
    parser.add_argument("--no-threads", action="store_true", help="skip Cortex on 2 threads")
    parser.add_argument("--threads-models", default=",".join(threads_bench.DEFAULT_MODELS),
                        help="models of the threads section, from: " + ", ".join(model_bench.MODEL_NAMES))
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in model_bench.ALL_NAMES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(model_bench.ALL_NAMES)}")

    info = machine.describe()
    print(f"Benchmarking on {info['cpu']} ({info['cores']} cores)", flush=True)
    settings = {"rounds": args.rounds}
    try:
        node = NodeRunner()
        settings["ortweb_version"] = node.ask(cmd="version")["web"]
    except (NodeUnavailable, RuntimeError, OSError) as e:
        print(f"  onnxruntime-web columns will be n/a: {e}", flush=True)
        node = None
    threads_names = [n.strip() for n in args.threads_models.split(",") if n.strip()]
    unknown = [n for n in threads_names if n not in threads_bench.DEFAULT_MODELS]
    if unknown:
        parser.error(f"unknown --threads-models {', '.join(unknown)}; known: {', '.join(threads_bench.DEFAULT_MODELS)}")
    models, gemms, peak, drifts, threads, gil = [], [], {}, [], [], None
    try:
        if not args.no_gemm:
            print("GEMM micro-benchmarks", flush=True)
            gemms, peak = threads_bench.measured("GEMM", lambda: gemm_bench.run_all(node, rounds=args.rounds), drifts)
        if not args.no_models:
            print("Models", flush=True)
            models = threads_bench.measured("models", lambda: [model_bench.bench_model(name, node, rounds=args.rounds)
                                                               for name in names], drifts)
        if not args.no_threads:
            threads, gil = threads_bench.measured("threads", lambda: threads_bench.run_section(threads_names, 3),
                                                  drifts)
    finally:
        if node is not None:
            node.close()

    extra = [m for m in models if m.name in model_bench.EXTRA_NAMES]
    models = [m for m in models if m.name not in model_bench.EXTRA_NAMES]
    _, model_summary = report.model_table(models)
    _, gemm_summary = report.gemm_table(gemms, peak)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = report.render(info, models, model_summary, gemms, gemm_summary, peak, settings, date, extra)
    notes = [f"- {d.section}: {d.note()}" for d in drifts if d.section != "threads"]
    if notes:    # beside the figures they concern: the end of this section
        section = section.replace(report.END, "\n".join(["FMA-loop peak before and after each part:", "", *notes, ""])
                                  + "\n" + report.END)
    report.write_section(args.output, section)
    if threads:   # --no-threads keeps the threads section as it was
        threads_bench.write_section(args.output, threads_bench.render(info, threads, gil, drifts, date, 3))
    print(f"wrote {args.output}")
    if args.json:
        raw = {"machine": info, "settings": settings, "date": date, "peak_gflops": peak,
               "gemm": [g.to_json() for g in gemms], "models": [m.to_json() for m in models + extra],
               "summary": {**model_summary, **gemm_summary, **threads_bench.summary(threads)},
               "threads": [t.to_json() for t in threads], "gil": gil, "peak_drift": [d.to_json() for d in drifts]}
        write_bytes_atomically(args.json, (json.dumps(raw, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
