"""Slice a Conv along its output rows (`decompose --parallel N`) instead of its output channels.

A Conv lowers to a GEMM whose activation side is the im2col of its input, packed at run time into
panels of 16 output columns (backends/wasm/gemm.py); the weight side is packed at compile time.
Slicing the output channels gives every slice the whole im2col to pack again: N slices pack N
times what the whole Conv packs, a share of the work that grows as the channels per slice shrink
(measured on one thread, wasmtime: two halves of a 3x3 Conv 64 -> 64 on 56x56 cost 1.09x the whole,
256 -> 256 on 14x14 1.18x). Slicing the output rows gives each slice the im2col of its own rows
only, so the halves add up to the whole but for a Slice of the input rows each reads (its rows
plus the kernel's halo); each slice holds the whole weight instead of its share, which costs
memory, not time per run.

    slice k: rows [lo, hi) of Y = Conv(X[:, :, a:b, :]) with the top and bottom pads that the rows
             [a, b) of X still need, then the epilogue (bias, Relu...) on those rows
    Y = Concat(slice 0, ..., slice N-1, axis=2)

Taken for a 2-D Conv with explicit pads whose slices keep at least `MIN_COLUMNS` output columns
(whole panels) and whose kernel spans more than one row; a 1x1 Conv, whose im2col is its input,
gains too little to pay for the Slice and the Concat along the rows (measured: resnet50's 1x1
Convs sliced by rows cost more CPU than by channels), unless it reads a row-sliced result (a 3x3
Conv's): its slice k then reads that result's slice k as it is, so neither Concat nor Slice comes
between them and slice k of both may share a CU. Otherwise the Conv slices along its channels
(`split_large_ops.split_unit`).
The elementwise epilogue splits with it while its constants broadcast along the rows (a bias per
channel) or have one entry per output row.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ir import dtypes
from ir.graph import Graph, Node, Value
from ir.ops import ELEMENTWISE, kind_of
from passes.split_large_ops import epilogue_axes, slice_constant

ROW_AXIS = 2
MIN_COLUMNS = 64      # output columns (rows x width) per slice: four of the GEMM's 16-column panels


def rows_sliceable(conv: Node, pieces: int) -> bool:
    """Whether `conv` slices along its rows: it can, and its kernel spans more than one row, so the
    im2col a channel slice would pack again is the input times the kernel's size (a 1x1 Conv's is
    the input itself, which a row slice's Slice and a Concat along the rows cost about as much as)."""
    return row_slices_fit(conv, pieces) and conv.inputs[1].shape[2] > 1


def continues_rows(conv: Node, pieces: int, row_parts: dict[int, list[Value]]) -> bool:
    """Whether `conv` reads a row-sliced result row by row, so that its row slices read that
    result's slices with neither a Concat before nor a Slice."""
    parts = row_parts.get(id(conv.inputs[0]))
    return parts is not None and len(parts) == pieces and row_slices_fit(conv, pieces) and reads_rows_alike(conv)


def row_slices_fit(conv: Node, pieces: int) -> bool:
    """Whether `conv` can be cut into `pieces` slices of its output rows, each wide enough."""
    if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.outputs) != 1:
        return False
    x, out = conv.inputs[0], conv.outputs[0]
    if not (x.is_static and out.is_static and len(x.shape) == 4 and len(out.shape) == 4):
        return False
    if conv.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return False
    rows, width = out.shape[ROW_AXIS], out.shape[ROW_AXIS + 1]
    return rows >= pieces and (rows // pieces) * width >= MIN_COLUMNS


def reads_rows_alike(conv: Node) -> bool:
    """Whether each output row of `conv` reads the same input row alone (a 1x1 Conv, stride 1, no
    pads on the rows): its row slices can read the row slices of its producer as they are."""
    w = conv.inputs[1]
    pads = list(conv.attrs.get("pads", [0, 0, 0, 0]))
    return (w.shape[2] == 1 and int(conv.attrs.get("strides", [1, 1])[0]) == 1 and pads[0] == pads[2] == 0
            and conv.inputs[0].shape[ROW_AXIS] == conv.outputs[0].shape[ROW_AXIS])


def split_rows(graph: Graph, unit: list[Node], pieces: int, piece_of: dict[int, int],
               row_parts: dict[int, list[Value]]) -> list[Node]:
    """The nodes replacing `unit` (a Conv and its epilogue): `pieces` row slices, each recorded in
    `piece_of`, their Concat, and what of the epilogue does not split. `row_parts` maps a value
    row-sliced before (id) to its slices; the joined result's slices join it. A Conv that
    `reads_rows_alike` reads its input's slices there, in place of Slices of the joined input, so
    slice k of both ops can share a CU and the producer's Concat may go unread."""
    conv = unit[0]
    x, out = conv.inputs[0], conv.outputs[0]
    rows = out.shape[ROW_AXIS]
    parts = row_parts[id(x)] if continues_rows(conv, pieces, row_parts) else None
    plans = [(conv, None)]
    for node in unit[1:]:
        if kind_of(node.op_type, node.domain) != ELEMENTWISE:
            break
        axes = epilogue_axes(node, {id(n.outputs[0]) for n, _ in plans}, rows, ROW_AXIS - 4)
        if axes is None:
            break
        plans.append((node, axes))
    # What stays after the join may read only the last split node's output, the one the Concat rebuilds.
    while len(plans) > 1 and any(v is n.outputs[0] for n, _ in plans[:-1] for m in unit[len(plans):] for v in m.inputs):
        plans.pop()
    rest = unit[len(plans):]

    kernel = conv.inputs[1].shape[2]
    stride = int(conv.attrs.get("strides", [1, 1])[0])
    dilation = int(conv.attrs.get("dilations", [1, 1])[0])
    pads = list(conv.attrs.get("pads", [0, 0, 0, 0]))
    reach = (kernel - 1) * dilation + 1
    bounds = np.linspace(0, rows, pieces + 1).round().astype(int)
    label = conv.fusion_group or conv.name
    new_nodes: list[Node] = []
    piece_outputs = []
    for k, (lo, hi) in enumerate(zip(bounds.tolist(), bounds[1:].tolist())):
        first_of_slice = len(new_nodes)
        start, end = lo * stride - pads[0], (hi - 1) * stride - pads[0] + reach
        a, b = max(start, 0), min(end, x.shape[ROW_AXIS])
        shape = list(x.shape)
        shape[ROW_AXIS] = b - a
        if parts is not None and parts[k].shape == tuple(shape):
            part_in = parts[k]
        else:
            part_in = Value(graph.fresh_name(f"{x.name}_rows{k}"), x.dtype, tuple(shape))
            bounds_k = [Value(graph.fresh_name(f"{conv.name}_rows{k}_{key}"), dtypes.INT64, (1,), np.array([v], np.int64))
                        for key, v in (("starts", a), ("ends", b), ("axes", ROW_AXIS))]
            new_nodes.append(Node("Slice", [x, *bounds_k], [part_in], name=graph.fresh_name(f"{conv.name}_input{k}")))
        group = f"{label}/rows{k}" if len(plans) > 1 else None
        made: dict[int, Value] = {}
        for node, axes in plans:
            if node is conv:
                inputs = [part_in, *node.inputs[1:]]
                attrs = dict(node.attrs)
                attrs["pads"] = [a - start, pads[1], end - b, pads[3]]
            else:
                inputs = [made[id(v)] if v is not None and id(v) in made else
                          slice_constant(graph, v, axis, lo, hi, k) if v is not None and axis is not None else v
                          for v, axis in zip(node.inputs, axes)]
                attrs = dict(node.attrs)
            result = node.outputs[0]
            shape = list(result.shape)
            shape[ROW_AXIS] = hi - lo
            made[id(result)] = Value(graph.fresh_name(f"{result.name}_rows{k}"), result.dtype, tuple(shape))
            new_nodes.append(Node(node.op_type, inputs, [made[id(result)]], attrs,
                                  graph.fresh_name(f"{node.name}_rows{k}"), node.domain,
                                  {**node.attr_types, **({"pads": AttributeProto.INTS} if node is conv else {})},
                                  node.doc_string, group))
        piece_outputs.append(made[id(plans[-1][0].outputs[0])])
        piece_of.update((id(n), k) for n in new_nodes[first_of_slice:])
    joined = plans[-1][0].outputs[0]
    row_parts[id(joined)] = piece_outputs
    new_nodes.append(Node("Concat", piece_outputs, [joined], {"axis": ROW_AXIS},
                          graph.fresh_name(f"{conv.name}_join"), attr_types={"axis": AttributeProto.INT}))
    if len(rest) == 1:
        rest[0].fusion_group = None   # what stays after the join is a group only if it is a chain of two
    new_nodes.extend(rest)
    return new_nodes
