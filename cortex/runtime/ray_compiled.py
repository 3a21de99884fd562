"""The Ray executor's requests as a Ray Compiled Graph (`executor_options={"compiled_graph": True}`).

A Compiled Graph (`ray.dag` + `experimental_compile`) fixes the calls of a request once: each
stage's actor runs a loop that reads its input from a channel and writes its result to the next,
so a hop costs no task submission, scheduling or object-store round trip. Between processes of
one node a channel is shared memory; across nodes the raylets carry it.

The graph is one chain through every stage of the pipeline, the same for every request, policy
and set of requested outputs. A message is (chain id, the chain or None, tensors, the traces of the
stages that ran, a CU's error or None): the caller writes one with the feeds to the first stage;
each stage runs its CUs on the tensors it received, adds what it made and its trace, keeps what
later stages or the caller read (`ray_plan.Planner.chain`) and writes that to the next; the caller
reads the last stage's message only (one channel, not one per stage). A CU's error travels in the
message, so that the stages after it still see a chain sent with that request.

A message crosses a channel as one bytes object, pickled here (protocol 5, numpy arrays in band):
Ray's own serialization of a value holding numpy arrays took 0.25 ms a round trip to an actor on
this process's node, bytes 0.10 ms, and the pickling both ways 0.01 ms. Unpickled arrays are
the reader's own, not views of a channel's buffer that the next message overwrites. What a stage runs, returns and
passes on is the plan of (policy, outputs), sent with the first request that uses it and kept by
the actors under its id; skip, cache and branch decisions are the stages' schedulers', as on the
actor path, so conditional CUs run too. A stage the plan does not call only passes messages on.
The actors are the executor's own (`CUStage.run_chained`).

Bounded waits. Each channel holds one message until its reader takes the next, and each stage
holds the one it works on: a chain of N stages holds N + 1 requests that the caller has not read,
so at most that many are in flight (more, and `execute` would wait on a stage that waits on the
caller). `execute` waits at most `timeout_s` for room, reading a result at most `timeout_s`;
teardown is bounded by Ray's own `RAY_CGRAPH_teardown_timeout`.

Failures. A request the graph cannot finish (an error of a lost actor or channel) tears the graph
down, and it and the requests after it in the batch run on the actor path, with its resubmission
on node loss; the next batch compiles a new graph. The outputs returned still always come from one
complete run. Not every loss ends in an error, though: with Ray 2.60 an actor killed while its
graph ran once crashed the head's raylet (a failed check in experimental_mutable_object_provider
writing to the closed channel), and the driver with it. So the option is for clusters whose nodes
stay up; the actor path is the one that survives node loss.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict, deque
from collections.abc import Callable

from cortex.runtime.ray_plan import Chain

# Chains the caller remembers having sent; an actor keeps twice as many, so that a chain the caller
# still counts as sent is one the actors hold (both evict the least recently used).
SENT_CHAINS = 32
KEPT_CHAINS = 2 * SENT_CHAINS


class CompiledRequests:
    """One compiled graph: a chain through `actors`, one stage each."""

    def __init__(self, actors: list, window: int, timeout_s: float):
        # Ray is an optional dependency: imported once the executor is used.
        from ray.dag import InputNode
        with InputNode() as message:
            node = message
            for k, actor in enumerate(actors):
                node = actor.run_chained.bind(k, node)
        self.window = max(1, min(window, len(actors) + 1))
        self.timeout_s = timeout_s
        self.graph = node.experimental_compile(_max_inflight_executions=self.window, _submit_timeout=timeout_s)
        self.sent: OrderedDict[int, None] = OrderedDict()

    def run_many(self, batch: list[dict], chain_id: int, chain: Chain, collect: Callable[[int, object], object],
                 failures: tuple[type, ...], timeouts: tuple[type, ...]) -> list:
        """`collect(index, ref)` for each request executed, in order, up to `window` in flight, `ref`
        the last stage's message to come; stops at the first request the graph fails: `collect`
        returns None for it, or `execute` raises one of `failures`. Returns what was collected.
        `execute` finding no room in `timeout_s` raises one of `timeouts`, as it is. The message read
        from `ref` is bytes: `decode` it."""
        done, pending, submitted, broken = [], deque(), 0, False
        for index in range(len(batch)):
            while not broken and submitted < len(batch) and submitted - index < self.window:
                try:
                    pending.append(self.graph.execute(
                        encode((chain_id, self._unsent(chain_id, chain), batch[submitted], [], None))))
                except timeouts:
                    raise
                except failures:
                    broken = True
                    break
                submitted += 1
            if not pending:
                return done
            result = collect(index, pending.popleft())
            if result is None:
                return done
            done.append(result)
        return done

    def _unsent(self, chain_id: int, chain: Chain) -> Chain | None:
        """The chain, if the actors may not hold it yet; else None (they have it by its id)."""
        if chain_id in self.sent:
            self.sent.move_to_end(chain_id)
            return None
        self.sent[chain_id] = None
        if len(self.sent) > SENT_CHAINS:
            self.sent.popitem(last=False)
        return chain

    def teardown(self) -> None:
        self.graph.teardown()


def encode(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=5)


def decode(data: bytes) -> tuple:
    return pickle.loads(data)
