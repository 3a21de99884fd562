"""Running the app on uvicorn: the listening socket is bound first (a taken port is one clear
error, and `--port 0` picks a free one that the startup line names), then uvicorn serves until
SIGTERM or SIGINT, finishing the requests in flight before it returns."""

from __future__ import annotations

import signal
import socket

import uvicorn
from starlette.applications import Starlette

from ir.errors import CortexError


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CortexError(f"--host {host!r}: not an address this machine can listen on ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise CortexError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def serve(app: Starlette, sock: socket.socket, drain_timeout_s: float) -> None:
    """Serve until a signal; return once the requests in flight are answered (or the drain timeout
    passed)."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=drain_timeout_s,
                            lifespan="off")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it shut down on once it is done. SIGTERM is a normal stop for a
    # server (orchestrators send it), so by then it only has to return, and the command exits 0.
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


def _drained(signum, frame) -> None:
    """SIGTERM after uvicorn has drained: nothing is left to stop."""
