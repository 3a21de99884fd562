"""DFT as a dense linear map along one axis.

The discrete Fourier transform (forward or inverse, one-sided or not, padded or cropped to
dft_length) is linear in the real and imaginary parts of its input. The compiler asks the ONNX
reference evaluator to transform every basis vector of one line at once (as a batch), which gives
the map's matrix exactly as the spec defines it; the loop nest then applies that constant matrix
to every line of the input.
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ir.errors import UnsupportedError
from ir.loops.expr import cast
from ir.ops.registry import OTHER, lowering, register

register("DFT", kind=OTHER)


def _line_matrix(node, opset: int, length: int, components: int, dft_length) -> np.ndarray:
    """M[k, out_component, j, in_component] of the transform of one line of `length` samples."""
    from onnx.reference import ReferenceEvaluator
    basis = np.eye(length * components, dtype=np.float64).reshape(length * components, length, components)
    attrs = {k: v for k, v in node.attrs.items() if k != "axis"}
    inputs, inits = ["x"], []
    if dft_length is not None:
        inits.append(numpy_helper.from_array(np.array(dft_length, dtype=np.int64), "dft_length"))
        inputs.append("dft_length")
    if opset >= 20:
        inits.append(numpy_helper.from_array(np.array(1, dtype=np.int64), "axis"))
        inputs += [""] * (2 - len(inputs)) + ["axis"]
    else:
        attrs["axis"] = 1
    model = helper.make_model(
        helper.make_graph([helper.make_node("DFT", inputs, ["y"], **attrs)], "line",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, list(basis.shape))],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)], inits),
        opset_imports=[helper.make_opsetid("", opset)])
    (out,) = ReferenceEvaluator(model).run(None, {"x": basis})      # [basis, k, 2]
    return out.reshape(length, components, *out.shape[1:]).transpose(2, 3, 0, 1)


@lowering("loops", "DFT")
def _dft(b, node):
    x, y = b.input(node, 0), b.output(node)
    opset = int(b.graph.opset_imports.get("", 21))
    rank = len(x.shape)
    if opset >= 20:
        given = b.const_input(node, 2)
        axis = int(given.reshape(-1)[0]) if given is not None else -2
    else:
        axis = int(node.attrs.get("axis", 1))
    axis %= rank
    if axis == rank - 1:
        raise UnsupportedError(f"{node.describe()}: DFT along the component axis")
    length = b.const_input(node, 1)
    dft_length = int(length.reshape(-1)[0]) if length is not None else None
    matrix = _line_matrix(node, opset, x.shape[axis], x.shape[-1], dft_length)
    if matrix.shape[:2] != (y.shape[axis], y.shape[-1]):
        raise UnsupportedError(f"{node.describe()}: cannot reproduce the output shape {list(y.shape)}")
    dtype = "float64" if x.dtype == "float64" else "float32"
    m = b.constant(matrix.astype(dtype), node.name + "_dft")
    t = "f64" if dtype == "float64" else "f32"
    with b.loops(y.shape, "o") as out:
        acc = b.local(t, 0.0, "acc")
        with b.loop(x.shape[axis], "j") as j, b.loop(x.shape[-1], "c") as c:
            src = list(out)
            src[axis], src[-1] = j, c
            b.assign(acc, acc + m[(out[axis], out[-1], j, c)] * cast(x[tuple(src)], t))
        b.store(y, tuple(out), acc)
