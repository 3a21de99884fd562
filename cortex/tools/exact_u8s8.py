"""onnxruntime as an exact reference for uint8 x int8 products on every machine.

onnxruntime's x86 kernels without VNNI (AVX2, AVX-512 without VNNI) multiply uint8 by int8 with
pmaddubsw, which sums each pair of products in 16 bits with saturation: 255 * 127 twice comes out
32767, not 64770. Cortex computes those products exactly, so on such a machine a bit-exact
comparison with onnxruntime fails on onnxruntime's side. Its uint8 x uint8 products are exact
there, and shifting an int8 operand and its zero point by +128 to uint8 keeps every difference
(b - zero point), and so every product, the same: `exact_u8s8` rewrites a model that way. `cortex verify` runs its
reference so, and so do the samples' and the tests' references, each only on a machine where
`onnxruntime_saturates_u8s8()`.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# op (domain, type) -> (A's input index, or None where A is uint8 inside the op, and the int8
# operands it multiplies A by, each with its zero point's index)
U8S8_PRODUCTS = {
    ("", "MatMulInteger"): (0, ((1, 3),)),
    ("", "ConvInteger"): (0, ((1, 3),)),
    ("", "QLinearMatMul"): (0, ((3, 5),)),
    ("", "QLinearConv"): (0, ((3, 5),)),
    ("com.microsoft", "MatMulIntegerToFloat"): (0, ((1, 5),)),
    ("com.microsoft", "DynamicQuantizeMatMul"): (None, ((1, 3),)),
    ("com.microsoft", "QGemm"): (0, ((3, 5),)),
    ("com.microsoft", "DynamicQuantizeLSTM"): (None, ((1, 9), (2, 11))),
    # a QDQ model's int8 weights: onnxruntime fuses their DequantizeLinear into its uint8 x int8 kernels
    ("", "DequantizeLinear"): (None, ((0, 2),)),
}
WEIGHTS_ONLY = {("", "DequantizeLinear")}        # where only an initializer operand is shifted


@functools.cache
def onnxruntime_saturates_u8s8() -> bool:
    """Whether this machine's onnxruntime saturates a pair of uint8 x int8 products at 16 bits."""
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(np.full((2, 1), 127, np.int8), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"a": np.full((1, 2), 255, np.uint8)})[0]
    return int(got[0, 0]) != 2 * 255 * 127


SHIFTED = "__as_uint8"          # the suffix of an int8 value's uint8 copy
PROTOBUF_LIMIT = 2**31 - 1     # a rewritten model is handed over as one serialized message


def reference_source(model, feeds: dict, load=onnx.load) -> tuple[str | bytes, dict, bool]:
    """What onnxruntime's InferenceSession runs as the exact reference of `model` (a ModelProto or
    a path, read with `load`): the model itself, or `exact_u8s8`'s rewrite where this machine's
    onnxruntime saturates and the model has a uint8 x int8 product; the feeds for it; and whether
    it was rewritten. A path is read only when a rewrite may be needed."""
    if onnxruntime_saturates_u8s8():
        loaded = model if isinstance(model, onnx.ModelProto) else load(model)
        if has_u8s8_candidates(loaded) and loaded.ByteSize() < PROTOBUF_LIMIT:
            rewritten, feeds = exact_u8s8(loaded, feeds)
            return rewritten.SerializeToString(), feeds, True
    return (model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)), feeds, False


def has_u8s8_candidates(model: onnx.ModelProto) -> bool:
    return any((n.domain if n.domain != "ai.onnx" else "", n.op_type) in U8S8_PRODUCTS for n in model.graph.node)


def exact_u8s8(model: onnx.ModelProto, feeds: dict) -> tuple[onnx.ModelProto, dict]:
    """`model` and `feeds` with every int8 B (and its zero point) of a product whose A is uint8
    shifted to uint8: initializers and feeds in place of the originals, computed ones through
    Cast/Add/Cast. The outputs are the same numbers; onnxruntime computes them exactly."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    feeds = dict(feeds)
    graph = model.graph
    types = _elem_types(model, feeds)
    initializers = {t.name: t for t in graph.initializer}
    inputs = {v.name: v for v in graph.input}
    shifted: dict[str, str] = {}
    added: list[onnx.NodeProto] = []        # conversions of computed values, before their reader

    def shift(name: str) -> str:
        if name in shifted:
            return shifted[name]
        new = name + SHIFTED
        if name in initializers:
            value = numpy_helper.to_array(initializers[name]).astype(np.int16) + 128
            graph.initializer.append(numpy_helper.from_array(value.astype(np.uint8), new))
        elif name in feeds:
            feeds.update(shifted_feeds({name: feeds[name]}, [new]))
            shape = inputs[name].type.tensor_type.shape
            graph.input.append(helper.make_tensor_value_info(new, TensorProto.UINT8, [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]))
        else:
            added.extend([helper.make_node("Cast", [name], [f"{new}__i16"], to=TensorProto.INT16),
                          helper.make_node("Constant", [], [f"{new}__128"],
                                           value=numpy_helper.from_array(np.array(128, np.int16))),
                          helper.make_node("Add", [f"{new}__i16", f"{new}__128"], [f"{new}__sum"]),
                          helper.make_node("Cast", [f"{new}__sum"], [new], to=TensorProto.UINT8)])
        shifted[name] = new
        return new

    nodes = []
    for node in graph.node:
        key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
        a, operands = U8S8_PRODUCTS.get(key, (None, ()))
        if a is not None and (a >= len(node.input) or types.get(node.input[a]) != TensorProto.UINT8):
            operands = ()
        for b, zero in operands:
            if b >= len(node.input) or types.get(node.input[b]) != TensorProto.INT8 \
                    or (key in WEIGHTS_ONLY and node.input[b] not in initializers):
                continue
            node.input[b] = shift(node.input[b])
            if zero < len(node.input) and node.input[zero]:
                node.input[zero] = shift(node.input[zero])
                continue
            while len(node.input) < zero:
                node.input.append("")
            name = f"{node.input[b]}__zero"
            if name not in initializers:
                graph.initializer.append(numpy_helper.from_array(np.array(128, np.uint8), name))
                initializers[name] = graph.initializer[-1]
            if zero < len(node.input):
                node.input[zero] = name
            else:
                node.input.append(name)
        nodes += [*added, node]
        added.clear()
    del graph.node[:]
    graph.node.extend(nodes)
    return model, feeds


def shifted_feeds(feeds: dict, names) -> dict:
    """`feeds` with the shifted copy of each int8 feed that `names` (a rewritten model's inputs) asks for."""
    feeds = dict(feeds)
    for name in names:
        if name.endswith(SHIFTED) and name not in feeds and name[:-len(SHIFTED)] in feeds:
            feeds[name] = np.asarray(np.asarray(feeds[name[:-len(SHIFTED)]]).astype(np.int16) + 128, dtype=np.uint8)
    return feeds


def _elem_types(model: onnx.ModelProto, feeds: dict) -> dict[str, int]:
    """Element types of the graph's values, as far as onnx's inference knows them."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:           # a model onnx cannot infer (contrib ops): what it declares
        inferred = model
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update((t.name, t.data_type) for t in graph.initializer)
    for name, value in feeds.items():
        dtype = np.asarray(value).dtype
        if dtype in (np.uint8, np.int8):
            types[name] = TensorProto.UINT8 if dtype == np.uint8 else TensorProto.INT8
    for node in graph.node:     # DynamicQuantizeLinear's output is uint8 whatever inference says
        if node.op_type == "DynamicQuantizeLinear" and node.output:
            types[node.output[0]] = TensorProto.UINT8
    return types
