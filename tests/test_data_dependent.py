"""Data-dependent output shapes (ir/bounds.py): NonZero, Compress, Unique and NonMaxSuppression
compile with static upper bounds and return their real shape at run time. Each model is compiled
once and run on inputs that select different numbers of elements, through the installed CLI, and
matched against onnxruntime on the source model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import cortex
from backends.cuda import device as cuda_device
from backends.cuda import toolchain as cuda_toolchain
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import HostMemoryGpu
from cortex.pipeline import load_and_optimize
from ir.errors import CortexError
from testdata import run_onnxruntime

OPSET = 17


def save_model(path: Path, nodes, inputs, outputs, constants=()) -> Path:
    graph = helper.make_graph(nodes, path.stem, inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in constants])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), path)
    return path


def cli_ok(argv) -> str:
    code, out, err = run_cli(argv)
    assert code == 0, err
    return out


def compile_wasm(model: Path, folder: Path, *decompose_flags) -> Path:
    cli_ok(["decompose", "--model-path", model, "--output-dir", folder / "cus", *decompose_flags])
    cli_ok(["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"])
    cli_ok(["compile-wasm", "--cu-dir", folder / "cus", "--dag", folder / "dag.json", "--output", folder / "wasm-bin"])
    return folder / "dag.json"


def run_compiled(dag: Path, feeds: dict, folder: Path) -> dict[str, np.ndarray]:
    np.savez(folder / "feeds.npz", **feeds)
    cli_ok(["run", dag, "--input", folder / "feeds.npz", "--output", folder / "got.npz"])
    with np.load(folder / "got.npz") as got:
        return dict(got)


def assert_matches_onnxruntime(model: Path, dag: Path, feed_sets: list[dict], folder: Path) -> list[tuple]:
    """Every output equals onnxruntime's, shape included; returns the output shapes of each run."""
    shapes = []
    for feeds in feed_sets:
        want = run_onnxruntime(onnx.load(model), feeds)
        got = run_compiled(dag, feeds, folder)
        assert sorted(got) == sorted(want)
        for name, expected in want.items():
            assert got[name].dtype == expected.dtype, name
            assert got[name].shape == expected.shape, (name, got[name].shape, expected.shape)
            np.testing.assert_array_equal(got[name], expected, err_msg=name)
        shapes.append(tuple(got[name].shape for name in sorted(want)))
    return shapes


def test_nonzero_returns_as_many_coordinates_as_the_input_has_nonzeros(tmp_path):
    model = save_model(tmp_path / "nonzero.onnx", [helper.make_node("NonZero", ["x"], ["y"])],
                       [helper.make_tensor_value_info("x", T.FLOAT, [3, 4])],
                       [helper.make_tensor_value_info("y", T.INT64, [2, "n"])])
    dag = compile_wasm(model, tmp_path)
    assert json.loads(dag.read_text())["tensors"]["y"]["shape"] == [2, 12]
    rng = np.random.default_rng(0)
    feeds = [{"x": np.where(rng.random((3, 4)) < p, rng.standard_normal((3, 4)), 0).astype(np.float32)}
             for p in (0.3, 0.8)]
    feeds += [{"x": np.zeros((3, 4), np.float32)}, {"x": np.full((3, 4), np.nan, np.float32)}]
    shapes = assert_matches_onnxruntime(model, dag, feeds, tmp_path)
    assert len({s[0][1] for s in shapes}) == 4 and shapes[2] == ((2, 0),)


def test_boolean_mask_indexing_as_torch_exports_it(tmp_path):
    """torch's x[x > t] exports as NonZero -> Transpose -> GatherND: the gathered rows keep the
    selection's run-time length."""
    nodes = [helper.make_node("Greater", ["x", "t"], ["mask"]), helper.make_node("NonZero", ["mask"], ["where"]),
             helper.make_node("Transpose", ["where"], ["index"], perm=[1, 0]),
             helper.make_node("GatherND", ["x", "index"], ["picked"]), helper.make_node("Mul", ["picked", "t"], ["y"])]
    model = save_model(tmp_path / "mask.onnx", nodes, [helper.make_tensor_value_info("x", T.FLOAT, [3, 5])],
                       [helper.make_tensor_value_info("y", T.FLOAT, ["n"])], [("t", np.float32(0.25))])
    dag = compile_wasm(model, tmp_path)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((3, 5)).astype(np.float32)} for _ in range(2)]
    feeds.append({"x": np.zeros((3, 5), np.float32)})
    shapes = assert_matches_onnxruntime(model, dag, feeds, tmp_path)
    assert len(set(shapes)) == 3 and shapes[2] == ((0,),)


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_compress_by_a_condition_given_at_run_time(axis, tmp_path):
    attrs = {} if axis is None else {"axis": axis}
    model = save_model(tmp_path / "compress.onnx", [helper.make_node("Compress", ["x", "keep"], ["y"], **attrs),
                                                    helper.make_node("Neg", ["y"], ["z"])],
                       [helper.make_tensor_value_info("x", T.FLOAT, [4, 5]),
                        helper.make_tensor_value_info("keep", T.BOOL, [4])],
                       [helper.make_tensor_value_info("z", T.FLOAT, None)])
    dag = compile_wasm(model, tmp_path)
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    conditions = [[True, False, True, True], [False, False, False, False], [False, True, False, False]]
    shapes = assert_matches_onnxruntime(model, dag, [{"x": x, "keep": np.array(c)} for c in conditions], tmp_path)
    assert len(set(shapes)) == 3


@pytest.mark.parametrize("sorted_", [1, 0])
def test_unique_with_all_four_outputs(sorted_, tmp_path):
    outputs = ["y", "indices", "inverse", "counts"]
    model = save_model(tmp_path / "unique.onnx", [helper.make_node("Unique", ["x"], outputs, sorted=sorted_)],
                       [helper.make_tensor_value_info("x", T.INT64, [10])],
                       [helper.make_tensor_value_info(n, T.INT64, None) for n in outputs])
    dag = compile_wasm(model, tmp_path)
    feeds = [{"x": np.array(v, np.int64)} for v in
             ([3, 1, 3, 2, 1, 7, 7, 0, 3, 5], [4] * 10, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0])]
    shapes = assert_matches_onnxruntime(model, dag, feeds, tmp_path)
    assert [s[3] for s in shapes] == [(6,), (1,), (10,)]     # y, by sorted output name


def test_unique_along_an_axis(tmp_path):
    outputs = ["y", "indices", "inverse", "counts"]
    model = save_model(tmp_path / "unique_axis.onnx", [helper.make_node("Unique", ["x"], outputs, axis=0)],
                       [helper.make_tensor_value_info("x", T.FLOAT, [5, 2])],
                       [helper.make_tensor_value_info("y", T.FLOAT, None)] +
                       [helper.make_tensor_value_info(n, T.INT64, None) for n in outputs[1:]])
    dag = compile_wasm(model, tmp_path)
    rows = [np.array([[1, 2], [0, 5], [1, 2], [0, 4], [0, 5]], np.float32), np.ones((5, 2), np.float32)]
    shapes = assert_matches_onnxruntime(model, dag, [{"x": x} for x in rows], tmp_path)
    assert shapes[0] != shapes[1]


def detection_model(path: Path, boxes: int = 16, classes: int = 3) -> Path:
    """A detector's postprocess: NonMaxSuppression, then the selected boxes, their scores (a flat
    index computed elementwise from the selection) and classes gathered by its indices."""
    nodes = [
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_floor"], ["selected"]),
        helper.make_node("Gather", ["selected", "two"], ["box_index"], axis=1),
        helper.make_node("Gather", ["selected", "one"], ["class_index"], axis=1),
        helper.make_node("Squeeze", ["boxes", "zero"], ["boxes_2d"]),
        helper.make_node("Gather", ["boxes_2d", "box_index"], ["det_boxes"], axis=0),
        helper.make_node("Reshape", ["scores", "flat"], ["scores_flat"]),
        helper.make_node("Mul", ["class_index", "stride"], ["class_offset"]),
        helper.make_node("Add", ["class_offset", "box_index"], ["score_index"]),
        helper.make_node("Gather", ["scores_flat", "score_index"], ["det_scores"], axis=0),
        helper.make_node("Cast", ["class_index"], ["det_classes"], to=T.INT32),
    ]
    constants = [("max_out", np.array([4], np.int64)), ("iou", np.array([0.45], np.float32)),
                 ("score_floor", np.array([0.25], np.float32)), ("two", np.array(2, np.int64)),
                 ("one", np.array(1, np.int64)), ("zero", np.array([0], np.int64)),
                 ("flat", np.array([-1], np.int64)), ("stride", np.array(boxes, np.int64))]
    return save_model(path, nodes,
                      [helper.make_tensor_value_info("boxes", T.FLOAT, [1, boxes, 4]),
                       helper.make_tensor_value_info("scores", T.FLOAT, [1, classes, boxes])],
                      [helper.make_tensor_value_info("det_boxes", T.FLOAT, ["n", 4]),
                       helper.make_tensor_value_info("det_scores", T.FLOAT, ["n"]),
                       helper.make_tensor_value_info("det_classes", T.INT32, ["n"])], constants)


def detection_feeds(count: int = 3, boxes: int = 16, classes: int = 3) -> list[dict]:
    """Overlapping boxes, as [y1, x1, y2, x2] and some flipped; scores that leave more or fewer
    boxes above the floor from one run to the next."""
    rng = np.random.default_rng(7)
    feeds = []
    for k in range(count):
        corner = rng.random((1, boxes, 2)).astype(np.float32) * 3
        size = rng.random((1, boxes, 2)).astype(np.float32) + 0.5
        box = np.concatenate([corner, corner + size], -1)
        box[:, ::3] = box[:, ::3][..., [2, 3, 0, 1]]
        scores = (rng.random((1, classes, boxes)) * (1.0, 0.3, 0.27)[k % 3]).astype(np.float32)
        feeds.append({"boxes": box, "scores": scores})
    return feeds


def test_nms_then_gather_of_the_selected_boxes(tmp_path):
    model = detection_model(tmp_path / "postprocess.onnx")
    dag = compile_wasm(model, tmp_path)
    shapes = assert_matches_onnxruntime(model, dag, detection_feeds(), tmp_path)
    assert len({s[0] for s in shapes}) == 3


def test_bounded_values_cross_cu_borders(tmp_path):
    """One node per CU: the selection and what is derived from it pass between CUs at their real
    shape, and the CU reading two of them knows they share one length."""
    model = detection_model(tmp_path / "postprocess.onnx")
    dag = compile_wasm(model, tmp_path, "--max-cu-depth", 1, "--min-cu-size", 0)
    document = json.loads(dag.read_text())
    assert len(document["cus"]) > 2
    assert document["tensors"]["box_index"]["bound_axis"] == 0
    shapes = assert_matches_onnxruntime(model, dag, detection_feeds(), tmp_path)
    assert len({s[0] for s in shapes}) == 3


def with_sum_of_scores(path: Path) -> Path:
    proto = onnx.load(detection_model(path))
    proto.graph.node.append(helper.make_node("ReduceSum", ["det_scores"], ["total"], keepdims=0))
    proto.graph.output.append(helper.make_tensor_value_info("total", T.FLOAT, []))
    onnx.save(proto, path)
    return path


def test_a_reader_that_cannot_take_the_bound_is_refused_in_one_line(tmp_path):
    model = with_sum_of_scores(tmp_path / "summed.onnx")
    cli_ok(["decompose", "--model-path", model, "--output-dir", tmp_path / "cus"])
    cli_ok(["build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json"])
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path / "cus", "--dag", tmp_path / "dag.json",
                            "--output", tmp_path / "wasm-bin"])
    assert_one_line_error(code, err, "ReduceSum", "known only at run time", "--fallback onnxruntime")


def test_a_fallback_cu_reads_a_bounded_value_at_its_real_shape(tmp_path):
    model = with_sum_of_scores(tmp_path / "summed.onnx")
    dag = compile_wasm(model, tmp_path, "--fallback", "onnxruntime")
    assert any(cu.get("runs_on") == "onnxruntime" for cu in json.loads(dag.read_text())["cus"])
    for feeds in detection_feeds():
        want = run_onnxruntime(onnx.load(model), feeds)
        got = run_compiled(dag, feeds, tmp_path)
        np.testing.assert_array_equal(got["det_boxes"], want["det_boxes"])
        np.testing.assert_allclose(got["total"], want["total"], rtol=1e-6)


def test_an_op_mixing_the_length_with_other_dims_is_named(tmp_path):
    model = save_model(tmp_path / "concat.onnx",
                       [helper.make_node("NonZero", ["x"], ["nz"]),
                        helper.make_node("Concat", ["nz", "nz"], ["y"], axis=1)],
                       [helper.make_tensor_value_info("x", T.FLOAT, [6])],
                       [helper.make_tensor_value_info("y", T.INT64, None)])
    with pytest.raises(CortexError, match="Concat.*known only at run time"):
        load_and_optimize(model)
    code, _, err = run_cli(["decompose", "--model-path", model, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "Concat", "'nz'", "known only at run time")


def test_shape_inference_gives_the_upper_bound_and_the_dynamic_axis(tmp_path):
    model = detection_model(tmp_path / "postprocess.onnx", boxes=10, classes=2)
    graph = load_and_optimize(model).graph
    values = {v.name: v for v in graph.values()}
    assert (values["selected"].shape, values["selected"].bound_axis) == ((8, 3), 0)      # 4 per class, 2 classes
    assert (values["det_boxes"].shape, values["det_boxes"].bound_axis) == ((8, 4), 0)
    assert values["det_scores"].length_key == values["selected"].length_key
    assert not values["boxes_2d"].is_bounded and not values["scores_flat"].is_bounded


@pytest.mark.skipif(cuda_toolchain.find_nvcc() is None, reason="nvcc not installed")
def test_detection_postprocess_on_cuda_sim_and_the_gpu_path(tmp_path, monkeypatch):
    """cuda-sim, then the `cuda` device's own path (GPU tensors, the length read back from the
    device) over host memory, as tests/test_cuda_device.py runs it where there is no GPU."""
    model = detection_model(tmp_path / "postprocess.onnx")
    dag = compile_wasm(model, tmp_path, "--max-cu-depth", 2, "--min-cu-size", 0)
    cli_ok(["compile-cuda", "--cu-dir", tmp_path / "cus", "--dag", dag, "--output", tmp_path / "cuda-bin",
            "--compiler", "nvrtc", "--arch", "sm_90"])
    records = [cu["artifacts"]["cuda"] for cu in json.loads(dag.read_text())["cus"]]
    assert any("bounds" in r for r in records)
    gpu = HostMemoryGpu({r["ptx"]["sha256"]: dag.parent / r["folder"] / r["source"]["file"] for r in records})
    monkeypatch.setattr(cuda_device, "CudaDevice", lambda: gpu)
    for device in ("cuda-sim", "cuda"):
        compiled = cortex.load(dag, device=device)
        lengths = set()
        for feeds in detection_feeds():
            want = run_onnxruntime(onnx.load(model), feeds)
            got = compiled.run(feeds)
            for name, expected in want.items():
                assert got[name].shape == expected.shape and got[name].dtype == expected.dtype, (device, name)
                np.testing.assert_array_equal(got[name], expected, err_msg=f"{device}: {name}")
            lengths.add(got["det_boxes"].shape[0])
        assert len(lengths) == 3, device
