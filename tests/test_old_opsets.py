"""Expansions at the model's opset, 9 to 12: the opsets 2019-2021 converters wrote, which users
cannot re-export. The bodies are written at opset 13 or 17; ir/ops/body_opset.py reads them at an
older one, or names the node and the op that cannot be written there."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ir.ops  # noqa: F401  (registers every op)
import test_contrib_quantized as quantized_cases
import test_contrib_transformer as transformer_cases
import test_ml_ops as ml_cases
import test_tree_ensembles as tree_cases
from cli_helpers import build_and_run
from ir.errors import UnsupportedError
from ir.ops.body_opset import read_at_opset
from ir.ops.registry import REGISTRY
from ir.onnx_import import import_model
from samples import contrib_models as contrib

OLD_OPSETS = (9, 10, 11, 12)
RNG = np.random.default_rng(11)


def _tree_models() -> dict[str, onnx.ModelProto]:
    rng = np.random.default_rng(5)
    regressor = tree_cases.ml_model("TreeEnsembleRegressor", TensorProto.FLOAT, 8, [("Y", TensorProto.FLOAT, [8, 2])], 1,
                                    n_targets=2, **tree_cases.forest_attributes(rng, 3, 3, 2))
    classifier = tree_cases.ml_model("TreeEnsembleClassifier", TensorProto.FLOAT, 8,
                                     [("Y", TensorProto.INT64, [8]), ("Z", TensorProto.FLOAT, [8, 3])], 1,
                                     classlabels_int64s=[0, 1, 2], **tree_cases.classifier_attributes(rng, 3, 3, 3, False))
    ensemble = tree_cases.ml_model("TreeEnsemble", TensorProto.FLOAT, 8, [("Y", TensorProto.FLOAT, [8, 2])], 5,
                                   n_targets=2, aggregate_function=1, post_transform=0,
                                   **tree_cases.as_tree_ensemble(rng, 3, 3, 2))
    return {"TreeEnsembleRegressor": regressor, "TreeEnsembleClassifier": classifier, "TreeEnsemble": ensemble}


def _node(op: str, inputs: dict, outputs: int = 1, domain: str = "com.microsoft", **attrs) -> onnx.ModelProto:
    """A one-node model: inputs named c_* are initializers (the expansion reads their values), a
    None value is an absent optional input, the rest are graph inputs."""
    names = [f"y{j}" for j in range(outputs)]
    order = [k if v is not None else "" for k, v in inputs.items()]
    given = {k: v for k, v in inputs.items() if v is not None}
    graph = helper.make_graph(
        [helper.make_node(op, order, names, name=op.lower(), domain=domain, **attrs)], op,
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in given.items() if not k.startswith("c_")],
        [onnx.ValueInfoProto(name=n) for n in names],
        [onnx.numpy_helper.from_array(v, k) for k, v in given.items() if k.startswith("c_")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])


def _more_models() -> dict[str, onnx.ModelProto]:
    """One node of each expansion the other test modules' cases do not hold."""
    def f32(*shape):
        return RNG.standard_normal(shape).astype(np.float32)

    def i8(*shape):
        return RNG.integers(-100, 100, shape).astype(np.int8)
    sv = ml_cases.SV.ravel().tolist()
    return {
        "BiasAdd": _node("BiasAdd", {"x": f32(2, 3, 4), "b": f32(4), "s": f32(2, 3, 4)}),
        "BiasSplitGelu": _node("BiasSplitGelu", {"x": f32(2, 3, 8), "b": f32(8)}),
        "QuantizeLinear": _node("QuantizeLinear", {"x": f32(3, 4), "s": np.float32(0.1), "z": np.int8(2)}),
        "DequantizeLinear": _node("DequantizeLinear", {"x": i8(3, 4), "s": np.float32(0.1), "z": np.int8(2)}),
        "GatherBlockQuantized": _node("GatherBlockQuantized", {
            "c_table": RNG.integers(0, 256, (6, 16), dtype=np.uint8), "ids": np.array([4, 1], np.int64),
            "c_scales": RNG.uniform(0.01, 0.1, (6, 1)).astype(np.float32)},
            bits=4, block_size=32, gather_axis=0, quantize_axis=1),
        "DynamicQuantizeLSTM": _node("DynamicQuantizeLSTM", {
            "x": f32(5, 2, 4), "c_W": i8(1, 4, 32), "c_R": i8(1, 8, 32), "b": f32(1, 64), "lens": None,
            "h": f32(1, 2, 8), "c": f32(1, 2, 8), "p": None, "ws": np.full(1, 0.01, np.float32),
            "wz": np.zeros(1, np.int8), "rs": np.full(1, 0.01, np.float32), "rz": np.zeros(1, np.int8)},
            outputs=3, hidden_size=8),
        "MatMulNBits": _node("MatMulNBits", {"a": f32(3, 32), "c_b": RNG.integers(0, 255, (4, 1, 16)).astype(np.uint8),
                                             "c_scales": np.full(4, 0.1, np.float32)},
                             K=32, N=4, bits=4, block_size=32),
        "SVMClassifier": ml_cases.ml_model("SVMClassifier", ml_cases.X, [("Y", TensorProto.INT64), ("Z", TensorProto.FLOAT)],
                                           kernel_type="RBF", kernel_params=[0.8, 0.0, 0.0], support_vectors=sv,
                                           vectors_per_class=[4, 3], coefficients=ml_cases.SV_COEF[0].tolist(), rho=[0.1],
                                           classlabels_ints=[3, 4]),
        "SVMRegressor": ml_cases.ml_model("SVMRegressor", ml_cases.X, [("Y", TensorProto.FLOAT)], kernel_type="LINEAR",
                                          kernel_params=[0.0, 0.0, 0.0], support_vectors=sv, n_supports=7,
                                          coefficients=ml_cases.SV_COEF[0].tolist(), rho=[0.2]),
    }


def representative_models() -> list[tuple[str, onnx.ModelProto]]:
    """Every case of the contrib and ML tests, and one node of each expansion they do not hold."""
    models = [(name, case.model()) for name, case in transformer_cases.CASES.items()]
    models += [(name, quantized_cases.node_model(op, feeds, constants, order, **attrs))
               for name, (op, feeds, constants, order, attrs) in quantized_cases.CASES.items()]
    models += [(name, ml_cases.ml_model(op, x, outputs, opset, **attrs))
               for name, (op, x, outputs, opset, attrs) in ml_cases.CASES.items()]
    return models + list(_tree_models().items()) + list(_more_models().items())


def expanded_nodes():
    """(case, node) for each node of the representative models whose op the registry expands."""
    for name, model in representative_models():
        for node in import_model(model).nodes:
            entry = REGISTRY.get((node.domain, node.op_type))
            if entry is not None and entry.expansion is not None:
                yield name, node


def test_every_registered_expansion_has_a_representative_node():
    covered = {(node.domain, node.op_type) for _, node in expanded_nodes()}
    missing = sorted(key for key, entry in REGISTRY.items() if entry.expansion is not None and key not in covered)
    assert not missing, f"expansions without a representative node here: {missing}"


@pytest.mark.parametrize("opset", OLD_OPSETS)
def test_every_expansion_reads_at_an_old_opset_or_names_the_node_and_op(opset):
    """Each body, read at `opset`, is valid there node by node (ONNX's checker against that opset's
    schemas), or the reading is one error naming the node and the opset. From opset 11 on, the
    opset of quantize_dynamic's and the transformer optimizer's inputs, every one reads."""
    failures = []
    for name, node in expanded_nodes():
        try:
            function = REGISTRY[(node.domain, node.op_type)].expansion(node)
        except Exception:       # a form the expansion declines or that waits for shapes: not about opsets
            continue
        try:
            read = read_at_opset(function, opset, node.describe())
        except UnsupportedError as error:
            assert str(error).startswith(node.describe()) and f"opset {opset}" in str(error), str(error)
            failures.append(f"{name}: {error}")
            continue
        context = onnx.checker.C.CheckerContext()
        context.ir_version = onnx.IR_VERSION
        context.opset_imports = {"": opset, "com.microsoft": 1, "ai.onnx.ml": 3}
        for proto in read.node:
            if proto.domain in ("", "ai.onnx") and not any(a.g.node for a in proto.attribute):
                onnx.checker.check_node(proto, context)     # a subgraph's nodes read names of the body
    if opset >= 11:
        assert not failures, "\n".join(failures)


# -- onnxruntime's quantizer on opset 11 and 12 models, through the CLI -------------------------
def _at(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """The float models use ops whose form is the same from opset 11 to 17."""
    model.opset_import[0].version = opset
    return model


QUANTIZED = {   # name -> (quantized model in a folder, feeds)
    "dynamic-quantize-matmul": (lambda opset, d: contrib.fused(contrib.quantized_dynamic(_at(contrib._matmul_model(1), opset), d), d),
                                {"x": RNG.standard_normal((2, 16)).astype(np.float32)}),
    "matmul-integer-to-float": (lambda opset, d: contrib.fused(contrib.quantized_dynamic(_at(contrib._matmul_model(2), opset), d), d),
                                {"x": RNG.standard_normal((2, 16)).astype(np.float32)}),
    "qoperator-net": (lambda opset, d: contrib.quantized_static(_at(contrib._qoperator_float_model(), opset), d,
                                                                contrib.qoperator_calibration_feeds()),
                      {"x": RNG.standard_normal((1, 3, 12, 12)).astype(np.float32)}),
    "dynamic-quantize-lstm": (lambda opset, d: contrib.quantized_dynamic(_at(contrib._lstm_model(), opset), d, ["LSTM"]),
                              {"x": RNG.standard_normal((5, 2, 4)).astype(np.float32)}),
}


def _quantized(name: str, opset: int, tmp_path):
    make, feeds = QUANTIZED[name]
    folder = tmp_path / "quantized"
    folder.mkdir()
    path = make(opset, folder)
    model = onnx.load(path)
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    assert any(n.domain == "com.microsoft" for n in model.graph.node), "the quantizer wrote no contrib op"
    return path, feeds


def _onnxruntime(path, feeds) -> dict:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _cortex(path, feeds, tmp_path) -> dict:
    shape = "x".join(map(str, feeds["x"].shape))
    out = tmp_path / "cortex"
    out.mkdir()
    return build_and_run(path, out, feeds, f"--input-shape=x={shape}")


@pytest.mark.slow
@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize("name", ["dynamic-quantize-matmul", "matmul-integer-to-float", "qoperator-net"])
def test_quantizer_outputs_of_old_opset_models_match_onnxruntime(name, opset, tmp_path):
    path, feeds = _quantized(name, opset, tmp_path)
    got, want = _cortex(path, feeds, tmp_path), _onnxruntime(path, feeds)
    for key, expected in want.items():
        np.testing.assert_allclose(got[key], expected, rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("opset", [11, 12])
def test_dynamic_quantize_lstm_of_an_old_opset_model_compiles_and_is_close(opset, tmp_path):
    """The body runs a float LSTM of the dequantized weights where onnxruntime also quantizes the
    activations: close, not equal (cosine similarity)."""
    path, feeds = _quantized("dynamic-quantize-lstm", opset, tmp_path)
    got, want = _cortex(path, feeds, tmp_path), _onnxruntime(path, feeds)
    for key, expected in want.items():
        a, b = got[key].ravel().astype(np.float64), expected.ravel().astype(np.float64)
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.99, key
