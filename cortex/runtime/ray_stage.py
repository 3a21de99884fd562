"""One stage of the Ray executor on its actor (`cortex/runtime/ray_executor.py`): the normal
scheduler on the stage's CUs and normal device, loaded from this node's copy of their files
(`ray_artifacts.py`), called per request or group of requests on the actor path, or as a turn in a
Compiled Graph's chain (`ray_compiled.py`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cortex.runtime.cache import ResultCache
from cortex.runtime.policy import Policy
from cortex.runtime.ray_artifacts import ShippedFile, local_error, materialise, node_cache_dir
from cortex.runtime.ray_cluster import ray_module
from cortex.runtime.ray_compiled import KEPT_CHAINS, decode, encode
from cortex.runtime.ray_plan import Chain, stage_dag
from cortex.runtime.request import Request
from cortex.runtime.scheduler import SequentialScheduler
from ir.errors import CortexError


class StageScheduler(SequentialScheduler):
    """The scheduler on one stage: it returns those of the tensors asked for that exist after its
    walk (an untaken branch's never do, and are not shipped)."""

    def _results(self, outputs: list[str], request: Request) -> dict[str, np.ndarray]:
        return super()._results([name for name in outputs if name in request.env], request)


@dataclass(frozen=True)
class Shipment:
    """What an actor needs to load its stage without the driver's folder."""
    dag_path: str                       # the driver's dag.json, as the caller named it (for errors)
    folder: str                         # the driver's folder, resolved (for errors)
    files: list[ShippedFile]
    contents: dict[str, list]           # sha256 -> [object ref]: in a list, so Ray hands the ref, not the bytes
    key: str
    cache_dir: str | None               # None: this node's default (ray_artifacts.node_cache_dir)


class CUStage:
    """One Ray actor: the scheduler on one stage's CUs, on the normal device, loaded from this
    node's copy of their files."""

    def __init__(self, dag: dict, shipment: Shipment, device: str, cu_ids: list[str], cache_bytes: int):
        self.loaded_policies: set[Policy] = set()
        self.chains: OrderedDict[int, Chain] = OrderedDict()     # a Compiled Graph's plans, by id
        # A load error is kept and raised by the first call: Ray does not hand an error raised in
        # an actor's constructor to the caller, only its text, and the caller wants the local error.
        self.load_error: CortexError | None = None
        self.dag_path: Path | None = None
        self.dag, self.shipment = dag, shipment
        try:
            self.dag_path = self._materialise()
        except CortexError as e:
            self.load_error = e
            return
        try:
            # An actor walks its stage one CU after the other: its runs of CUs run as segments.
            self.scheduler = StageScheduler(stage_dag(dag, cu_ids), self.dag_path, device, ResultCache(cache_bytes),
                                            segments=True)
            self.scheduler.load()
        except CortexError as e:
            self.load_error = local_error(e, self.dag_path, shipment.dag_path, shipment.folder)

    def _materialise(self) -> Path:
        """This node's copy of the stage's files (fetched where the node lacks them): its dag.json."""
        shipment = self.shipment
        root = Path(shipment.cache_dir) if shipment.cache_dir else node_cache_dir()
        try:
            return materialise(root, shipment.key, self.dag, shipment.files,
                               lambda sha256: ray_module().get(shipment.contents[sha256][0]))
        except OSError as e:
            raise CortexError(f"{root}: cannot keep {shipment.dag_path}'s artifacts on this node "
                              f"({e.strerror or e})") from None

    def _check_copy(self) -> None:
        """The node's copy is made again if it went (a cleaned cache folder) before a call is
        served: the scheduler still loads files from it after the first request (the variants a
        policy picks, at that policy's first request), and a stage that serves must be one that
        could load. One stat per call; materialise fetches only what is missing, at the same path."""
        if not self.dag_path.is_file():
            self._materialise()

    def where(self) -> dict:
        """The node and process this actor runs in, and the dag.json it loaded there."""
        return {"node": ray_module().get_runtime_context().get_node_id(), "pid": os.getpid(),
                "dag_path": str(self.dag_path)}

    def resident_bytes(self) -> int:
        if self.load_error is not None:
            raise self.load_error
        return self.scheduler.resident_bytes()

    def run(self, policy: Policy, returns: list[str], feeds: dict, *upstream: dict) -> tuple[dict, dict]:
        """The tensors of `returns` that exist, and what this stage did (its part of the trace)."""
        if self.load_error is not None:
            raise self.load_error
        self._check_copy()
        if policy not in self.loaded_policies:
            self.scheduler.variants.load(policy)
            self.loaded_policies.add(policy)
        env = dict(feeds)
        for part in upstream:
            env.update(part)
        results, request = self.scheduler.run(env, policy, returns)
        return results, {"activated": request.activated, "skipped": request.skipped,
                         "cpu_seconds": request.cpu_seconds, "live_bytes": request.live_bytes}

    def run_group(self, policy: Policy, returns: list[str], count: int, feeds: list[dict] | None,
                  *upstream: dict) -> tuple:
        """`run` for `count` requests in one call (feeds None: this stage reads no model input;
        `upstream`: each earlier stage's `count` dicts, one after the other), so that a call's own
        cost is paid once for the group: each request's tensors, then the list of their traces.
        Each request's tensors are a return of their own: Ray keeps a return of up to 100 KiB in
        its reply, and fetching a larger one from the object store stalled for a second at a
        time (Ray 2.60, two nodes on loopback)."""
        parts = [self.run(policy, returns, feeds[i] if feeds is not None else {},
                          *(upstream[j * count + i] for j in range(len(upstream) // count)))
                 for i in range(count)]
        return (*(tensors for tensors, _ in parts), [trace for _, trace in parts])

    def run_chained(self, stage: int, message: bytes) -> bytes:
        """This stage's turn in a Compiled Graph's chain (`ray_compiled.py`): `message` is (chain id,
        the chain or None once sent, tensors, traces, a CU's error or None); the message to the next."""
        chain_id, sent, tensors, traces, error = decode(message)
        if sent is not None:
            chain = self.chains[chain_id] = sent
            if len(self.chains) > KEPT_CHAINS:
                self.chains.popitem(last=False)
        elif chain_id in self.chains:
            chain = self.chains[chain_id]
            self.chains.move_to_end(chain_id)
        else:
            raise CortexError(f"stage {stage} of the compiled graph does not hold plan {chain_id}")
        step = chain.steps[stage]
        if step.runs and error is None:
            try:
                results, trace = self.run(chain.policy, list(step.returns), tensors)
                tensors, traces = {**tensors, **results}, [*traces, trace]
            except CortexError as e:
                error = e
        return encode((chain_id, sent, {n: v for n, v in tensors.items() if n in step.passes_on}, traces, error))
