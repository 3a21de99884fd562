"""The Ray executor's requests as a Ray Compiled Graph (`executor_options={"compiled_graph": True}`).

A Compiled Graph (`ray.dag` + `experimental_compile`) fixes the calls of a request once: each
stage's actor runs a loop that reads its inputs from shared-memory channels and writes its result
to the next, so a hop costs no task submission, scheduling or object-store round trip. What the
graph fixes is the plan: which stages are called, what each returns and reads. That holds for
every request of a static dag under one policy and one set of requested outputs, so a graph is
compiled per (policy, outputs) on first use and replaced when a request asks for another.
Conditional CUs are refused at load: which stages a request needs would change with the branch a
condition takes. The actors are the executor's own, running the same `CUStage.run`.

Failures. A request the graph cannot finish (an error of a lost actor or channel) tears the graph
down, and it and the requests after it in the batch run on the actor path, with its resubmission
on node loss; the next batch compiles a new graph. The outputs returned still always come from one
complete run. Not every loss ends in an error, though: with Ray 2.60 an actor killed while its
graph ran once crashed the head's raylet (a failed check in experimental_mutable_object_provider
writing to the closed channel), and the driver with it. So the option is for clusters whose nodes
stay up; the actor path is the one that survives node loss.
"""

from __future__ import annotations

from collections import deque

from cortex.runtime.policy import Policy
from cortex.runtime.ray_plan import StageCall

IN_FLIGHT = 3       # requests a graph holds at once (see CompiledRequests)


class CompiledRequests:
    """One compiled graph: the calls of `plan` over `actors`, under `policy`."""

    def __init__(self, actors: list, plan: list[StageCall], policy: Policy, outputs: list[str], window: int,
                 timeout_s: float):
        # Ray is an optional dependency: imported once the executor is used.
        from ray.dag import InputNode, MultiOutputNode
        self.key = (policy, tuple(outputs))
        nodes = {}
        with InputNode() as feeds:
            for call in plan:
                nodes[call.stage] = actors[call.stage].run_linked.bind(
                    policy, call.returns, feeds if call.feeds else {}, *(nodes[j] for j in call.reads))
            graph = MultiOutputNode([nodes[call.stage] for call in plan])
        # Each channel holds one value until all its readers read it, and this process reads every
        # stage's output: past the oldest result not read yet, a stage can hold one request written
        # and one being run, the input channel a third; a fourth and `execute` waits for a reader
        # that never comes.
        self.window = max(1, min(window, IN_FLIGHT))
        self.graph = graph.experimental_compile(_max_inflight_executions=self.window, _submit_timeout=timeout_s)

    def run_many(self, batch: list[dict], collect, failures: tuple[type, ...]) -> list:
        """`collect(index, ref)` for each request executed, in order, up to `window` in flight; stops
        at the first request the graph fails: `collect` returns None for it, or `execute` raises
        one of `failures`. Returns what was collected."""
        done, pending, submitted, broken = [], deque(), 0, False
        for index in range(len(batch)):
            while not broken and submitted < len(batch) and submitted - index < self.window:
                try:
                    pending.append(self.graph.execute(batch[submitted]))
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

    def teardown(self) -> None:
        self.graph.teardown()
