"""The Open Inference Protocol (KServe v2) over HTTP, as a Starlette app.

    GET  /v2/health/live, /v2/health/ready, /v2            liveness, readiness, server metadata
    GET  /v2/models/{name}[/versions/{v}][/ready]          model metadata and readiness
    POST /v2/models/{name}[/versions/{v}]/infer            JSON tensors or the binary extension
    GET  /metrics                                          Prometheus

Per request, `X-Cortex-Policy` picks the scheduler's policy and `X-Cortex-Trace: true` returns the
run's trace as the response parameter `cortex_trace` (a JSON string: the protocol's parameters
are scalars). Every error is `{"error": "..."}` with a 4xx for the request's mistakes (the body is
read with a size limit, 413, and a deadline, 408, before any of it is decoded) and a 500 for a
failure while running it; neither stops the server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cortex.runtime.policy import POLICIES
from cortex.serve.codec import (
    HEADER_LENGTH,
    RequestError,
    decode_request,
    encode_response,
    tensor_metadata,
)
from cortex.serve.metrics import CONTENT_TYPE, ServerMetrics
from cortex.serve.pool import ModelPool, RunFailed
from cortex.serve.specializations import model_parameters

SERVER_NAME = "cortex"
SERVER_VERSION = "0.1.0"
MODEL_VERSION = "1"
EXTENSIONS = ["binary_tensor_data"]


@dataclass
class ServeSettings:
    model_name: str
    max_body_bytes: int
    read_timeout_s: float


def create_app(pool: ModelPool, settings: ServeSettings) -> Starlette:
    metrics = ServerMetrics(settings.model_name, [s["name"] for s in pool.sections or ()])
    metrics.loaded(pool.instances_loaded())
    check_shapes = pool.shape_rule(f"model {settings.model_name!r}")
    check_values = pool.value_rule(f"model {settings.model_name!r}")
    metadata = {"name": settings.model_name, "versions": [MODEL_VERSION], "platform": "cortex_dag",
                "inputs": [tensor_metadata(spec) for spec in pool.inputs],
                "outputs": [tensor_metadata(spec) for spec in pool.outputs]}
    if pool.sections:
        metadata["parameters"] = model_parameters(pool.sections, pool.options.pad_to_bucket)

    def model_or_404(request: Request) -> None:
        name = request.path_params["name"]
        if name != settings.model_name:
            raise RequestError(f"unknown model {name!r}: this server serves {settings.model_name!r}", 404)
        version = request.path_params.get("version")
        if version is not None and version != MODEL_VERSION:
            raise RequestError(f"model {name!r} has no version {version!r}: its one version is {MODEL_VERSION!r}", 404)

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})     # the pool is loaded before the server listens

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def model_metadata(request: Request) -> Response:
        model_or_404(request)
        return JSONResponse(metadata)

    async def model_ready(request: Request) -> Response:
        model_or_404(request)
        return JSONResponse({"name": settings.model_name, "ready": True})

    async def infer(request: Request) -> Response:
        start = time.perf_counter()
        try:
            response = await _infer(request)
        except RequestError as e:
            response = error_response(str(e), e.status)
        metrics.request(response.status_code, time.perf_counter() - start)
        return response

    async def _infer(request: Request) -> Response:
        model_or_404(request)
        policy = request.headers.get("x-cortex-policy")
        if policy is not None and policy not in POLICIES:
            raise RequestError(f"X-Cortex-Policy {policy!r}: expected one of {', '.join(POLICIES)}")
        with_trace = _flag(request.headers.get("x-cortex-trace"), "X-Cortex-Trace")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise RequestError(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed", 415)
        body = await read_body(request, settings)
        decoded = decode_request(body, request.headers.get(HEADER_LENGTH), pool.inputs, pool.outputs, check_shapes)
        if check_values is not None:        # a value no specialization was built for: the request's fault
            check_values(decoded.feeds)
        try:
            run = await pool.run(decoded.feeds, decoded.outputs, policy)
        except RunFailed as e:
            metrics.failed(e.sandbox_events)
            metrics.loaded(pool.instances_loaded())      # the failed instance was replaced, nothing loaded
            return error_response(f"the model failed on this request: {e}", 500)
        metrics.ran(run.trace, pool.resident_bytes(), run.sandbox_events)
        if run.specialization is not None:
            metrics.ran_on(run.specialization)
            metrics.loaded(pool.instances_loaded())
        head = {"model_name": settings.model_name, "model_version": MODEL_VERSION}
        if decoded.id is not None:
            head["id"] = decoded.id
        if with_trace:
            head["parameters"] = {"cortex_trace": json.dumps(run.trace, separators=(",", ":"))}
        content, header_length = encode_response(run.outputs, decoded.binary_outputs, head)
        if header_length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(header_length)})

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    async def request_error(request: Request, exc: RequestError) -> Response:
        return error_response(str(exc), exc.status)

    async def server_error(request: Request, exc: Exception) -> Response:
        # A bug in the server: the client still gets the protocol's error body; uvicorn logs it.
        return error_response(f"internal error in cortex serve: {type(exc).__name__}: {exc}", 500)

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *(Route(base, model_metadata, methods=["GET"]) for base in (model, versioned)),
        *(Route(f"{base}/ready", model_ready, methods=["GET"]) for base in (model, versioned)),
        *(Route(f"{base}/infer", infer, methods=["POST"]) for base in (model, versioned)),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, RequestError: request_error,
                                                     Exception: server_error})


async def read_body(request: Request, settings: ServeSettings) -> bytes:
    """The whole body, refused with a 413 as soon as it passes the limit (before it is all read) and
    with a 408 when the client has not sent it within the read timeout."""
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body is {declared} bytes, over the limit of {limit} bytes (--max-body-mb)", 413)
    chunks, size = [], 0
    try:
        with anyio.fail_after(settings.read_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(f"the body passes the limit of {limit} bytes (--max-body-mb)", 413)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(f"the client sent {size} bytes of the body in {settings.read_timeout_s:g} s and no more "
                           f"(--read-timeout-s)", 408) from None
    except ClientDisconnect:
        raise RequestError("the client disconnected before sending the whole body", 400) from None
    return b"".join(chunks)


def error_response(message: str, status: int) -> Response:
    # A refused body may still be arriving: closing the connection keeps it from being read as the
    # next request.
    headers = {"Connection": "close"} if status in (408, 413) else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _flag(value: str | None, header: str) -> bool:
    if value is None:
        return False
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise RequestError(f"{header} {value!r}: expected true or false")
