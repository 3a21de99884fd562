"""`python -m bench.conformance [--device wasm] [--jobs 2] [--cases REGEX]`: run the node tests
through Cortex and write docs/conformance.md and docs/conformance.json."""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.conformance.devices import device_names, unavailable_reason
from bench.conformance.pool import run_cases
from bench.conformance.table import headline, summarize, write_json, write_markdown
from samples.node_tests import node_test_names

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.conformance", description=__doc__)
    parser.add_argument("--device", default="wasm", choices=device_names())
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per case (default 60 on wasm; 300 on cuda-sim and cuda, which compile C++ per CU)")
    parser.add_argument("--cases", default=None, help="only the cases whose name matches this regex")
    parser.add_argument("--output", type=Path, default=None,
                        help="the Markdown table (default docs/conformance.md, or docs/conformance-DEVICE.md); "
                             "the JSON goes next to it")
    args = parser.parse_args(argv)
    output = args.output or REPO / "docs" / ("conformance.md" if args.device == "wasm"
                                            else f"conformance-{args.device}.md")
    names = [n for n in node_test_names() if args.cases is None or re.search(args.cases, n)]
    meta = {"device": args.device, "commit": _commit(), "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "make conformance" + ("" if args.device == "wasm" else f" DEVICE={args.device}")
            if args.cases is None else "python -m bench.conformance " + " ".join(sys.argv[1:] if argv is None else argv)}
    unavailable = unavailable_reason(args.device)
    start = time.monotonic()
    if unavailable:
        print(f"device {args.device}: {unavailable}; writing a table that says so", file=sys.stderr)
        results = []
        meta["unavailable"] = unavailable
    else:
        done = [0]

        def progress(result) -> None:
            done[0] += 1
            if result.outcome in ("failed", "crashed") or done[0] % 100 == 0:
                print(f"[{done[0]}/{len(names)}] {result.name}: {result.outcome} {result.why[:150]}", flush=True)

        timeout = args.timeout or (60.0 if args.device == "wasm" else 300.0)
        results = run_cases(names, args.device, args.jobs, timeout, progress)
    meta["seconds"] = round(time.monotonic() - start, 1)
    write_markdown(output, results, meta)
    write_json(output.with_suffix(".json"), results, meta)
    summary = summarize(results)
    print(f"{headline(summary)} {summary['failed']} failed, {summary['unsupported']} unsupported, "
          f"{summary['crashed']} crashed; {summary['ort-cannot-run']} onnxruntime cannot run, "
          f"{summary['out-of-scope']} out of scope; {meta['seconds']} s. Wrote {output}")
    return 0


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
