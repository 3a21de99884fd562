"""DFT and STFT as dense linear maps.

The discrete Fourier transform (forward or inverse, one-sided or not, padded or cropped to
dft_length) is linear in the real and imaginary parts of its input. The compiler asks the ONNX
reference evaluator to transform every basis vector of one line at once (as a batch), which gives
the map's matrix exactly as the spec defines it; the loop nest then applies that constant matrix
to every line of the input.

STFT (torch.stft's export, an audio model's front end) is the DFT of each windowed frame: the
frames, times the window, are copied into rows of one matrix, and that matrix times the DFT's is
one GEMM (the target's kernel where it offers one), whose rows are the output's [frame, bin, 2].
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ir import dtypes
from ir.errors import UnsupportedError
from ir.graph import Value
from ir.loops.contraction import ContractionOperands, GemmSpec
from ir.loops.expr import cast
from ir.ops.registry import OTHER, lowering, register

register("DFT", "STFT", kind=OTHER)

# STFT is one-sided unless told otherwise (DFT is not): what the lowering reads, and what shape
# inference states to ONNX, whose rule reads the absent attribute as two-sided (onnx 1.23).
STFT_DEFAULTS = {"onesided": 1}


def _line_matrix(attrs: dict, opset: int, length: int, components: int, dft_length) -> np.ndarray:
    """M[k, out_component, j, in_component] of the DFT (with the node attributes `attrs`) of one
    line of `length` samples."""
    from onnx.reference import ReferenceEvaluator
    basis = np.eye(length * components, dtype=np.float64).reshape(length * components, length, components)
    attrs = {k: v for k, v in attrs.items() if k != "axis"}
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
    matrix = _line_matrix(node.attrs, opset, x.shape[axis], x.shape[-1], dft_length)
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


@lowering("loops", "STFT")
def _stft(b, node):
    x, window, y = b.input(node, 0), b.input(node, 2), b.output(node)
    step = int(b.const_input(node, 1).reshape(-1)[0])
    given = b.const_input(node, 3)
    if given is not None:
        frame = int(given.reshape(-1)[0])
    elif window is not None:
        frame = int(window.shape[0])
    else:
        raise UnsupportedError(f"{node.describe()}: STFT with neither a window nor a frame_length")
    # [batch, samples, components]; torch's export also gives a real signal as [batch, samples],
    # which onnxruntime accepts
    batch, components = x.shape[0], x.shape[2] if len(x.shape) == 3 else 1
    frames, bins = y.shape[1], y.shape[2]
    opset = int(b.graph.opset_imports.get("", 21))
    onesided = int(node.attrs.get("onesided", STFT_DEFAULTS["onesided"]))
    matrix = _line_matrix({"onesided": onesided}, min(opset, 19), frame, components, None)  # [bin, 2, j, c]
    if matrix.shape[:2] != (bins, 2):
        raise UnsupportedError(f"{node.describe()}: cannot reproduce the output shape {list(y.shape)}")
    rows, columns, depth = batch * frames, bins * 2, frame * components
    windowed = b.temp("float32", (batch, frames, frame, components), "frames")
    with b.loop(batch, "n") as n, b.loop(frames, "f") as f, b.loop(frame, "j") as j, b.loop(components, "c") as c:
        sample = cast(x[(n, f * step + j, c) if len(x.shape) == 3 else (n, f * step + j)], "f32")
        b.store(windowed, (n, f, j, c), sample * cast(window[(j,)], "f32") if window is not None else sample)
    a, out = windowed.view((rows, depth)), y.view((rows, columns))
    basis = Value(node.name + "_stft_basis", dtypes.FLOAT, (columns, depth),
                  matrix.reshape(columns, depth).astype(np.float32))
    spec = GemmSpec(rows, columns, depth, trans_b=True)
    if y.dtype == "float32" and b.offers(spec):
        b.call_contraction(spec, ContractionOperands(a, b.contraction_weight(spec, basis), out), windowed.name, basis.name)
        return
    m = b.buffer(basis)
    with b.loop(rows, "r") as r, b.loop(columns, "k") as k:
        acc = b.local("f32", 0.0, "acc")
        with b.loop(depth, "i") as i:
            b.assign(acc, acc + a[(r, i)] * m[(k, i)])
        b.store(out, (r, k), acc)
