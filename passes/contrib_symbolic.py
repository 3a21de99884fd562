"""onnxruntime's symbolic shape inference (`onnxruntime.tools.symbolic_shape_infer`) with rules for
the contrib ops its table lacks: those that onnxruntime's quantizer and graph optimiser write, each
written from the op's schema in onnxruntime's ContribOperators.md and with the tool's own helpers.
`passes.contrib_shapes` imports this module only for a model that has contrib nodes."""

from __future__ import annotations

import onnx
from onnx import helper
from onnxruntime.tools import symbolic_shape_infer
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_attribute

INT_MAX = 2**31 - 1
LOGGER = symbolic_shape_infer.logger


class ContribShapeInference(SymbolicShapeInference):
    """onnxruntime's symbolic shape inference with rules for the contrib ops its table lacks."""

    def __init__(self):
        super().__init__(INT_MAX, auto_merge=False, guess_output_rank=False, verbose=0)
        self.dispatcher_.update({
            "DynamicQuantizeMatMul": self._infer_DynamicQuantizeMatMul,
            "MatMulIntegerToFloat": self._infer_MatMulIntegerToFloat,
            "FusedMatMul": self._infer_FusedMatMul,
            "DynamicQuantizeLSTM": self._infer_DynamicQuantizeLSTM,
            "QGemm": self._infer_QGemm,
            "QLinearSigmoid": self._propagate_shape_and_type,
            "QLinearLeakyRelu": self._propagate_shape_and_type,
            "QLinearSoftmax": self._propagate_shape_and_type,
            "QLinearGlobalAveragePool": self._infer_QLinearGlobalAveragePool,
            "QLinearConcat": self._infer_QLinearConcat,
        })

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The model with the value_info found; what the tool cannot follow stays unknown. (The
        tool's `infer_shapes` would write a file to the working directory when it stops early.)"""
        self._preprocess(model)
        while self.run_:
            if not self._infer_impl():
                break
        self._update_output_from_vi()
        return self.out_mp_

    def _set_output(self, node, index: int, dtype: int, shape) -> None:
        self.known_vi_[node.output[index]].CopyFrom(
            helper.make_tensor_value_info(node.output[index], dtype, shape))

    def _dtype_of_input(self, node, index: int) -> int:
        return self.known_vi_[node.input[index]].type.tensor_type.elem_type

    # A, B, b_scale, b_zero_point, bias -> float Y = A x dequantized B
    def _infer_DynamicQuantizeMatMul(self, node):  # noqa: N802 (the tool's naming)
        self._compute_matmul_shape(node, self._dtype_of_input(node, 2))

    # A, B, a_scale, b_scale, a_zero_point, b_zero_point, bias -> Y of a_scale's type
    def _infer_MatMulIntegerToFloat(self, node):  # noqa: N802
        self._compute_matmul_shape(node, self._dtype_of_input(node, 2))

    def _infer_FusedMatMul(self, node):  # noqa: N802
        """alpha * op(A) x op(B), op transposing the last two axes; transBatch* move the batch axes
        and have no rule here (the output stays unknown)."""
        if get_attribute(node, "transBatchA", 0) or get_attribute(node, "transBatchB", 0):
            return
        a, b = self._get_shape(node, 0), self._get_shape(node, 1)
        if len(a) < 2 or len(b) < 2:
            self._compute_matmul_shape(node)
            return
        if get_attribute(node, "transA", 0):
            a = [*a[:-2], a[-1], a[-2]]
        if get_attribute(node, "transB", 0):
            b = [*b[:-2], b[-1], b[-2]]
        shape = [*self._broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1]]
        self._set_output(node, 0, self._dtype_of_input(node, 0), shape)

    def _infer_DynamicQuantizeLSTM(self, node):  # noqa: N802
        """LSTM's outputs: X [seq, batch, input] -> Y [seq, directions, batch, hidden], Y_h and
        Y_c [directions, batch, hidden]."""
        seq, batch = self._get_shape(node, 0)[:2]
        hidden = get_attribute(node, "hidden_size")
        direction = get_attribute(node, "direction", b"forward")
        directions = 2 if direction in (b"bidirectional", "bidirectional") else 1
        dtype = self._dtype_of_input(node, 0)
        shapes = [[seq, directions, batch, hidden], [directions, batch, hidden], [directions, batch, hidden]]
        for index, shape in enumerate(shapes[:len(node.output)]):
            if node.output[index]:
                self._set_output(node, index, dtype, shape)

    def _infer_QGemm(self, node):  # noqa: N802
        """A, a_scale, a_zp, B, b_scale, b_zp, C, y_scale, y_zp -> [M, N]: quantized as y_zp when
        y_scale is given, else float."""
        a, b = self._get_shape(node, 0), self._get_shape(node, 3)
        m = a[1] if get_attribute(node, "transA", 0) else a[0]
        n = b[0] if get_attribute(node, "transB", 0) else b[1]
        quantized = len(node.input) > 8 and node.input[7] and node.input[8]
        dtype = self._dtype_of_input(node, 8) if quantized else onnx.TensorProto.FLOAT
        self._set_output(node, 0, dtype, [m, n])

    def _infer_QLinearGlobalAveragePool(self, node):  # noqa: N802
        shape = self._get_shape(node, 0)
        if get_attribute(node, "channels_last", 0):
            out = [shape[0], *([1] * (len(shape) - 2)), shape[-1]]
        else:
            out = [*shape[:2], *([1] * (len(shape) - 2))]
        self._set_output(node, 0, self._dtype_of_input(node, 0), out)

    def _infer_QLinearConcat(self, node):  # noqa: N802
        """Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per input."""
        shapes = [self._get_shape(node, i) for i in range(2, len(node.input), 3)]
        axis = get_attribute(node, "axis")
        axis = axis + len(shapes[0]) if axis < 0 else axis
        total = shapes[0][axis]
        for s in shapes[1:]:
            total = total + s[axis] if isinstance(total, int) and isinstance(s[axis], int) else None
        if total is not None:
            self._set_output(node, 0, self._dtype_of_input(node, 2), [*shapes[0][:axis], total, *shapes[0][axis + 1:]])
