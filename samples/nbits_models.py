"""Float models as onnxruntime's weight-only quantizer writes them 4-bit, cached at
`.cache/models/nbits-*.onnx`.

`MatMulNBitsQuantizer` (onnxruntime.quantization.matmul_nbits_quantizer) replaces every MatMul
against a constant weight by a com.microsoft MatMulNBits: 4-bit codes in blocks of `block_size`
along K, one float scale per block, and (asymmetric) a 4-bit zero point per block. Its
`accuracy_level` attribute only tells onnxruntime's CPU kernel how to compute (4: quantize A to
int8 and multiply integers; unset: float A times dequantized blocks), not what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from samples.cache import CACHE_DIR, ensure_file

BLOCK_SIZE = 32


@dataclass(frozen=True)
class NBitsForm:
    """One way to quantize: the quantizer's options, and the name they give the file."""
    symmetric: bool
    accuracy_level: int | None = None
    block_size: int = BLOCK_SIZE

    @property
    def name(self) -> str:
        return (f"b{self.block_size}-{'sym' if self.symmetric else 'asym'}"
                f"-acc{self.accuracy_level if self.accuracy_level is not None else 'default'}")

    @property
    def title(self) -> str:
        return (f"int4 b{self.block_size} {'symmetric' if self.symmetric else 'asymmetric'}"
                + (f", accuracy level {self.accuracy_level}" if self.accuracy_level is not None else ""))


FORMS = tuple(NBitsForm(symmetric, level) for level in (None, 4) for symmetric in (True, False))


def nbits_model(source: Path, model_name: str, form: NBitsForm) -> Path:
    """`source` quantized to 4 bits in `form`, built once per (model_name, form)."""
    def write(target: Path) -> None:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=4, block_size=form.block_size,
                                         is_symmetric=form.symmetric, accuracy_level=form.accuracy_level)
        quantizer.process()
        onnx.save(quantizer.model.model, str(target))
    return ensure_file(CACHE_DIR / "models" / f"nbits-{model_name}-{form.name}.onnx", write)


def matmul_nbits_model(m: int, n: int, k: int, bits: int, block: int, level: int, zero_points: bool,
                       seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One MatMulNBits node with random codes, scales of about 1 / sqrt(K) and (with `zero_points`)
    packed zero point codes; and its feed."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    constants = {"b": rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8),
                 "scales": (rng.random(n * blocks) * 2 / np.sqrt(k) + 0.01).astype(np.float32)}
    inputs = ["a", "b", "scales"]
    if zero_points:
        constants["zero_points"] = rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8)
        inputs.append("zero_points")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)
    graph = helper.make_graph([node], "matmul_nbits", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(v, name) for name, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model, {"a": rng.standard_normal((m, k)).astype(np.float32)}
