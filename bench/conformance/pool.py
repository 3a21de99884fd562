"""Run cases in parallel, each in its own process with a time limit.

A process per case buys what a thread or a long-lived worker cannot: a case that hangs or takes the
interpreter down (a wasmtime abort, a segfault in a native library) is killed or reaped without
stalling the suite. The processes are forked from a fork server that has imported the pipeline once
and has never run anything, so each starts in milliseconds and inherits no thread pools (a process
forked from one that has compiled wasm would wait forever on the compiler threads it did not inherit).
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Callable, Iterable

import onnx

from bench.conformance.cases import case_op
from bench.conformance.run_case import CaseResult, run_case
from samples.node_tests import NODE_TESTS_DIR


PRELOAD = ["bench.conformance.run_case", "cortex.commands.decompose", "cortex.dag", "cortex.runtime",
           "backends.wasm.build"]


def run_cases(names: Iterable[str], device: str, jobs: int = 2, timeout: float = 60.0,
              on_result: Callable[[CaseResult], None] | None = None,
              run: Callable[[str, str], CaseResult] = run_case) -> list[CaseResult]:
    """Results in the order of `names`. `run` (a module-level function) runs one case."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    pending = deque(names)
    order = {name: i for i, name in enumerate(pending)}
    running: dict = {}      # connection -> (process, case name, start time)
    results: dict[str, CaseResult] = {}
    # The children's temporary folders live in one scratch folder, removed at the end even when a
    # killed child could not clean up after itself.
    scratch = tempfile.mkdtemp(prefix="cortex-conformance-")

    def finish(result: CaseResult) -> None:
        results[result.name] = result
        if on_result:
            on_result(result)

    try:
        while pending or running:
            while pending and len(running) < max(1, jobs):
                name = pending.popleft()
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(run, name, device, sender, scratch), daemon=True)
                process.start()
                sender.close()
                running[receiver] = (process, name, time.monotonic())
            for conn in wait(list(running), timeout=0.2):
                process, name, start = running.pop(conn)
                try:
                    result = conn.recv()
                except (EOFError, OSError):
                    process.join()
                    result = CaseResult(name, _op_of(name), "crashed",
                                        f"the process running it died (exit code {process.exitcode})",
                                        seconds=round(time.monotonic() - start, 3))
                conn.close()
                process.join()
                finish(result)
            now = time.monotonic()
            for conn, (process, name, start) in list(running.items()):
                if now - start > timeout:
                    process.kill()
                    process.join()
                    conn.close()
                    del running[conn]
                    finish(CaseResult(name, _op_of(name), "crashed", f"timed out after {timeout:g} s",
                                      seconds=round(now - start, 3)))
    finally:
        for process, _, _ in running.values():      # interrupted: leave no case running
            process.kill()
            process.join()
        shutil.rmtree(scratch, ignore_errors=True)
    return sorted(results.values(), key=lambda r: order[r.name])


def _child(run, name: str, device: str, sender, scratch: str) -> None:
    tempfile.tempdir = scratch
    try:
        result = run(name, device)
    except BaseException as e:  # the harness itself failed on this case: still one result
        result = CaseResult(name, _op_of(name), "crashed", f"{type(e).__name__}: {str(e).strip()[:300]}")
    sender.send(result)
    sender.close()


def _op_of(name: str) -> str:
    try:
        return case_op(onnx.load(NODE_TESTS_DIR / name / "model.onnx", load_external_data=False))
    except Exception:  # an unreadable case still gets its row
        return "?"
