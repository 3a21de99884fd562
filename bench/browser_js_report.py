"""The Chromium tables of `make bench-js`'s section (figures from bench/browser_js.py, the Node
memory figures from bench/ortweb/memory_node.mjs): markdown lines, goals stated beside what was
measured, misses said plainly."""

from __future__ import annotations

import numpy as np

THREADS_GOAL = 0.67     # Cortex on 2 threads / onnxruntime-web on 2 threads, geomean
COLD_GOAL = 1.0         # MiniLM's cold load to first result, Cortex / onnxruntime-web
WARM_GOAL = 0.3         # its warm load (second visit)
MEMORY_SLACK = 0.10     # after release, within 10% of before create
MB = 1 << 20


def geomean(values: list[float]) -> float | None:
    return float(np.exp(np.mean(np.log(values)))) if values else None


def _ms(spread: dict | None) -> str:
    return "n/a" if spread is None else f"{spread['median_ms']:.2f} ({spread['min_ms']:.2f}-{spread['max_ms']:.2f})"


def _ratio(ratio: dict | None) -> str:
    return "n/a" if ratio is None else f"{ratio['median']:.2f}"


def _verdict(value: float | None, goal: float) -> str:
    if value is None:
        return "not measured"
    return f"{value:.2f} (goal ≤ {goal}: {'met' if value <= goal else 'missed'})"


def chromium_line(c: dict) -> str:
    """One progress line for the console."""
    run = c.get("run", {})
    parts = [f"{name} {spread['median_ms']:.2f} ms" for name, spread in run.items()]
    load = c.get("load", {})
    if load:
        parts.append(f"cold {load['cortex-cold']['median_ms']:.0f}/{load['ortweb-cold']['median_ms']:.0f} ms, "
                     f"warm {load['cortex-warm']['median_ms']:.0f}/{load['ortweb-warm']['median_ms']:.0f} ms")
    parts += [f"{k}: {v}" for k, v in c.get("errors", {}).items()]
    return "; ".join(parts)


def _memory_cell(m: dict | None, prefix: str = "") -> str:
    if not m or m.get(f"{prefix}before") is None or m.get(f"{prefix}after_release") is None:
        return "n/a"
    before, after_run, after_release = (m[f"{prefix}{k}"] for k in ("before", "after_run", "after_release"))
    back = after_release / before - 1
    return (f"{before / MB:.1f} / {after_run / MB:.1f} / {after_release / MB:.1f} "
            f"({back:+.0%}{', within 10%' if back <= MEMORY_SLACK else ', over 10%'})")


def _later_cell(m: dict | None) -> str:
    """A later session on the same page: after its run / after its release, against the first one's release."""
    if not m or m.get("rss_after_release2") is None:
        return ""
    start, run, back = m["rss_after_release"], m["rss_after_run2"], m["rss_after_release2"]
    change = back / start - 1
    return f"; later session {run / MB:.1f} / {back / MB:.1f} ({change:+.0%})"


def _private_cell(m: dict | None) -> str:
    """The private part of the resident set (RssAnon) after release, against the whole RSS before create."""
    if not m or m.get("anon_before") is None or m.get("anon_after_release") is None or not m.get("rss_before"):
        return ""
    grown = (m["anon_after_release"] - m["anon_before"]) / m["rss_before"]
    return (f"; private {m['anon_before'] / MB:.1f} / {m['anon_after_run'] / MB:.1f} / {m['anon_after_release'] / MB:.1f} "
            f"({grown:+.0%} of RSS before{', within 10%' if grown <= MEMORY_SLACK else ', over 10%'})")


def chromium_tables(results: list[dict], chromium_version: str | None, rounds: int) -> list[str]:
    """The section's Chromium tables and memory table, from bench_js's per-model results."""
    measured = [r for r in results if (r.get("chromium") or {}).get("load")]
    unmeasured = [f"{r['model']}: {r['chromium']['errors'].get('chromium')}" for r in results
                  if r.get("chromium") and not r["chromium"].get("load")]
    lines = ["", f"### In headless Chromium {chromium_version or ''}".rstrip(), "",
             ("Debian's Chromium driven by playwright, pages served from 127.0.0.1 by a threaded http.server, "
              "plain or with COOP/COEP headers (crossOriginIsolated). Run: wall time per `session.run` "
              "(a page has no CPU clock), all contestants of a model alternating run by run, median (min-max); "
              "ratios are medians of adjacent runs' ratios. One thread: both runtimes on the plain page's main "
              "thread (onnxruntime-web numThreads 1, Cortex's default build under `strict`). Loads: from the "
              "runtime's import to the first `session.run` result, on a fresh browser context (cold: no http "
              "cache, no Cache API entry) and on a second page of that context (warm: Cortex's modules from "
              "the Cache API `cortex-modules`, onnxruntime-web's .mjs/.wasm/.onnx from the http cache)."), "",
             "| model | Cortex run ms | ort-web run ms | run ratio | Cortex cold ms | ort-web cold ms | cold ratio "
             "| Cortex warm ms | ort-web warm ms | warm ratio | max abs diff vs onnxruntime (Cortex / ort-web) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in measured:
        c = r["chromium"]
        run, load, agree = c.get("run", {}), c.get("load", {}), c.get("max_abs_vs_onnxruntime", {})
        diff = " / ".join("n/a" if agree.get(k) is None else f"{agree[k]:.2g}" for k in ("cortex-1t", "ortweb-1t"))
        lines.append(f"| {r['model']} | {_ms(run.get('cortex-1t'))} | {_ms(run.get('ortweb-1t'))} | "
                     f"{_ratio(c.get('run_ratio'))} | {_ms(load.get('cortex-cold'))} | {_ms(load.get('ortweb-cold'))} | "
                     f"{load['cold_ratio']:.2f} | {_ms(load.get('cortex-warm'))} | {_ms(load.get('ortweb-warm'))} | "
                     f"{load['warm_ratio']:.2f} | {diff} |")
    if unmeasured:
        lines += ["", "Not measured in Chromium: " + "; ".join(unmeasured) + "."]
    run_geo = geomean([r["chromium"]["run_ratio"]["median"] for r in measured if r["chromium"].get("run_ratio")])
    minilm = next((r["chromium"]["load"] for r in measured if r["model"].startswith("minilm")), None)
    lines += ["", f"One-thread run ratio, geometric mean: {_verdict(run_geo, 1.0) if run_geo else 'not measured'}. "
              + ("MiniLM load, Cortex / onnxruntime-web: cold " + _verdict(minilm["cold_ratio"], COLD_GOAL)
                 + ", warm " + _verdict(minilm["warm_ratio"], WARM_GOAL) + "." if minilm else "MiniLM's loads were not measured in this run.")]
    lines += ["", "#### Two threads in Chromium", "",
              ("This machine has 2 cores, so 2 threads are measured against 1; 4 threads cannot be measured honestly "
               "here (they would time-slice 2 cores). onnxruntime-web numThreads 2 needs SharedArrayBuffer, so it runs "
               "in a Worker of the isolated page in both comparisons. (a) Cortex `numThreads: 2` on the plain page's "
               "main thread, on a `--parallel 2` build of the model (its large contractions sliced into 2 independent "
               "CUs; a default build is a chain of CUs, which runs on one thread whatever numThreads says): "
               "independent CUs on a Worker, no isolation needed; its speedup is against the default build on one thread. (b) Cortex's `--wasm-features threads` "
               "build under `threads: 2` in a Worker of the isolated page: each large contraction in parts on 2 threads. "
               "Speedups are 1 thread / 2 threads of the same runtime (Cortex: its default build on one thread)."), "",
              "| model | Cortex numThreads 2 ms (plain) | Cortex threads 2 ms (isolated) | ort-web 2t ms (isolated) "
              "| (a) ratio | (b) ratio | Cortex speedup (a) | Cortex speedup (b) | ort-web speedup | not measured |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in measured:
        c = r["chromium"]
        run = c.get("run", {})
        missing = "; ".join(f"{k}: {v}" for k, v in c.get("errors", {}).items() if not k.startswith("memory"))
        lines.append(f"| {r['model']} | {_ms(run.get('cortex-numThreads2'))} | {_ms(run.get('cortex-threads2'))} | "
                     f"{_ms(run.get('ortweb-2t'))} | {_ratio(c.get('numthreads_ratio'))} | {_ratio(c.get('threads_ratio'))} | "
                     f"{_ratio(c.get('cortex_numthreads_speedup'))} | {_ratio(c.get('cortex_threads_speedup'))} | "
                     f"{_ratio(c.get('ortweb_speedup'))} | {missing or '-'} |")
    a = geomean([r["chromium"]["numthreads_ratio"]["median"] for r in measured if r["chromium"].get("numthreads_ratio")])
    b = geomean([r["chromium"]["threads_ratio"]["median"] for r in measured if r["chromium"].get("threads_ratio")])
    lines += ["", f"Geometric mean, Cortex 2 threads / onnxruntime-web 2 threads: (a) {_verdict(a, THREADS_GOAL)}, "
              f"(b) {_verdict(b, THREADS_GOAL)}."]
    lines += ["", "#### Memory after `session.release()`", "",
              ("MB before create / after the first run / after `release()` (change after release against before "
               f"create; goal: within {MEMORY_SLACK:.0%}). Chromium: the page renderer's resident bytes (/proc) in a "
               "Chromium of its own with no DevTools client (a DevTools client's Network agent keeps every "
               "fetched file in the renderer), garbage collected first (--expose-gc), the runtime already "
               "imported before create, the session object still held after release; Cortex proxy: the session "
               "created with `proxy: true`, in a dedicated Worker that `release()` ends; a later session: a second "
               "create, run and release on the same page, against the first's release (what a session adds once "
               "the page has run one); private: the renderer's RssAnon (heaps, wasm memories, compiled code), "
               "its growth after release taken against the whole RSS before create: the rest of the resident "
               "set is file-backed, mostly Chromium's own executable, which a page's first use of the "
               "optimising compilers pages in once (~10 MB on MiniLM, for onnxruntime-web too) and the kernel "
               "takes back under pressure; "
               "`performance.measureUserAgentSpecificMemory()` is not used: it counts no non-shared "
               "WebAssembly.Memory. Node: `process.memoryUsage().rss` after `gc()` (node --expose-gc), one process "
               "per contestant, with MALLOC_TRIM_THRESHOLD_=0 (glibc gives freed heap pages back at once), the files "
               "fetched over http from 127.0.0.1 or read from disk (Node's fetch keeps native memory of its own "
               "after the bodies are dropped: MiniLM's 43 module files fetched, read and dropped with no compile "
               "and no Cortex left +26-30 MB). onnxruntime-web starts its wasm instance at its first session, so its before "
               "excludes it."), "",
              "| model | Chromium Cortex RSS | Chromium Cortex proxy RSS | Chromium ort-web RSS | Node Cortex RSS (http) "
              "| Node ort-web RSS (http) | Node Cortex RSS (files) | Node ort-web RSS (files) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.get("chromium") or {}
        node = r.get("node_memory", {})
        chromium = {k: _memory_cell(m, "rss_") + _private_cell(m) + _later_cell(m) for k, m in c.get("memory", {}).items()}
        lines.append(f"| {r['model']} | {chromium.get('cortex', 'n/a')} | {chromium.get('cortex-proxy', 'n/a')} | "
                     f"{chromium.get('ortweb', 'n/a')} | {_memory_cell(node.get('cortex'))} | "
                     f"{_memory_cell(node.get('ortweb'))} | {_memory_cell(node.get('cortex-file'))} | "
                     f"{_memory_cell(node.get('ortweb-file'))} |")
    notes = [f"{r['model']} {k}: {v}" for r in results for k, v in {**(r.get('chromium') or {}).get('errors', {}),
                                                                   **{f'node memory {k}': v for k, v in r.get('node_memory_errors', {}).items()}}.items()
             if "memory" in k]
    if notes:
        lines += ["", "Memory not measured: " + "; ".join(notes) + "."]
    return lines
