"""Generation builds output only a step's new key/value rows (`decompose --kv-buckets`).

The generation runtime writes only the rows a step added to its cache (cortex/generation/), yet a
model's present outputs are whole cache buffers: copying them out of the CUs costs a fifth of a
decode step at a 1280-token bucket in Qwen2.5-0.5B's shape (91 against 74 ms). This pass makes each
present output its S new rows, [B, KVH, S, HD]:
- shared-buffer models (present as long as the past): rows L .. L+S-1, with L + S = sum(mask), the
  cache length the attention itself reads from the mask;
- concat models (present = past, then the new rows): rows P .. P+S-1 of the P + S.
The output keeps its name; a runtime tells a rows build by present's extent, S.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir import dtypes
from ir.errors import CortexError
from ir.graph import Graph, Node, Value
from passes.base import Pass


@dataclass
class NewCacheRows(Pass):
    name = "new-cache-rows"
    present: tuple[str, ...] = ()
    mask: str = "attention_mask"
    tokens: int = 1
    first_row: int | None = None        # concat models: P; shared-buffer models: None (from the mask)

    def run(self, graph: Graph) -> Graph:
        outputs = {v.name: v for v in graph.outputs}
        rows, nodes = self._rows(graph)
        for name in self.present:
            whole = outputs.get(name)
            if whole is None or not whole.is_static or len(whole.shape) != 4:
                raise CortexError(f"new-cache-rows: {name} is not a 4-D output of static shape")
            whole.name = graph.fresh_name(f"{name}.buffer")
            new = Value(name, whole.dtype, (whole.shape[0], whole.shape[1], self.tokens, whole.shape[3]))
            nodes.append(Node("Gather", [whole, rows], [new], {"axis": 2}, name=graph.fresh_name(f"{name}.rows")))
            graph.outputs = [new if v is whole else v for v in graph.outputs]
        graph.nodes.extend(nodes)
        return graph

    def _rows(self, graph: Graph) -> tuple[Value, list[Node]]:
        """The step's row indices, [S] int64, and the nodes that compute them."""
        steps = np.arange(self.tokens, dtype=np.int64)
        if self.first_row is not None:
            return _constant(graph, "new_rows", self.first_row + steps), []
        mask = next((v for v in graph.inputs if v.name == self.mask), None)
        if mask is None:
            raise CortexError(f"new-cache-rows: the model has no input {self.mask!r}")
        axes = _constant(graph, "mask_axes", np.array([1], np.int64))
        total = Value(graph.fresh_name("cache_length"), mask.dtype, (1,))
        as_int64 = Value(graph.fresh_name("cache_length_64"), dtypes.INT64, (1,))
        rows = Value(graph.fresh_name("new_rows"), dtypes.INT64, (self.tokens,))
        return rows, [Node("ReduceSum", [mask, axes], [total], {"keepdims": 0}, name=graph.fresh_name("cache_length")),
                      Node("Cast", [total], [as_int64], {"to": dtypes.INT64}, name=graph.fresh_name("cache_length_64")),
                      Node("Add", [as_int64, _constant(graph, "row_offsets", steps - self.tokens)], [rows],
                           name=graph.fresh_name("new_rows"))]


def _constant(graph: Graph, base: str, array: np.ndarray) -> Value:
    return Value(graph.fresh_name(base), dtypes.INT64, tuple(array.shape), const=array)
