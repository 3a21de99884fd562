"""`cortex serve`: serve a compiled dag.json over HTTP (Open Inference Protocol / KServe v2)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from backends.limits import AUTO_DEADLINE
from cortex.commands.generated_options import with_options
from cortex.commands.shared_options import DeviceOption
from cortex.console import out
from cortex.runtime.options import RuntimeOptions
from cortex.serve.app import ServeSettings, create_app
from cortex.serve.pool import ModelPool
from cortex.serve.server import bind
from cortex.serve.server import serve as serve_app
from ir.errors import CortexError

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MB = 1 << 20


# A server defaults to deadlines from each CU's cost: one hostile request must not hold a worker.
@with_options(RuntimeOptions, into="runtime", defaults={"cu_timeout_ms": AUTO_DEADLINE},
              exclude=("trust_threshold", "cache_bytes", "pins", "executor", "address", "executor_options"))
def serve(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled for the device.")],
    runtime: RuntimeOptions,
    host: Annotated[str, typer.Option("--host", help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="The TCP port (0: a free one, named in the startup line).")]
    = 8000,
    model_name: Annotated[str | None, typer.Option("--model-name", help="The model's name in /v2/models/NAME "
                                                      "(default: the name of dag.json's folder).")] = None,
    device: DeviceOption = "wasm",
    workers: Annotated[int, typer.Option("--workers", help="Model instances, each serving one request at a time.")]
    = 1,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", help="The largest request body, in MB (413 past "
                                               "it).")] = 64.0,
    read_timeout_s: Annotated[float, typer.Option("--read-timeout-s", help="Seconds a client has to send a request's "
                                                  "body (408 past it).")] = 30.0,
    drain_timeout_s: Annotated[float, typer.Option("--drain-timeout-s", help="Seconds SIGTERM waits for the requests "
                                                   "in flight.")] = 30.0,
) -> None:
    """Serve the model over HTTP (Open Inference Protocol v2) with Prometheus metrics at /metrics.
    Each instance is loaded with the runtime options (--memory-budget: each instance's); a request's
    X-Cortex-Policy header overrides --policy."""
    if workers < 1:
        raise CortexError(f"--workers must be at least 1, got {workers}")
    if not 0 <= port <= 65535:
        raise CortexError(f"--port must be within 0..65535, got {port}")
    for option, value in (("--max-body-mb", max_body_mb), ("--read-timeout-s", read_timeout_s),
                          ("--drain-timeout-s", drain_timeout_s)):
        if not value > 0:
            raise CortexError(f"{option} must be positive, got {value:g}")
    name = model_name if model_name is not None else dag.resolve().parent.name
    if not MODEL_NAME.fullmatch(name):
        raise CortexError(f"--model-name {name!r}: use letters, digits, '_', '.' and '-' (it is part of the URL)")
    pool = ModelPool(dag, device, runtime, workers)
    app = create_app(pool, ServeSettings(name, max_body_bytes=int(max_body_mb * MB), read_timeout_s=read_timeout_s))
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    out.print(f"serving {name} ({dag}) on http://{_url_host(bound_host)}:{bound_port} with {workers} "
              f"instance{'s' if workers != 1 else ''} on {device}")
    sys.stdout.flush()                       # a supervisor reading the pipe learns the port now
    serve_app(app, sock, drain_timeout_s)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
