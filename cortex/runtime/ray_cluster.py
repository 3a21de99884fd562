"""The Ray cluster as the executor and parallel compile see it: Ray imported on first use, joining
a cluster (with a quick answer for a mistyped address), its free CPUs and node memory, the errors
after which a request is resubmitted, and `ray_map` (one Ray task per item) for
`cortex compile-<target> --executor ray`.
"""

from __future__ import annotations

import logging
import socket
import time

from ir.errors import CortexError


def ray_module():
    """Ray, imported on first use: it is an optional dependency (`pip install cortex-compiler[ray]`)
    and takes a second to import."""
    try:
        import ray
    except ImportError:
        raise CortexError("the ray executor needs Ray: pip install 'cortex-compiler[ray]'") from None
    return ray


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ("auto": the one `ray start` runs here; None: the one this
    process already joined, else a new local one)."""
    ray = ray_module()
    if ray.is_initialized():
        return
    if address and address != "auto" and "://" not in address:
        _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False,
                 configure_logging=True)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"--address {address}" if address else "a local Ray cluster"
        raise CortexError(f"{where}: cannot connect ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Ray retries a head that does not answer for minutes; a user who mistyped the address wants
    to know at once."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise CortexError(f"--address {address}: expected HOST:PORT of the Ray head, or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise CortexError(f"--address {address}: no Ray head answers there ({e.strerror or e})") from None


def free_cpus(ray, wanted: float, patience_s: float = 10.0) -> float:
    """The cluster's free CPUs, waiting up to `patience_s` for `wanted` of them: a closed model's
    actors give theirs back a moment after they are killed."""
    deadline = time.monotonic() + patience_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free + 1e-9 >= wanted or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


def node_memory(ray) -> int:
    """The `memory` resource of the cluster's largest live node: what one actor may ask for."""
    return int(max((node["Resources"].get("memory", 0) for node in ray.nodes() if node.get("Alive")), default=0))


def lost_errors(ray) -> tuple[type, ...]:
    """Errors after which a request is resubmitted: its actor, node or a result it needs is gone."""
    ex = ray.exceptions
    names = ("RayActorError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError",
             "ObjectReconstructionFailedError", "WorkerCrashedError", "NodeDiedError", "ObjectFetchTimedOutError")
    return tuple(getattr(ex, n) for n in names if hasattr(ex, n))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def ray_map(function, items: list, num_cpus: float = 1.0) -> list:
    """`map(function, items)` as one Ray task per item, results in order; an error an item raises
    (a CortexError naming its CU) is raised as it is. For `cortex compile-<target> --executor ray`."""
    ray = ray_module()
    task = ray.remote(num_cpus=num_cpus, max_retries=2)(_call)
    function_ref = ray.put(function)
    refs = [task.remote(function_ref, item) for item in items]
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, CortexError):
            raise type(cause)(str(cause)) from None
        raise CortexError(f"a Ray task failed: {first_line(e)}") from None


def _call(function, item):
    return function(item)



def cu_map(executor: str, address: str | None):
    """How `compile-<target> --executor` spreads the CU builds: None for the local threads, else
    one Ray task per CU on the cluster at `address`."""
    if executor not in ("local", "ray"):
        raise CortexError(f"--executor {executor}: expected local or ray")
    if executor == "local":
        if address is not None:
            raise CortexError("--address names a Ray cluster: it needs --executor ray")
        return None
    connect(address)
    return ray_map
